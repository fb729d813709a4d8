"""configs/paper/: the papers' setting runs as written once its two files exist. Here the files
are stand-ins of the same formats (a tiny Llama saved as a Hugging Face directory, a Dolly-format
JSONL), placed where the config expects them, and the run is shrunk only in size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nestfed.nn.backbone import byte_tokenizer, tiny_model

ROOT = Path(__file__).resolve().parents[2]
CATEGORIES = [
    "open_qa",
    "general_qa",
    "classification",
    "closed_qa",
    "brainstorming",
    "information_extraction",
    "summarization",
    "creative_writing",
]


@pytest.mark.slow
def test_paper_config_runs_with_its_files_in_place(cli, tmp_path):
    model_dir = tmp_path / "models" / "TinyLlama-1.1B"
    tok = byte_tokenizer()
    tiny_model("llama", len(tok), hidden=128).save_pretrained(model_dir)  # k_proj: [64, 128], room for r = 64
    tok.save_pretrained(model_dir)
    data = tmp_path / "data" / "databricks-dolly-15k.jsonl"
    data.parent.mkdir()
    data.write_text(
        "".join(
            json.dumps(
                {"instruction": f"Say {i}.", "context": "", "response": f"{i} {i}", "category": CATEGORIES[i % 8]}
            )
            + "\n"
            for i in range(240)
        )
    )
    res = cli(
        "run",
        ROOT / "configs" / "paper" / "prelort_tinyllama_dolly.toml",
        "--methods",
        "prelort,zeropad",
        "--set",
        "federation.rounds=1",
        "--set",
        "train.local_steps=1",
        "--set",
        "data.max_train=4",
        "--set",
        "data.max_test=2",
        "--set",
        "data.block_size=32",
        "--set",
        "output.plots=false",
        "--set",
        "train.micro_batch_size=2",
        "--set",
        "train.gradient_checkpointing=true",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    runs = sorted((tmp_path / "runs").rglob("summary.json"))
    assert len(runs) == 2
    resolved = (runs[0].parent / "config.toml").read_text()
    assert 'device = "auto"' in resolved and "ranks = [4, 4, 4, 8, 8, 16, 16, 32, 32, 64]" in resolved
