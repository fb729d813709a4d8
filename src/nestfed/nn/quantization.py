"""The frozen backbone's linear layers held quantised by bitsandbytes, as QLoRA holds them.

QLoRA (Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", arXiv 2305.14314,
section 3): the frozen weights are stored in 4-bit NormalFloat (``nf4``: blocks of 64 weights,
one absmax constant each; with double quantisation the constants are quantised to 8 bits in blocks
of 256) and dequantised to the compute dtype in every forward; the LoRA matrices beside them stay
in 16 or 32 bits and are what trains. ``int8`` is LLM.int8 (Dettmers et al., arXiv 2208.07339):
row-wise absmax int8 weights, activations' outlier columns (magnitude above 6.0) in float.

Every ``nn.Linear`` of the model is replaced, except the output head and any layer whose weight is
the input embedding's (tied), as transformers' ``BitsAndBytesConfig`` does by default, so a model
quantised here holds the same bytes as one loaded with ``load_in_4bit`` / ``load_in_8bit``
(tests/nn/test_quantization.py). The kernels are bitsandbytes' (CPU and CUDA); nestfed only
chooses the layers and sizes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import torch
from torch import nn

from nestfed.nn.placement import resolve_device, resolve_dtype

#: LLM.int8's outlier threshold (transformers' ``llm_int8_threshold`` default)
INT8_THRESHOLD = 6.0


def dense_dtype(layer: nn.Module) -> torch.dtype:
    """Find the floating dtype a layer computes in.

    Args:
        layer: a Linear, plain or quantised.

    Returns:
        Its weight's dtype, or for a quantised layer the dtype it dequantises to (nf4's compute
        dtype; float32 for int8 and when none is set).
    """
    w = layer.weight
    if w.dtype.is_floating_point:
        return w.dtype
    return getattr(layer, "compute_dtype", None) or torch.float32


def is_quantized(layer: nn.Module) -> bool:
    """Tell whether a layer holds its weight quantised.

    Args:
        layer: any module.

    Returns:
        True for an integer-typed weight.
    """
    w = getattr(layer, "weight", None)
    return isinstance(w, torch.Tensor) and not w.dtype.is_floating_point


def quantizable(model: nn.Module) -> list[str]:
    """List the plain ``nn.Linear`` layers to quantise.

    Args:
        model: the backbone.

    Returns:
        Their paths: all but the output head and layers that share the input embedding's weight.
    """
    emb = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = {emb.weight.data_ptr()} if emb is not None else set()
    return [
        name
        for name, m in model.named_modules()
        if type(m) is nn.Linear and m is not head and m.weight.data_ptr() not in tied
    ]


def _bnb() -> ModuleType:
    """bitsandbytes (its noisy loggers are quieted when nestfed is imported: nestfed/__init__.py)."""
    import bitsandbytes

    return bitsandbytes


def _nf4(m: nn.Linear, compute_dtype: torch.dtype, double_quant: bool) -> nn.Module:
    bnb = _bnb()

    q = bnb.nn.Linear4bit(
        m.in_features,
        m.out_features,
        bias=m.bias is not None,
        compute_dtype=compute_dtype,
        compress_statistics=double_quant,
        quant_type="nf4",
        device="meta",
    )
    q.weight = bnb.nn.Params4bit(
        m.weight.data, requires_grad=False, compress_statistics=double_quant, quant_type="nf4", module=q
    )
    keep_trainable_layout(q)
    return _placed(q, m)


def keep_trainable_layout(layer: nn.Module) -> None:
    """Keep an nf4 layer out of bitsandbytes' packed CPU inference layout.

    On a CPU with AVX512-BF16, bitsandbytes 0.50 repacks a Linear4bit's weight in place on its first
    forward in eval mode without gradients (nestfed's frozen prefix, an evaluation), and from then
    on computes it in bfloat16 with a kernel that has no backward: the LoRA layers below it would
    silently get no gradient through it. Off, every forward dequantises and multiplies
    (``gemm_4bit``; ``MatMul4Bit`` with its backward when gradients are needed).

    Args:
        layer: a bitsandbytes Linear4bit; other layers are left as they are.
    """
    if hasattr(layer, "support_avx512bf16_for_cpu"):
        layer.support_avx512bf16_for_cpu = False


def _int8(m: nn.Linear) -> nn.Module:
    bnb = _bnb()

    q = bnb.nn.Linear8bitLt(
        m.in_features,
        m.out_features,
        bias=m.bias is not None,
        has_fp16_weights=False,
        threshold=INT8_THRESHOLD,
        device="meta",
    )
    q.weight = bnb.nn.Int8Params(m.weight.data, requires_grad=False, has_fp16_weights=False)
    return _placed(q, m)


def _placed(q: nn.Module, m: nn.Linear) -> nn.Module:
    """``q`` with ``m``'s bias (frozen), moved to ``m``'s device: moving a Params4bit or Int8Params
    is what quantises it."""
    if m.bias is not None:
        q.bias = nn.Parameter(m.bias.data, requires_grad=False)
    return q.to(m.weight.device)


def quantize_linears(
    model: nn.Module, quantization: str, compute_dtype: torch.dtype, double_quant: bool = True
) -> list[str]:
    """Replace the model's linear layers by bitsandbytes layers holding the same weights quantised.

    Args:
        model: the backbone, changed in place (the layers of `quantizable`).
        quantization: ``nf4`` (Linear4bit), ``int8`` (Linear8bitLt) or ``none`` (changes nothing).
        compute_dtype: the dtype nf4 layers dequantise to and compute in.
        double_quant: quantise nf4's absmax constants too (QLoRA's double quantisation).

    Returns:
        The replaced paths.

    Raises:
        ValueError: for another name.
    """
    if quantization == "none":
        return []
    if quantization not in ("nf4", "int8"):
        raise ValueError(f"model.quantization: unknown '{quantization}' (none, int8, nf4)")
    names = quantizable(model)
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        m = getattr(parent, leaf)
        q = _nf4(m, compute_dtype, double_quant) if quantization == "nf4" else _int8(m)
        setattr(parent, leaf, q)
    return names


def release_checkpoint(model: nn.Module) -> None:
    """Give the float parameters and buffers left after quantisation storage of their own.

    transformers maps a safetensors checkpoint into memory, and one tensor still viewing the mapping
    keeps every page quantisation read resident: the dense weights would stay in the process's
    memory beside their packed copies.

    Args:
        model: the quantised backbone; its float tensors (embeddings, norms) are copied.
    """
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.dtype.is_floating_point:
                t.data = t.data.clone()


def _state_tensors(layer: nn.Module) -> Iterator[torch.Tensor]:
    """The tensors a quantised layer keeps beside its weight: nf4's quantisation state (absmax,
    code book, and the nested state of double quantisation), int8's row scales."""
    state = getattr(layer.weight, "quant_state", None)
    while state is not None:
        for name in ("absmax", "code", "offset"):
            t = getattr(state, name, None)
            if isinstance(t, torch.Tensor):
                yield t
        state = getattr(state, "state2", None)
    for holder in (layer.weight, getattr(layer, "state", None)):  # the first forward moves it to the state
        scb = getattr(holder, "SCB", None)
        if isinstance(scb, torch.Tensor):
            yield scb


def quantization_state_bytes(model: nn.Module) -> int:
    """Measure the quantisation state of every quantised layer, each storage once.

    The state is neither parameters nor buffers, so a count over those misses it.

    Args:
        model: the backbone.

    Returns:
        Its bytes (nf4's absmax, code book and nested state; int8's row scales).
    """
    seen: dict[int, int] = {}
    for m in model.modules():
        if is_quantized(m):
            for t in _state_tensors(m):
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def bnb_config(model: object) -> dict[str, object] | None:
    """Give the ``BitsAndBytesConfig`` arguments that load a base quantised as nestfed quantises it.

    What an exported adapter records and what PEFT or lm-eval pass to load the same base. The
    compute dtype is resolved for this machine (``auto``: float32 on the CPU, bfloat16 on CUDA).

    Args:
        model: a ModelConfig (its ``quantization``, ``double_quant``, ``compute_dtype``, ``device``).

    Returns:
        transformers' ``BitsAndBytesConfig`` keyword arguments; None for ``none``.
    """
    q = getattr(model, "quantization", "none")
    if q == "nf4":
        return {
            "load_in_4bit": True,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": bool(model.double_quant),
            "bnb_4bit_compute_dtype": resolve_dtype(model.compute_dtype, resolve_device(model.device)),
        }
    if q == "int8":
        return {"load_in_8bit": True, "llm_int8_threshold": INT8_THRESHOLD}
    return None
