"""Held-out evaluation: cross-entropy and perplexity, multiple-choice accuracy."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from nestfed.nn.frozen_prefix import labelled_logits


@torch.no_grad()
def evaluate_lm(
    model: nn.Module,
    labels: torch.Tensor,
    input_ids: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    start: int = 0,
    batch_size: int = 8,
    letter_ids: list[int] | None = None,
) -> dict[str, float]:
    """Token-weighted next-token cross-entropy over a dataset.

    Args:
        model: the backbone with the payload loaded.
        labels: [N, T] (HF convention, -100 ignored).
        input_ids: [N, T] token ids; or None when ``hidden`` is given.
        hidden: [N, T, d] the frozen prefix's outputs entering layer ``start``; or None.
        start: the first layer run on ``hidden``.
        batch_size: rows per forward pass.
        letter_ids: the candidate token ids (MMLU's 4 letters, a recall task's values); None for no
            accuracy.

    Returns:
        ``loss`` (nats per labelled token), ``ppl`` = exp(loss), ``tokens`` (labelled tokens
            counted) and, with ``letter_ids``, ``accuracy``: the fraction of labelled tokens whose
            argmax over the candidates' logits is the label (multiple choice has one labelled token
            per row, the gold letter; multi-query recall one per query).
    """
    total, count, correct = 0.0, 0, 0
    N = labels.shape[0]
    letters = None if letter_ids is None else torch.as_tensor(letter_ids)
    for i in range(0, N, batch_size):
        sl = slice(i, i + batch_size)
        lab = labels[sl]
        logits, targets = labelled_logits(
            model, lab, None if input_ids is None else input_ids[sl], None if hidden is None else hidden[sl], start
        )
        total += float(F.cross_entropy(logits.float(), targets, reduction="sum"))
        count += int(targets.numel())
        if letters is not None:
            letters = letters.to(logits.device)
            pred = letters[logits[:, letters].argmax(dim=1)]
            correct += int((pred == targets).sum())
    loss = total / max(count, 1)
    out = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": float(count)}
    if letter_ids is not None:
        out["accuracy"] = correct / max(count, 1)
    return out
