"""Write a global LoRA adapter as a PEFT adapter directory that ``PeftModel.from_pretrained`` loads.

The directory holds ``adapter_config.json`` (written by ``peft.LoraConfig.save_pretrained``) and
``adapter_model.safetensors`` with PEFT's saved key names
(``base_model.model.<module>.lora_A.weight``). nestfed's scale s becomes PEFT's
``lora_alpha / r`` by setting ``lora_alpha = s * r``, so the loaded model computes the same logits.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from nestfed.io import atomic
from nestfed.nn.keys import module_of

QUANTIZATION_PREFIX = "The following `bitsandbytes` quantization config was used during training:"


def model_card(base_model: str, quantization: Mapping[str, object]) -> str:
    """Write the adapter's README.md as PEFT writes it for an adapter trained over a quantised base.

    As ``PeftModel.create_or_update_model_card`` does: ``library_name: peft`` and the base model in
    the metadata, the ``bitsandbytes`` config under "Training procedure".

    Args:
        base_model: the base model's name or path; none when empty.
        quantization: the keyword arguments of transformers' ``BitsAndBytesConfig``, one
            ``- key: value`` line each.

    Returns:
        The model card's text.
    """
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(library_name="peft", base_model=base_model or None)
    lines = [f"- {k}: {str(v).removeprefix('torch.')}" for k, v in quantization.items()]
    text = "\n".join(["## Training procedure", "", QUANTIZATION_PREFIX, *lines, ""])
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{text}"))


def export_peft_adapter(
    state: dict[str, torch.Tensor],
    scaling: float,
    out_dir: str | Path,
    base_model: str = "",
    lora_dropout: float = 0.0,
    quantization: Mapping[str, object] | None = None,
) -> Path:
    """Write a global LoRA adapter as a PEFT adapter directory.

    The directory is written beside its target and renamed into place (never half-written), with
    the user's umask.

    Args:
        state: ``{PEFT key: tensor}``, one rank r for every layer.
        scaling: the s that multiplies B @ A in nestfed (exported as lora_alpha = s * r).
        out_dir: the adapter directory, created or replaced.
        base_model: the base model's name or path (``base_model_name_or_path``); none when empty.
        lora_dropout: the dropout the adapter trained with (``lora.lora_dropout``; PEFT applies it
            in training only).
        quantization: the base's ``BitsAndBytesConfig`` keyword arguments when it trained over a
            quantised backbone (nestfed.nn.quantization.bnb_config), recorded in a README.md model
            card as PEFT records them.

    Returns:
        ``out_dir``, as a Path.

    Raises:
        ValueError: when layers disagree on the rank, the rank is 0 (PEFT cannot load it) or a key
            is not a LoRA key.
    """
    modules = sorted({module_of(k)[0] for k in state})
    ranks = {state[k].shape[0] for k in state if k.endswith("lora_A.weight")}
    if len(ranks) != 1:
        raise ValueError(f"every layer must share one rank to export, got ranks {sorted(ranks)}")
    r = ranks.pop()
    if r < 1:
        raise ValueError("the adapter has rank 0 (nothing was aggregated into it); PEFT cannot load it")
    pattern = "^(" + "|".join(re.escape(m) for m in modules) + ")$"
    from peft import LoraConfig  # here: peft imports bitsandbytes, about 1.4 s that every node process would pay

    config = LoraConfig(
        r=r,
        lora_alpha=scaling * r,
        target_modules=pattern,
        lora_dropout=lora_dropout,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model or None,
    )

    def build(tmp: Path) -> None:
        config.save_pretrained(tmp)
        if quantization:
            (tmp / "README.md").write_text(model_card(base_model, quantization))
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, tmp / "adapter_model.safetensors")

    return atomic.write_dir(Path(out_dir), build)
