"""FedSLM step 4, weak-to-strong elicitation on the server (arXiv 2607.29071; docs/methods.md section 2).

The strong student f_s (the full pretrained model, trainable through LoRA) learns from the weak
supervisor f_w (the compressed model holding the fused W_g) on unlabeled server text with the
auxiliary confidence loss (Burns et al., 2023, "Weak-to-strong generalization", eq. 1):

    L = (1 - a) CE(f_w, f_s) + a CE(stopgrad(hard(f_s)), f_s)

per next-token position, CE(p, q) = -sum_v p(v) log q(v). ``hard`` makes the student's own
prediction a one-hot target at its argmax (decision: Burns et al. harden a classifier with a
threshold chosen to match the class balance; for a 49K-token vocabulary the argmax is the natural
hardening). a = 0 is pure imitation of the weak model; a > 0 anchors the student to its own
confident predictions ("imitation folly" mitigation).
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn import functional as F

from nestfed.federation.training import train_on_blocks
from nestfed.nn.frozen_prefix import CachedText


def confidence_loss(
    student_logits: torch.Tensor, weak_logits: torch.Tensor, alpha: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The auxiliary confidence loss, mean over the scored positions, in nats.

    Args:
        student_logits: [B, T, V] (carries the gradient).
        weak_logits: [B, T, V] (no gradient is taken through it).
        alpha: a in [0, 1].
        mask: [B, T] bool, the positions to score; None scores all.

    Returns:
        The 0-dim loss.

    Raises:
        ValueError: for alpha outside [0, 1] or mismatched shapes.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"elicitation alpha must be in [0, 1], got {alpha}")
    if student_logits.shape != weak_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and weak logits {tuple(weak_logits.shape)} differ in shape"
        )
    logq = F.log_softmax(student_logits.float(), dim=-1)  # [B, T, V]
    per_pos = torch.zeros(logq.shape[:-1], dtype=logq.dtype, device=logq.device)
    if alpha < 1.0:
        p_w = F.softmax(weak_logits.detach().float(), dim=-1)
        per_pos = per_pos + (1.0 - alpha) * -(p_w * logq).sum(-1)
    if alpha > 0.0:
        hard = student_logits.detach().argmax(-1, keepdim=True)  # [B, T, 1]
        per_pos = per_pos + alpha * -logq.gather(-1, hard).squeeze(-1)
    if mask is None:
        return per_pos.mean()
    m = mask.to(per_pos.dtype)
    return (per_pos * m).sum() / m.sum().clamp_min(1.0)


def elicit(
    student: nn.Module,
    params: list[nn.Parameter],
    weak: nn.Module,
    student_text: CachedText,
    weak_text: CachedText,
    alpha: float,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    max_grad_norm: float = 1.0,
) -> dict[str, float]:
    """Train ``params`` of the strong student for ``steps`` AdamW steps on the confidence loss.

    Batches of ``batch_size`` blocks are drawn in a seeded order without replacement (reshuffled per
    epoch). The weak model runs without gradient.

    Args:
        student: the full model with its LoRA.
        params: the student's trained parameters.
        weak: the weak model f_w.
        student_text: the server text as the student sees it.
        weak_text: the same blocks as the weak model sees them.
        alpha: a in [0, 1].
        steps: AdamW steps (>= 0).
        batch_size: blocks per step.
        lr: the learning rate.
        seed: the batch order's seed.
        max_grad_norm: the gradient clipping norm.

    Returns:
        ``loss_first`` and ``loss_last`` (nats, the first and last step's loss), ``steps``,
            ``time_s``.

    Raises:
        ValueError: for alpha outside [0, 1] or steps < 0.
    """
    if steps < 0:
        raise ValueError(f"elicitation steps must be >= 0, got {steps}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"elicitation alpha must be in [0, 1], got {alpha}")
    t0 = time.perf_counter()

    def loss_of(idx: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            w = weak_text.logits(weak, idx)
        return confidence_loss(student_text.logits(student, idx), w, alpha)

    student.train()
    losses = train_on_blocks(
        params, loss_of, student_text.input_ids.shape[0], steps, batch_size, lr, seed, max_grad_norm
    )
    student.eval()
    return {
        "loss_first": losses[0] if losses else float("nan"),
        "loss_last": losses[-1] if losses else float("nan"),
        "steps": float(steps),
        "time_s": time.perf_counter() - t0,
    }
