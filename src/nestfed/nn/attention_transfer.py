"""Attention transfer: fit a memory layer so that, under its window, it outputs what full softmax
attention outputs.

Source: LoLCATs (Zhang et al. 2025, "LoLCATs: On Low-Rank Linearizing of Large Language Models",
section 3.1, "attention transfer"): before any task training, each linearised layer is trained on
its own to match the frozen model's softmax attention output (MSE), fed the frozen model's own
inputs to that layer, with a learning rate of about 1e-2; LoRA comes after. Here the student is a
layer with its delta-rule memory enabled and its softmax path bounded by the window
(nestfed.nn.memory, nestfed.nn.bounded_attention); the teacher is the same layer with full
attention and no memory. Only what the memory adds (its rules) trains, so the window's part of
the output is the teacher's own, and what is left to fit is what lies past the window.

The error is reported relative to the target's mean square (``rel_mse`` = mean((y - y*)^2) /
mean(y*^2)), per layer, for the window alone (the memory knocked out), the memory at the start and
the memory after the fit: a memory that reads brings the last below the first.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nestfed.nn.bounded_attention import attention_modules, bounded_layers
from nestfed.nn.memory import memory_knocked_out, memory_rules


@dataclass
class LayerRecord:
    """What one memory layer receives and must give back over the transfer rows.

    Attributes:
        hidden: the layer's attention input [N, T, hidden].
        target: the full-attention output of its attention module [N, T, hidden] (after o_proj).
        position_embeddings: RoPE (cos, sin), each [1, T, D] (every row has positions 0..T-1).
        attention_mask: what the decoder layer handed its attention for the first batch (None for
            SDPA's implicit causal mask).
    """

    hidden: torch.Tensor
    target: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    attention_mask: Any = None


@dataclass
class TransferFacts:
    """What a fit did.

    Attributes:
        steps: optimiser steps taken.
        rows: transfer rows.
        tokens: rows x length, each seen once per epoch.
        seconds: wall time of the fit, measurements included.
        rel_mse: ``{layer: {"window": the window alone, "start": the memory before, "end": after}}``.
    """

    steps: int
    rows: int
    tokens: int
    seconds: float
    rel_mse: dict[int, dict[str, float]] = field(default_factory=dict)


@contextmanager
def full_attention(model: nn.Module) -> Iterator[None]:
    """Compute the backbone's full attention in every bounded layer within the block (the teacher).

    No window, no sinks, no memory; every bound and memory switch is restored afterwards.

    Args:
        model: the backbone with bounded layers.

    Yields:
        Nothing.
    """
    bounds = bounded_layers(model)
    rules = memory_rules(model)
    saved = {i: (b.window, b.sink, b.fixed) for i, b in bounds.items()}
    enabled = {i: r.enabled for i, r in rules.items()}
    for b in bounds.values():
        b.window, b.sink, b.fixed = 0, 0, False
    for r in rules.values():
        r.enabled = False
    try:
        yield
    finally:
        for i, (w, s, f) in saved.items():
            bounds[i].window, bounds[i].sink, bounds[i].fixed = w, s, f
        for i, e in enabled.items():
            rules[i].enabled = e


@torch.no_grad()
def record_layers(model: nn.Module, layers: list[int], input_ids: torch.Tensor, batch: int) -> dict[int, LayerRecord]:
    """Record the attention input and output of some decoder layers under full attention.

    Args:
        model: the backbone (run under `full_attention`).
        layers: the decoder layers to record.
        input_ids: [N, T] the transfer rows.
        batch: rows per forward.

    Returns:
        ``{layer: record}`` (`LayerRecord`).

    Raises:
        ValueError: for a layer without attention.
    """
    attns = attention_modules(model)
    seen: dict[int, dict[str, list]] = {i: {"h": [], "y": [], "pe": None, "mask": None} for i in layers}
    hooks = []

    def hook(i: int):
        def run(module, args, kwargs, output):
            h = kwargs.get("hidden_states", args[0] if args else None)
            seen[i]["h"].append(h.detach().clone())
            seen[i]["y"].append(output[0].detach().clone())
            if seen[i]["pe"] is None:
                cos, sin = kwargs["position_embeddings"]
                seen[i]["pe"] = (cos[:1].detach().clone(), sin[:1].detach().clone())
                seen[i]["mask"] = kwargs.get("attention_mask")

        return run

    for i in layers:
        if i not in attns:
            raise ValueError(f"attention transfer: layer {i} has no attention module")
        hooks.append(attns[i].register_forward_hook(hook(i), with_kwargs=True))
    try:
        with full_attention(model):
            for s in range(0, input_ids.shape[0], batch):
                model(input_ids=input_ids[s : s + batch].to(model.device))
    finally:
        for h in hooks:
            h.remove()
    return {i: LayerRecord(torch.cat(v["h"]), torch.cat(v["y"]), v["pe"], v["mask"]) for i, v in seen.items()}


def _student(attn: nn.Module, rec: LayerRecord, idx: torch.Tensor) -> torch.Tensor:
    """The layer's attention output [b, T, hidden] on rows ``idx`` of the record, as installed now
    (window, sinks, memory)."""
    cos, sin = rec.position_embeddings
    b = len(idx)
    mask = rec.attention_mask
    if isinstance(mask, torch.Tensor) and mask.shape[0] not in (1, b):
        mask = mask[:1]
    out, _ = attn(
        hidden_states=rec.hidden[idx],
        position_embeddings=(cos.expand(b, -1, -1), sin.expand(b, -1, -1)),
        attention_mask=mask,
    )
    return out


def _rel_mse(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (y.float() - target.float()).pow(2).mean() / target.float().pow(2).mean().clamp(min=1e-12)


@torch.no_grad()
def relative_errors(model: nn.Module, records: dict[int, LayerRecord], batch: int) -> dict[int, float]:
    """Measure each recorded layer as installed now against its full-attention target.

    Args:
        model: the backbone.
        records: ``{layer: record}`` from `record_layers`.
        batch: rows per forward.

    Returns:
        ``{layer: rel_mse}``.
    """
    attns = attention_modules(model)
    out = {}
    for i, rec in records.items():
        n = rec.hidden.shape[0]
        errs = [
            float(_rel_mse(_student(attns[i], rec, torch.arange(s, min(s + batch, n))), rec.target[s : s + batch]))
            * min(batch, n - s)
            for s in range(0, n, batch)
        ]
        out[i] = sum(errs) / n
    return out


def transfer_memory(
    model: nn.Module, records: dict[int, LayerRecord], steps: int, lr: float, batch: int, seed: int = 0
) -> TransferFacts:
    """Fit the memory rules of the recorded layers, minimising the sum over layers of rel_mse.

    Each layer trains on its own inputs, in one AdamW group, no weight decay, gradient norm clipped
    at 1; the memories must be installed and enabled.

    Args:
        model: the backbone with its memories.
        records: ``{layer: record}`` from `record_layers`.
        steps: optimiser steps.
        lr: AdamW's learning rate.
        batch: rows per step, drawn in a seeded order.
        seed: the order's seed.

    Returns:
        The facts: the window alone, start and end per layer.

    Raises:
        ValueError: when a recorded layer has no memory.
    """
    attns, rules = attention_modules(model), memory_rules(model)
    missing = [i for i in records if i not in rules]
    if missing:
        raise ValueError(f"attention transfer: layer(s) {missing} have no memory installed")
    t0 = time.perf_counter()
    with memory_knocked_out(model):
        window = relative_errors(model, records, batch)
    start = relative_errors(model, records, batch)
    params = [p for i in records for p in rules[i].parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    n = next(iter(records.values())).hidden.shape[0]
    g = torch.Generator().manual_seed(seed)
    order, pos = torch.randperm(n, generator=g), 0
    for _ in range(steps):
        if pos + batch > n:
            order, pos = torch.randperm(n, generator=g), 0
        idx = order[pos : pos + batch]
        pos += batch
        loss = sum(_rel_mse(_student(attns[i], rec, idx), rec.target[idx]) for i, rec in records.items())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    for p in params:
        p.requires_grad_(False)
    end = relative_errors(model, records, batch)
    T = next(iter(records.values())).hidden.shape[1]
    return TransferFacts(
        steps,
        n,
        n * T,
        time.perf_counter() - t0,
        {i: {"window": window[i], "start": start[i], "end": end[i]} for i in records},
    )
