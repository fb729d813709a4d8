"""FedNL's dual-path attention: a delta-rule memory beside each frozen softmax attention layer.

Source: FedNL, "Federated Nested Learning" (arXiv 2605.16350), sections 3-4 (docs/methods.md section
3): every backbone weight stays frozen; each wrapped attention layer keeps its softmax path and
gains a linear path that shares its q, k, v projections (frozen weights plus LoRA). The layer
follows TPTT's LiZAttention (Furfaro 2025, "TPTT: Transforming Pretrained Transformers into
Titans"), with docs/methods.md's decisions:

    q_lin = l2norm(silu(q)), k_lin = l2norm(silu(k)) per head     (before RoPE)   [B, T, H, D]
    v_lin = v * D^-0.5                                                              [B, T, H, D]
    beta_{t,h} = sigmoid(w_h . mean(k_{t-b+1..t, g(h)}) + c_h)   (the beta projection)  [B, T, H]
    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T,  o_t = S_t^T q_t  (delta rule, S_0 = 0)
    O = alpha * RMSNorm(O_lin) * rms(O_softmax) + (1 - alpha) * O_softmax,  then the frozen o_proj.

Decisions where the sources are silent (written here and in the issue note):

- Grouped-query attention: k and v (and k's causal average) are repeated to the H query heads
  as ``repeat_kv`` does, and beta has its own projection row per *query* head, so the H memories
  of one key/value group differ. Memory per layer: H * D * D numbers (9 x 64 x 64 for SmolLM2).
- The beta projection reads the causal average over the last ``beta_window`` tokens of the raw
  k projection (after LoRA, before RoPE and normalisation); it starts at w = 0, c = 0 (beta =
  0.5 everywhere), so its gradient is not zero at the start.
- RMSNorm of the linear output has no weight (adds no parameter), and the normalised output is
  multiplied by the RMS of the softmax path's output at the same token and head, so that alpha
  mixes two outputs of one magnitude. Without that rescaling a unit-RMS linear output swamps
  SmolLM2's softmax outputs (RMS far below 1): an untrained memory at alpha = 0.05 on every layer
  raised the next-token CE on Austen from 2.77 to 7.08 nats, which the constant schedule's
  0.01 -> 0.5 ramp could not survive.
- The gate (``gate``): ``constant`` -- alpha is a one-element parameter that forward detaches
  (never trained; the strategy's schedule sets it, docs/methods.md "scheduled from 0.01 to 0.5 over
  the first steps"); ``learned`` -- alpha = sigmoid(a) per layer, a an nn.Parameter;
  ``dynamic`` -- alpha_t = 0.1 + 0.8 * sigmoid(Conv1d(hidden -> 1, kernel 16, causal)(x)_t),
  weight 0 and bias set so that alpha starts at ``alpha_init``.
- The softmax path may use a sliding window of ``window`` tokens (0 = none): query t sees keys
  t - window + 1 .. t. The window applies while the memory is enabled, or in a stream that asks
  for it (see :mod:`nestfed.evaluation.streaming`); a disabled layer without a stream is the backbone.
  Optionally the first ``sink`` tokens of the sequence stay visible to every query (the
  "attention sinks" of StreamingLLM, Xiao et al., ICLR 2024: a model trained with full attention
  parks attention mass on the first tokens, and a window that drops them degrades it sharply);
  the KV cache then holds ``sink + window - 1`` tokens, still constant. Default 0 (a plain window).

Mechanics: :func:`install_memory` adds a :class:`MemoryRule` module as ``self_attn.memory`` and
replaces that attention module's ``forward`` (the module itself and its q/k/v/o projections keep
their paths, so LoRA keys stay PEFT's ``...self_attn.q_proj.lora_A.weight``). The rule's
parameters travel as ``base_model.model.<layer>.self_attn.memory.<name>`` payload keys, which the
client trainer loads, trains and returns like any other shipped parameter.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from nestfed.config.schema import GATES  # the gates [memory] accepts: one list for config and layer
from nestfed.nn.keys import PEFT_PREFIX, layer_indices, layer_of
from nestfed.nn.layer_inputs import layer_window, positional_mask
from nestfed.nn.placement import trainable_dtype
from nestfed.ops.delta_rule import delta_rule, delta_rule_recurrent

DYNAMIC_RANGE = (0.1, 0.9)  # docs/methods.md: the dynamic gate is rescaled to [0.1, 0.9]
MEMORY_KEY = ".memory."


@dataclass(frozen=True)
class MemorySettings:
    """How a memory layer is built.

    gate: ``constant`` | ``learned`` | ``dynamic`` (see the module docstring). alpha_init: the
    gate's starting value in [0, 1] (dynamic: clipped into (0.1, 0.9)). window: softmax sliding
    window in tokens (0 = unbounded). beta_window: tokens in beta's causal average of k (>= 1).
    dynamic_kernel: the dynamic gate's Conv1d width in tokens (docs/methods.md: 16). chunk_size:
    tokens per chunk of the chunkwise delta rule in training (32 is fastest on a 2-core CPU).
    operator: ``chunkwise`` (training and streaming) or ``recurrent`` (the per-token reference).
    sink: tokens at the start that every windowed query still sees (attention sinks; 0 = none).
    """

    gate: str = "learned"
    alpha_init: float = 0.05
    window: int = 0
    beta_window: int = 4
    dynamic_kernel: int = 16
    chunk_size: int = 32
    operator: str = "chunkwise"
    sink: int = 0

    def __post_init__(self) -> None:
        if self.gate not in GATES:
            raise ValueError(f"memory.gate: unknown gate '{self.gate}' (known: {', '.join(GATES)})")
        if not 0.0 <= self.alpha_init <= 1.0:
            raise ValueError(f"memory.alpha_init must be in [0, 1], got {self.alpha_init}")
        if self.window < 0 or self.sink < 0:
            raise ValueError(f"memory.window and memory.sink must be >= 0 tokens, got {self.window}, {self.sink}")
        if self.beta_window < 1 or self.dynamic_kernel < 1 or self.chunk_size < 1:
            raise ValueError("memory.beta_window, memory.dynamic_kernel and memory.chunk_size must be >= 1")
        if self.operator not in ("chunkwise", "recurrent"):
            raise ValueError(f"memory.operator must be 'chunkwise' or 'recurrent', got '{self.operator}'")


@dataclass
class LayerStream:
    """What one memory layer carries from one chunk of a token stream to the next.

    pos: tokens already seen (the next chunk's first absolute position). k, v: the softmax
    path's KV cache [B, H_kv, c, D] after RoPE, at most ``window - 1`` tokens when window > 0
    (plus the first ``sink`` tokens; unbounded when window = 0). window: this stream's softmax
    window (tokens, 0 = none). sink: attention-sink tokens kept visible (0 = none).
    memory: whether the linear path runs. S: the delta-rule state [B, H, D, D] (fp32; None
    before the first chunk). k_tail: the last ``beta_window - 1`` raw keys [B, n, H_kv, D];
    x_tail: the last ``dynamic_kernel - 1`` gate inputs [B, n, hidden]. sink_rotation: RoPE
    (cos, sin), each [1, 1, D], of a shift delta (tokens) applied to the cached sinks for the next
    chunk only, so that sink j sits at position j + delta just before the window (StreamingLLM's
    positions within the cache, Xiao et al., ICLR 2024, section 3.2) rather than at j, thousands of
    tokens away from the queries; None = the sinks keep their absolute positions. The cache keeps
    the sinks rotated at their own positions; the shift is applied per chunk (RoPE rotations
    compose: R(j + delta) = R(delta) R(j)).
    """

    window: int = 0
    memory: bool = True
    sink: int = 0
    pos: int = 0
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    S: torch.Tensor | None = None
    k_tail: torch.Tensor | None = None
    x_tail: torch.Tensor | None = None
    n_sink: int = 0  # how many of the cached keys are sinks (they come first)
    sink_positions: str = "absolute"  # "cache": nestfed.evaluation.streaming.shift_sinks sets sink_rotation per chunk
    sink_rotation: tuple[torch.Tensor, torch.Tensor] | None = None

    def nbytes(self) -> int:
        """Bytes held by this layer's stream state (KV cache, memory state, tails)."""
        return sum(
            t.numel() * t.element_size() for t in (self.k, self.v, self.S, self.k_tail, self.x_tail) if t is not None
        )


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


class MemoryRule(nn.Module):
    """The trainable memory rules of one attention layer: beta's projection and the gate.

    Parameters (FedNL's theta besides LoRA): ``beta_weight`` [H, D] and ``beta_bias`` [H]
    (beta_{t,h} = sigmoid(beta_weight[h] . kbar_{t,g(h)} + beta_bias[h])); the gate:
    ``alpha`` [1] (constant, detached in forward), ``gate_logit`` [1] (learned) or
    ``gate_conv`` (dynamic, Conv1d(hidden, 1, kernel)). ``enabled``: whether the linear path
    runs (False: the layer computes exactly the backbone's attention). ``stream``: the
    :class:`LayerStream` while a stream is being processed, else None.

    Raises ValueError when the head counts do not divide (H must be a multiple of H_kv).
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, settings: MemorySettings):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"attention heads {num_heads} are not a multiple of key/value heads {num_kv_heads}")
        self.settings = settings
        self.num_heads, self.num_kv_heads, self.head_dim, self.hidden = num_heads, num_kv_heads, head_dim, hidden
        self.beta_weight = nn.Parameter(torch.zeros(num_heads, head_dim))
        self.beta_bias = nn.Parameter(torch.zeros(num_heads))
        if settings.gate == "constant":
            self.alpha = nn.Parameter(torch.tensor([float(settings.alpha_init)]))
        elif settings.gate == "learned":
            self.gate_logit = nn.Parameter(torch.tensor([_logit(settings.alpha_init)]))
        else:
            lo, hi = DYNAMIC_RANGE
            a = min(max(settings.alpha_init, lo + 1e-3), hi - 1e-3)
            self.gate_conv = nn.Conv1d(hidden, 1, settings.dynamic_kernel)
            with torch.no_grad():
                self.gate_conv.weight.zero_()
                self.gate_conv.bias.fill_(_logit((a - lo) / (hi - lo)))
        self.enabled = False
        self.stream: LayerStream | None = None
        self.padding: torch.Tensor | None = None  # [B, T] bool, True = a real token (set per model call)

    # -- beta ------------------------------------------------------------------------------------
    def beta(
        self, k: torch.Tensor, tail: torch.Tensor | None = None, valid: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Write strengths beta [B, T, H] in (0, 1) from the raw keys k [B, T, H_kv, D].

        tail: up to ``beta_window - 1`` raw keys [B, n, H_kv, D] that precede k (a stream's
        previous chunk); the average runs over the min(beta_window, tokens available) last keys.
        valid: [B, T] bool, False at padding: pads are left out of every average and get beta 0
        (they write nothing), so a padded row computes what the unpadded one does.
        """
        bw = self.settings.beta_window
        n = 0 if tail is None else tail.shape[1]
        x = k if tail is None else torch.cat([tail.to(k.dtype), k], dim=1)
        T = k.shape[1]
        w = x.new_ones(x.shape[0], x.shape[1])
        if valid is not None:
            w[:, n:] = valid.to(x.dtype)
        csum = torch.cumsum(x * w[:, :, None, None], dim=1)
        pad = torch.cat([csum.new_zeros(csum.shape[0], 1, *csum.shape[2:]), csum], dim=1)
        counts = torch.cat([w.new_zeros(w.shape[0], 1), torch.cumsum(w, dim=1)], dim=1)  # [B, n + T + 1]
        end = torch.arange(n + 1, n + T + 1, device=k.device)
        start = (end - bw).clamp(min=0)
        kbar = (pad[:, end] - pad[:, start]) / (counts[:, end] - counts[:, start]).clamp(min=1).view(-1, T, 1, 1)
        kbar = kbar.repeat_interleave(self.num_heads // self.num_kv_heads, dim=2)  # [B, T, H, D]
        beta = torch.sigmoid(
            torch.einsum("bthd,hd->bth", kbar, self.beta_weight.to(k.dtype)) + self.beta_bias.to(k.dtype)
        )
        return beta if valid is None else beta * valid.to(beta.dtype)[:, :, None]

    # -- gate ------------------------------------------------------------------------------------
    def gate(self, x: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
        """The mixing weight alpha of the linear path: a [1, 1, 1, 1] tensor (constant, learned)
        or [B, T, 1, 1] (dynamic, from the attention input x [B, T, hidden] and its stream tail
        [B, n, hidden])."""
        g = self.settings.gate
        if g == "constant":
            return self.alpha.detach().to(x.dtype).view(1, 1, 1, 1)
        if g == "learned":
            return torch.sigmoid(self.gate_logit).to(x.dtype).view(1, 1, 1, 1)
        kern = self.settings.dynamic_kernel
        prev = x.new_zeros(x.shape[0], kern - 1, x.shape[2])
        if tail is not None and tail.shape[1]:
            prev[:, kern - 1 - tail.shape[1] :] = tail.to(x.dtype)
        xp = torch.cat([prev, x], dim=1).transpose(1, 2)  # [B, hidden, T + kern - 1]
        z = F.conv1d(xp, self.gate_conv.weight.to(x.dtype), self.gate_conv.bias.to(x.dtype))  # [B, 1, T]
        lo, hi = DYNAMIC_RANGE
        return (lo + (hi - lo) * torch.sigmoid(z)).transpose(1, 2).unsqueeze(-1)  # [B, T, 1, 1]

    def alpha_value(self) -> float | None:
        """The current alpha of a constant or learned gate (None for a dynamic gate)."""
        if self.settings.gate == "constant":
            return float(self.alpha.detach())
        if self.settings.gate == "learned":
            return float(torch.sigmoid(self.gate_logit.detach()))
        return None


def _rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2 over the last dim) + eps), no weight."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def _combine(mask: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Both masks at once: ``mask`` [1, 1, Tq, Tk] (boolean, True = attend, or additive float, as
    :func:`nestfed.nn.layer_inputs.positional_mask` builds it for the attention implementation)
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


def memory_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Forward of an attention module with a :class:`MemoryRule` at ``self.memory``.

    hidden_states: [B, T, hidden] (the decoder layer's normed input); position_embeddings: the
    RoPE (cos, sin), each [B, T, D]. Returns (output [B, T, hidden], None). The softmax path is
    the backbone's own (same projections, per-head q/k norms where the model has them (Qwen3,
    Gemma-3), RoPE and attention kernel), so with the memory
    disabled or alpha = 0 and no window the output equals the backbone's bit for bit (tested).
    A Hugging Face KV cache (``past_key_values``) is updated as the backbone does, but it cannot
    carry the memory state: with the memory enabled only a first (prefill) call is accepted;
    streams of any length use :mod:`nestfed.evaluation.streaming`.

    Raises ValueError without position embeddings, or for a cached call with the memory enabled.
    """
    mem: MemoryRule = self.memory
    if position_embeddings is None:
        raise ValueError(f"layer {self.layer_idx}: position_embeddings (RoPE cos, sin) are required")
    B, T, _ = hidden_states.shape
    D = self.head_dim
    hidden_shape = (B, T, -1, D)
    q = self.q_proj(hidden_states).view(hidden_shape)  # [B, T, H, D]
    k = self.k_proj(hidden_states).view(hidden_shape)  # [B, T, Hkv, D]
    if getattr(self, "q_norm", None) is not None:  # Qwen3, Gemma-3: per-head RMSNorm before RoPE
        q = self.q_norm(q)
    if getattr(self, "k_norm", None) is not None:
        k = self.k_norm(k)
    v = self.v_proj(hidden_states).view(hidden_shape)
    cos, sin = position_embeddings
    q_rot, k_rot = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    v_t = v.transpose(1, 2)
    stream = mem.stream
    use_memory = mem.enabled if stream is None else (stream.memory and mem.enabled)
    window = stream.window if stream is not None else (mem.settings.window if mem.enabled else 0)
    sink = stream.sink if stream is not None else mem.settings.sink

    # -- softmax path (the backbone's), with an optional window and a stream's bounded KV cache
    mask = attention_mask
    keys, values = k_rot, v_t
    if past_key_values is not None:
        if stream is not None:
            raise ValueError(f"layer {self.layer_idx}: give a Hugging Face cache or a nestfed stream, not both")
        keys, values = past_key_values.update(k_rot, v_t, self.layer_idx)
        if keys.shape[2] > T and use_memory:
            raise ValueError(
                f"layer {self.layer_idx}: a Hugging Face KV cache does not carry the delta-rule memory "
                "state across calls; stream with nestfed.evaluation.streaming instead"
            )
    cache_keys = keys  # what a stream carries on: the sinks at their own positions
    own = layer_window(self.config, self.layer_idx)  # the layer's own sliding window (0 = none)
    if stream is not None:
        if stream.k is not None:
            cache_keys = torch.cat([stream.k, k_rot], dim=2)
            keys = _shift_sinks(stream, cache_keys)
            values = torch.cat([stream.v, v_t], dim=2)
        q_pos = torch.arange(stream.pos, stream.pos + T, device=q.device)
        recent = keys.shape[2] - (0 if stream.k is None else stream.n_sink)
        k_pos = torch.arange(stream.pos + T - recent, stream.pos + T, device=q.device)
        if stream.k is not None and stream.n_sink:
            k_pos = torch.cat([torch.arange(stream.n_sink, device=q.device), k_pos])
        mask = _combine(positional_mask(self.config, q_pos, k_pos, q_rot.dtype, window, sink, own), attention_mask)
    elif window > 0 and T > window:
        pos = torch.arange(T, device=q.device)
        valid = mem.padding if mem.padding is not None and mem.padding.shape == (B, T) else None
        if sink and valid is not None and not bool(valid.all()):  # the sinks: each row's first real tokens
            pos = valid.long().cumsum(1) - 1  # [B, T]: real-token positions (pads are masked anyway)
        mask = _combine(positional_mask(self.config, pos, pos, q_rot.dtype, window, sink, own), attention_mask)
    interface = _attention_interface(self)
    soft, _ = interface(
        self,
        q_rot,
        keys,
        values,
        mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        sliding_window=getattr(self, "sliding_window", None),
    )
    # soft: [B, T, H, D]
    out = soft
    if use_memory:
        H = q.shape[2]
        G = H // k.shape[2]
        q_lin = F.normalize(F.silu(q), dim=-1)
        k_lin = F.normalize(F.silu(k), dim=-1).repeat_interleave(G, dim=2)
        v_lin = (v * D**-0.5).repeat_interleave(G, dim=2)
        valid = mem.padding if stream is None and mem.padding is not None and mem.padding.shape == (B, T) else None
        gate_in = hidden_states
        if valid is not None:  # pads write nothing and feed neither beta's average nor the gate
            keep = valid.to(k_lin.dtype)[:, :, None, None]
            k_lin, v_lin = k_lin * keep, v_lin * keep
            gate_in = hidden_states * valid.to(hidden_states.dtype)[:, :, None]
        beta = mem.beta(k, None if stream is None else stream.k_tail, valid)
        s0 = None if stream is None else stream.S
        op = delta_rule_recurrent if mem.settings.operator == "recurrent" else delta_rule
        o_lin, s_new = op(
            q_lin,
            k_lin,
            v_lin,
            beta,
            initial_state=s0,
            output_final_state=stream is not None,
            chunk_size=mem.settings.chunk_size,
        )
        alpha = mem.gate(gate_in, None if stream is None else stream.x_tail)
        # RMS-normalised, then put on the softmax output's scale (per token and head), so that
        # alpha mixes two outputs of one magnitude (see the module docstring)
        lin = _rms_norm(o_lin).to(soft.dtype) * soft.pow(2).mean(dim=-1, keepdim=True).add(1e-12).sqrt()
        out = alpha * lin + (1 - alpha) * soft
        if stream is not None:
            stream.S = s_new.detach()
            bw, kern = mem.settings.beta_window, mem.settings.dynamic_kernel
            kt = k.detach() if stream.k_tail is None else torch.cat([stream.k_tail, k.detach()], dim=1)
            stream.k_tail = kt[:, kt.shape[1] - min(bw - 1, kt.shape[1]) :]
            if mem.settings.gate == "dynamic":
                xt = (
                    hidden_states.detach()
                    if stream.x_tail is None
                    else torch.cat([stream.x_tail, hidden_states.detach()], 1)
                )
                stream.x_tail = xt[:, xt.shape[1] - min(kern - 1, xt.shape[1]) :]
    if stream is not None:
        # keep the sinks (positions < sink, under a window) and the last span - 1 keys, span the
        # narrower of the stream's window and the layer's own; everything when neither bounds it
        span = min((w for w in (window, own) if w > 0), default=0)
        sinks = (k_pos < sink) if window > 0 else torch.zeros_like(k_pos, dtype=torch.bool)
        keep_mask = (
            torch.ones(keys.shape[2], dtype=torch.bool, device=keys.device)
            if span == 0
            else (k_pos >= stream.pos + T - (span - 1)) | sinks
        )
        stream.k = cache_keys[:, :, keep_mask].detach()
        stream.v = values[:, :, keep_mask].detach()
        stream.n_sink = int((sinks & keep_mask).sum())
        stream.pos += T
    attn_output = out.reshape(B, T, -1).contiguous()
    return self.o_proj(attn_output), None


# ----------------------------------------------------------------------------- install / query


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """{decoder layer index: its ``self_attn`` module} of a Llama, Qwen2, Qwen3 or Gemma-3 causal LM.

    Raises ValueError when the model has no ``model.layers`` with ``self_attn``.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise ValueError("the delta-rule memory needs a Llama/Qwen2-family model with model.layers[i].self_attn")
    return {i: layer.self_attn for i, layer in enumerate(layers)}


def resolve_layers(model: nn.Module, layers: tuple[int, ...] | list[int] = ()) -> list[int]:
    """Decoder-layer indices (negative counts from the top; empty = every layer), sorted.

    Raises ValueError for an index out of range.
    """
    n = len(attention_modules(model))
    return layer_indices(layers, n, "memory.layers") if layers else list(range(n))


def install_memory(model: nn.Module, settings: MemorySettings, layers: tuple[int, ...] | list[int] = ()) -> list[int]:
    """Give the attention module of each chosen decoder layer a :class:`MemoryRule` (disabled)
    and the dual-path forward; return the layer indices. Idempotent per layer (a layer that
    already has a memory keeps it). The rule's parameters do not require grad until trained.

    Raises ValueError for a model without such layers or a layer index out of range.
    """
    attns = attention_modules(model)
    chosen = resolve_layers(model, layers)
    cfg = model.config
    for i in chosen:
        attn = attns[i]
        if hasattr(attn, "memory"):
            continue
        H = cfg.num_attention_heads
        Hkv = getattr(cfg, "num_key_value_heads", None) or H
        rule = MemoryRule(cfg.hidden_size, H, Hkv, attn.head_dim, settings)
        w = attn.q_proj.weight if hasattr(attn.q_proj, "weight") else attn.q_proj.base_layer.weight
        rule.to(device=w.device, dtype=trainable_dtype(w.dtype))
        for p in rule.parameters():
            p.requires_grad_(False)
        attn.memory = rule
        attn.forward = memory_attention_forward.__get__(attn, type(attn))
    if not getattr(model, "_nestfed_padding_hooks", False):
        model.register_forward_pre_hook(_note_padding, with_kwargs=True)
        model.register_forward_hook(_forget_padding)
        model._nestfed_padding_hooks = True
    return chosen


def _note_padding(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: hand a call's 2-D attention mask [B, T] (1 = token, 0 = pad) to every
    memory rule, so that the linear path leaves pads out (the decoder layers see only the 4-D
    softmax mask)."""
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    padding = mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()) else None
    for rule in memory_rules(model).values():
        rule.padding = padding


def _forget_padding(model: nn.Module, args: tuple, output: Any) -> None:
    """Forward hook: clear the call's padding from every memory rule."""
    for rule in memory_rules(model).values():
        rule.padding = None


def memory_rules(model: nn.Module) -> dict[int, MemoryRule]:
    """{decoder layer index: MemoryRule} of every installed memory layer."""
    try:
        attns = attention_modules(model)
    except ValueError:
        return {}
    return {i: a.memory for i, a in attns.items() if isinstance(getattr(a, "memory", None), MemoryRule)}


def set_memory_enabled(model: nn.Module, enabled: bool) -> None:
    """Switch every memory layer's linear path on or off (off = the backbone's attention)."""
    for rule in memory_rules(model).values():
        rule.enabled = bool(enabled)


def is_memory_key(key: str) -> bool:
    """Whether a payload key names a memory-rule parameter (``...self_attn.memory.<name>``)."""
    return MEMORY_KEY in key


def memory_arrays(model: nn.Module) -> dict[str, torch.Tensor]:
    """The memory rules as payload arrays ``base_model.model.<path>`` (detached CPU copies)."""
    out = {}
    for name, p in model.named_parameters():
        if ".self_attn.memory." in name:
            out[f"{PEFT_PREFIX}{name}"] = p.detach().cpu().clone()
    return out


def set_constant_alpha(model: nn.Module, alpha: float) -> None:
    """Set alpha of every constant-gate memory layer (the schedule's value); other gates untouched."""
    with torch.no_grad():
        for rule in memory_rules(model).values():
            if rule.settings.gate == "constant":
                rule.alpha.fill_(float(alpha))


def alpha_schedule(step: int, start: float, end: float, warmup_steps: int) -> float:
    """The constant gate's schedule (TPTT, docs/methods.md section 3): linear from ``start`` at step 0
    to ``end`` at ``warmup_steps``, then ``end``. step: local steps done so far in the run."""
    if warmup_steps <= 0:
        return float(end)
    f = min(max(step, 0) / warmup_steps, 1.0)
    return float(start + (end - start) * f)


def lowest_memory_layer(model: nn.Module) -> int | None:
    """The lowest decoder layer holding a memory (None when none is installed)."""
    rules = memory_rules(model)
    return min(rules) if rules else None


_ALPHA_KEY = re.compile(r"\.memory\.alpha$")


def is_constant_alpha_key(key: str) -> bool:
    """Whether a payload key is a constant gate's alpha (set by the schedule, never trained)."""
    return bool(_ALPHA_KEY.search(key))


def sync_memory(model: nn.Module, arrays: dict[str, torch.Tensor]) -> None:
    """Enable exactly the memory layers whose rules the payload carries (a payload without memory
    keys, e.g. any LoRA-only method's, leaves every layer computing the backbone's attention)."""
    rules = memory_rules(model)
    if not rules:
        return
    present = {layer_of(k) for k in arrays if is_memory_key(k)}
    for i, rule in rules.items():
        rule.enabled = i in present


def fresh_rule_arrays(model: nn.Module, layers: list[int] | tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Initial memory rules for the given layers, payload-keyed: the parameters of a newly built
    :class:`MemoryRule` with each installed layer's settings (whatever the installed rules hold
    now, e.g. after an earlier run on the same model). Raises KeyError for a layer without memory."""
    rules = memory_rules(model)
    out = {}
    for i in layers:
        if i not in rules:
            raise KeyError(f"layer {i} has no memory installed")
        r = rules[i]
        fresh = MemoryRule(r.hidden, r.num_heads, r.num_kv_heads, r.head_dim, r.settings)
        for name, p in fresh.named_parameters():
            out[f"{PEFT_PREFIX}model.layers.{i}.self_attn.memory.{name}"] = p.detach().clone()
    return out
