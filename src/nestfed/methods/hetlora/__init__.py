"""HetLoRA (Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation
Models", EMNLP 2024): zero-padding plus sparsity-weighted aggregation plus rank self-pruning.

- Local rank self-pruning: the client adds lambda * sum_layers ||s B_tail A_tail||_F to its loss,
  where the tail is the last ceil(tail * r_k) rank dimensions, and after local training prunes its
  rank to max(1, floor(prune_ratio * r_k)) when the tail's norm fell below its value in the
  client's previous round. It then sends the smaller adapter and keeps the smaller rank.
- Server: every reply zero-padded to r_max and averaged with weights proportional to the Frobenius
  norm of the client's update ||s B_k A_k||_F per layer (``weighting = "norm"``; ``"examples"``
  uses n_k, which with equal ranks and no pruning is exactly FedAvg). Each client then receives
  the global adapter truncated to its current rank.

Options: section ``[hetlora]`` (`HetLoRAOptions`).
"""

from __future__ import annotations

from dataclasses import dataclass

from nestfed.config import ExperimentConfig
from nestfed.config.capabilities import GLOBAL_ADAPTER, MEAN_AGGREGATOR, RANK_PREFIX_CLIENTS
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method

WEIGHTINGS = ("norm", "examples")


@dataclass(frozen=True)
class HetLoRAOptions:
    """Options of ``[hetlora]``.

    Attributes:
        reg: lambda, the weight of the rank self-pruning regulariser (>= 0).
        tail: the fraction of the rank it regularises, in (0, 1].
        prune_ratio: the rank kept when pruning, in (0, 1].
        weighting: ``norm`` (Frobenius norm of each update) or ``examples`` (n_k).
        pruning: whether clients prune their rank at all.

    Raises:
        ValueError: for a value out of range or an unknown weighting.
    """

    reg: float = 0.01
    tail: float = 0.25
    prune_ratio: float = 0.9
    weighting: str = "norm"
    pruning: bool = True

    def __post_init__(self) -> None:
        if self.reg < 0:
            raise ValueError(f"reg must be >= 0, got {self.reg}")
        if not 0 < self.tail <= 1:
            raise ValueError(f"tail must be in (0, 1], got {self.tail}")
        if not 0 < self.prune_ratio <= 1:
            raise ValueError(f"prune_ratio must be in (0, 1], got {self.prune_ratio}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be 'norm' or 'examples', got '{self.weighting}'")


def _check(cfg: ExperimentConfig) -> None:
    """A robust rule or central DP cuts the replies into one zero-padded block with n_k weights:
    HetLoRA's own rule only under ``weighting = "examples"`` (its norm weights have no block form).
    Raises ValueError naming the field."""
    if cfg.section("hetlora").weighting == "norm" and (cfg.robust.rule != "mean" or cfg.privacy.mode == "central"):
        field = "robust.rule" if cfg.robust.rule != "mean" else "privacy.mode"
        raise ValueError(
            f"{field}: hetlora aggregates robustly or with central DP only with hetlora.weighting = "
            "'examples' (its Frobenius-norm weights have no rank-block form; set it to use the rule)"
        )


METHOD = lora_method(
    "hetlora",
    "zero-pad, weights proportional to each update's Frobenius norm, rank "
    "self-pruning regulariser and pruning on the client (Cho et al. 2024)",
    "nestfed.methods.hetlora.strategy",
    sections={"hetlora": HetLoRAOptions},
    check_config=_check,
    capabilities=RANK_PREFIX_CLIENTS | MEAN_AGGREGATOR | GLOBAL_ADAPTER | {C.RESUME},
    refusals={
        C.SECURE_AGGREGATION: "its weights are each update's Frobenius norm, which no sum of updates gives",
    },
)
