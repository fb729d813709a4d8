"""The fault matrix: every injected client fault against every aggregating method, with default
settings (nothing set but the fault), on the tiny random Llama over real BBC News (3 clients, one
topic each, ranks 2 / 4 / 8, or 4 for the equal-rank methods; 3 rounds of 4 local steps at lr 1e-2,
so that training moves the model). docs/trust.md.

Faults (``[attack]``, client 0 unless said): its update x 1e6 (``scale``), x 100; constant entries
of 1e9 and of 1e30 (``constant``); NaN entries; the reply in float64; the sign-flipped update;
Gaussian noise of std 1e3 instead of the update; a free rider; every client sending NaN. Outcome
per cell: ``rejected`` (the faulty client's reply never reached an aggregate), ``clipped``,
``survived`` (accepted, final held-out perplexity finite and within 5% of the clean run's),
``degraded +x%`` (accepted, finite and better than the backbone, but more than 5% above the clean
run: an attack no norm screen can see, for a robust rule), ``failed loudly`` (the run stopped with
one line, nestfed.errors.RunFailed), ``n/a`` (the method refuses the setting, e.g. a robust rule) or
``SILENT`` (none of these: the model became non-finite or worse than the backbone while the run
went on). Prints one JSON
object (``--out`` writes it, ``--table`` a markdown table beside it).

    .venv/bin/python bench/studies/faults.py [--out bench/results/faults.json] [--methods prelort,zeropad]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from nestfed.io.markdown import markdown_table

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
BASE = [
    "data.num_clients=3",
    "federation.rounds=3",
    "train.local_steps=4",
    "train.lr=1e-2",
    "output.plots=false",
    "output.truncations=[]",
    "train.threads=2",
]
EXTRA = {"fednl": ['lora.target_modules=["q_proj","k_proj","v_proj"]']}  # FedNL keeps o_proj frozen
FAULTS = {
    "update x 1e6": ["attack.kind=scale", "attack.scale=1e6", "attack.clients=[0]"],
    "update x 100": ["attack.kind=scale", "attack.scale=100", "attack.clients=[0]"],
    "constant 1e9": ["attack.kind=constant", "attack.value=1e9", "attack.clients=[0]"],
    "constant 1e30": ["attack.kind=constant", "attack.value=1e30", "attack.clients=[0]"],
    "NaN": ["attack.kind=nans", "attack.clients=[0]"],
    "float64 reply": ["attack.kind=float64", "attack.clients=[0]"],
    "sign flip": ["attack.kind=sign_flip", "attack.clients=[0]"],
    "sign flip, median rule": ["attack.kind=sign_flip", "attack.clients=[0]", "robust.rule=median"],
    "noise std 1e3": ["attack.kind=noise", "attack.noise_std=1e3", "attack.clients=[0]"],
    "free rider": ["attack.kind=free_rider", "attack.clients=[0]"],
    "every client NaN": ["attack.kind=nans", "attack.clients=[0,1,2]"],
}
#: settings a method needs for a fault's rule: HetLoRA takes a robust rule only with n_k weights
UNDER = {("hetlora", "sign flip, median rule"): ["hetlora.weighting=examples"]}
SKIP = ("fedslm", "fedmkt", "local_only")  # no aggregate of client updates to attack (or other models)


def final_ppl(run: Path, line: int = -1) -> float:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    ev = lines[line].get("eval") or {}
    return sum(v["ppl"] for v in ev.values()) / len(ev) if ev else float("nan")


def outcome(run: Path, clean: float, backbone: float, attacked: list[int]) -> tuple[str, float]:
    """The cell's outcome and its final perplexity (module docstring)."""
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][1:]
    ppl = final_ppl(run)
    statuses = [ln["clients"].get(str(c), {}).get("status") for ln in lines for c in attacked]
    close = math.isfinite(ppl) and abs(ppl / clean - 1) <= 0.05
    if statuses and all(s == "rejected" for s in statuses) and (close or len(attacked) > 1):
        return "rejected", ppl
    if any("clipped_to" in ln["clients"].get(str(c), {}) for ln in lines for c in attacked) and close:
        return "clipped", ppl
    if close:
        return "survived", ppl
    if math.isfinite(ppl) and ppl < backbone:
        return f"degraded {100 * (ppl / clean - 1):+.0f}%", ppl
    return "SILENT", ppl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--methods", help="comma-separated (default: every aggregating method)")
    args = parser.parse_args()
    from nestfed import methods
    from nestfed.errors import ConfigError, RunFailed
    from nestfed.experiments.prepare import prepare
    from nestfed.experiments.run import run_method

    names = args.methods.split(",") if args.methods else [m for m in methods.REGISTRY if m not in SKIP]
    t0 = time.perf_counter()
    preps: dict[str, object] = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            hetero = methods.get(name).can(methods.Capability.HETEROGENEOUS_RANKS)
            ranks = "lora.ranks=[2,4,8]" if hetero else "lora.ranks=[4]"
            base = BASE + [ranks, f"strategy.name={name}"] + EXTRA.get(name, [])
            cfg = methods.load_config(TINY, base)
            if ranks not in preps:
                preps[ranks] = prepare(cfg)
            prep = preps[ranks]
            run_method(prep, cfg, Path(tmp) / name / "clean")
            clean = final_ppl(Path(tmp) / name / "clean")
            backbone = final_ppl(Path(tmp) / name / "clean", 0)
            cells = {}
            for fault, extra in FAULTS.items():
                run = Path(tmp) / name / fault.replace(" ", "_")
                try:
                    c = methods.load_config(TINY, base + extra + UNDER.get((name, fault), []))
                except ConfigError as exc:
                    cells[fault], cells[fault + " (line)"] = "n/a", str(exc).rsplit(": ", 1)[-1]
                    continue
                attacked = list(c.attack.clients)
                try:
                    run_method(prep, c, run)
                    cells[fault], ppl = outcome(run, clean, backbone, attacked)
                except RunFailed as exc:
                    cells[fault], ppl = "failed loudly", float("nan")
                    cells[fault + " (line)"] = str(exc).split(": ", 1)[-1]
                cells[fault + " (ppl)"] = ppl
                print(f"{name} / {fault}: {cells[fault]} ({ppl:.2f}, clean {clean:.2f})", file=sys.stderr)
            rows.append({"method": name, "backbone_ppl": backbone, "clean_ppl": clean, **cells})
    result = {
        "bench": "faults",
        "faults": {k: v for k, v in FAULTS.items()},
        "rows": rows,
        "silent": [(r["method"], f) for r in rows for f in FAULTS if r[f] == "SILENT"],
        "degraded": [(r["method"], f, r[f]) for r in rows for f in FAULTS if r[f].startswith("degraded")],
        "wall_s": time.perf_counter() - t0,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
        args.out.with_suffix(".md").write_text(table(result))


def table(result: dict) -> str:
    """The markdown table of docs/trust.md: one row per method, one column per fault."""
    faults = list(result["faults"])
    rows = [
        [r["method"], f"{r['backbone_ppl']:.2f}", f"{r['clean_ppl']:.2f}", *(r[f] for f in faults)]
        for r in result["rows"]
    ]
    return "\n".join(markdown_table(["method", "backbone ppl", "clean ppl", *faults], rows)) + "\n"


if __name__ == "__main__":
    main()
