"""Training and scoring on multi-query associative recall outside the federation: what pretrains
``tiny-llama-mqar`` (nestfed.experiments.pretrained_tiny) and what the memory's capability tests
and benchmark train (tests/nn/test_memory_capability.py, bench/studies/fednl_mqar_capability.py).

Rows come from nestfed.data.mqar (Zoology's MQAR; Arora et al. 2024); the loss is the next-token
cross-entropy on the queried values only, the accuracy the argmax over the vocabulary's values at
each queried position.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from nestfed.data.mqar import Vocab, mqar_batch


@dataclass(frozen=True)
class MqarTask:
    """The shape of an MQAR row and its tokens.

    Attributes:
        vocab: the keys and values (token ids).
        fillers: the filler token ids.
        pairs: the key-value pairs per row.
        queries: the queried keys per row (<= pairs).
        gap: the fillers between the pairs and the queries.
    """

    vocab: Vocab
    fillers: tuple[int, ...]
    pairs: int = 4
    queries: int = 4
    gap: int = 16

    def batch(self, n: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw fresh rows.

        Args:
            n: the number of rows.
            rng: the random source.

        Returns:
            input_ids and labels, each [n, 2 (pairs + queries) + gap] (labels -100 but at the
            queried values).
        """
        return mqar_batch(self.vocab, self.fillers, n, self.pairs, self.queries, self.gap, rng)


def train_on_mqar(
    model: nn.Module,
    groups: Sequence[dict[str, Any]],
    task: MqarTask,
    steps: int,
    batch: int,
    seed: int,
    on_step: Callable[[int, float], None] | None = None,
) -> float:
    """Train a model on fresh MQAR rows with AdamW; the model is left in eval mode.

    Args:
        model: a causal LM (``model(input_ids=...).logits``).
        groups: AdamW's parameter groups, each with its ``lr`` (no weight decay unless a group sets
            one); the parameters must require grad.
        task: the rows' shape.
        steps: the optimiser steps.
        batch: fresh rows per step.
        seed: the seed of the rows' ``random.Random``.
        on_step: called as ``on_step(step, loss)`` after each step; None: not called.

    Returns:
        The last step's loss (nats per queried value; 0.0 for no step).
    """
    opt = torch.optim.AdamW(list(groups), weight_decay=0.0)
    rng = random.Random(seed)
    model.train()
    loss = torch.tensor(0.0)
    for step in range(steps):
        ids, labels = task.batch(batch, rng)
        logits = model(input_ids=ids).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if on_step is not None:
            on_step(step, loss.item())
    model.eval()
    return loss.item()


@torch.no_grad()
def recall_accuracy(model: nn.Module, task: MqarTask, rows: int, seed: int, batch: int = 64) -> float:
    """The recall accuracy of a model on fresh MQAR rows.

    Args:
        model: a causal LM (``model(input_ids=...).logits``).
        task: the rows' shape.
        rows: the number of fresh rows.
        seed: the seed of the rows' ``random.Random``.
        batch: rows per forward pass.

    Returns:
        The fraction of queried values whose argmax over the vocabulary's values is right (chance:
        1 / len(values)).
    """
    rng = random.Random(seed)
    values = torch.tensor(task.vocab.values)
    right = total = 0
    for s in range(0, rows, batch):
        ids, labels = task.batch(min(batch, rows - s), rng)
        logits = model(input_ids=ids).logits[:, :-1]
        target = labels[:, 1:]
        mask = target != -100
        pred = values[logits[mask][:, values].argmax(-1)]
        right += int((pred == target[mask]).sum())
        total += int(mask.sum())
    return right / max(total, 1)
