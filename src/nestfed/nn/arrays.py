"""Load a payload into a model, and read the trained arrays back out.

A payload (``{key: tensor}``, nestfed.nn.keys) sets every LoRA layer's adapter (its rank follows
the shapes; a layer the payload omits gets rank 0), every layer's frozen low-rank residual
(``merged_A`` / ``merged_B``; removed when absent), every layer's trainable core (``lora_core`` or
``lora_heads``, nestfed.nn.lora_core; removed when absent), and any model parameter it names
(``base_model.model.<parameter path>``: a memory layer's rules, an SVD layer's core). Memory
layers run exactly where the payload carries their rules (nestfed.nn.memory.sync_memory).
"""

from __future__ import annotations

import torch
from torch import nn

from nestfed.nn.keys import PEFT_PREFIX, lora_core_key, merged_key, module_of, peft_key
from nestfed.nn.lora import lora_modules
from nestfed.nn.lora_core import core_kind_of
from nestfed.nn.memory import sync_memory

Arrays = dict[str, torch.Tensor]


def extra_parameters(model: nn.Module, arrays: Arrays) -> dict[str, nn.Parameter]:
    """Find the payload keys that name a plain model parameter (not a LoRA matrix or residual factor).

    Key ``base_model.model.<parameter path>`` names ``model.get_parameter(<parameter path>)``.

    Args:
        model: the model the payload is for.
        arrays: the payload, ``{key: tensor}`` (nestfed.nn.keys).

    Returns:
        ``{key: parameter}`` for every key that is not a LoRA layer's.

    Raises:
        KeyError: for a key that names neither a LoRA layer nor a parameter.
    """
    modules = lora_modules(model)
    out = {}
    for key in arrays:
        try:
            if module_of(key)[0] in modules:
                continue
        except KeyError:
            pass
        path = key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else None
        try:
            out[key] = model.get_parameter(path) if path else None
        except AttributeError:
            out[key] = None
        if out[key] is None:
            raise KeyError(f"payload key {key} names no LoRA layer or parameter of the model")
    return out


def apply_arrays(model: nn.Module, arrays: Arrays, scaling: float) -> None:
    """Load a payload into the model (see the module docstring).

    Shapes: lora_A [r, in], lora_B [out, r], merged_A [R, in], merged_B [out, R], lora_core /
    lora_heads [r, q] (nestfed.nn.lora_core).

    Args:
        model: the model with LoRA layers.
        arrays: the payload, ``{key: tensor}`` (nestfed.nn.keys).
        scaling: every LoRA layer's scale s.

    Raises:
        KeyError: for a key that names nothing.
        ValueError: for a shape mismatch.
    """
    extras = extra_parameters(model, arrays)
    for name, m in lora_modules(model).items():
        a, b = arrays.get(peft_key(name, "lora_A")), arrays.get(peft_key(name, "lora_B"))
        if a is None:
            a, b = torch.zeros(0, m.in_features), torch.zeros(m.out_features, 0)
        m.set_weights(a, b)
        m.scaling = float(scaling)
        m.set_merged(arrays.get(merged_key(name, "A")), arrays.get(merged_key(name, "B")))
        kind = core_kind_of(arrays, name)
        m.set_core(kind, None if kind is None else arrays[lora_core_key(name, kind)])
    with torch.no_grad():
        for key, param in extras.items():
            if param.shape != arrays[key].shape:
                raise ValueError(f"payload key {key}: shape {tuple(arrays[key].shape)}, parameter {tuple(param.shape)}")
            param.copy_(arrays[key])
    sync_memory(model, arrays)


def lora_parameters(model: nn.Module, train_a: bool = True) -> list[nn.Parameter]:
    """Select the LoRA parameters to train, layer by layer, switching requires_grad to match.

    A layer with a core trains only its core's parameters (A and B frozen); requires_grad is on for
    the returned parameters, off for the frozen ones.

    Args:
        model: the model with LoRA layers.
        train_a: train A and B when True, only B when False.

    Returns:
        [A, B] (or [B]) of every layer of rank > 0, or its core's parameters.
    """
    params = []
    for m in lora_modules(model).values():
        if m.rank == 0:
            continue
        if m.lora_core is not None:
            m.lora_A.weight.requires_grad_(False)
            m.lora_B.weight.requires_grad_(False)
            for p in m.lora_core.trainable():
                p.requires_grad_(True)
                params.append(p)
            continue
        m.lora_A.weight.requires_grad_(train_a)
        m.lora_B.weight.requires_grad_(True)
        params += [m.lora_A.weight, m.lora_B.weight] if train_a else [m.lora_B.weight]
    return params


def lora_arrays(model: nn.Module, with_a: bool = True) -> Arrays:
    """Read the adapter as loaded now, as PEFT-keyed detached copies.

    Args:
        model: the model with LoRA layers.
        with_a: include every layer's A when True.

    Returns:
        A [r, in] (when ``with_a``) and B [out, r] of every layer of rank > 0; for a layer with a
        core only the core's reply [r, q] (its frozen A and B never travel back).
    """
    out = {}
    for name, m in lora_modules(model).items():
        if m.rank == 0:
            continue
        if m.lora_core is not None:
            out[lora_core_key(name, m.lora_core.kind)] = m.lora_core.reply()
            continue
        if with_a:
            out[peft_key(name, "lora_A")] = m.lora_A.weight.detach().clone()
        out[peft_key(name, "lora_B")] = m.lora_B.weight.detach().clone()
    return out
