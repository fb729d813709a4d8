"""FedSLM's ``[elicitation]`` section (step 4, weak-to-strong elicitation on the server)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ElicitationOptions:
    """Options of ``[elicitation]``: FedSLM's weak-to-strong elicitation on the server (step 4).

    The full model (LoRA of ``rank`` on the [lora] layers) learns from the weak fused model on the
    server text with L = (1 - a) CE(f_w, f_s) + a CE(hard(f_s), f_s).

    Attributes:
        alpha: a for the reported server model, in [0, 1].
        compare_alphas: further values of a evaluated beside it, each in [0, 1] (and always "none",
            the pretrained model).
        steps: AdamW steps of the elicitation (>= 0).
        batch_size: server-text blocks per step (>= 1).
        lr: the AdamW learning rate (> 0).
        rank: the student LoRA's rank (>= 1).
        seed: the order of the server text's batches.

    Raises:
        ValueError: for a value out of range.
    """

    alpha: float = 0.5
    compare_alphas: tuple[float, ...] = (0.0,)
    steps: int = 8
    batch_size: int = 4
    lr: float = 5e-3
    rank: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for a in (self.alpha, *self.compare_alphas):
            if not 0 <= a <= 1:
                raise ValueError(f"alpha / compare_alphas must be in [0, 1], got {a}")
        if self.steps < 0 or self.batch_size < 1 or self.lr <= 0 or self.rank < 1:
            raise ValueError("steps >= 0, batch_size >= 1, lr > 0 and rank >= 1 are required")
