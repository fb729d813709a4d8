"""FFA-LoRA (Sun et al., ICLR 2024): A frozen at its random initialisation, only B trained and averaged.

With A shared and fixed, averaging B averages B A exactly. Heterogeneous ranks are handled by
zero-padding B (the rows of A beyond a client's rank are simply unused by it).
"""

from __future__ import annotations

from nestfed.config.capabilities import GLOBAL_ADAPTER, MEAN_AGGREGATOR, RANK_PREFIX_CLIENTS
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method

METHOD = lora_method(
    "ffa_lora",
    "A frozen at its random init, only B trained and averaged (Sun et al. 2024)",
    "nestfed.methods.ffa_lora.strategy",
    capabilities=RANK_PREFIX_CLIENTS | MEAN_AGGREGATOR | GLOBAL_ADAPTER | {C.RESUME},
    refusals={
        C.SECURE_AGGREGATION: "its rebuild from sums (B only, A frozen) is not written",
    },
)
