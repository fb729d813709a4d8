"""FedSA-LoRA (Guo, Zeng, Wang, Fan, Wang and Qu, "Selective Aggregation for Low-Rank Adaptation in
Federated Learning", ICLR 2025, arXiv 2410.01463; its method section): both LoRA matrices train on
the clients, but only A (which the paper finds learns general knowledge) is sent and averaged; B
(client-specific) never leaves its client and is the client's kept state between rounds
(docs/methods.md, "Baselines reviewers ask for").

- Server: the n_k-weighted mean of the clients' A (FedAvg on A, the paper's server step). Only A
  travels, in both directions.
- Client: loads the global A prefix of its rank and its own B (zeros before its first round: the
  usual B = 0 initialisation), trains both, sends A back and keeps B (``ctx.state["own_B"]``,
  checkpointed with every round). It evaluates the global A with its own B.
- *Decision* (heterogeneous ranks; the paper uses one rank): row j of the global A is the
  n_k-weighted mean over the replying clients that hold row j (r_k > j); a row no replying client
  holds keeps its value (`holder_mean`). Zero-padding would multiply the rows only high-rank
  clients hold by their data share every round, so a lone rank-r_max client's extra rows of A
  would decay towards zero while its B, kept locally, expects them. With equal ranks this is
  exactly FedAvg on A.
- *Decision* (export; there is no global B in FedSA-LoRA, and the server never sees any B): the
  exported PEFT adapter is the shared global A (rank r_max) with B = 0, i.e. the backbone's
  function with A as the shared initialisation a new client would start from. The personalised
  models (global A, client k's own B) are what the per-client evaluation measures; the B's live in
  the checkpoints' client state. The run's summary says so (``adapter_note``), and the
  mechanism reports (truncation curve, dimension importance) skip the method (it declares no
  ``GLOBAL_MODEL`` or ``EXPORT_AT_RANK``).
- Robust rules and central DP work per rank segment of A (the blocks whose rows are held by the
  same clients, as PreLort's); secure aggregation rebuilds the holder mean from sums alone.

Under Flower the B's stay on the nodes' disks (nestfed.flower.node_state), so a resumed Flower run
continues each client from its own B.
"""

from __future__ import annotations

from nestfed.config.capabilities import MEAN_AGGREGATOR, RANK_PREFIX_CLIENTS
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method

METHOD = lora_method(
    "fedsa_lora",
    "only A is shared and averaged (per held row at heterogeneous ranks); each "
    "client keeps its own B (Guo et al. 2025)",
    "nestfed.methods.fedsa_lora.strategy",
    capabilities=RANK_PREFIX_CLIENTS | MEAN_AGGREGATOR | {C.SECURE_AGGREGATION, C.RESUME},
    refusals={
        C.GLOBAL_MODEL: "each client keeps its own B",
        C.EXPORT_AT_RANK: "each client keeps its own B",
    },
)
