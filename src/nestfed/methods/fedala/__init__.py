"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma and Guan, "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning", AAAI 2023): FedAvg on the server; each client starts a round
from theta_local + (theta_global - theta_local) * W on its top layers, with element-wise weights
W in [0, 1] it learns on local data (section 4, eq. 5-7). W and the local model never travel:
they are the client's kept state (``ala_weights``, ``ala_local``), checkpointed with the round.

Applied here to the trained parameters (LoRA A and B): ``layers`` = how many of the top decoder
layers holding LoRA are mixed (FedALA's p), ``steps`` = local batches spent learning W per round
(FedALA trains W to convergence in the first round it applies and one epoch after; a fixed step
count fits CPU budgets), ``eta`` = W's learning rate (FedALA's default 1.0).

Options: section ``[fedala]`` (`FedALAOptions`).
"""

from __future__ import annotations

from dataclasses import dataclass

from nestfed.config.capabilities import GLOBAL_ADAPTER, MEAN_AGGREGATOR
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method


@dataclass(frozen=True)
class FedALAOptions:
    """Options of ``[fedala]``.

    Attributes:
        layers: top decoder layers holding LoRA that are mixed element-wise (FedALA's p; >= 0).
        steps: ALA batches spent learning W per round (>= 0).
        eta: W's learning rate (> 0; FedALA's default 1.0).

    Raises:
        ValueError: for layers or steps < 0, or eta <= 0.
    """

    layers: int = 1
    steps: int = 2
    eta: float = 1.0

    def __post_init__(self) -> None:
        if self.layers < 0 or self.steps < 0:
            raise ValueError(f"layers and steps must be >= 0, got {self.layers}, {self.steps}")
        if self.eta <= 0:
            raise ValueError(f"eta must be > 0, got {self.eta}")


METHOD = lora_method(
    "fedala",
    "FedAvg; each client mixes the global and its local model on its top layers with "
    "element-wise weights it learns (Zhang et al. 2023)",
    "nestfed.methods.fedala.strategy",
    sections={"fedala": FedALAOptions},
    capabilities=MEAN_AGGREGATOR | GLOBAL_ADAPTER | {C.SECURE_AGGREGATION, C.RESUME},
)
