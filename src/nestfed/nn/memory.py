"""FedNL's dual-path attention: a delta-rule memory beside each frozen softmax attention layer.

Source: FedNL, "Federated Nested Learning" (arXiv 2605.16350), sections 3-4 (docs/methods.md section
3): every backbone weight stays frozen; each wrapped attention layer keeps its softmax path and
gains a linear path that shares its q, k, v projections (frozen weights plus LoRA). The layer is
built as the reference implementations build theirs (flash-linear-attention's DeltaNet, Yang et al.
2024; TPTT's LiZAttention, Furfaro 2025; Infini-attention, Munkhdalai et al. 2024; LoLCATs, Zhang
et al. 2025), every choice an option of `nestfed.nn.memory_rule.MemorySettings`:

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
  answer depends on the memory (`memory_knocked_out`).

Mechanics: `install_memory` wraps the chosen layers' attention
(nestfed.nn.bounded_attention.install_bounded_attention, which computes the softmax path) and adds
a `nestfed.nn.memory_rule.MemoryRule` (nestfed.nn.memory_rule, which holds the rules and
their settings) as ``self_attn.memory``, the wrapper's linear path (`MemoryRule.mix`).
The rule's parameters travel as ``base_model.model.<layer>.self_attn.memory.<name>`` payload keys,
which the client trainer loads, trains and returns like any other shipped parameter.
"""

from __future__ import annotations

import re
from contextlib import contextmanager

import torch
from torch import nn

from nestfed.nn.bounded_attention import attached, attention_modules, install_bounded_attention, narrower
from nestfed.nn.keys import PEFT_PREFIX, layer_indices, layer_of
from nestfed.nn.memory_rule import MemoryRule, MemorySettings
from nestfed.nn.placement import trainable_dtype
from nestfed.nn.quantization import dense_dtype

MEMORY_KEY = ".memory."


# ----------------------------------------------------------------------------- install / query


def resolve_layers(model: nn.Module, layers: tuple[int, ...] | list[int] = (), what: str = "layers") -> list[int]:
    """Make decoder-layer indices absolute and sorted.

    Args:
        model: the backbone.
        layers: indices (negative counts from the top); empty = every layer.
        what: the setting they come from, for the error message.

    Returns:
        The indices, sorted.

    Raises:
        ValueError: for an index out of range, its message starting with ``what``.
    """
    n = len(attention_modules(model))
    return layer_indices(layers, n, what) if layers else list(range(n))


def install_memory(model: nn.Module, settings: MemorySettings, layers: tuple[int, ...] | list[int] = ()) -> list[int]:
    """Give chosen decoder layers a `MemoryRule` (disabled) as their attention's linear path.

    The attention is bounded (nestfed.nn.bounded_attention) with the settings' window and sinks.
    Idempotent per layer (a layer that already has a memory keeps it). The rule's parameters do not
    require grad until trained.

    Args:
        model: the backbone, changed in place.
        settings: how each memory is built.
        layers: decoder-layer indices (negative counts from the top); empty = every layer.

    Returns:
        The layer indices.

    Raises:
        ValueError: for a model without such layers or a layer index out of range.
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
    """Find every installed memory layer.

    Args:
        model: the backbone.

    Returns:
        ``{decoder layer index: MemoryRule}``.
    """
    return attached(model, "memory", MemoryRule)


def set_memory_enabled(model: nn.Module, enabled: bool) -> None:
    """Switch every memory layer's linear path on or off.

    Args:
        model: the backbone.
        enabled: on, or off (the backbone's attention).
    """
    for rule in memory_rules(model).values():
        rule.enabled = bool(enabled)


def is_memory_key(key: str) -> bool:
    """Tell whether a payload key names a memory-rule parameter.

    Args:
        key: a payload key.

    Returns:
        True for ``...self_attn.memory.<name>``.
    """
    return MEMORY_KEY in key


def memory_arrays(model: nn.Module) -> dict[str, torch.Tensor]:
    """Read the memory rules as payload arrays.

    Args:
        model: the backbone.

    Returns:
        ``{base_model.model.<path>: tensor}``, detached CPU copies.
    """
    out = {}
    for name, p in model.named_parameters():
        if ".self_attn.memory." in name:
            out[f"{PEFT_PREFIX}{name}"] = p.detach().cpu().clone()
    return out


@contextmanager
def memory_knocked_out(model: nn.Module):
    """Remove every memory's read within the block: each layer returns its softmax output (alpha = 0).

    The knockout that shows whether an answer depends on the memory (Benfeghoul et al. 2025, arXiv
    2510.05901, component-level diagnostics).

    Args:
        model: the backbone.

    Yields:
        Nothing; each layer's switch is restored on exit.
    """
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
    """Set the window dropout for the next calls.

    Args:
        model: the backbone.
        drop: ``{layer: [H] bool}``, True where that head's softmax output is suppressed; layers not
            named, or all when None: none suppressed.
    """
    for i, rule in memory_rules(model).items():
        rule.drop = None if drop is None else drop.get(i)


def set_constant_alpha(model: nn.Module, alpha: float) -> None:
    """Set alpha of every constant-gate memory layer; other gates untouched.

    Args:
        model: the backbone.
        alpha: the schedule's value.
    """
    with torch.no_grad():
        for rule in memory_rules(model).values():
            if rule.settings.gate == "constant":
                rule.alpha.fill_(float(alpha))


def alpha_schedule(step: int, start: float, end: float, warmup_steps: int) -> float:
    """Evaluate the constant gate's schedule (TPTT, docs/methods.md section 3).

    Args:
        step: local steps done so far in the run.
        start: alpha at step 0.
        end: alpha from ``warmup_steps`` on.
        warmup_steps: steps of the linear ramp; <= 0 gives ``end`` at once.

    Returns:
        alpha, linear from ``start`` to ``end``, then ``end``.
    """
    if warmup_steps <= 0:
        return float(end)
    f = min(max(step, 0) / warmup_steps, 1.0)
    return float(start + (end - start) * f)


def lowest_memory_layer(model: nn.Module) -> int | None:
    """Find the lowest decoder layer holding a memory.

    Args:
        model: the backbone.

    Returns:
        Its index; None when none is installed.
    """
    rules = memory_rules(model)
    return min(rules) if rules else None


_ALPHA_KEY = re.compile(r"\.memory\.alpha$")


def is_constant_alpha_key(key: str) -> bool:
    """Tell whether a payload key is a constant gate's alpha (set by the schedule, never trained).

    Args:
        key: a payload key.

    Returns:
        True for ``...memory.alpha``.
    """
    return bool(_ALPHA_KEY.search(key))


def sync_memory(model: nn.Module, arrays: dict[str, torch.Tensor]) -> None:
    """Enable exactly the memory layers whose rules the payload carries.

    A payload without memory keys (any LoRA-only method's) leaves every layer computing the
    backbone's attention.

    Args:
        model: the backbone.
        arrays: the payload.
    """
    rules = memory_rules(model)
    if not rules:
        return
    present = {layer_of(k) for k in arrays if is_memory_key(k)}
    for i, rule in rules.items():
        rule.enabled = i in present


def fresh_rule_arrays(model: nn.Module, layers: list[int] | tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Build initial memory rules for some layers, payload-keyed.

    The parameters of a newly built `MemoryRule` with each installed layer's settings,
    whatever the installed rules hold now (e.g. after an earlier run on the same model).

    Args:
        model: the backbone with its memories.
        layers: decoder-layer indices.

    Returns:
        ``{payload key: tensor}``.

    Raises:
        KeyError: for a layer without memory.
    """
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
