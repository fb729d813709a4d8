"""Local-only training: every client trains its own adapter alone, never aggregated.

The baseline every federated comparison needs (what a client gets without the federation): client
k starts from the global initial adapter's prefix of its rank r_k (A random, B = 0; the same start
as every other method), keeps its own adapter between rounds (``ctx.state["adapter"]``, saved with
each checkpoint) and is evaluated under it. The server's state never changes. There is no global
adapter: the exported adapter is the untrained initial one, and the mechanism reports (truncation
curve, dimension importance) skip this method (it declares no ``GLOBAL_MODEL`` or ``EXPORT_AT_RANK``).

Replies still carry the trained arrays (so the round loop validates them and the metrics line
records their norms), but the server ignores them; ``bytes_up`` / ``bytes_down`` therefore show
what a federated method with the same payload would send, not traffic local training needs.
"""

from __future__ import annotations

from nestfed.config.capabilities import RANK_PREFIX_CLIENTS
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method

METHOD = lora_method(
    "local_only",
    "each client trains its own adapter alone, never aggregated (the baseline "
    "every federated comparison should include)",
    "nestfed.methods.local_only.strategy",
    capabilities=RANK_PREFIX_CLIENTS | {C.SECURE_AGGREGATION, C.SERVER_OPTIMIZER, C.RESUME},
    refusals={
        C.ROBUST_AGGREGATION: "local-only training aggregates nothing",
        C.GLOBAL_MODEL: "each client keeps its own adapter",
        C.EXPORT_AT_RANK: "each client keeps its own adapter",
    },
)
