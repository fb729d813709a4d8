"""Payload key naming, shared by every layer that ships parameters (PEFT's saved names).

A payload is a flat ``{key: tensor}`` dict. LoRA matrices use PEFT's keys,
``base_model.model.<module path>.lora_A.weight`` (A: [r, in]) and ``...lora_B.weight``
(B: [out, r]); a layer's frozen low-rank residual uses ``...<module>.merged_A`` / ``merged_B``;
a LoRA layer's trainable core (nestfed.nn.lora_core) uses ``...<module>.lora_core.weight`` or
``...<module>.lora_heads.weight``; any other parameter of the model travels as
``base_model.model.<parameter path>``.
"""

from __future__ import annotations

import re

PEFT_PREFIX = "base_model.model."
LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")
_MODULE_KEY = re.compile(
    re.escape(PEFT_PREFIX) + r"(.+)\.(?:(lora_A|lora_B|lora_core|lora_heads)\.weight|(merged_A|merged_B))"
)


def peft_key(module_name: str, which: str) -> str:
    """Name PEFT's saved key of a LoRA matrix.

    Args:
        module_name: the module path.
        which: ``lora_A`` or ``lora_B``.

    Returns:
        ``base_model.model.<module>.<which>.weight``.
    """
    return f"{PEFT_PREFIX}{module_name}.{which}.weight"


def merged_key(module_name: str, which: str) -> str:
    """Name the key of a layer's frozen residual factor.

    Args:
        module_name: the module path.
        which: ``A`` (the factor [R, in]) or ``B`` (the factor [out, R]).

    Returns:
        ``base_model.model.<module>.merged_A`` or ``...merged_B``.
    """
    return f"{PEFT_PREFIX}{module_name}.merged_{which}"


def lora_core_key(module_name: str, kind: str) -> str:
    """Name the key of a LoRA layer's trainable core.

    Args:
        module_name: the module path.
        kind: ``lora_core`` (Fed-SB's R [r, r]) or ``lora_heads`` (RAVAN's heads stacked, [r, q]).

    Returns:
        ``base_model.model.<module>.<kind>.weight``.
    """
    return f"{PEFT_PREFIX}{module_name}.{kind}.weight"


def module_of(key: str) -> tuple[str, str]:
    """Split a LoRA payload key into its module path and kind.

    Args:
        key: a payload key.

    Returns:
        (module path, kind), kind one of ``lora_A``, ``lora_B``, ``lora_core``, ``lora_heads``,
        ``merged_A``, ``merged_B``.

    Raises:
        KeyError: when the key is none of these.
    """
    m = _MODULE_KEY.fullmatch(key)
    if m is None:
        raise KeyError(f"not a LoRA payload key: {key}")
    return m.group(1), m.group(2) or m.group(3)


#: payload keys whose dim 0 is the rank dimension: A [r, in] and a trainable core [r, q] (its row j
#: feeds B's column j; nestfed.nn.lora_core)
_RANK_ROWS = ("lora_A.weight", "lora_core.weight", "lora_heads.weight")


def rank_dim(key: str) -> int | None:
    """Find the rank dimension of a payload key.

    Args:
        key: a payload key.

    Returns:
        0 for ``lora_A`` [r, in] and a core (``lora_core`` [r, r], ``lora_heads`` [r, q]), 1 for
        ``lora_B`` [out, r], None for any other key.
    """
    if key.endswith(_RANK_ROWS):
        return 0
    if key.endswith("lora_B.weight"):
        return 1
    return None


def layer_indices(indices: tuple[int, ...] | list[int], num_layers: int, field: str) -> list[int]:
    """Make decoder-layer indices absolute, deduplicated and sorted.

    Args:
        indices: layer indices; a negative one counts from the top (-1 is layer num_layers - 1).
        num_layers: the model's decoder layers.
        field: the config key the indices come from, for the error message.

    Returns:
        The absolute indices, sorted, each once.

    Raises:
        ValueError: "<field>: index i out of range for n layers", for an index outside
            [-num_layers, num_layers).
    """
    out = set()
    for i in indices:
        j = i + num_layers if i < 0 else i
        if not 0 <= j < num_layers:
            raise ValueError(f"{field}: index {i} out of range for {num_layers} layers")
        out.add(j)
    return sorted(out)


def layer_of(name: str) -> int | None:
    """Read the decoder-layer index in a module path or payload key.

    Args:
        name: a module path or payload key.

    Returns:
        The index (``...layers.3.self_attn...`` -> 3), None when it names no layer.
    """
    m = LAYER_INDEX.search("." + name + ".")
    return int(m.group(1)) if m else None
