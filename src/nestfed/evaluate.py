"""Held-out evaluation: cross-entropy and perplexity, multiple-choice accuracy."""

from __future__ import annotations

import math

import torch
from torch import nn

from nestfed.data.tasks import answer_positions, choice_logits
from nestfed.frozen_prefix import causal_lm_loss, lm_logits


@torch.no_grad()
def evaluate_lm(model: nn.Module, labels: torch.Tensor, input_ids: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None, start: int = 0, batch_size: int = 8,
                letter_ids: list[int] | None = None) -> dict[str, float]:
    """Token-weighted next-token cross-entropy over a dataset.

    labels: [N, T] (HF convention, -100 ignored); input_ids: [N, T] or hidden: [N, T, d] entering
    layer ``start``. Returns ``loss`` (nats per labelled token), ``ppl`` = exp(loss), ``tokens``
    (labelled tokens counted) and, when ``letter_ids`` (4 token ids) is given, ``accuracy``: the
    fraction of rows whose argmax over the 4 letter logits at the answer position is the gold letter.
    """
    total, count, correct, rows = 0.0, 0, 0, 0
    N = labels.shape[0]
    for i in range(0, N, batch_size):
        sl = slice(i, i + batch_size)
        logits = lm_logits(model, None if input_ids is None else input_ids[sl],
                           None if hidden is None else hidden[sl], start)
        lab = labels[sl]
        n_tok = int((lab[:, 1:] != -100).sum())
        total += float(causal_lm_loss(logits, lab, reduction="sum"))
        count += n_tok
        if letter_ids is not None:
            gold = lab.gather(1, (answer_positions(lab) + 1).unsqueeze(1)).squeeze(1)
            pred = torch.as_tensor(letter_ids)[choice_logits(logits, lab, letter_ids).argmax(dim=1)]
            correct += int((pred == gold).sum())
            rows += lab.shape[0]
    loss = total / max(count, 1)
    out = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": float(count)}
    if letter_ids is not None:
        out["accuracy"] = correct / max(rows, 1)
    return out
