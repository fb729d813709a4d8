"""FedSLM's recovery curve (issue 24 item 3): do compressed clients recover over rounds of federated
core training, and at which compression ratio rho?

For each rho, every client of configs/fedslm_bbc_news.toml (SmolLM2, BBC News, 5 topic clients,
the top 4 layers compressed with whitened SVD) runs at that rho, and FedSLM trains for ``--rounds``
rounds; each round's held-out perplexity of the compressed clients (the mean over clients of each
client's own test set) is read from the run's metrics.jsonl. Against it: the uncompressed backbone
(round 0 of the full-model FedAvg run) and full-model FedAvg+LoRA over the same rounds. The
weak-to-strong elicitation's alpha sweep runs at the end of every FedSLM run (alpha 0.5 and
``elicitation.compare_alphas``). Each run is a ``nestfed run`` subprocess (the ratios change what is
prepared); one JSON object is printed and written with ``--out``, a plot with ``--plot``.

    .venv/bin/python bench/studies/fedslm_recovery.py --rounds 10 --seed 0 \
        --out bench/results/fedslm_recovery/seed0.json --plot bench/results/fedslm_recovery/seed0.png
    .venv/bin/python bench/studies/fedslm_recovery.py --table bench/results/fedslm_recovery/seed0.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nestfed.io.markdown import markdown_row, markdown_table

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "fedslm_bbc_news.toml"


def curve(run_dir: Path) -> list[float]:
    """Mean held-out perplexity over the clients at every evaluated round (round 0 first)."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        ev = json.loads(line).get("eval")
        if ev:
            out.append(sum(v["ppl"] for v in ev.values()) / len(ev))
    return out


def one(method: str, rho: float | None, rounds: int, seed: int, work: Path, extra: list[str] = ()) -> dict:
    sets = [
        f"federation.rounds={rounds}",
        f"federation.seed={seed}",
        f"lora.init_seed={seed}",
        f"output.dir={work}",
        "elicitation.compare_alphas=[0.0,0.25,0.75]",
        "output.plots=false",
    ]
    if rho is not None:
        sets.append(f"compression.client_ratios=[{rho},{rho},{rho},{rho},{rho}]")
    if method == "fedavg":
        sets += ["lora.ranks=[16]", "strategy.name=fedavg"]
    sets += list(extra)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "nestfed.cli", "run", str(CONFIG), "--methods", method]
    for s in sets:
        cmd += ["--set", s]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{method} rho={rho}: failed\n{r.stderr[-3000:]}")
    summaries = sorted(work.rglob("summary.json"), key=lambda p: p.stat().st_mtime)
    run_dir = summaries[-1].parent
    summary = json.loads(summaries[-1].read_text())
    row = {
        "method": method,
        "rho": rho,
        "seed": seed,
        "ppl_by_round": curve(run_dir),
        "wall_s": time.perf_counter() - t0,
    }
    for key in ("elicitation", "server", "client_memory"):
        if key in summary:
            row[key] = summary[key]
    return row


def table(result: dict) -> str:
    """Mean client held-out perplexity at rounds 0, 1, 2, 5 and the last, per run."""
    rows = result["runs"]
    last = max(len(r["ppl_by_round"]) for r in rows) - 1
    marks = [m for m in (0, 1, 2, 5, last) if m <= last]
    marks = sorted(set(marks))
    out = markdown_table(["run", *(f"round {m}" for m in marks), "wall s"])
    for r in rows:
        name = "FedAvg+LoRA, full model" if r["method"] == "fedavg" else f"FedSLM, rho = {r['rho']}"
        cells = [f"{r['ppl_by_round'][m]:.2f}" if m < len(r["ppl_by_round"]) else "-" for m in marks]
        out.append(markdown_row([name, *cells, f"{r['wall_s']:.0f}"]))
    return "\n".join(out) + "\n"


def seeds_table(results: list[dict]) -> str:
    """Over seeds: each run's mean client held-out perplexity (mean ± 95% t half width) at rounds 0,
    1, 2, 5 and the last, its best round, and that round's paired difference from the uncompressed
    backbone (FedAvg's round 0 of the same seed; bold when the interval excludes 0)."""
    from nestfed.experiments.intervals import mean_interval, paired_difference

    keys = [(r["method"], r["rho"]) for r in results[0]["runs"]]
    last = min(len(r["ppl_by_round"]) for res in results for r in res["runs"]) - 1
    marks = sorted({m for m in (0, 1, 2, 5, last) if m <= last})
    backbone = [next(r for r in res["runs"] if r["method"] == "fedavg")["ppl_by_round"][0] for res in results]
    head = [f"run ({len(results)} seeds)", *(f"round {m}" for m in marks)]
    out = markdown_table([*head, "best round (mean)", "best vs backbone, % [95%]"])
    for method, rho in keys:
        curves = [
            next(r for r in res["runs"] if (r["method"], r["rho"]) == (method, rho))["ppl_by_round"] for res in results
        ]
        means = [mean_interval([c[m] for c in curves]) for m in range(last + 1)]
        best = min(range(1, last + 1), key=lambda m: means[m].mean)
        d = paired_difference([100 * (c[best] - b) / b for c, b in zip(curves, backbone)])
        i = d.interval
        diff = f"{i.mean:+.1f}" if i.n < 2 else f"{i.mean:+.1f} [{i.low:+.1f}, {i.high:+.1f}]"
        name = "FedAvg+LoRA, full model" if method == "fedavg" else f"FedSLM, rho = {rho}"
        out.append(
            markdown_row([name, *(means[m].text() for m in marks), best, f"**{diff}**" if d.significant else diff])
        )
    return "\n".join(out) + "\n"


def merged(data: dict) -> str:
    """The seeds table of a merged file (``{"bench": "fedslm_recovery_seeds", "seeds": [...]}``)."""
    return seeds_table(data["seeds"])


def alpha_table(data: dict) -> str:
    """The weak-to-strong alpha sweep over a merged file's seeds: the server's full model's mean
    client held-out perplexity after elicitation from each FedSLM run's weak model (``none`` = the
    backbone), mean ± 95% t half width."""
    from nestfed.experiments.intervals import mean_interval

    results = data["seeds"]
    rhos = [r["rho"] for r in results[0]["runs"] if r["method"] == "fedslm"]
    alphas = ["none", "alpha=0", "alpha=0.25", "alpha=0.5", "alpha=0.75"]
    out = markdown_table([f"weak model ({len(results)} seeds)", *alphas])
    for rho in rhos:
        runs = [next(r for r in res["runs"] if r["rho"] == rho) for res in results]
        cells = [mean_interval([r["elicitation"][a]["mean_ppl"] for r in runs]).text() for a in alphas]
        out.append(markdown_row([f"FedSLM rho = {rho}, round {len(runs[0]['ppl_by_round']) - 1}", *cells]))
    return "\n".join(out) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in result["runs"]:
        label = "FedAvg+LoRA (full model)" if r["method"] == "fedavg" else f"FedSLM rho = {r['rho']}"
        ax.plot(range(len(r["ppl_by_round"])), r["ppl_by_round"], marker="o", label=label)
    backbone = next((r["ppl_by_round"][0] for r in result["runs"] if r["method"] == "fedavg"), None)
    if backbone is not None:
        ax.axhline(backbone, color="grey", ls="--", label="uncompressed backbone")
    ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel("mean client held-out perplexity")
    ax.set_title(f"FedSLM recovery, SmolLM2 top-4 layers compressed, seed {result['seed']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rhos", type=float, nargs="+", default=[0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--set", dest="extra", action="append", default=[], help="section.key=value for every run")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--table", type=Path, help="print the table of this result file and stop")
    ap.add_argument("--seeds-table", type=Path, nargs="+", help="print the table over these seeds' result files")
    ap.add_argument("--merge", type=Path, help="with --seeds-table: write the seeds' results into this one file")
    a = ap.parse_args()
    if a.table:
        print(table(json.loads(a.table.read_text())), end="")
        return
    if a.seeds_table:
        results = [json.loads(p.read_text()) for p in a.seeds_table]
        if a.merge:
            files = [str(p.relative_to(ROOT)) if p.is_absolute() else str(p) for p in a.seeds_table]
            a.merge.write_text(
                json.dumps({"bench": "fedslm_recovery_seeds", "files": files, "seeds": results}, indent=1) + "\n"
            )
        if a.plot:
            mean = {
                "seed": "mean of " + ", ".join(str(r["seed"]) for r in results),
                "runs": [
                    {
                        **run,
                        "ppl_by_round": [
                            sum(x) / len(x) for x in zip(*(res["runs"][i]["ppl_by_round"] for res in results))
                        ],
                    }
                    for i, run in enumerate(results[0]["runs"])
                ],
            }
            plot(mean, a.plot)
        print(seeds_table(results), end="")
        return
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rho in a.rhos:
            runs.append(one("fedslm", rho, a.rounds, a.seed, Path(tmp) / f"fedslm_{rho}", a.extra))
            print(f"rho {rho}: {[round(x, 2) for x in runs[-1]['ppl_by_round']]}", file=sys.stderr, flush=True)
            partial = {
                "bench": "fedslm_recovery",
                "seed": a.seed,
                "rounds": a.rounds,
                "overrides": a.extra,
                "runs": runs,
            }
            if a.out:
                a.out.parent.mkdir(parents=True, exist_ok=True)
                a.out.write_text(json.dumps(partial, indent=1) + "\n")
        runs.append(one("fedavg", None, a.rounds, a.seed, Path(tmp) / "fedavg", a.extra))
    result = {
        "bench": "fedslm_recovery",
        "seed": a.seed,
        "rounds": a.rounds,
        "config": str(CONFIG.relative_to(ROOT)),
        "overrides": a.extra,
        "runs": runs,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    if a.plot:
        plot(result, a.plot)


if __name__ == "__main__":
    main()
