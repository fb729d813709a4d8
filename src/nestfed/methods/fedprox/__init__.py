"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar and Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020): FedAvg's aggregation, with the proximal term
mu/2 ||theta - theta_global||^2 added to every client's local loss (eq. 2).

Options: section ``[fedprox]`` (`FedProxOptions`).
"""

from __future__ import annotations

from dataclasses import dataclass

from nestfed.config.capabilities import GLOBAL_ADAPTER, MEAN_AGGREGATOR
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method


@dataclass(frozen=True)
class FedProxOptions:
    """Options of ``[fedprox]``.

    Attributes:
        mu: the proximal weight (>= 0; 0 is FedAvg exactly).

    Raises:
        ValueError: when mu < 0.
    """

    mu: float = 0.01

    def __post_init__(self) -> None:
        if self.mu < 0:
            raise ValueError(f"mu must be >= 0, got {self.mu}")


METHOD = lora_method(
    "fedprox",
    "FedAvg with the proximal term mu/2 ||theta - theta_global||^2 on every client (Li et al. 2020)",
    "nestfed.methods.fedprox.strategy",
    sections={"fedprox": FedProxOptions},
    capabilities=MEAN_AGGREGATOR | GLOBAL_ADAPTER | {C.SECURE_AGGREGATION, C.RESUME},
)
