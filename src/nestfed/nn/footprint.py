"""A client's training footprint at LoRA rank r: the memory model that turns a device's memory budget
into the largest rank it can train (``population.memory_mib``, nestfed.config.population).

    bytes(r) = W + 16 P(r) + S(r)

- W: the frozen backbone's parameters and buffers at their dtype (each storage once, LoRA excluded;
  a quantised backbone's packed weights and their quantisation state, ``model.quantization``);
- P(r) = r * sum over LoRA layers of (in + out): the trainable parameters at rank r, 16 bytes each
  (a float32 value, its gradient and AdamW's two moments; nestfed.nn.placement keeps what trains in
  float32);
- S(r): the bytes autograd saves for one (micro-)batch's backward, measured by a probe: one forward
  of a random batch of the configured shape (``train.micro_batch_size`` or ``train.batch_size`` rows
  of ``data.block_size`` tokens, entering the first adapted layer when the frozen prefix is cached)
  at ranks 1 and r_max under ``torch.autograd.graph.saved_tensors_hooks`` (storages counted once,
  parameters and buffers excluded); S is linear in r between and beyond the probes (every
  rank-dependent saved tensor is [B, T, r]), so activation checkpointing and micro-batches are
  accounted for as they are configured.

What it leaves out: the client's own data and cached prefix, the allocator's slack, kernels'
workspaces and the runtime (a lower bound on a step's peak: bench/perf/fedslm_memory.py sets the same
accounting beside the sampled resident memory). For a model of SmolLM2's size, LoRA on a few layers
changes bytes(r) by a few MB per rank step: budgets then choose ranks only when they sit close to
W + S, and the footprint of the whole model, not the rank, decides which devices can take part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from nestfed.config import TrainConfig
from nestfed.nn.frozen_prefix import labelled_logits
from nestfed.nn.lora import active_rank, lora_modules
from nestfed.nn.placement import model_device
from nestfed.nn.quantization import quantization_state_bytes


def weight_bytes(model: nn.Module) -> int:
    """Measure W, the bytes of the model's parameters and buffers, LoRA matrices excluded.

    Each storage counts once; for a quantised backbone the packed weights count at their integer
    dtype, plus the quantisation state beside them (nestfed.nn.quantization.quantization_state_bytes).

    Args:
        model: the backbone, LoRA injected or not.

    Returns:
        W, in bytes.
    """
    seen, total = set(), quantization_state_bytes(model)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if ".lora_" in name:
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def saved_bytes(model: nn.Module, batch: int, tokens: int, start: int, rank: int, seed: int = 0) -> int:
    """Measure S(rank), the bytes autograd saves during one training forward of a random batch.

    Every LoRA layer runs at sub-rank ``rank`` and trainable; the model's parameters keep their
    requires_grad flags afterwards.

    Args:
        model: the backbone with LoRA layers.
        batch: rows of the random batch.
        tokens: tokens per row.
        start: the decoder layer the batch enters (random hidden states), or 0 for token ids.
        rank: the sub-rank of every LoRA layer.
        seed: the random batch's seed.

    Returns:
        S(rank), in bytes (storages counted once, parameters and buffers excluded).
    """
    params = [p for m in lora_modules(model).values() for p in (m.lora_A.weight, m.lora_B.weight)]
    with active_rank(model, rank):
        return trained_saved_bytes(model, params, batch, tokens, start, seed)


def trained_saved_bytes(
    model: nn.Module, params: list[nn.Parameter], batch: int, tokens: int, start: int, seed: int = 0
) -> int:
    """Measure the bytes autograd saves during one training forward of a random batch, ``params`` trained.

    The probe behind `saved_bytes` for any trainable tensors (LoRA factors, a compressed model's
    SVD cores); the parameters keep their requires_grad flags afterwards.

    Args:
        model: a causal LM (the backbone, or a model derived from it).
        params: the parameters that train in the step (set to require grad for the probe).
        batch: rows of the random batch.
        tokens: tokens per row.
        start: the decoder layer the batch enters (random hidden states), or 0 for token ids.
        seed: the random batch's seed.

    Returns:
        The saved bytes (storages counted once, parameters and buffers excluded).
    """
    flags = [p.requires_grad for p in params]
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    labels = torch.randint(0, vocab, (batch, tokens), generator=g)
    dev = model_device(model)
    ids = hidden = None
    if start > 0:
        hidden = torch.randn(batch, tokens, model.config.hidden_size, generator=g).to(dev)
    else:
        ids = labels.clone()
    owned = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in owned:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    try:
        for p in params:
            p.requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits, targets = labelled_logits(
                model, labels.to(dev), None if ids is None else ids.to(dev), hidden, start
            )
            loss = F.cross_entropy(logits.float(), targets)
        del loss, logits
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)
    return int(sum(seen.values()))


def step_rows(train: TrainConfig) -> int:
    """Give the rows of one (micro-)batch a training step's backward holds at once.

    Args:
        train: the step's shape (``batch_size``, ``micro_batch_size``).

    Returns:
        ``train.micro_batch_size`` when it splits the batch, else ``train.batch_size``.
    """
    return train.micro_batch_size if 0 < train.micro_batch_size < train.batch_size else train.batch_size


@dataclass(frozen=True)
class TrainedFootprint:
    """The training footprint of a model whose trained tensors are fixed (e.g. a compressed model's SVD cores).

    bytes = weights + 16 * trainable + saved, the same accounting as `Footprint` (the module
    docstring) without a rank to vary.

    Attributes:
        weights: W, the bytes of the frozen parameters and buffers (the trained tensors excluded).
        trainable: trainable parameters, 16 bytes each (a float32 value, its gradient, AdamW's two moments).
        saved: bytes autograd saves for one (micro-)batch's backward (`trained_saved_bytes`).
    """

    weights: int
    trainable: int
    saved: int

    @property
    def bytes(self) -> int:
        """W + 16 P + S, in bytes."""
        return self.weights + 16 * self.trainable + self.saved

    @classmethod
    def measure(
        cls, model: nn.Module, params: list[nn.Parameter], train: TrainConfig, block_size: int, start: int
    ) -> TrainedFootprint:
        """Measure the footprint of a training step that trains ``params``: one probe forward.

        Args:
            model: the model (sharing storages with another is fine: each storage counts once).
            params: the parameters that train (each its own storage).
            train: the step's shape (``batch_size``, ``micro_batch_size``).
            block_size: tokens per row (``data.block_size``).
            start: the decoder layer the batch enters when the frozen prefix is cached, else 0.

        Returns:
            The footprint.
        """
        trained = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
        weights = weight_bytes(model) - sum(trained.values())
        saved = trained_saved_bytes(model, params, step_rows(train), block_size, start)
        return cls(weights, sum(p.numel() for p in params), saved)


@dataclass(frozen=True)
class Footprint:
    """A client's training footprint at any rank (the module docstring).

    bytes(r) = weights + 16 * per_rank * r + saved_at_1 + saved_slope * (r - 1).

    Attributes:
        weights: W, bytes.
        per_rank: trainable parameters per unit of rank, the sum of (in + out) over the LoRA layers.
        saved_at_1: S(1), bytes.
        saved_slope: (S(r_max) - S(1)) / (r_max - 1), bytes per unit of rank.
    """

    weights: int
    per_rank: int
    saved_at_1: int
    saved_slope: float

    @classmethod
    def measure(cls, model: nn.Module, train: TrainConfig, block_size: int, start: int) -> Footprint:
        """Measure the footprint of a model for the configured step: probes at ranks 1 and r_max.

        Args:
            model: the backbone, LoRA injected at r_max.
            train: the step's shape (``batch_size``, ``micro_batch_size``).
            block_size: tokens per row (``data.block_size``).
            start: the first adapted decoder layer when the frozen prefix is cached, else 0.

        Returns:
            The footprint (`saved_bytes` at ranks 1 and r_max).

        Raises:
            ValueError: for a model without LoRA layers.
        """
        modules = lora_modules(model)
        if not modules:
            raise ValueError("the model has no LoRA layers to size")
        per_rank = sum(m.in_features + m.out_features for m in modules.values())
        r_max = min(m.rank for m in modules.values())
        batch = step_rows(train)
        lo = saved_bytes(model, batch, block_size, start, 1)
        hi = saved_bytes(model, batch, block_size, start, r_max) if r_max > 1 else lo
        return cls(weight_bytes(model), per_rank, lo, (hi - lo) / (r_max - 1) if r_max > 1 else 0.0)

    def bytes(self, rank: int) -> int:
        """Evaluate the footprint at a rank.

        Args:
            rank: the LoRA rank r.

        Returns:
            bytes(r).

        Raises:
            ValueError: for rank < 1.
        """
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        return int(self.weights + 16 * self.per_rank * rank + self.saved_at_1 + self.saved_slope * (rank - 1))

    def describe(self, ranks: list[int]) -> dict[str, float]:
        """Tabulate the footprint at some ranks, for a report.

        Args:
            ranks: the ranks.

        Returns:
            ``{str(rank): MiB}``.
        """
        return {str(r): self.bytes(r) / 2**20 for r in ranks}
