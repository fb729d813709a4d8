"""Local training primitives every method shares: a batch, seeded batch orders, AdamW steps.

A `Batch` holds labels and either token ids or the frozen prefix's cached outputs
(nestfed.nn.frozen_prefix); its `Batch.loss` is the causal-LM cross-entropy with the LM
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
    """A training batch: labels and either token ids or the hidden states entering a decoder layer.

    Attributes:
        labels: [B, T] token ids; -100 = no loss.
        input_ids: [B, T] token ids, or None with ``hidden``.
        hidden: [B, T, d] the frozen prefix's outputs entering decoder layer ``start``, or None.
        start: the decoder layer ``hidden`` enters; 0 with ``input_ids``.
        share: this batch's fraction of its step's labelled tokens (1 for a whole batch; a
            micro-batch's share, `micro_batches`).
    """

    labels: torch.Tensor
    input_ids: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    start: int = 0
    share: float = 1.0

    def loss(self, model: nn.Module) -> torch.Tensor:
        """Compute the model's mean next-token cross-entropy on this batch, times ``share``.

        The LM head runs on the labelled positions only (nestfed.nn.frozen_prefix.labelled_logits).
        With ``share``, the micro-batches' losses of one step sum to the whole batch's, and so do
        their gradients.

        Args:
            model: the backbone with its adapters.

        Returns:
            A 0-dim tensor: nats per labelled token, times ``share``.
        """
        logits, targets = labelled_logits(model, self.labels, self.input_ids, self.hidden, self.start)
        loss = F.cross_entropy(logits.float(), targets)
        return loss if self.share == 1.0 else loss * self.share

    def micro_batches(self, size: int) -> list[Batch]:
        """Cut this batch into micro-batches for gradient accumulation.

        Backpropagating every micro-batch's `loss` gives the whole batch's gradient (up to float
        rounding) with one micro-batch's activations alive at a time.

        Args:
            size: rows per micro-batch; 0, or size >= B, keeps the batch whole.

        Returns:
            The micro-batches, each with its share of the labelled tokens; [self] when whole.
        """
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
    """Draw seeded batches of row indices.

    A permutation of 0..n-1 is consumed in order and redrawn when exhausted (every row once per
    epoch).

    Args:
        n: the number of rows.
        steps: the number of batches.
        batch_size: rows per batch (at most n are drawn).
        seed: the permutations' seed.

    Yields:
        ``steps`` LongTensors [min(batch_size, n)].
    """
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
    """Make one batch of some training rows of a client's data.

    Args:
        d: the client's data.
        idx: [n] the row indices.

    Returns:
        The batch, from the cached frozen-prefix outputs when ``d`` holds them, else from token
        ids.
    """
    if d.train_hidden is not None:
        return Batch(d.train_labels[idx], hidden=d.train_hidden[idx], start=d.start)
    return Batch(d.train_labels[idx], input_ids=d.train_ids[idx])


def client_batches(d: ClientData, steps: int, batch_size: int, seed: int) -> Iterator[Batch]:
    """Draw a client's training batches in the seeded order of `block_batches`.

    Args:
        d: the client's data.
        steps: the number of batches.
        batch_size: rows per batch.
        seed: the order's seed.

    Yields:
        ``steps`` batches (`rows_batch`).
    """
    for idx in block_batches(d.num_examples, steps, batch_size, seed):
        yield rows_batch(d, idx)


@contextmanager
def seeded_steps(seed: int, device: torch.device) -> Iterator[None]:
    """Seed torch's global generator inside the block, and restore the caller's state after.

    For what training draws from it (LoRA dropout's masks), so the draws depend on the seed alone.

    Args:
        seed: the seed.
        device: the training device; a CUDA device's generator is seeded (and restored) too.

    Yields:
        Nothing: the block runs with the seeded generators.
    """
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
    """Train parameters by AdamW steps (no weight decay) over seeded batches of rows.

    ``params`` train only here (requires_grad is switched on, then off); the global generator is
    seeded by ``seed`` meanwhile (`seeded_steps`).

    Args:
        params: the parameters trained.
        loss_of: ``loss_of(idx) -> scalar loss`` of a batch of row indices.
        n: the number of rows.
        steps: the number of steps.
        batch_size: rows per batch (`block_batches`).
        lr: AdamW's learning rate.
        seed: the batches' and the global generator's seed.
        max_grad_norm: the gradient-norm clipping bound; 0 for none.

    Returns:
        The loss of every step (nats).
    """
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
