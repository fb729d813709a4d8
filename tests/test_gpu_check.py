"""bench/tools/gpu_check.py's dry run: every part of the prepared GPU check runs on the CPU at tiny sizes,
so a typo or a broken import shows here, not in the few minutes of a lent GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_part(tmp_path):
    out = tmp_path / "gpu_check.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tools" / "gpu_check.py"), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(out.read_text())
    parts = ["cuda_tests", "lora_vs_peft", "qlora", "prelort", "fednl", "fedslm", "two_rounds"]
    assert got["dry_run"] is True and got["device"] == "cpu"
    for part in parts:
        assert "error" not in got[part], (part, got[part].get("traceback"))
    assert got["two_rounds"]["result"]["finished"] is True
    assert got["lora_vs_peft"]["result"]["tiny"]["tokens_per_s_ratio"] > 0
    assert got["qlora"]["result"]["tokens_per_s_ratio"] > 0
    assert [f"R_k={n}" for n in (1, 2, 3, 4)] == sorted(got["prelort"]["result"])
    assert set(got["criteria"]) == {
        "lora_tokens_per_s_vs_peft>=0.9",
        "qlora_tokens_per_s_vs_peft>=0.9",
        "fednl_fused_vs_lora>=0.7",
        "fedslm_peak_memory<=0.6",
        "two_rounds_finished",
        "cuda_tests_passed",
    }


@pytest.mark.slow
def test_gpu_check_without_cuda_says_so():
    """Run through bench/gpu_check.py, the path the GPU instructions name: it forwards the
    arguments, the message and the exit status of bench/tools/gpu_check.py."""
    import torch

    if torch.cuda.is_available():
        return
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py")], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and "no CUDA device: run with --dry-run" in p.stderr
