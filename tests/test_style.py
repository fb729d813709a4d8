"""The tree is lint-clean and formatter-clean (ruff, configured in pyproject.toml's [tool.ruff]),
so CI enforces both; .pre-commit-config.yaml runs the same checks before a commit."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent))
    assert exe, "ruff is part of the test extra"
    return subprocess.run([exe, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check_finds_nothing():
    r = ruff("check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_ruff_format_would_change_nothing():
    r = ruff("format", "--check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_pre_commit_runs_the_same_ruff():
    cfg = (ROOT / ".pre-commit-config.yaml").read_text()
    pinned = next(ln for ln in (ROOT / "pyproject.toml").read_text().splitlines() if '"ruff==' in ln)
    version = pinned.split('"ruff==')[1].split('"')[0]
    assert f"rev: v{version}" in cfg and "id: ruff-check" in cfg and "id: ruff-format" in cfg
