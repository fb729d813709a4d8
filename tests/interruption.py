"""A finished run directory made to look as if its process died during round ``rnd``: what a crash
there leaves (checkpoints, metrics lines and clients lines of the rounds before it; no summary, no
adapter), for resume tests."""

import shutil
from pathlib import Path


def interrupted_in_round(run: Path, rnd: int) -> None:
    """Remove round ``rnd``'s checkpoint and every later one, the summary, the adapter, and the
    metrics lines of round ``rnd`` on (lines 0..rnd-1 stay: one per committed round)."""
    for p in (run / "checkpoints").glob("round_*.safetensors"):
        if int(p.stem.split("_")[1]) >= rnd:
            p.unlink()
    (run / "summary.json").unlink()
    shutil.rmtree(run / "adapter")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:rnd]) + "\n")
