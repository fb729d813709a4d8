"""How fast the command line answers: ``nestfed --help``, ``nestfed methods`` and a config error
(issue 22's target: under 1.5 s on a quiet machine), each the wall time of a fresh process, the
median of ``--repeats`` runs, taken interleaved with a baseline checkout when one is given
(``--baseline-src DIR``: its ``src`` folder, run with the same interpreter through PYTHONPATH), so a
loaded machine hits both alike. Prints one JSON object (and writes it with ``--out``).

    .venv/bin/python bench/perf/cli_start.py [--repeats 5] [--baseline-src /path/to/old/src] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {
    "help": ["--help"],
    "methods": ["methods"],
    "config_error": ["run", "configs/tiny.toml", "--set", "lora.rank=3"],
}


def timed(args: list[str], src: str | None) -> float:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "from nestfed.cli import main; main()", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        check=False,
    )
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline-src")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sides = {"now": None} | ({"baseline": args.baseline_src} if args.baseline_src else {})
    times: dict[str, dict[str, list[float]]] = {s: {c: [] for c in COMMANDS} for s in sides}
    for _ in range(args.repeats):
        for name, cmd in COMMANDS.items():
            for side, src in sides.items():
                times[side][name].append(timed(cmd, src))
    out = {
        "bench": "cli_start",
        "repeats": args.repeats,
        "load_1min": os.getloadavg()[0],
        "median_s": {s: {c: round(statistics.median(v), 3) for c, v in t.items()} for s, t in times.items()},
        "all_s": {s: {c: [round(x, 3) for x in v] for c, v in t.items()} for s, t in times.items()},
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
