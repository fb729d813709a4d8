"""FedNL's dual-path attention: a delta-rule memory beside each frozen softmax attention layer.

Source: FedNL, "Federated Nested Learning" (arXiv 2605.16350), sections 3-4 (docs/methods.md section
3): every backbone weight stays frozen; each wrapped attention layer keeps its softmax path and
gains a linear path that shares its q, k, v projections (frozen weights plus LoRA). The layer is
built as the reference implementations build theirs (flash-linear-attention's DeltaNet, Yang et al.
2024; TPTT's LiZAttention, Furfaro 2025; Infini-attention, Munkhdalai et al. 2024; LoLCATs, Zhang
et al. 2025), every choice an option of :class:`MemorySettings`:

    q', k', v' = ShortConv_q(q), ShortConv_k(k), ShortConv_v(v)   (causal, kernel 4, per channel)
    q_lin = l2norm(silu(q')), k_lin = l2norm(silu(k')) per head   (before RoPE)        [B, T, H, D]
    v_lin = v' * D^-0.5                                                                 [B, T, H, D]
    beta_{t,h} = sigmoid(w_h . x_t + c_h)   (x the layer's input; ``beta_source = "hidden"``)
    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T,  o_t = S_t^T q_t   (delta rule, S_0 = 0)
    read = RMSNorm(o) * g_h * rms(O_softmax)      (g [H, D] learned, 1 at the start)
    O = alpha_h * read + (1 - alpha_h) * O_softmax,  then the frozen o_proj.

Each choice and its source:

- Short causal convolution on q, k, v (``conv_size``, default 4; 0 = none): DeltaNet's
  ``ShortConvolution`` ("crucial", Yang et al. 2024, section 3.3). It lets a key carry the token
  before it, which is what associative recall needs (a value is read under the key that preceded
  it). Its taps start at the identity (nestfed.nn.causal_conv), so a fresh convolution changes
  nothing; no bias, no activation inside it (silu follows on q and k).
- q, k through SiLU then L2-normalised per head, v scaled by D^-0.5: TPTT's (and DeltaNet's
  q/k choice).
- beta from the layer's input x (``beta_source = "hidden"``): DeltaNet's ``b_proj``, one row per
  query head, started at w = 0, c = 0 (beta = 0.5 everywhere, a non-zero gradient). ``"keys"``:
  TPTT's, a causal average over the last ``beta_window`` raw keys (after LoRA, before RoPE).
- The read is RMS-normalised per head with a learned weight g (``norm_weight``; DeltaNet's
  per-head output RMSNorm), started at 1, and put on the softmax path's scale at the same token
  and head (rms(O_softmax)): the backbone is frozen and pretrained, and its softmax outputs have an
  RMS far below 1 (SmolLM2), so a unit-RMS read would swamp them (an untrained memory at alpha =
  0.05 on every layer raised the next-token CE on Austen from 2.77 to 7.08 nats without this). g
  lets training silence a head whose read is noise, per head and dimension.
- An optional output gate per head (``output_gate``): 2 sigmoid(W_h . x_t + b_h), W = 0, b = 0
  (1 at the start, so turning it on changes nothing); DeltaNet gates its output by the layer's
  input the same way (a swish per channel there).
- The gate alpha (``gate``): ``learned`` -- alpha = sigmoid(a), per head (``gate_scope =
  "head"``, Infini-attention's and LoLCATs' choice) or per layer, starting at ``alpha_init`` = 0.5
  (where Infini-attention's sigmoid(0) and TPTT's mixing weight start); ``constant`` -- one
  alpha per layer that forward detaches (never trained; the strategy's schedule sets it, TPTT's
  0.01 -> 0.5); ``dynamic`` -- alpha_t = 0.1 + 0.8 sigmoid(Conv1d(hidden -> 1 or H, kernel 16,
  causal)(x)_t), weight 0 and bias set so that alpha starts at ``alpha_init``. Adam moves a
  parameter by about its learning rate per step whatever the gradient's size, so the gate, beta
  and the rest of the rule train in their own parameter group at 10-100x the LoRA's rate with no
  weight decay (FedNL's ``[fednl] rule_lr``; Infini-attention's reproduction needed 0.01).
- Grouped-query attention: k and v (after their convolution) are repeated to the H query heads as
  ``repeat_kv`` does, so the H memories of one key/value group differ through beta and q. Memory
  per layer: H * D * D numbers (9 x 64 x 64 for SmolLM2).
- The softmax path may use a sliding window of ``window`` tokens with ``sink`` attention sinks
  while the memory is enabled (nestfed.nn.bounded_attention); a disabled layer without a stream
  computes the backbone's attention.
- Two switches: ``drop`` (set per training step by FedNL's client hooks, never at evaluation):
  the heads, [H] bool, whose softmax output is suppressed this step so that the memory has to
  carry (Scheduled Sliding-window Dropout; Benfeghoul et al. 2025, "Paying Attention to Hybrid
  Attention", arXiv 2510.05901, found hybrid conversions bypass their linear branch without it);
  ``knocked_out``: the memory's read removed (alpha = 0), the evaluation that shows whether an
  answer depends on the memory (:func:`memory_knocked_out`).

Mechanics: :func:`install_memory` wraps the chosen layers' attention
(nestfed.nn.bounded_attention.install_bounded_attention, which computes the softmax path) and adds
a :class:`MemoryRule` as ``self_attn.memory``, the wrapper's linear path (:meth:`MemoryRule.mix`).
The rule's parameters travel as ``base_model.model.<layer>.self_attn.memory.<name>`` payload keys,
which the client trainer loads, trains and returns like any other shipped parameter.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from nestfed.nn.bounded_attention import (
    LayerStream,
    attached,
    attention_modules,
    install_bounded_attention,
    narrower,
)
from nestfed.nn.causal_conv import causal_conv, identity_taps, next_tail
from nestfed.nn.gates import BETA_SOURCES, DYNAMIC_RANGE, GATE_SCOPES, GATES
from nestfed.nn.keys import PEFT_PREFIX, layer_indices, layer_of
from nestfed.nn.placement import trainable_dtype
from nestfed.nn.quantization import dense_dtype
from nestfed.ops.delta_rule import delta_rule, delta_rule_recurrent

MEMORY_KEY = ".memory."


@dataclass(frozen=True)
class MemorySettings:
    """How a memory layer is built (the module docstring gives each choice's source).

    gate: ``constant`` | ``learned`` | ``dynamic``. alpha_init: the gate's start in [0, 1]
    (dynamic: clipped into (0.1, 0.9)). gate_scope: ``head`` (one gate per query head) or
    ``layer`` (one per layer; a constant gate is always one per layer). window: softmax sliding
    window in tokens (0 = unbounded). sink: tokens at the start that every windowed query still
    sees (attention sinks; 0 = none). beta_source: ``hidden`` (a projection of the layer's input)
    or ``keys`` (a causal average of ``beta_window`` raw keys, >= 1). conv_size: taps of the short
    causal convolution on q, k, v (0 = none). norm_weight: a learned per-head weight on the
    normalised read. output_gate: a per-head output gate from the layer's input. dynamic_kernel:
    the dynamic gate's Conv1d width in tokens (docs/methods.md: 16). chunk_size: tokens per chunk of
    the chunkwise delta rule in training (32 is fastest on a 2-core CPU). operator: ``chunkwise``
    (training and streaming) or ``recurrent`` (the per-token reference).

    Raises ValueError naming the setting for a value out of range.
    """

    gate: str = "learned"
    alpha_init: float = 0.5
    gate_scope: str = "head"
    window: int = 0
    sink: int = 0
    beta_source: str = "hidden"
    beta_window: int = 4
    conv_size: int = 4
    norm_weight: bool = True
    output_gate: bool = False
    dynamic_kernel: int = 16
    chunk_size: int = 32
    operator: str = "chunkwise"

    def __post_init__(self) -> None:
        for key, value, known in (
            ("gate", self.gate, GATES),
            ("gate_scope", self.gate_scope, GATE_SCOPES),
            ("beta_source", self.beta_source, BETA_SOURCES),
            ("operator", self.operator, ("chunkwise", "recurrent")),
        ):
            if value not in known:
                raise ValueError(f"{key}: unknown {key} '{value}' (known: {', '.join(known)})")
        if not 0.0 <= self.alpha_init <= 1.0:
            raise ValueError(f"alpha_init must be in [0, 1], got {self.alpha_init}")
        if self.window < 0 or self.sink < 0 or self.conv_size < 0:
            raise ValueError(
                f"window, sink and conv_size must be >= 0, got {self.window}, {self.sink}, {self.conv_size}"
            )
        if self.beta_window < 1 or self.dynamic_kernel < 1 or self.chunk_size < 1:
            raise ValueError("beta_window, dynamic_kernel and chunk_size must be >= 1")

    @property
    def gates(self) -> str:
        """How many gates a layer has: ``head`` or ``layer`` (a constant gate: ``layer``)."""
        return "layer" if self.gate == "constant" else self.gate_scope


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


class MemoryRule(nn.Module):
    """The trainable memory rules of one attention layer (FedNL's theta besides LoRA).

    Parameters, by :class:`MemorySettings`: ``beta_weight`` [H, hidden] (``beta_source =
    "hidden"``) or [H, D] (``"keys"``) and ``beta_bias`` [H]; the gate: ``alpha`` [1] (constant,
    detached in forward), ``gate_logit`` [G] (learned; G = H per head, 1 per layer) or
    ``gate_conv`` (dynamic, Conv1d(hidden, G, kernel)); ``conv_q`` [H * D, conv_size], ``conv_k``
    and ``conv_v`` [H_kv * D, conv_size] (the short convolution; identity taps at the start);
    ``norm_weight`` [H, D] (ones); ``out_gate_weight`` [H, hidden] and ``out_gate_bias`` [H]
    (zeros). ``enabled``: whether the linear path runs (False: the layer computes exactly the
    backbone's attention). ``drop`` ([H] bool or None) and ``knocked_out``: module docstring. The
    layer's linear path (nestfed.nn.bounded_attention.LinearPath): :meth:`mix`.

    Raises ValueError when the head counts do not divide (H must be a multiple of H_kv).
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, settings: MemorySettings):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"attention heads {num_heads} are not a multiple of key/value heads {num_kv_heads}")
        s = self.settings = settings
        self.num_heads, self.num_kv_heads, self.head_dim, self.hidden = num_heads, num_kv_heads, head_dim, hidden
        H, D = num_heads, head_dim
        self.beta_weight = nn.Parameter(torch.zeros(H, hidden if s.beta_source == "hidden" else D))
        self.beta_bias = nn.Parameter(torch.zeros(H))
        G = H if s.gates == "head" else 1
        if s.gate == "constant":
            self.alpha = nn.Parameter(torch.tensor([float(s.alpha_init)]))
        elif s.gate == "learned":
            self.gate_logit = nn.Parameter(torch.full((G,), _logit(s.alpha_init)))
        else:
            lo, hi = DYNAMIC_RANGE
            a = min(max(s.alpha_init, lo + 1e-3), hi - 1e-3)
            self.gate_conv = nn.Conv1d(hidden, G, s.dynamic_kernel)
            with torch.no_grad():
                self.gate_conv.weight.zero_()
                self.gate_conv.bias.fill_(_logit((a - lo) / (hi - lo)))
        if s.conv_size:
            self.conv_q = nn.Parameter(identity_taps(H * D, s.conv_size))
            self.conv_k = nn.Parameter(identity_taps(num_kv_heads * D, s.conv_size))
            self.conv_v = nn.Parameter(identity_taps(num_kv_heads * D, s.conv_size))
        if s.norm_weight:
            self.norm_weight = nn.Parameter(torch.ones(H, D))
        if s.output_gate:
            self.out_gate_weight = nn.Parameter(torch.zeros(H, hidden))
            self.out_gate_bias = nn.Parameter(torch.zeros(H))
        self.enabled = False
        self.drop: torch.Tensor | None = None
        self.knocked_out = False

    # -- beta ------------------------------------------------------------------------------------
    def beta(
        self,
        k: torch.Tensor,
        tail: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write strengths beta [B, T, H] in (0, 1).

        ``beta_source = "hidden"``: from the layer's input hidden_states [B, T, hidden].
        ``"keys"``: from the raw keys k [B, T, H_kv, D]; tail: up to ``beta_window - 1`` raw keys
        [B, n, H_kv, D] that precede k (a stream's previous chunk); the average runs over the
        min(beta_window, tokens available) last keys. valid: [B, T] bool, False at padding: pads
        are left out of every average and get beta 0 (they write nothing), so a padded row
        computes what the unpadded one does. Raises ValueError for the hidden source without
        hidden_states.
        """
        if self.settings.beta_source == "hidden":
            if hidden_states is None:
                raise ValueError("beta: beta_source = 'hidden' needs the layer's hidden_states")
            z = hidden_states @ self.beta_weight.to(hidden_states.dtype).T + self.beta_bias.to(hidden_states.dtype)
            beta = torch.sigmoid(z)
        else:
            beta = torch.sigmoid(self._key_average(k, tail, valid) + self.beta_bias.to(k.dtype))
        return beta if valid is None else beta * valid.to(beta.dtype)[:, :, None]

    def _key_average(self, k: torch.Tensor, tail: torch.Tensor | None, valid: torch.Tensor | None) -> torch.Tensor:
        """beta_weight . mean of the last ``beta_window`` raw keys, per query head: [B, T, H]."""
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
        return torch.einsum("bthd,hd->bth", kbar, self.beta_weight.to(k.dtype))

    # -- gate ------------------------------------------------------------------------------------
    def gate(self, x: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
        """The mixing weight alpha of the linear path: [1, 1, G, 1] (constant, learned; G = 1 or
        H) or [B, T, G, 1] (dynamic, from the attention input x [B, T, hidden] and its stream tail
        [B, n, hidden])."""
        g = self.settings.gate
        if g == "constant":
            return self.alpha.detach().to(x.dtype).view(1, 1, 1, 1)
        if g == "learned":
            return torch.sigmoid(self.gate_logit).to(x.dtype).view(1, 1, -1, 1)
        kern = self.settings.dynamic_kernel
        prev = x.new_zeros(x.shape[0], kern - 1, x.shape[2])
        if tail is not None and tail.shape[1]:
            prev[:, kern - 1 - tail.shape[1] :] = tail.to(x.dtype)
        xp = torch.cat([prev, x], dim=1).transpose(1, 2)  # [B, hidden, T + kern - 1]
        z = F.conv1d(xp, self.gate_conv.weight.to(x.dtype), self.gate_conv.bias.to(x.dtype))  # [B, G, T]
        lo, hi = DYNAMIC_RANGE
        return (lo + (hi - lo) * torch.sigmoid(z)).transpose(1, 2).unsqueeze(-1)  # [B, T, G, 1]

    def alphas(self) -> list[float] | None:
        """The current alpha of each gate of a constant or learned gate ([1] or [H] values; None
        for a dynamic gate, whose alpha depends on the input)."""
        if self.settings.gate == "constant":
            return [float(self.alpha.detach())]
        if self.settings.gate == "learned":
            return torch.sigmoid(self.gate_logit.detach().float()).tolist()
        return None

    def alpha_value(self) -> float | None:
        """The mean of :meth:`alphas` (None for a dynamic gate)."""
        a = self.alphas()
        return None if a is None else sum(a) / len(a)

    # -- the linear path -----------------------------------------------------------------------
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
        """O = alpha * read + (1 - alpha) * soft [B, T, H, D] (module docstring), the read from the
        delta rule over q [B, T, H, D], k and v [B, T, H_kv, D] (before RoPE) and the layer's input
        hidden_states [B, T, hidden]. A stream's ``state`` carries S [B, H, D, D] and the tails of
        the short convolution (``conv_tail``), beta's key average (``k_tail``) and the dynamic gate
        (``x_tail``). valid [B, T]: pads write nothing and feed neither a convolution, beta nor the
        gate. With ``knocked_out`` the softmax output comes back unchanged (alpha = 0); heads in
        ``drop`` return the read alone."""
        if self.knocked_out:
            return soft
        state = None if stream is None else stream.state
        x = hidden_states if valid is None else hidden_states * valid.to(hidden_states.dtype)[:, :, None]
        q_lin, k_lin, v_lin = self.inputs(q, k, v, valid, state)
        beta = self.beta(k, None if state is None else state.get("k_tail"), valid, x)
        op = delta_rule_recurrent if self.settings.operator == "recurrent" else delta_rule
        o_lin, s_new = op(
            q_lin,
            k_lin,
            v_lin,
            beta,
            initial_state=None if state is None else state.get("S"),
            output_final_state=state is not None,
            chunk_size=self.settings.chunk_size,
        )
        read = self.read(o_lin, soft, x)
        alpha = self.gate(x, None if state is None else state.get("x_tail"))
        if self.drop is not None:  # window dropout: these heads' softmax output is suppressed this step
            alpha = torch.where(self.drop.to(alpha.device).view(1, 1, -1, 1), torch.ones_like(alpha), alpha)
        if state is not None:
            self._carry(state, s_new, q, k, v, x)
        return alpha * read + (1 - alpha) * soft

    def inputs(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor | None = None,
        state: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the delta rule reads and writes: q_lin, k_lin, v_lin, each [B, T, H, D], from the
        raw projections q [B, T, H, D], k and v [B, T, H_kv, D] through the short convolution (a
        stream's ``conv_tail`` before them) and :func:`memory_inputs`; pads (valid [B, T] False)
        are zeroed before the convolution and write nothing."""
        if valid is not None:
            keep = valid.to(q.dtype)[:, :, None, None]
            q, k, v = q * keep, k * keep, v * keep
        if self.settings.conv_size:
            q, k, v = self._convolved(q, k, v, None if state is None else state.get("conv_tail"))
        q_lin, k_lin, v_lin = memory_inputs(q, k, v)
        if valid is not None:
            keep = valid.to(k_lin.dtype)[:, :, None, None]
            k_lin, v_lin = k_lin * keep, v_lin * keep
        return q_lin, k_lin, v_lin

    def _convolved(self, q, k, v, tail: torch.Tensor | None):
        """q, k, v through their short convolutions, as one [B, T, (H + 2 H_kv) D] signal."""
        B, T = q.shape[:2]
        sizes = (q.shape[2] * q.shape[3], k.shape[2] * k.shape[3], v.shape[2] * v.shape[3])
        x = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        w = torch.cat([self.conv_q, self.conv_k, self.conv_v], dim=0)
        yq, yk, yv = causal_conv(x, w, tail).split(sizes, dim=-1)
        return yq.view_as(q), yk.view_as(k), yv.view_as(v)

    def read(self, o_lin: torch.Tensor, soft: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The memory's contribution before the gate: RMSNorm(o_lin) [B, T, H, D], times the
        per-head norm weight and output gate when the settings have them, on the softmax output's
        scale (per token and head)."""
        out = _rms_norm(o_lin).to(soft.dtype)
        if self.settings.norm_weight:
            out = out * self.norm_weight.to(soft.dtype)
        if self.settings.output_gate:
            z = x @ self.out_gate_weight.to(x.dtype).T + self.out_gate_bias.to(x.dtype)  # [B, T, H]
            out = out * (2 * torch.sigmoid(z)).to(soft.dtype)[..., None]
        return out * soft.pow(2).mean(dim=-1, keepdim=True).add(1e-12).sqrt()

    def _carry(self, state: dict[str, torch.Tensor], s_new: torch.Tensor, q, k, v, x: torch.Tensor) -> None:
        """Update a stream's state after a chunk: S and the tails the next chunk needs."""
        s = self.settings
        state["S"] = s_new.detach()
        if s.beta_source == "keys":
            state["k_tail"] = next_tail(k, state.get("k_tail"), s.beta_window)
        if s.conv_size:
            B, T = q.shape[:2]
            raw = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
            state["conv_tail"] = next_tail(raw, state.get("conv_tail"), s.conv_size)
        if s.gate == "dynamic":
            state["x_tail"] = next_tail(x, state.get("x_tail"), s.dynamic_kernel)


def memory_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The delta rule's inputs from (convolved) projections: q_lin = l2norm(silu(q)),
    k_lin = l2norm(silu(k)), v_lin = v * D^-0.5, from q [B, T, H, D] and k, v [B, T, H_kv, D];
    k_lin and v_lin repeated to the H query heads. Returns three [B, T, H, D] tensors."""
    D, G = q.shape[-1], q.shape[2] // k.shape[2]
    q_lin = F.normalize(F.silu(q), dim=-1)
    k_lin = F.normalize(F.silu(k), dim=-1).repeat_interleave(G, dim=2)
    return q_lin, k_lin, (v * D**-0.5).repeat_interleave(G, dim=2)


def _rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2 over the last dim) + eps), no weight."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- install / query


def resolve_layers(model: nn.Module, layers: tuple[int, ...] | list[int] = (), what: str = "layers") -> list[int]:
    """Decoder-layer indices (negative counts from the top; empty = every layer), sorted.

    Raises ValueError for an index out of range, its message starting with ``what`` (the setting).
    """
    n = len(attention_modules(model))
    return layer_indices(layers, n, what) if layers else list(range(n))


def install_memory(model: nn.Module, settings: MemorySettings, layers: tuple[int, ...] | list[int] = ()) -> list[int]:
    """Give the attention module of each chosen decoder layer a :class:`MemoryRule` (disabled) as
    the linear path of its bounded attention (nestfed.nn.bounded_attention, with the settings'
    window and sinks); return the layer indices. Idempotent per layer (a layer that already has a
    memory keeps it). The rule's parameters do not require grad until trained.

    Raises ValueError for a model without such layers or a layer index out of range.
    """
    attns = attention_modules(model)
    chosen = resolve_layers(model, layers)
    install_bounded_attention(model, chosen, settings.window, settings.sink)
    cfg = model.config
    for i in chosen:
        attn = attns[i]
        if hasattr(attn, "memory"):
            continue
        if attn.bounds.fixed:  # a deployment's bound (model.attention_window): the memory narrows it at most
            attn.bounds.window = narrower(attn.bounds.window, settings.window)
        else:
            attn.bounds.window, attn.bounds.sink = settings.window, settings.sink
        H = cfg.num_attention_heads
        Hkv = getattr(cfg, "num_key_value_heads", None) or H
        rule = MemoryRule(cfg.hidden_size, H, Hkv, attn.head_dim, settings)
        q = attn.q_proj if hasattr(attn.q_proj, "weight") else attn.q_proj.base_layer
        rule.to(device=q.weight.device, dtype=trainable_dtype(dense_dtype(q)))
        for p in rule.parameters():
            p.requires_grad_(False)
        attn.memory = rule
    return chosen


def memory_rules(model: nn.Module) -> dict[int, MemoryRule]:
    """{decoder layer index: MemoryRule} of every installed memory layer."""
    return attached(model, "memory", MemoryRule)


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


@contextmanager
def memory_knocked_out(model: nn.Module):
    """Within the block every memory layer returns its softmax output unchanged (alpha = 0), the
    memory's read removed: the knockout that shows whether an answer depends on the memory
    (Benfeghoul et al. 2025, arXiv 2510.05901, component-level diagnostics)."""
    rules = list(memory_rules(model).values())
    before = [r.knocked_out for r in rules]
    for r in rules:
        r.knocked_out = True
    try:
        yield
    finally:
        for r, b in zip(rules, before):
            r.knocked_out = b


def set_dropped_heads(model: nn.Module, drop: dict[int, torch.Tensor] | None) -> None:
    """Window dropout for the next calls: {layer: [H] bool, True where that head's softmax output is
    suppressed} (layers not named, or ``drop`` None: none suppressed)."""
    for i, rule in memory_rules(model).items():
        rule.drop = None if drop is None else drop.get(i)


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
