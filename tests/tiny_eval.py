"""Helpers for the evaluation-harness tests: a tiny MMLU folder, a tiny model saved as a Hugging
Face directory and a PEFT adapter on it."""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from nestfed.evaluation import harness
from nestfed.nn.backbone import byte_tokenizer, tiny_model

SUBJECTS = [s for subjects in harness.CATEGORIES.values() for s in subjects]


def write_mmlu(root: Path, n: int = 2, answers: dict[str, list[int]] | None = None) -> Path:
    """A tiny MMLU folder: the 44 subjects of FlowerTune's categories, ``n`` questions each (headered
    format), gold answers from ``answers[subject]`` or cycling A-D."""
    for subject in SUBJECTS:
        folder = root / "test"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"{subject}_test.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["question", "choice0", "choice1", "choice2", "choice3", "answer"])
            for i in range(n):
                gold = answers[subject][i] if answers else i % 4
                w.writerow(
                    [
                        f"In {subject}, which item {i} is {'odd' if i % 2 else 'even'}",
                        f"a{i}",
                        f"b{i}",
                        f"c{i}",
                        f"d{i}",
                        gold,
                    ]
                )
    return root


def save_tiny(root: Path) -> tuple[Path, Path]:
    """A tiny random Llama with the byte tokenizer saved as a Hugging Face directory, and a PEFT
    LoRA adapter on it with large random weights (so that it changes the answers)."""
    from peft import LoraConfig, get_peft_model

    tok = byte_tokenizer()
    model = tiny_model("llama", len(tok), seed=1)
    base = root / "tiny"
    model.save_pretrained(base)
    tok.save_pretrained(base)
    peft_model = get_peft_model(
        tiny_model("llama", len(tok), seed=1),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False),
    )
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 1.0)
    adapter = root / "adapter"
    peft_model.save_pretrained(adapter)
    return base, adapter
