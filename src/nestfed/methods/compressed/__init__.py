"""What FedSLM and FedMKT share: compressed client models (one SVD of the backbone, one model per
compression ratio), the server text held out from every client, the ``[compression]`` section,
and trainers that route each client to its group's model."""
