"""nestfed on Flower's deployment engine (flwr 1.42, the ``flower`` extra).

- `nestfed.flower.records`: nestfed payloads and configs <-> Flower records.
- `nestfed.flower.client_app`: the ClientApp (one partition per SuperNode, the core's
  ``ClientTrainer`` unchanged).
- `nestfed.flower.server_app`: the ServerApp (any nestfed strategy through the Message
  API: a QUERY round, then per round one TRAIN message per node with its own arrays); its run
  config is `nestfed.flower.run_settings`, its exchange `nestfed.flower.transport`.
- `nestfed.flower.secure`: secure aggregation with Flower's SecAgg+ (workflow and mod).

The app bundle to launch with ``flwr run`` is the ``flower_app/`` directory of the repository.
"""
