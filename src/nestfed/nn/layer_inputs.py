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
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from nestfed.errors import ConfigError

MASKS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def layer_types(model: nn.Module) -> list[str]:
    """Each decoder layer's attention type (``config.layer_types``; all ``full_attention`` when the
    config has none). Raises ConfigError naming a type nestfed cannot build a mask for."""
    inner = model.model
    types = list(getattr(inner.config, "layer_types", None) or ["full_attention"] * len(inner.layers))
    unknown = sorted(set(types) - set(MASKS))
    if unknown:
        raise ConfigError(f"model: decoder layers of type {', '.join(unknown)} "
                          f"({type(model).__name__}) cannot be computed exactly by nestfed "
                          f"(it builds {', '.join(MASKS)} attention)")
    return types


def decoder_inputs(model: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[list[Any], list[Any]]:
    """Per decoder layer, its attention mask and its position embeddings (cos, sin) for hidden
    states hidden [B, T, H] at positions position_ids [1, T] (or [B, T]), with no padding and no
    cache: what ``model.model.forward`` passes to ``layers[i]``. Returns (masks, position
    embeddings), each a list of one entry per layer (masks may be ``None``: SDPA's causal path).
    Raises ConfigError as :func:`layer_types` does."""
    inner = model.model
    types = layer_types(model)
    kinds = sorted(set(types))
    args = {"config": inner.config, "inputs_embeds": hidden, "attention_mask": None, "past_key_values": None,
            "position_ids": position_ids}
    masks = {t: MASKS[t](**args) for t in kinds}
    rope = inner.rotary_emb
    if "layer_type" in inspect.signature(rope.forward).parameters:
        embeddings = {t: rope(hidden, position_ids, t) for t in kinds}
    else:
        shared = rope(hidden, position_ids=position_ids)
        embeddings = {t: shared for t in kinds}
    return [masks[t] for t in types], [embeddings[t] for t in types]
