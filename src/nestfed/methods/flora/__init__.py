"""FLoRA (Wang et al., NeurIPS 2024): stacking-based aggregation, merged into the base each round.

The server forms the exact sum sum_k p_k s_k B_k A_k (p_k = n_k / N) by stacking: A_stack rows are
the p_k s_k A_k, B_stack columns the B_k, so B_stack @ A_stack equals the sum with no cross terms.
The stack is merged into the base weights (kept factorised as each layer's frozen
``merged_B @ merged_A``, accumulated over rounds), and every client starts each round from a fresh
LoRA of its own rank (A random, B = 0). The server and the clients use the same scale s_k (the
public code's scaling mismatch is avoided), and every client's update enters the sum (its FedIT
branch's first-client-only average is avoided).

Downlink: the whole accumulated stack, so a client that skipped rounds is still exact (stateless
clients); it grows by sum_k r_k rows per round, which the byte accounting shows.
"""

from __future__ import annotations

from nestfed.config.capabilities import RANK_PREFIX_CLIENTS
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method

METHOD = lora_method(
    "flora",
    "stack the clients' p_k s_k B_k A_k exactly, merge into the base every round, "
    "fresh LoRA per round (Wang et al. 2024)",
    "nestfed.methods.flora.strategy",
    capabilities=RANK_PREFIX_CLIENTS | {C.RESUME, C.GLOBAL_MODEL},
    refusals={
        C.ROBUST_AGGREGATION: "FLoRA stacks every client's exact product B_k A_k, each in its own "
        "subspace: a coordinate-wise or distance rule over them means nothing (a norm bound, "
        "validation.max_update_norm, does apply; docs/trust.md)",
        C.SERVER_OPTIMIZER: "its global state is a stack that grows by sum_k r_k rows every round (the "
        "clients' exact products, merged into the base), so no array keeps its shape and there is no "
        "pseudo-gradient to step",
        C.SECURE_AGGREGATION: "it stacks every client's exact factors, which a sum of updates loses",
        C.EXPORT_AT_RANK: "its global state is a stack of every client's factors (rank sum_k r_k), "
        "not a nested adapter of rank r_max",
    },
)
