"""What a decoder layer receives besides its hidden states, built as the backbone's own forward builds it.

A path that runs a model's decoder layers itself (the frozen prefix, nestfed.nn.frozen_prefix)
must give each layer the attention mask and the rotary position embeddings the model's own
``forward`` would: the causal mask of the layer's type (``config.layer_types``: full or sliding
window attention, e.g. Qwen2 with ``use_sliding_window``) from transformers' own
``create_causal_mask`` / ``create_sliding_window_causal_mask`` (for SDPA, full causal attention is
``None`` plus ``is_causal``, as before; for eager attention an additive mask), and the rotary
embedding of the layer's type where the model keeps one per type (``rotary_emb(x, position_ids,
layer_type)``, Gemma-3's local and global bases). A layer type nestfed cannot build a mask for is
refused, naming it, rather than computed wrongly.

Paths that run the layers on a chunk beside a key/value cache of their own (a stream, or FedNL's
windowed softmax path, nestfed.nn.memory) build the mask of queries at absolute positions over
cached keys at absolute positions with `positional_mask`, through transformers' own mask
interface (``ALL_MASK_ATTENTION_FUNCTIONS``: boolean for SDPA, additive for eager attention), and
the rotary embedding of each layer's type with `layer_rotary` / `rotary`.

`check_architecture` refuses, with one line naming what is missing, a model whose forward
these paths do not reproduce: only the families whose logits are tested equal to the model's own
(``FAMILIES``), without a config switch nestfed does not apply (``UNAPPLIED``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    create_causal_mask,
    create_sliding_window_causal_mask,
)

from nestfed.errors import ConfigError

MASKS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
#: ``config.model_type`` of the families whose logits through every nestfed path are tested equal to
#: ``model(input_ids).logits`` (tests/evaluation/test_logit_paths.py): another family's forward may do
#: what these paths do not (embedding or logit multipliers, fused projections, other norms).
FAMILIES = ("llama", "qwen2", "qwen3", "gemma3_text")
#: config switches that change a model's forward in ways nestfed's paths do not reproduce
UNAPPLIED = ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention")
#: the parts of a model nestfed's paths run itself
PARTS = ("model.embed_tokens", "model.layers", "model.rotary_emb", "model.norm", "lm_head")
#: attention implementations whose mask transformers builds from any mask function
POSITIONAL = ("sdpa", "eager")


def check_architecture(model: nn.Module) -> None:
    """Refuse a model that nestfed cannot compute exactly, before anything is run or written.

    Args:
        model: accepted when a ``*ForCausalLM`` of one of ``FAMILIES`` that has every part of
            ``PARTS``, sets none of ``UNAPPLIED`` and whose layer types `layer_types` knows.

    Raises:
        ConfigError: one line naming the model's class and what is missing.
    """
    name = type(model).__name__
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in FAMILIES:
        raise ConfigError(
            f"model: {name} (model_type '{kind}') cannot be computed exactly by nestfed: its forward is "
            f"reproduced only for the families {', '.join(FAMILIES)}"
        )
    for path in PARTS:
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"model: {name} has no {path}, which nestfed's logit paths run themselves")
    for key in UNAPPLIED:
        value = getattr(model.model.config, key, None)
        if value:
            raise ConfigError(f"model: {name} sets {key} = {value!r}, which nestfed's logit paths do not apply")
    layer_types(model)


def layer_types(model: nn.Module) -> list[str]:
    """List each decoder layer's attention type.

    Args:
        model: the backbone.

    Returns:
        ``config.layer_types``; all ``full_attention`` when the config has none.

    Raises:
        ConfigError: naming a type nestfed cannot build a mask for.
    """
    inner = model.model
    types = list(getattr(inner.config, "layer_types", None) or ["full_attention"] * len(inner.layers))
    unknown = sorted(set(types) - set(MASKS))
    if unknown:
        raise ConfigError(
            f"model: decoder layers of type {', '.join(unknown)} "
            f"({type(model).__name__}) cannot be computed exactly by nestfed "
            f"(it builds {', '.join(MASKS)} attention)"
        )
    return types


def decoder_inputs(model: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[list[Any], list[Any]]:
    """Build each decoder layer's attention mask and position embeddings as the model's forward does.

    What ``model.model.forward`` passes to ``layers[i]``, with no padding and no cache.

    Args:
        model: the backbone.
        hidden: [B, T, H] hidden states.
        position_ids: [1, T] (or [B, T]) positions.

    Returns:
        (masks, position embeddings (cos, sin)), each a list of one entry per layer (masks may be
        ``None``: SDPA's causal path).

    Raises:
        ConfigError: as `layer_types` does.
    """
    inner = model.model
    types = layer_types(model)
    kinds = sorted(set(types))
    args = {
        "config": inner.config,
        "inputs_embeds": hidden,
        "attention_mask": None,
        "past_key_values": None,
        "position_ids": position_ids,
    }
    masks = {t: MASKS[t](**args) for t in kinds}
    return [masks[t] for t in types], layer_rotary(model, hidden, position_ids)


def _per_type(rope: nn.Module) -> bool:
    """Whether a rotary embedding keeps one rotation per layer type (Gemma-3's local and global bases)."""
    return "layer_type" in inspect.signature(rope.forward).parameters


def rotary(model: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor, layer_type: str) -> tuple[Any, Any]:
    """Compute the rotary embedding that layers of one type get.

    Args:
        model: the backbone.
        hidden: [B, T, H] hidden states; they give the dtype and device.
        position_ids: [1, T] (or [B, T]) positions.
        layer_type: the layers' attention type (``config.layer_types``).

    Returns:
        (cos, sin), each [B, T, D].
    """
    rope = model.model.rotary_emb
    return rope(hidden, position_ids, layer_type) if _per_type(rope) else rope(hidden, position_ids=position_ids)


def layer_rotary(model: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor) -> list[Any]:
    """Compute each decoder layer's rotary embedding.

    Args:
        model: the backbone.
        hidden: [B, T, H] hidden states; they give the dtype and device.
        position_ids: [1, T] positions.

    Returns:
        One (cos, sin) per layer, each [B, T, D]: one per layer type where the model keeps one per
        type, else one shared by all.

    Raises:
        ConfigError: as `layer_types` does.
    """
    types = layer_types(model)
    if not _per_type(model.model.rotary_emb):
        shared = rotary(model, hidden, position_ids, types[0])
        return [shared] * len(types)
    embeddings = {t: rotary(model, hidden, position_ids, t) for t in sorted(set(types))}
    return [embeddings[t] for t in types]


def rope_kind(model: nn.Module, layer_type: str) -> tuple[str, float]:
    """Read the kind of the rotary embedding that layers of one type get.

    Args:
        model: the backbone.
        layer_type: the layers' attention type.

    Returns:
        (rope_type, attention scaling), e.g. ``("default", 1.0)``; yarn scales cos and sin by its
        attention factor.
    """
    rope = model.model.rotary_emb
    kind = getattr(rope, "rope_type", "default")
    if isinstance(kind, dict):  # one per layer type
        return kind.get(layer_type, "default"), float(getattr(rope, f"{layer_type}_attention_scaling", 1.0))
    return kind, float(getattr(rope, "attention_scaling", 1.0))


def layer_window(config: Any, index: int) -> int:
    """Read the size of a decoder layer's own sliding window.

    Args:
        config: the model's config.
        index: the decoder layer.

    Returns:
        Tokens: ``config.sliding_window`` for a ``sliding_attention`` layer of
        ``config.layer_types``; 0 = full causal attention.
    """
    types = getattr(config, "layer_types", None)
    return int(config.sliding_window) if types and types[index] == "sliding_attention" else 0


def positional_mask(
    config: Any,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    dtype: torch.dtype,
    window: int = 0,
    sink: int = 0,
    own_window: int = 0,
) -> torch.Tensor:
    """Build the softmax mask of queries over cached keys, both at absolute positions.

    A cache's keys need not be contiguous (sinks, then a window). The key at k is seen from q when
    k <= q, k > q - own_window and (k > q - window or k < sink). Built by transformers' mask
    interface for ``config._attn_implementation``, as the model's own masks.

    Args:
        config: the model's config.
        q_pos: [Tq] query positions, or [B, Tq] per row.
        k_pos: [Tk] key positions, or [B, Tk] per row.
        dtype: the dtype of an additive (eager) mask.
        window: a stream's or FedNL's window, tokens; 0 = none.
        sink: attention sinks kept beside the window, tokens.
        own_window: the layer's own sliding window, tokens; 0 = none.

    Returns:
        [1, 1, Tq, Tk] (or [B, 1, Tq, Tk] for per-row positions): boolean (True = attend) for SDPA,
        additive float of ``dtype`` (0 or its minimum) for eager attention.

    Raises:
        ConfigError: for another implementation (flash attention takes no such mask).
    """
    impl = config._attn_implementation
    if impl not in POSITIONAL:
        raise ConfigError(
            f"model: attention implementation '{impl}' cannot take the mask of a stream or a window "
            f"over a key/value cache (nestfed builds it for {', '.join(POSITIONAL)})"
        )

    batched = q_pos.dim() == 2  # [B, T] per-row positions (a left-padded batch's real-token positions)

    def seen(batch_idx, head_idx, q_idx, kv_idx):
        q, k = (q_pos[batch_idx, q_idx], k_pos[batch_idx, kv_idx]) if batched else (q_pos[q_idx], k_pos[kv_idx])
        ok = k <= q
        if own_window > 0:
            ok = ok & (k > q - own_window)
        if window > 0:
            ok = ok & ((k > q - window) | (k < sink))
        return ok

    return ALL_MASK_ATTENTION_FUNCTIONS[impl](
        batch_size=q_pos.shape[0] if batched else 1,
        q_length=q_pos.shape[-1],
        kv_length=k_pos.shape[-1],
        mask_function=seen,
        allow_is_causal_skip=False,
        dtype=dtype,
        device=q_pos.device,
    )
