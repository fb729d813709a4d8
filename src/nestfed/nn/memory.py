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
- The softmax path may use a sliding window of ``window`` tokens with ``sink`` attention sinks
  while the memory is enabled (nestfed.nn.bounded_attention); a disabled layer without a stream
  computes the backbone's attention.

Mechanics: :func:`install_memory` wraps the chosen layers' attention
(nestfed.nn.bounded_attention.install_bounded_attention, which computes the softmax path) and adds
a :class:`MemoryRule` as ``self_attn.memory``, the wrapper's linear path (:meth:`MemoryRule.mix`).
The rule's parameters travel as ``base_model.model.<layer>.self_attn.memory.<name>`` payload keys,
which the client trainer loads, trains and returns like any other shipped parameter.
"""

from __future__ import annotations

import math
import re
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
from nestfed.nn.gates import DYNAMIC_RANGE, GATES
from nestfed.nn.keys import PEFT_PREFIX, layer_indices, layer_of
from nestfed.nn.placement import trainable_dtype
from nestfed.ops.delta_rule import delta_rule, delta_rule_recurrent

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
            raise ValueError(f"gate: unknown gate '{self.gate}' (known: {', '.join(GATES)})")
        if not 0.0 <= self.alpha_init <= 1.0:
            raise ValueError(f"alpha_init must be in [0, 1], got {self.alpha_init}")
        if self.window < 0 or self.sink < 0:
            raise ValueError(f"window and sink must be >= 0 tokens, got {self.window}, {self.sink}")
        if self.beta_window < 1 or self.dynamic_kernel < 1 or self.chunk_size < 1:
            raise ValueError("beta_window, dynamic_kernel and chunk_size must be >= 1")
        if self.operator not in ("chunkwise", "recurrent"):
            raise ValueError(f"operator must be 'chunkwise' or 'recurrent', got '{self.operator}'")


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


class MemoryRule(nn.Module):
    """The trainable memory rules of one attention layer: beta's projection and the gate.

    Parameters (FedNL's theta besides LoRA): ``beta_weight`` [H, D] and ``beta_bias`` [H]
    (beta_{t,h} = sigmoid(beta_weight[h] . kbar_{t,g(h)} + beta_bias[h])); the gate:
    ``alpha`` [1] (constant, detached in forward), ``gate_logit`` [1] (learned) or
    ``gate_conv`` (dynamic, Conv1d(hidden, 1, kernel)). ``enabled``: whether the linear path
    runs (False: the layer computes exactly the backbone's attention). The layer's linear path
    (nestfed.nn.bounded_attention.LinearPath): :meth:`mix`.

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
        """O = alpha * RMSNorm(O_lin) * rms(soft) + (1 - alpha) * soft [B, T, H, D] (module
        docstring), O_lin the delta rule's output over q [B, T, H, D], k and v [B, T, H_kv, D]
        (before RoPE). A stream's ``state`` carries S [B, H, D, D] and the tails of beta's average
        (``k_tail``) and of the dynamic gate (``x_tail``). valid [B, T]: pads write nothing and feed
        neither beta's average nor the gate."""
        q_lin, k_lin, v_lin = memory_inputs(q, k, v)
        gate_in = hidden_states
        if valid is not None:
            keep = valid.to(k_lin.dtype)[:, :, None, None]
            k_lin, v_lin = k_lin * keep, v_lin * keep
            gate_in = hidden_states * valid.to(hidden_states.dtype)[:, :, None]
        state = None if stream is None else stream.state
        beta = self.beta(k, None if state is None else state.get("k_tail"), valid)
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
        alpha = self.gate(gate_in, None if state is None else state.get("x_tail"))
        # RMS-normalised, then put on the softmax output's scale (per token and head), so that
        # alpha mixes two outputs of one magnitude (see the module docstring)
        lin = _rms_norm(o_lin).to(soft.dtype) * soft.pow(2).mean(dim=-1, keepdim=True).add(1e-12).sqrt()
        if state is not None:
            state["S"] = s_new.detach()
            kt = k.detach() if "k_tail" not in state else torch.cat([state["k_tail"], k.detach()], dim=1)
            state["k_tail"] = kt[:, kt.shape[1] - min(self.settings.beta_window - 1, kt.shape[1]) :]
            if self.settings.gate == "dynamic":
                kern = self.settings.dynamic_kernel
                x = hidden_states.detach()
                xt = x if "x_tail" not in state else torch.cat([state["x_tail"], x], 1)
                state["x_tail"] = xt[:, xt.shape[1] - min(kern - 1, xt.shape[1]) :]
        return alpha * lin + (1 - alpha) * soft


def memory_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the delta rule reads and writes (module docstring): q_lin = l2norm(silu(q)),
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
        w = attn.q_proj.weight if hasattr(attn.q_proj, "weight") else attn.q_proj.base_layer.weight
        rule.to(device=w.device, dtype=trainable_dtype(w.dtype))
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
