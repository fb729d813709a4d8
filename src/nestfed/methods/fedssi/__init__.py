"""FedSSI (Li et al., "Rehearsal-Free Continual Federated Learning with Synergistic Synaptic
Intelligence", ICML 2025) as a baseline: FedAvg on the server; each client first runs a
personalised surrogate model from the global theta (eq. 5, mixing local and global knowledge
with lambda), takes its synaptic-intelligence parameter importance Omega along that path
(eq. 6-7), then trains with CE + c * sum Omega (theta - theta_global)^2 (eq. 2).

Options: section ``[fedssi]`` (`FedSSIOptions`).
"""

from __future__ import annotations

from dataclasses import dataclass

from nestfed.config.capabilities import GLOBAL_ADAPTER, MEAN_AGGREGATOR
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method


@dataclass(frozen=True)
class FedSSIOptions:
    """Options of ``[fedssi]``.

    Attributes:
        c: the regulariser's weight (>= 0).
        psm_lambda: the surrogate's mixing lambda, in (0, 1] (1: purely local).
        psm_steps: surrogate (PSM) steps per round (>= 0; 0: Omega = 1, a plain proximal term).
        xi: the synaptic-intelligence damping (> 0).

    Raises:
        ValueError: for a value out of range.
    """

    c: float = 0.1
    psm_lambda: float = 0.5
    psm_steps: int = 2
    xi: float = 1e-3

    def __post_init__(self) -> None:
        if self.c < 0:
            raise ValueError(f"c must be >= 0, got {self.c}")
        if not 0 < self.psm_lambda <= 1:
            raise ValueError(f"psm_lambda must be in (0, 1], got {self.psm_lambda}")
        if self.psm_steps < 0:
            raise ValueError(f"psm_steps must be >= 0, got {self.psm_steps}")
        if self.xi <= 0:
            raise ValueError(f"xi must be > 0, got {self.xi}")


METHOD = lora_method(
    "fedssi",
    "FedAvg with a synaptic-intelligence importance-weighted proximal term from a "
    "personalised surrogate (Li et al. 2025)",
    "nestfed.methods.fedssi.strategy",
    sections={"fedssi": FedSSIOptions},
    capabilities=MEAN_AGGREGATOR | GLOBAL_ADAPTER | {C.SECURE_AGGREGATION, C.RESUME},
)
