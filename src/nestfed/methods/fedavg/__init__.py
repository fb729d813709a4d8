"""FedAvg on homogeneous LoRA (McMahan et al., 2017): the n_k-weighted mean of every client's A and B."""

from __future__ import annotations

from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method

METHOD = lora_method(
    "fedavg",
    "homogeneous LoRA averaged with n_k weights (McMahan et al. 2017)",
    "nestfed.methods.fedavg.strategy",
    capabilities=frozenset(
        {C.ROBUST_AGGREGATION, C.SECURE_AGGREGATION, C.SERVER_OPTIMIZER, C.RESUME, C.GLOBAL_MODEL, C.EXPORT_AT_RANK}
    ),
)
