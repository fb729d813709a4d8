"""Streaming inference at constant memory: a token stream of any length, one chunk at a time.

FedNL's inference (arXiv 2605.16350, section 4.3; docs/methods.md section 3): the softmax path of each
layer keeps a KV cache bounded by its sliding window, the delta-rule memory S carries everything
older, so the state carried from chunk to chunk has a fixed size whatever the stream's length.

Every attention layer needs a bounded attention installed to hold its stream state
(`nestfed.nn.bounded_attention.install_bounded_attention`; FedNL's memory layers have one); a
layer without an enabled memory runs the backbone's attention over its window only
(``mode = "window"``) or over everything seen (``mode = "full"``, unbounded: the plain-attention
baseline). Every mode keeps each layer's own sliding window where the model has
one (Qwen2's ``use_sliding_window``, Gemma-3's local layers), and each layer's rotary embedding and
mask are built as the model builds them, under SDPA or eager attention alike
(nestfed.nn.layer_inputs): ``mode = "full"`` computes ``model(ids).logits`` chunk by chunk
(tested). `stream_nll` returns the next-token negative log-likelihood of every token after
the first, which is the same whether the stream is cut into chunks or not (tested), and
`binned_ce` turns it into the streaming-CE probe's bins.

A model without bounded attention streams through Hugging Face's own KV cache with
`stream_nll_hf` (the backbone's plain attention, its cache growing with the stream).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F
from transformers import DynamicCache

from nestfed.nn.bounded_attention import LayerStream, attention_modules, bounded_layers
from nestfed.nn.layer_inputs import layer_rotary, layer_types, rope_kind, rotary
from nestfed.nn.placement import autocast, to_model

MODES = ("memory", "window", "full")
SINK_POSITIONS = ("cache", "absolute")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # frequencies independent of the position


@dataclass
class StreamStats:
    """What a stream cost.

    Attributes:
        state_bytes: the state carried after each chunk (KV caches, memory states, tails), in bytes.
        tokens: tokens processed.
        chunks: chunks processed.
    """

    state_bytes: list[int] = field(default_factory=list)
    tokens: int = 0
    chunks: int = 0


@contextmanager
def streaming(
    model: nn.Module, mode: str = "memory", window: int = 512, sink: int = 0, sink_positions: str = "cache"
) -> Iterator[dict[int, LayerStream]]:
    """Attach a fresh `LayerStream` to every attention layer for the duration of a stream.

    The streams are detached on exit.

    Args:
        model: the backbone, bounded attention installed on every attention layer.
        mode: ``memory``: layers whose memory is enabled run it, every softmax path uses the window;
            ``window``: no memory, every softmax path windowed (a sliding-window baseline);
            ``full``: no memory and no stream window (the model's own attention; the cache is
            bounded only by the layers' own sliding windows).
        window: the stream's window in tokens (>= 1 for ``memory`` and ``window``).
        sink: the first tokens every windowed query keeps seeing (attention sinks,
            nn/bounded_attention.py; 0 = none).
        sink_positions: ``cache``: before each chunk the sinks move to the positions just before the
            window (StreamingLLM's positions within the cache, Xiao et al., ICLR 2024, section 3.2;
            `shift_sinks`), so no query is ever further than ``sink + window + chunk`` tokens
            from a key it sees, whatever the stream's length; ``absolute``: sink j stays at position
            j (past the backbone's trained context once the stream is long enough).

    Yields:
        {layer index: LayerStream}.

    Raises:
        ValueError: for an unknown mode or sink_positions, a bad window, or a layer without bounded
            attention.
    """
    if mode not in MODES:
        raise ValueError(f"stream mode must be one of {', '.join(MODES)}, got '{mode}'")
    if sink_positions not in SINK_POSITIONS:
        raise ValueError(f"sink_positions must be one of {', '.join(SINK_POSITIONS)}, got '{sink_positions}'")
    if mode != "full" and window < 1:
        raise ValueError(f"stream mode '{mode}' needs a window >= 1 token, got {window}")
    layers = bounded_layers(model)
    missing = [i for i in attention_modules(model) if i not in layers]
    if missing:
        raise ValueError(
            f"streaming needs bounded attention on every attention layer; layer {missing[0]} has none "
            "(nestfed.nn.bounded_attention.install_bounded_attention(model))"
        )
    streams = {}
    for i, bounds in layers.items():
        streams[i] = LayerStream(
            window=0 if mode == "full" else window, memory=mode == "memory", sink=sink, sink_positions=sink_positions
        )
        bounds.stream = streams[i]
    try:
        yield streams
    finally:
        for bounds in layers.values():
            bounds.stream = None


def shift_sinks(model: nn.Module, pos: int) -> None:
    """Move the streams' sinks before a chunk whose first token sits at position ``pos``.

    Every attached stream whose sinks use cache positions gets the RoPE rotation that moves sink j
    to ``pos - window + 1 - sink + j`` (just before the first window key the chunk's first query
    sees), or none while that shift is <= 0 (the sinks are still in place). StreamingLLM (Xiao et
    al., ICLR 2024), section 3.2.

    The shift composes with the sinks' own rotation, so the RoPE frequencies must not depend on the
    position (``rope_type`` default, linear, llama3 or yarn; yarn's attention scaling is divided out
    so the sinks are not scaled twice). Each layer's shift uses its own layer type's rotation
    (Gemma-3's local and global bases).

    Args:
        model: the backbone with streams attached.
        pos: the chunk's first absolute position.

    Raises:
        ValueError: for another rope_type (dynamic, longrope): stream those with ``sink_positions =
            "absolute"``.
    """
    ref = model.model.embed_tokens.weight
    types = layer_types(model)
    for i, bounds in bounded_layers(model).items():
        st = bounds.stream
        if st is None:
            continue
        delta = pos - st.window + 1 - st.sink
        if st.sink_positions != "cache" or st.window < 1 or st.sink < 1 or delta <= 0:
            st.sink_rotation = None
            continue
        kind, scale = rope_kind(model, types[i])
        if kind not in STATIC_ROPE:
            raise ValueError(
                f"sink_positions 'cache' needs position-independent RoPE frequencies "
                f"({', '.join(STATIC_ROPE)}); this model's rope_type is '{kind}': "
                "use sink_positions 'absolute'"
            )
        cos, sin = rotary(model, ref[:1].unsqueeze(0), torch.tensor([[delta]], device=ref.device), types[i])
        st.sink_rotation = (cos / scale, sin / scale)  # each [1, 1, D]


def chunk_logits(model: nn.Module, ids: torch.Tensor, pos: int, last_only: bool = False) -> torch.Tensor:
    """Logits of one chunk whose first token sits at absolute position ``pos``.

    The streams' sinks are shifted first (`shift_sinks`). Each layer gets the rotary embedding
    of its type at the chunk's positions (nestfed.nn.layer_inputs.layer_rotary); its bounded
    attention builds the mask over its stream's cache (the layer's own sliding window, the stream's
    window and sinks) in its attention implementation's format
    (nestfed.nn.layer_inputs.positional_mask).

    Args:
        model: the backbone with streams attached.
        ids: [B, T] the chunk's token ids.
        pos: the chunk's first absolute position.
        last_only: compute the last position's logits only, as generation needs.

    Returns:
        [B, T, V] logits; [B, 1, V] with ``last_only``.
    """
    inner = model.model
    shift_sinks(model, pos)
    ids = to_model(model, ids)
    with autocast(model):  # the device and dtype policy: nestfed.nn.placement
        h = inner.embed_tokens(ids)
        position_ids = torch.arange(pos, pos + ids.shape[1], device=ids.device).unsqueeze(0)
        embeddings = layer_rotary(model, h, position_ids)
        for layer, pe in zip(inner.layers, embeddings):
            out = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=pe)
            h = out[0] if isinstance(out, tuple) else out
        return model.lm_head(inner.norm(h[:, -1:] if last_only else h))


def _nll_of_chunk(logits: torch.Tensor, prev_last: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """NLL [B, T'] of the chunk's tokens predictable so far: the first from the previous chunk's
    last logits (when there is one), the rest from this chunk's logits."""
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    ids = ids.to(logits.device)
    parts = []
    if prev_last is not None:
        parts.append(F.cross_entropy(prev_last.to(dt), ids[:, 0], reduction="none").unsqueeze(1))
    if ids.shape[1] > 1:
        lg = logits[:, :-1].to(dt)
        parts.append(
            F.cross_entropy(lg.reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1), reduction="none").view(
                ids.shape[0], -1
            )
        )
    return torch.cat(parts, dim=1) if parts else logits.new_zeros(ids.shape[0], 0, dtype=dt)


@torch.no_grad()
def stream_nll(
    model: nn.Module,
    ids: torch.Tensor,
    chunk: int = 1024,
    mode: str = "memory",
    window: int = 512,
    stats: StreamStats | None = None,
    sink: int = 0,
    on_chunk: Callable[[int, StreamStats], None] | None = None,
    sink_positions: str = "cache",
) -> torch.Tensor:
    """Next-token NLL of tokens 1..N-1 of a stream, ``chunk`` tokens at a time.

    The stream runs through the model's memory layers. Only one chunk's activations and logits live
    at a time; the state carried between chunks is bounded by the window (mode ``memory`` /
    ``window``). With sinks at cache positions the NLL depends on ``chunk``.

    Args:
        model: the backbone, bounded attention installed.
        ids: [B, N] token ids.
        chunk: tokens per chunk.
        mode: the stream mode (`streaming`).
        window: the stream's window in tokens (`streaming`).
        stats: filled with the state bytes after each chunk, when given.
        sink: attention sinks (`streaming`).
        on_chunk: called as ``on_chunk(chunk index, stats)`` after each chunk; None for none.
        sink_positions: ``cache`` or ``absolute`` (`streaming`).

    Returns:
        [B, N - 1] NLL in nats (fp32; fp64 for an fp64 model).

    Raises:
        ValueError: as `streaming` raises it, or for chunk < 1 or a non-2-D ids.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, got {chunk}")
    if ids.dim() != 2:
        raise ValueError(f"ids must be [B, N], got shape {tuple(ids.shape)}")
    stats = stats if stats is not None else StreamStats()
    out = []
    prev_last = None
    with streaming(model, mode, window, sink, sink_positions) as streams:
        for n, start in enumerate(range(0, ids.shape[1], chunk)):
            part = ids[:, start : start + chunk]
            logits = chunk_logits(model, part, start)
            out.append(_nll_of_chunk(logits, prev_last, part))
            prev_last = logits[:, -1]
            del logits
            stats.tokens += part.shape[1]
            stats.chunks += 1
            stats.state_bytes.append(sum(s.nbytes() for s in streams.values()))
            if on_chunk is not None:
                on_chunk(n, stats)
    return torch.cat(out, dim=1)


@torch.no_grad()
def stream_nll_hf(
    model: nn.Module,
    ids: torch.Tensor,
    chunk: int = 1024,
    stats: StreamStats | None = None,
    on_chunk: Callable[[int, StreamStats], None] | None = None,
) -> torch.Tensor:
    """The plain-attention baseline: the same NLL through Hugging Face's DynamicCache.

    Its keys and values grow with every token (the backbone as it ships).

    Args:
        model: the backbone.
        ids: [B, N] token ids.
        chunk: tokens per chunk.
        stats: filled with the cache bytes after each chunk, when given.
        on_chunk: called as ``on_chunk(chunk index, stats)`` after each chunk; None for none.

    Returns:
        [B, N - 1] NLL in nats.

    Raises:
        ValueError: for chunk < 1 or a non-2-D ids.
    """
    if chunk < 1 or ids.dim() != 2:
        raise ValueError(f"need chunk >= 1 and ids [B, N]; got chunk {chunk}, ids {tuple(ids.shape)}")
    stats = stats if stats is not None else StreamStats()
    cache = DynamicCache(config=model.config)
    out, prev_last = [], None
    for n, start in enumerate(range(0, ids.shape[1], chunk)):
        part = ids[:, start : start + chunk]
        with autocast(model):
            logits = model(input_ids=to_model(model, part), past_key_values=cache, use_cache=True).logits
        out.append(_nll_of_chunk(logits, prev_last, part))
        prev_last = logits[:, -1]
        del logits
        stats.tokens += part.shape[1]
        stats.chunks += 1
        stats.state_bytes.append(
            sum(
                t.numel() * t.element_size()
                for layer in cache.layers
                for t in (layer.keys, layer.values)
                if t is not None
            )
        )
        if on_chunk is not None:
            on_chunk(n, stats)
    return torch.cat(out, dim=1)


def binned_ce(nll: torch.Tensor, bin_size: int = 1024) -> dict[str, list[float]]:
    """The streaming-CE probe's curve (FedNL, arXiv 2605.16350, section 5.3).

    The mean NLL of each bin of ``bin_size`` consecutive predicted tokens, and each bin relative to
    the first.

    Args:
        nll: [N'] or [B, N'] (averaged over B).
        bin_size: predicted tokens per bin.

    Returns:
        ``ce`` (nats per token per bin), ``relative`` (ce / ce[0]), ``tokens`` (tokens per bin; the
            last bin may be shorter).

    Raises:
        ValueError: for an empty nll or bin_size < 1.
    """
    if bin_size < 1 or nll.numel() == 0:
        raise ValueError("binned_ce needs a non-empty nll and bin_size >= 1")
    x = nll.float().mean(0) if nll.dim() == 2 else nll.float()
    ce, tokens = [], []
    for s in range(0, x.numel(), bin_size):
        b = x[s : s + bin_size]
        ce.append(float(b.mean()))
        tokens.append(int(b.numel()))
    return {"ce": ce, "relative": [c / ce[0] for c in ce], "tokens": tokens}


@torch.no_grad()
def stream_evaluate(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    chunk: int,
    window: int,
    letter_ids: list[int] | None = None,
    sink: int = 0,
    sink_positions: str = "cache",
) -> dict[str, float]:
    """Held-out metrics of right-padded rows, each streamed alone at constant memory.

    Mode ``memory``: enabled memory layers run their memory, every softmax path sees ``window``
    tokens. For contexts whose one-pass forward does not fit (NIAH at 8K/16K on a CPU). The numbers
    are those `nestfed.evaluation.lm.evaluate_lm` gives when the one-pass forward uses the
    same window (tested; with sinks, for ``sink_positions="absolute"``, the one-pass forward's).

    Args:
        model: the backbone, bounded attention installed.
        input_ids: [N, T] token ids.
        labels: [N, T] (HF convention, -100 ignored; a row ends at its last labelled token).
        chunk: tokens per chunk.
        window: the stream's window in tokens.
        letter_ids: the candidate ids for accuracy; None for none.
        sink: attention sinks (`streaming`).
        sink_positions: ``cache`` or ``absolute`` (`streaming`).

    Returns:
        ``loss`` (nats per labelled token), ``ppl``, ``tokens`` and, with ``letter_ids``,
            ``accuracy``: the fraction of labelled tokens whose argmax over the candidates' logits
            is the label (one per row for multiple choice).

    Raises:
        ValueError: as `streaming` raises it, or for mismatched shapes.
    """
    if input_ids.shape != labels.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} must both be [N, T]")
    total, count, correct = 0.0, 0, 0
    letters = None if letter_ids is None else torch.as_tensor(letter_ids)
    for r in range(input_ids.shape[0]):
        lab = labels[r]
        marked = (lab != -100).nonzero().flatten()
        if marked.numel() == 0:
            continue
        end = int(marked.max()) + 1
        ids = input_ids[r : r + 1, :end]
        want = set((marked - 1).clamp(min=0).tolist())  # positions whose logits predict a label
        with streaming(model, "memory", window, sink, sink_positions):
            for start in range(0, end, chunk):
                part = ids[:, start : start + chunk]
                logits = chunk_logits(model, part, start)[0]  # [t, V]
                for p in sorted(x for x in want if start <= x < start + part.shape[1]):
                    if p + 1 >= end or int(lab[p + 1]) == -100:
                        continue
                    row = logits[p - start].float().cpu()  # one row of logits [V], in host memory
                    total += float(F.cross_entropy(row.unsqueeze(0), lab[p + 1 : p + 2]))
                    count += 1
                    if letters is not None:
                        correct += int(letters[row[letters].argmax()] == lab[p + 1])
    loss = total / max(count, 1)
    out = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": float(count)}
    if letters is not None:
        out["accuracy"] = correct / max(count, 1)
    return out
