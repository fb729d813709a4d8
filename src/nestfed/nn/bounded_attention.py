"""The backbone's softmax attention with a bounded context: an optional sliding window with attention
sinks, a stream's KV cache carried from chunk to chunk, and an optional linear path mixed in.

`install_bounded_attention` replaces the ``forward`` of chosen decoder layers' attention
modules (the module and its q/k/v/o projections keep their paths, so LoRA keys stay PEFT's
``...self_attn.q_proj.lora_A.weight``) and gives each a `Bounds` at ``self_attn.bounds``.
With no stream and no enabled linear path the layer computes exactly the backbone's attention
(tested bit for bit). A linear path (`LinearPath`, e.g. FedNL's delta-rule memory,
nestfed.nn.memory) is a submodule at ``self_attn.memory``: while it is enabled the softmax path
uses its window and sinks and the layer's output is the path's mix of both.

- Window: query t sees keys t - window + 1 .. t (0 = none). Sinks: the first ``sink`` tokens stay
  visible to every windowed query (StreamingLLM, Xiao et al., ICLR 2024: a model trained with full
  attention parks attention mass on the first tokens); under left padding they are each row's
  first real tokens. The KV cache of a stream then holds ``sink + window - 1`` tokens, constant.
- Streams (nestfed.evaluation.streaming): a `LayerStream` at ``bounds.stream`` carries the
  RoPE'd KV cache, trimmed to the narrower of the stream's window and the layer's own, and the
  linear path's own state (``stream.state``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from nestfed.nn.layer_inputs import layer_window, positional_mask


@dataclass
class LayerStream:
    """What one attention layer carries from one chunk of a token stream to the next.

    The cache keeps the sinks rotated at their own positions (RoPE rotations compose:
    R(j + delta) = R(delta) R(j)).

    Attributes:
        window: this stream's softmax window, tokens; 0 = none.
        memory: whether an enabled linear path runs.
        sink: attention-sink tokens kept visible; 0 = none.
        pos: tokens already seen (the next chunk's first absolute position).
        k: the softmax path's cached keys [B, H_kv, c, D] after RoPE: at most ``window - 1`` tokens
            when window > 0 (plus the first ``sink`` tokens); unbounded when window = 0.
        v: the cached values [B, H_kv, c, D], as k.
        n_sink: how many of the cached keys are sinks (they come first).
        sink_positions: ``absolute`` (the sinks keep their positions) or ``cache``
            (nestfed.evaluation.streaming.shift_sinks sets ``sink_rotation`` per chunk).
        sink_rotation: RoPE (cos, sin), each [1, 1, D], of a shift delta (tokens) applied to the
            cached sinks for the next chunk only, so that sink j sits at position j + delta just
            before the window (StreamingLLM's positions within the cache, section 3.2) rather than
            at j, thousands of tokens away from the queries; None = the sinks keep their absolute
            positions.
        state: the linear path's carried tensors (nestfed.nn.memory: the delta-rule state and its
            tails).
    """

    window: int = 0
    memory: bool = True
    sink: int = 0
    pos: int = 0
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    n_sink: int = 0
    sink_positions: str = "absolute"  # "cache": nestfed.evaluation.streaming.shift_sinks sets sink_rotation per chunk
    sink_rotation: tuple[torch.Tensor, torch.Tensor] | None = None
    state: dict[str, torch.Tensor] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Measure the memory this layer's stream state holds.

        Returns:
            Bytes of the KV cache and the linear path's state.
        """
        tensors = [self.k, self.v, *self.state.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class Bounds:
    """One wrapped attention layer's context bounds and per-call state.

    Attributes:
        window: the softmax window (tokens) while the layer's linear path is enabled, and a
            stream's default (nestfed.evaluation.streaming); 0 = none.
        sink: the attention sinks (tokens) kept beside the window.
        stream: the `LayerStream` while a stream is processed, else None.
        padding: [B, T] bool, True = a real token, set per model call (the decoder layers see only
            the 4-D softmax mask).
        fixed: window and sink bound the softmax path always, with or without a linear path, and no
            stream sees further (a deployment's bound, ``model.attention_window``).
    """

    window: int = 0
    sink: int = 0
    stream: LayerStream | None = None
    padding: torch.Tensor | None = None
    fixed: bool = False


class LinearPath(Protocol):
    """A path beside softmax attention (nestfed.nn.memory_rule.MemoryRule).

    Attributes:
        enabled: whether it runs.
    """

    enabled: bool

    def mix(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        hidden_states: torch.Tensor,
        soft: torch.Tensor,
        stream: LayerStream | None,
        valid: torch.Tensor | None,
    ) -> torch.Tensor:
        """Mix the path's read-out with the softmax output.

        Args:
            q: [B, T, H, D] queries, after LoRA and the per-head norms, before RoPE.
            k: [B, T, H_kv, D] keys, likewise.
            v: [B, T, H_kv, D] values.
            hidden_states: [B, T, hidden] the layer's input.
            soft: [B, T, H, D] the softmax output.
            stream: the stream; None outside one (its ``state`` is the path's to carry).
            valid: [B, T] bool, False at padding; None without padding.

        Returns:
            The layer's output [B, T, H, D], before o_proj.
        """
        ...


def _combine(mask: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Both masks at once: ``mask`` [1, 1, Tq, Tk] (boolean, True = attend, or additive float, as
    `nestfed.nn.layer_inputs.positional_mask` builds it for the attention implementation)
    and the caller's ``attention_mask`` (None, or the same kind [B, 1, Tq, Tk]: padding, the
    model's own causal or sliding mask). Returns a mask of ``mask``'s kind."""
    if attention_mask is None:
        return mask
    if mask.dtype == torch.bool:
        return (
            mask & attention_mask
            if attention_mask.dtype == torch.bool
            else attention_mask.masked_fill(~mask, torch.finfo(attention_mask.dtype).min)
        )
    if attention_mask.dtype == torch.bool:
        return mask.masked_fill(~attention_mask, torch.finfo(mask.dtype).min)
    return torch.minimum(mask, attention_mask.to(mask.dtype))


def _attention_interface(attn: nn.Module):
    module = __import__(type(attn).__module__, fromlist=["eager_attention_forward"])
    return ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, module.eager_attention_forward)


def _shift_sinks(stream: LayerStream, keys: torch.Tensor) -> torch.Tensor:
    """keys [B, H_kv, c, D] with the first ``stream.n_sink`` (the cached sinks) rotated on by
    ``stream.sink_rotation`` (cos, sin [1, 1, D]); unchanged when there is no rotation or no sink."""
    if stream.sink_rotation is None or not stream.n_sink:
        return keys
    cos, sin = (t.to(keys.dtype) for t in stream.sink_rotation)
    sinks = keys[:, :, : stream.n_sink]
    _, shifted = apply_rotary_pos_emb(sinks, sinks, cos, sin)  # the backbone's own rotation, by delta
    return torch.cat([shifted, keys[:, :, stream.n_sink :]], dim=2)


def projections(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Apply the backbone's projections (LoRA included) and its per-head q/k norms, before RoPE.

    Args:
        self: the attention module (its q_proj, k_proj, v_proj, and q_norm, k_norm where the model
            has them: Qwen3, Gemma-3).
        hidden_states: [B, T, hidden] the layer's normed input.

    Returns:
        q [B, T, H, D], k and v [B, T, H_kv, D].
    """
    B, T, _ = hidden_states.shape
    shape = (B, T, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(shape)
    k = self.k_proj(hidden_states).view(shape)
    if getattr(self, "q_norm", None) is not None:
        q = self.q_norm(q)
    if getattr(self, "k_norm", None) is not None:
        k = self.k_norm(k)
    return q, k, self.v_proj(hidden_states).view(shape)


def _keep_stream(stream: LayerStream, keys, values, k_pos, window: int, own: int, sink: int, T: int) -> None:
    """Trim the stream's KV cache after a chunk: the sinks (positions < sink, under a window) and the
    last span - 1 keys, span the narrower of the stream's window and the layer's own; everything when
    neither bounds it."""
    span = min((w for w in (window, own) if w > 0), default=0)
    sinks = (k_pos < sink) if window > 0 else torch.zeros_like(k_pos, dtype=torch.bool)
    keep = (
        torch.ones(keys.shape[2], dtype=torch.bool, device=keys.device)
        if span == 0
        else (k_pos >= stream.pos + T - (span - 1)) | sinks
    )
    stream.k = keys[:, :, keep].detach()
    stream.v = values[:, :, keep].detach()
    stream.n_sink = int((sinks & keep).sum())
    stream.pos += T


def bounded_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Run an attention module wrapped by `install_bounded_attention` (its forward).

    The softmax path is the backbone's own (projections, q/k norms, RoPE and attention kernel). A
    Hugging Face KV cache is updated as the backbone does, but it cannot carry a linear path's
    state: with the path enabled only a first (prefill) call is accepted; streams of any length use
    nestfed.evaluation.streaming.

    Args:
        self: the attention module, with its ``bounds`` (and ``memory``, a linear path, when set).
        hidden_states: [B, T, hidden] the decoder layer's normed input.
        position_embeddings: the RoPE (cos, sin), each [B, T, D].
        attention_mask: the model's 4-D mask (padding, causal or sliding), or None.
        past_key_values: a Hugging Face KV cache, or None.
        **kwargs: the decoder layer's other arguments, ignored.

    Returns:
        (output [B, T, hidden], None).

    Raises:
        ValueError: without position embeddings, for a cache and a stream together, or for a cached
            call with the linear path enabled.
    """
    bounds: Bounds = self.bounds
    path: LinearPath | None = getattr(self, "memory", None)
    if position_embeddings is None:
        raise ValueError(f"layer {self.layer_idx}: position_embeddings (RoPE cos, sin) are required")
    B, T, _ = hidden_states.shape
    q, k, v = projections(self, hidden_states)
    cos, sin = position_embeddings
    q_rot, k_rot = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    v_t = v.transpose(1, 2)
    stream = bounds.stream
    enabled = path is not None and path.enabled
    use_path = enabled and (stream is None or stream.memory)
    window, sink = _bounds_of(bounds, stream, enabled)
    keys, values = k_rot, v_t
    if past_key_values is not None:
        keys, values = _hf_cache(self, past_key_values, stream, k_rot, v_t, use_path)
    own = layer_window(self.config, self.layer_idx)  # the layer's own sliding window (0 = none)
    if stream is not None:
        context = _stream_context(self, stream, k_rot, v_t, q_rot.dtype, (window, sink, own), attention_mask)
        cache_keys, keys, values, k_pos, mask = context
    else:
        cache_keys, k_pos = keys, None  # what a stream would carry on: the sinks at their own positions
        mask = _window_mask(self, bounds.padding, keys.shape[2], T, q_rot, (window, sink, own), attention_mask)
    soft, _ = _attention_interface(self)(
        self,
        q_rot,
        keys,
        values,
        mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        sliding_window=getattr(self, "sliding_window", None),
    )  # [B, T, H, D]
    out = soft
    if use_path:
        padded = stream is None and bounds.padding is not None and bounds.padding.shape == (B, T)
        out = path.mix(q, k, v, hidden_states, soft, stream, bounds.padding if padded else None)
    if stream is not None:
        _keep_stream(stream, cache_keys, values, k_pos, window, own, sink, T)
    return self.o_proj(out.reshape(B, T, -1).contiguous()), None


def _bounds_of(bounds: Bounds, stream: LayerStream | None, enabled: bool) -> tuple[int, int]:
    """(window, sink) in tokens of one call: the stream's; else the layer's bounds when a linear
    path is ``enabled`` or the bounds are a deployment's (``fixed``; the window only: 0 otherwise).
    Under fixed bounds no stream sees past the deployment's window, and keeps its sinks."""
    window = stream.window if stream is not None else (bounds.window if enabled or bounds.fixed else 0)
    sink = stream.sink if stream is not None else bounds.sink
    if bounds.fixed and stream is not None:
        window, sink = narrower(window, bounds.window), max(sink, bounds.sink)
    return window, sink


def _hf_cache(
    self: nn.Module,
    past_key_values: Any,
    stream: LayerStream | None,
    k_rot: torch.Tensor,
    v_t: torch.Tensor,
    use_path: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) [B, H_kv, c, D]: the Hugging Face cache updated with this call's (as the
    backbone does). Raises ValueError with a stream as well, or when the cache already held keys
    and the linear path runs (a cache cannot carry its state)."""
    if stream is not None:
        raise ValueError(f"layer {self.layer_idx}: give a Hugging Face cache or a nestfed stream, not both")
    keys, values = past_key_values.update(k_rot, v_t, self.layer_idx)
    if keys.shape[2] > k_rot.shape[2] and use_path:
        raise ValueError(
            f"layer {self.layer_idx}: a Hugging Face KV cache does not carry the linear path's "
            "state across calls; stream with nestfed.evaluation.streaming instead"
        )
    return keys, values


def _stream_context(
    self: nn.Module,
    stream: LayerStream,
    k_rot: torch.Tensor,
    v_t: torch.Tensor,
    dtype: torch.dtype,
    spans: tuple[int, int, int],
    attention_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stream's chunk: (cache_keys: the cached keys then the chunk's, the sinks at their own
    positions; keys: the same with the cached sinks shifted (`_shift_sinks`); values; k_pos:
    the keys' absolute positions, the sinks first; mask [.., T, c] of ``dtype``'s kind: ``spans``
    = (window, sink, own window) over absolute positions, combined with ``attention_mask``)."""
    T = k_rot.shape[2]
    cache_keys, keys, values = k_rot, k_rot, v_t
    if stream.k is not None:
        cache_keys = torch.cat([stream.k, k_rot], dim=2)
        keys = _shift_sinks(stream, cache_keys)
        values = torch.cat([stream.v, v_t], dim=2)
    device = k_rot.device
    q_pos = torch.arange(stream.pos, stream.pos + T, device=device)
    recent = keys.shape[2] - (0 if stream.k is None else stream.n_sink)
    k_pos = torch.arange(stream.pos + T - recent, stream.pos + T, device=device)
    if stream.k is not None and stream.n_sink:
        k_pos = torch.cat([torch.arange(stream.n_sink, device=device), k_pos])
    mask = _combine(positional_mask(self.config, q_pos, k_pos, dtype, *spans), attention_mask)
    return cache_keys, keys, values, k_pos, mask


def _window_mask(
    self: nn.Module,
    padding: torch.Tensor | None,
    C: int,
    T: int,
    q_rot: torch.Tensor,
    spans: tuple[int, int, int],
    attention_mask: torch.Tensor | None,
) -> torch.Tensor | None:
    """The mask of a call without a stream: ``attention_mask`` as given unless the window (of
    ``spans`` = (window, sink, own window)) is narrower than the call's C keys (its T queries are
    the last T of them: C = T without a Hugging Face cache); then the window's and the sinks'
    positional mask combined with it, the sinks each row's first real tokens under left
    ``padding`` [B, C]."""
    window, sink, _ = spans
    if not (window > 0 and C > window):
        return attention_mask
    pos = torch.arange(C, device=q_rot.device)
    B = q_rot.shape[0]
    valid = padding if padding is not None and padding.shape == (B, C) else None
    if sink and valid is not None and not bool(valid.all()):  # the sinks: each row's first real tokens
        pos = valid.long().cumsum(1) - 1  # [B, C]: real-token positions (pads are masked anyway)
    return _combine(positional_mask(self.config, pos[..., C - T :], pos, q_rot.dtype, *spans), attention_mask)


# ----------------------------------------------------------------------------- install / query


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """Find the attention module of every decoder layer.

    Args:
        model: a Llama, Qwen2, Qwen3 or Gemma-3 causal LM.

    Returns:
        ``{decoder layer index: its self_attn module}``.

    Raises:
        ValueError: when the model has no ``model.layers`` with ``self_attn``.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ValueError("bounded attention needs a Llama/Qwen2-family model with model.layers[i].self_attn")
    return {i: layer.self_attn for i, layer in enumerate(layers)}


def narrower(a: int, b: int) -> int:
    """Choose the narrower of two windows.

    Args:
        a: a window, tokens; 0 = none.
        b: another.

    Returns:
        The narrower, tokens; 0 when neither bounds.
    """
    return min((w for w in (a, b) if w > 0), default=0)


def install_bounded_attention(
    model: nn.Module,
    layers: list[int] | tuple[int, ...] | None = None,
    window: int = 0,
    sink: int = 0,
    fixed: bool = False,
) -> list[int]:
    """Wrap the attention of some decoder layers with `bounded_attention_forward` and a `Bounds`.

    Idempotent per layer: a layer already wrapped keeps its bounds. The model gets forward hooks
    that hand each call's 2-D attention mask to every wrapped layer (``bounds.padding``).

    Args:
        model: the backbone, changed in place.
        layers: the decoder layers; None = every layer.
        window: `Bounds.window`, tokens.
        sink: `Bounds.sink`, tokens.
        fixed: `Bounds.fixed`.

    Returns:
        The layer indices.

    Raises:
        ValueError: for a model without decoder layers, a layer out of range or negative bounds.
    """
    if window < 0 or sink < 0:
        raise ValueError(f"window and sink must be >= 0 tokens, got {window}, {sink}")
    attns = attention_modules(model)
    chosen = sorted(attns) if layers is None else list(layers)
    for i in chosen:
        if i not in attns:
            raise ValueError(f"layer {i} is out of range (the model has {len(attns)} layers)")
        attn = attns[i]
        if isinstance(getattr(attn, "bounds", None), Bounds):
            continue
        attn.bounds = Bounds(window, sink, fixed=fixed)
        attn.forward = bounded_attention_forward.__get__(attn, type(attn))
    if not getattr(model, "_nestfed_padding_hooks", False):
        model.register_forward_pre_hook(_note_padding, with_kwargs=True)
        model.register_forward_hook(_forget_padding)
        model._nestfed_padding_hooks = True
    return chosen


def attached(model: nn.Module, name: str, cls: type) -> dict[int, Any]:
    """Find what the decoder layers' attention modules hold under an attribute.

    Args:
        model: the backbone.
        name: the attribute (``bounds``, ``memory``).
        cls: the type it must be.

    Returns:
        ``{decoder layer index: the attribute}`` where that is a ``cls``; empty for a model
        without decoder layers.
    """
    try:
        attns = attention_modules(model)
    except ValueError:
        return {}
    return {i: getattr(a, name) for i, a in attns.items() if isinstance(getattr(a, name, None), cls)}


def bounded_layers(model: nn.Module) -> dict[int, Bounds]:
    """Find the bounds of every wrapped attention layer.

    Args:
        model: the backbone.

    Returns:
        ``{decoder layer index: Bounds}``.
    """
    return attached(model, "bounds", Bounds)


def enabled_bounds(model: nn.Module) -> dict[int, Bounds]:
    """Find the bounds of the wrapped layers whose linear path is enabled now.

    Those are the layers whose window and sinks a stream of this model defaults to.

    Args:
        model: the backbone.

    Returns:
        ``{decoder layer index: Bounds}``.
    """
    paths = attached(model, "memory", nn.Module)
    return {i: b for i, b in bounded_layers(model).items() if i in paths and getattr(paths[i], "enabled", False)}


def _note_padding(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: hand a call's 2-D attention mask [B, T] (1 = token, 0 = pad) to every
    wrapped layer, so that its sinks and linear path leave pads out."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    padding = mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()) else None
    for bounds in bounded_layers(model).values():
        bounds.padding = padding


def _forget_padding(model: nn.Module, args: tuple, output: Any) -> None:
    """Forward hook: clear the call's padding from every wrapped layer."""
    for bounds in bounded_layers(model).values():
        bounds.padding = None
