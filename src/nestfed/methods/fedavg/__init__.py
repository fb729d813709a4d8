"""FedAvg on homogeneous LoRA (McMahan et al., 2017): the n_k-weighted mean of every client's A and B."""

from __future__ import annotations

from nestfed.config.capabilities import GLOBAL_ADAPTER, MEAN_AGGREGATOR
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method

METHOD = lora_method(
    "fedavg",
    "homogeneous LoRA averaged with n_k weights (McMahan et al. 2017)",
    "nestfed.methods.fedavg.strategy",
    capabilities=MEAN_AGGREGATOR | GLOBAL_ADAPTER | {C.SECURE_AGGREGATION, C.RESUME},
)
