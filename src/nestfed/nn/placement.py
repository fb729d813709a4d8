"""Where the backbone runs and in what precision: the device and dtype policy.

``model.device``: ``auto`` (the first CUDA device when one is visible, else the CPU), ``cpu``,
``cuda`` or ``cuda:N``. ``model.dtype``: ``auto`` (float32 on the CPU, bfloat16 on CUDA, float16
on a GPU without bfloat16), or ``float32`` / ``bfloat16`` / ``float16`` / ``float64``.

- The frozen backbone's weights take that dtype.
- What trains (LoRA's A and B, FedNL's rules, FedSLM's cores) is kept in float32 whenever the
  frozen weights are half precision (`trainable_dtype`); AdamW's state follows its parameters.
- The forward then runs under ``torch.autocast`` in the frozen dtype (`autocast`); losses
  are taken in float32.
- On the CPU in float32 nothing changes: no autocast, no cast, the same operations as before.

Data stays in host memory; each batch is moved to the model's device where it is used
(`to_model`), so one GPU holds one client's step at a time. `release` frees the
CUDA caching allocator between clients.
"""

from __future__ import annotations

import gc
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from nestfed.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
HALF = (torch.bfloat16, torch.float16)


def resolve_device(name: str) -> torch.device:
    """Resolve ``model.device`` to a torch device.

    Args:
        name: ``auto`` (the first CUDA device when one is visible, else the CPU), ``cpu``, ``cuda``
            or ``cuda:N``.

    Returns:
        The device.

    Raises:
        ConfigError: for another name, or a CUDA device this machine does not have (naming how
            many it has).
    """
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        index = int(name[5:]) if ":" in name else 0
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if index >= count:
            raise ConfigError(f"model.device = '{name}': this machine has {count} CUDA device(s) (use 'cpu' or 'auto')")
        return torch.device("cuda", index)
    raise ConfigError(f"model.device: '{name}' is not auto, cpu, cuda or cuda:N")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """Resolve ``model.dtype`` to the frozen weights' dtype on a device.

    Args:
        name: ``auto`` (float32 on the CPU; bfloat16 on CUDA, float16 where the GPU lacks
            bfloat16) or a key of DTYPES.
        device: where the backbone runs.

    Returns:
        The dtype.

    Raises:
        ConfigError: for an unknown name.
    """
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name not in DTYPES:
        raise ConfigError(f"model.dtype: unknown dtype '{name}' (auto, {', '.join(DTYPES)})")
    return DTYPES[name]


def trainable_dtype(frozen: torch.dtype) -> torch.dtype:
    """Choose the dtype of parameters that train beside frozen weights.

    Args:
        frozen: the frozen weights' dtype.

    Returns:
        float32 when ``frozen`` is half precision (bf16 / fp16 master weights lose small updates),
        else ``frozen`` itself.
    """
    return torch.float32 if frozen in HALF else frozen


def frozen_dtype(model: nn.Module) -> torch.dtype:
    """Read the dtype of the backbone's frozen weights (its input embedding's).

    Args:
        model: the backbone.

    Returns:
        The dtype.
    """
    return model.get_input_embeddings().weight.dtype


def model_device(model: nn.Module) -> torch.device:
    """Read the device the backbone's weights live on (its input embedding's).

    Args:
        model: the backbone.

    Returns:
        The device.
    """
    return model.get_input_embeddings().weight.device


def to_model(model: nn.Module, t: torch.Tensor | None) -> torch.Tensor | None:
    """Move a tensor to the model's device (no copy when it is there already).

    Args:
        model: the backbone.
        t: the tensor, or None.

    Returns:
        ``t`` on the model's device; None stays None.
    """
    return None if t is None else t.to(model_device(model), non_blocking=True)


def autocast(model: nn.Module) -> AbstractContextManager:
    """Choose the autocast context a forward of the model runs under.

    Args:
        model: the backbone.

    Returns:
        ``torch.autocast`` in the frozen weights' dtype when that is half precision, on the model's
        device type (CUDA or CPU); a no-op context for float32/float64 weights.
    """
    dtype = frozen_dtype(model)
    if dtype not in HALF:
        return nullcontext()
    return torch.autocast(model_device(model).type, dtype=dtype)


def release(device: torch.device) -> None:
    """Free the memory a finished client left behind, on CUDA.

    Python's garbage, then the caching allocator's unused blocks (so the next client's peak is its
    own).

    Args:
        device: the device used; nothing happens on the CPU.
    """
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
