"""FedMKT's ``[fedmkt]`` section."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FedMKTOptions:
    """Options of ``[fedmkt]``: FedMKT's mutual top-k logit distillation on the server text (Fan et al., COLING 2025).

    Attributes:
        topk: logits kept per token (>= 1).
        lm_weight: weight of the LM loss beside the distillation loss, in [0, 1] (FedMKT's code:
            0.9).
        client_steps: the clients' public distillation steps per round (>= 0).
        server_steps: the server's distillation steps per round (>= 0).
        batch_size: public blocks per step (>= 1).
        server_lr: AdamW learning rate of the server's LoRA (> 0).

    Raises:
        ValueError: for a value out of range.
    """

    topk: int = 10
    lm_weight: float = 0.9
    client_steps: int = 2
    server_steps: int = 5
    batch_size: int = 4
    server_lr: float = 5e-3

    def __post_init__(self) -> None:
        if (
            self.topk < 1
            or not 0 <= self.lm_weight <= 1
            or self.client_steps < 0
            or self.server_steps < 0
            or self.batch_size < 1
            or self.server_lr <= 0
        ):
            raise ValueError(
                "topk >= 1, lm_weight in [0, 1], steps >= 0, batch_size >= 1 and server_lr > 0 are required"
            )
