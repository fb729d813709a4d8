"""Local training primitives every method shares: a batch, seeded batch orders, AdamW steps.

A :class:`Batch` holds labels and either token ids or the frozen prefix's cached outputs
(nestfed.nn.frozen_prefix); its :meth:`Batch.loss` is the causal-LM cross-entropy with the LM
head run only where a next token is labelled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from nestfed.data.clients import ClientData
from nestfed.nn.frozen_prefix import labelled_logits


@dataclass
class Batch:
    """A training batch: labels [B, T] (-100 = no loss); input_ids [B, T] or hidden [B, T, d]
    entering decoder layer ``start``. share: this batch's fraction of its step's labelled tokens
    (1 for a whole batch; a micro-batch's share, :meth:`micro_batches`)."""

    labels: torch.Tensor
    input_ids: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    start: int = 0
    share: float = 1.0

    def loss(self, model: nn.Module) -> torch.Tensor:
        """Mean next-token cross-entropy (nats per labelled token) of the model on this batch (the LM
        head runs on the labelled positions only: nestfed.nn.frozen_prefix.labelled_logits), times
        ``share``: the micro-batches' losses of one step sum to the whole batch's, and so do their
        gradients."""
        logits, targets = labelled_logits(model, self.labels, self.input_ids, self.hidden, self.start)
        loss = F.cross_entropy(logits.float(), targets)
        return loss if self.share == 1.0 else loss * self.share

    def micro_batches(self, size: int) -> list[Batch]:
        """This batch cut into micro-batches of ``size`` rows (0, or size >= B: the batch itself),
        each with its share of the labelled tokens, for gradient accumulation: backpropagating every
        micro-batch's :meth:`loss` gives the whole batch's gradient (up to float rounding) with one
        micro-batch's activations alive at a time."""
        B = self.labels.shape[0]
        if size <= 0 or size >= B:
            return [self]
        total = max(int((self.labels[:, 1:] != -100).sum()), 1)
        out = []
        for i in range(0, B, size):
            sl = slice(i, i + size)
            labels = self.labels[sl]
            out.append(
                Batch(
                    labels,
                    None if self.input_ids is None else self.input_ids[sl],
                    None if self.hidden is None else self.hidden[sl],
                    self.start,
                    self.share * int((labels[:, 1:] != -100).sum()) / total,
                )
            )
        return out


def block_batches(n: int, steps: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Seeded batches of row indices [min(batch_size, n)]: a permutation of 0..n-1 consumed in
    order and redrawn when exhausted (every row once per epoch). Yields ``steps`` LongTensors."""
    g = torch.Generator().manual_seed(seed)
    order, pos = torch.randperm(n, generator=g), 0
    for _ in range(steps):
        idx = []
        while len(idx) < min(batch_size, n):
            if pos == n:
                order, pos = torch.randperm(n, generator=g), 0
            idx.append(int(order[pos]))
            pos += 1
        yield torch.tensor(idx)


def rows_batch(d: ClientData, idx: torch.Tensor) -> Batch:
    """The training rows ``idx`` [n] of client data ``d`` as one batch (from the cached
    frozen-prefix outputs when ``d`` holds them, else from token ids)."""
    if d.train_hidden is not None:
        return Batch(d.train_labels[idx], hidden=d.train_hidden[idx], start=d.start)
    return Batch(d.train_labels[idx], input_ids=d.train_ids[idx])


def client_batches(d: ClientData, steps: int, batch_size: int, seed: int) -> Iterator[Batch]:
    """``steps`` training batches of client data ``d`` in the seeded order of :func:`block_batches`
    (:func:`rows_batch`)."""
    for idx in block_batches(d.num_examples, steps, batch_size, seed):
        yield rows_batch(d, idx)


@contextmanager
def seeded_steps(seed: int, device: torch.device) -> Iterator[None]:
    """Inside: torch's global generator (the CPU's and ``device``'s when it is a CUDA device) seeded
    with ``seed``, for what training draws from it (LoRA dropout's masks); after: the caller's
    state restored, so the draws depend on the seed alone."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def train_on_blocks(
    params: list[nn.Parameter],
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    n: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    max_grad_norm: float = 1.0,
) -> list[float]:
    """``steps`` AdamW steps (no weight decay) of ``loss_of(idx) -> scalar loss`` over seeded batches of
    the n rows (:func:`block_batches`), with gradient-norm clipping. ``params`` train only here
    (requires_grad is switched on, then off); the global generator is seeded by ``seed`` meanwhile
    (:func:`seeded_steps`). Returns the loss of every step (nats)."""
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses = []
    with seeded_steps(seed, params[0].device if params else torch.device("cpu")):
        for idx in block_batches(n, steps, batch_size, seed):
            loss = loss_of(idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            opt.step()
            losses.append(loss.item())
    for p in params:
        p.requires_grad_(False)
    return losses
