"""Text generation from the model as loaded (any adapter nestfed evaluates): greedy or sampled
decoding, batched with left padding and a KV cache reused across steps, or token by token through
the model's streams where its attention is bounded or a memory runs.

Two paths, one result:

- **Cache** (the backbone's attention, LoRA at any rank): a batch of prompts left-padded with a 0/1
  attention mask and positions counted from each row's first real token; one prefill pass, then
  one token per step against transformers' ``DynamicCache`` -- what ``model.generate`` does
  (tested equal to it, with the adapter exported to PEFT, token for token). Prompts are batched
  longest first (little padding), only the last position's logits are computed, and a row that
  stopped leaves the batch and its cache (``generate`` keeps computing it to the longest row).
- **Stream** (a window, sinks or an enabled delta-rule memory: nestfed.nn.bounded_attention,
  nestfed.nn.memory): every prompt is a stream (nestfed.evaluation.streaming) with its sinks at
  their own positions, prefilled in one chunk, then one token per chunk, so each generated token
  sees exactly what a one-pass forward over the same tokens sees: the window, the sinks and the
  memory state carried token by token. Prompts of one length are streamed together.

Decoding (`Decoding`): greedy at ``temperature = 0``; else softmax(logits / temperature)
restricted to the smallest set of tokens whose probability reaches ``top_p`` (nucleus sampling,
Holtzman et al. 2020), drawn with a generator per prompt seeded from (seed, the prompt's index),
so a prompt's text does not depend on the batch it ran in. A row stops at any of ``stop_ids``
(kept in its output) or after ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from nestfed.evaluation.streaming import chunk_logits, streaming
from nestfed.nn.bounded_attention import bounded_layers, enabled_bounds
from nestfed.nn.placement import autocast, to_model
from nestfed.seeds import stream_seed


@dataclass(frozen=True)
class Decoding:
    """How to pick tokens (module docstring).

    Attributes:
        max_new_tokens: the most tokens generated per prompt, >= 1; default 32.
        temperature: 0 = greedy (the default); else the softmax temperature.
        top_p: the nucleus's probability mass, in (0, 1]; default 1 (no cut).
        seed: sampling's seed (each prompt's generator is seeded from it and the prompt's index).

    Raises:
        ValueError: for a value out of range.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def _pick(logits: torch.Tensor, d: Decoding, gens: list[torch.Generator | None]) -> torch.Tensor:
    """Next tokens [B] from the last logits [B, V]."""
    if d.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / d.temperature, dim=-1)
    if d.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= d.top_p  # tokens past the nucleus
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.stack([torch.multinomial(probs[i].cpu(), 1, generator=g)[0] for i, g in enumerate(gens)]).to(
        logits.device
    )


def _generators(d: Decoding, index: Sequence[int]) -> list[torch.Generator | None]:
    if d.temperature == 0:
        return [None] * len(index)
    return [torch.Generator().manual_seed(stream_seed(d.seed, 0, i, "generation")) for i in index]


def uses_streams(model: nn.Module) -> bool:
    """Whether generation streams token by token (module docstring).

    Args:
        model: the backbone with the payload loaded.

    Returns:
        True when the model's attention is bounded (a deployment's fixed window) or a memory runs.
    """
    fixed = any(b.fixed and (b.window > 0 or b.sink > 0) for b in bounded_layers(model).values())
    return fixed or bool(enabled_bounds(model))


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    decoding: Decoding,
    stop_ids: Sequence[int],
    pad_id: int,
    batch_size: int = 8,
    on_batch: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """The new tokens of each prompt, in the prompts' order (module docstring).

    Args:
        model: the backbone with the payload loaded.
        prompts: the prompts' token ids, each non-empty.
        decoding: how to pick tokens.
        stop_ids: tokens that end a row (kept in its output).
        pad_id: the id prompts are left-padded with.
        batch_size: prompts per batch.
        on_batch: called with the rows done after each batch; None for no progress.

    Returns:
        Per prompt, its new token ids (a non-empty list; the stop token included when one ended the
            row).

    Raises:
        ValueError: for an empty prompt or batch_size < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("generate: every prompt needs at least one token")
    out: list[list[int] | None] = [None] * len(prompts)
    if uses_streams(model):
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(len(p), []).append(i)
        batches = [idx[s : s + batch_size] for idx in groups.values() for s in range(0, len(idx), batch_size)]
        run = _stream_batch
    else:  # longest first, so a batch holds prompts of like length and pads little
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        batches = [order[s : s + batch_size] for s in range(0, len(order), batch_size)]
        run = _cache_batch
    done = 0
    for idx in batches:
        for i, toks in zip(idx, run(model, [prompts[i] for i in idx], idx, decoding, set(stop_ids), pad_id)):
            out[i] = toks
        done += len(idx)
        if on_batch is not None:
            on_batch(done)
    return [o for o in out if o is not None]


def _finish(
    rows: list[list[int]],
    stop: set[int],
    d: Decoding,
    alive: list[bool],
    tokens: torch.Tensor,
    live: Sequence[int] | None = None,
) -> None:
    """Append ``tokens`` [len(live)] to the rows ``live`` (default: every row) that are alive, and
    mark those that stopped."""
    for r, t in zip(range(len(rows)) if live is None else live, tokens.tolist()):
        if alive[r]:
            rows[r].append(t)
            if t in stop or len(rows[r]) >= d.max_new_tokens:
                alive[r] = False


def _cache_batch(model, prompts, index, d: Decoding, stop: set[int], pad_id: int) -> list[list[int]]:
    """Left-padded prompts through transformers' KV cache (module docstring); a row that stopped
    leaves the batch (its cache rows dropped), so short answers do not pay for long ones."""
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, T - len(p) :] = torch.tensor(list(p))
        mask[r, T - len(p) :] = 1
    gens = _generators(d, index)
    cache = DynamicCache(config=model.config)
    rows: list[list[int]] = [[] for _ in prompts]
    alive = [True] * len(prompts)
    live = list(range(len(prompts)))  # the rows still in the batch, in its order
    step_ids = ids
    while True:
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)[:, -step_ids.shape[1] :]
        with autocast(model):
            logits = model(
                input_ids=to_model(model, step_ids),
                attention_mask=to_model(model, mask),
                position_ids=to_model(model, position_ids),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,  # the next token's logits only: no [B, T, V] at the prefill
            ).logits[:, -1]
        nxt = _pick(logits, d, [gens[r] for r in live]).cpu()
        _finish(rows, stop, d, alive, nxt, live)
        keep = [j for j, r in enumerate(live) if alive[r]]
        if not keep:
            return rows
        if len(keep) < len(live):
            sel = torch.tensor(keep)
            cache.batch_select_indices(to_model(model, sel))
            mask, nxt, live = mask[sel], nxt[sel], [live[j] for j in keep]
        step_ids = nxt.unsqueeze(1)
        mask = torch.cat([mask, torch.ones((len(live), 1), dtype=torch.long)], dim=1)


def _stream_bounds(model: nn.Module) -> tuple[int, int]:
    """The window and sinks a stream of this model uses: those of its enabled memory layers, else
    its fixed (deployment) bound; a window of 0 (none) streams as an unbounded one."""
    layers = list(enabled_bounds(model).values()) or [b for b in bounded_layers(model).values() if b.fixed]
    window = max((b.window for b in layers), default=0)
    sink = max((b.sink for b in layers), default=0)
    return window or 1 << 30, sink


def _stream_batch(model, prompts, index, d: Decoding, stop: set[int], pad_id: int) -> list[list[int]]:
    """Prompts of one length streamed together, one token per chunk after the prefill."""
    window, sink = _stream_bounds(model)
    gens = _generators(d, index)
    rows: list[list[int]] = [[] for _ in prompts]
    alive = [True] * len(prompts)
    ids = torch.tensor([list(p) for p in prompts])
    with streaming(model, "memory", window, sink, sink_positions="absolute"):
        logits = chunk_logits(model, ids, 0, last_only=True)[:, -1]
        pos = ids.shape[1]
        while True:
            nxt = _pick(logits, d, gens).cpu()
            _finish(rows, stop, d, alive, nxt)
            if not any(alive):
                return rows
            logits = chunk_logits(model, nxt.unsqueeze(1), pos)[:, -1]
            pos += 1
