"""ZeroPad: heterogeneous ranks zero-padded to r_max and averaged over all clients with n_k weights.

The baseline PreLort (arXiv 2606.15963) is measured against (docs/methods.md, PreLort): client
A/B are padded with zeros to r_max and averaged in parameter space, which dilutes the high-rank rows.
"""

from __future__ import annotations

from nestfed.config.capabilities import GLOBAL_ADAPTER, MEAN_AGGREGATOR, RANK_PREFIX_CLIENTS
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method

METHOD = lora_method(
    "zeropad",
    "zero-pad every client adapter to r_max, average with n_k weights",
    "nestfed.methods.zeropad.strategy",
    capabilities=RANK_PREFIX_CLIENTS | MEAN_AGGREGATOR | GLOBAL_ADAPTER | {C.SECURE_AGGREGATION, C.RESUME},
)
