"""Federations of 10 to 10,000 clients: does a round's cost follow the clients it samples, not the
population? (issue 22; docs/scale.md)

Settings (each in a fresh subprocess, so one setting's memory never hides another's): the tiny random
Llama at 10, 100, 1,000 and 10,000 clients and SmolLM2-135M at 10 and 100, each at
``federation.fraction`` 0.1 and 0.01, over real BBC News dealt out as blocks (``data.unit = "block"``:
the corpus has 2,225 articles), IID, ranks drawn 40/30/20/10% at 2/4/8/16, 4 rounds, a fixed
evaluation panel of 10 clients (``evaluation.final = "panel"``, so no round evaluates the whole
population), the on-disk client cache off (every client is built from its text). Methods: PreLort
(segment means, folded into sums beyond ``federation.hold_replies`` replies) and ZeroPad; at 1,000
tiny clients and fraction 0.1 also HetLoRA (norm weights: holds every reply) and ZeroPad with a
coordinate-wise median (holds every reply).

Per setting: ``prepare_s`` (backbone, registering every client), ``rss_after_prepare_mb`` and
``peak_rss_mb`` (the process's maximum resident set, torch and the model included), and per round
(the median of rounds 2-4): ``round_s``, ``client_s`` (the clients' work: the exchange, training and
the payloads' serialisation), ``server_s`` (configure + validation + aggregation + the commit of the
metrics line and checkpoint), ``evaluate_s`` (the panel), ``server_share`` (server_s / (client_s +
server_s)), the aggregation's own ``aggregate_s`` and ``commit_s``, ``held_bytes`` (what the rule
held), ``bytes_per_round``, and the client pool's counters (clients built). Prints one JSON object and
writes it with ``--out`` (and a plot beside it with ``--plot``).

    .venv/bin/python bench/perf/scale.py [--out bench/results/scale.json] [--plot bench/results/scale.png]
        [--only tiny|smollm2] [--rounds 4]
    .venv/bin/python bench/perf/scale.py --table bench/results/scale.json [--plot P]  # results.md's table, plot
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nestfed.io.markdown import markdown_row, markdown_table

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
BASE = [
    "data.partition=iid",
    "data.unit=block",
    "lora.ranks=[8]",
    "population.rank_shares={2=0.4,4=0.3,8=0.2,16=0.1}",
    "evaluation.final=panel",
    "train.client_cache=off",
    "output.plots=false",
    "output.truncations=[]",
    "train.threads=2",
]
MODELS = {
    "tiny": [
        "model.name=tiny-llama",
        "data.block_size=64",
        "data.max_train=8",
        "data.max_test=2",
        "train.local_steps=2",
    ],
    "smollm2": [
        "model.name=smollm2-135m",
        "data.block_size=128",
        "data.max_train=4",
        "data.max_test=2",
        "train.local_steps=2",
        "lora.layers=[-4,-3,-2,-1]",
    ],
}
SIZES = {"tiny": (10, 100, 1000, 10000), "smollm2": (10, 100)}
FRACTIONS = (0.1, 0.01)


def rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one(setting: dict) -> dict:
    """Run one setting in this process; return its figures."""
    from nestfed import methods
    from nestfed.config import clients_per_round
    from nestfed.experiments.prepare import prepare
    from nestfed.experiments.run import run_method

    k, fraction = setting["clients"], setting["fraction"]
    overrides = (
        BASE
        + MODELS[setting["model"]]
        + [
            f"data.num_clients={k}",
            f"federation.fraction={fraction}",
            f"federation.rounds={setting['rounds']}",
            f"evaluation.clients={min(10, k)}",
        ]
        + setting.get("extra", [])
    )
    cfg = methods.load_config(TINY, overrides + [f"strategy.name={setting['methods'][0]}"])
    t0 = time.perf_counter()
    prep = prepare(cfg)
    out = {
        **setting,
        "sampled_per_round": clients_per_round(fraction, k),
        "prepare_s": time.perf_counter() - t0,
        "rss_after_prepare_mb": rss_mb(),
        "runs": {},
    }
    for name in setting["methods"]:
        label, _, rule = name.partition("+")
        c = methods.load_config(
            TINY, overrides + [f"strategy.name={label}"] + ([f"robust.rule={rule}"] if rule else [])
        )
        commits: dict[int, float] = {}

        def on_event(kind, info, commits=commits):
            if kind == "round_done":
                commits[info["round"]] = info["commit_s"]

        with tempfile.TemporaryDirectory() as tmp:
            summary = run_method(prep, c, Path(tmp) / "run", on_event=on_event)
            lines = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        steady = [ln for ln in lines if ln["round"] >= 2]
        rounds = []
        for ln in steady:
            t = ln["timing"]
            server = t["configure_s"] + t["validate_s"] + t["aggregate_s"] + commits.get(ln["round"], 0.0)
            rounds.append(
                {
                    "round_s": ln["time_s"] + commits.get(ln["round"], 0.0),
                    "client_s": t["exchange_s"],
                    "server_s": server,
                    "evaluate_s": t["evaluate_s"],
                    "aggregate_s": t["aggregate_s"],
                    "commit_s": commits.get(ln["round"], 0.0),
                    "held_bytes": ln.get("replies", {}).get("held_bytes"),
                    "bytes_per_round": ln["bytes_down"] + ln["bytes_up"],
                }
            )
        med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0] if rounds[0][key] is not None}
        med["server_share"] = med["server_s"] / (med["server_s"] + med["client_s"])
        med["held_bytes"] = max((r["held_bytes"] or 0) for r in rounds)
        med["folded"] = any(ln.get("replies", {}).get("folded_replies") for ln in steady)
        out["runs"][name] = med
        out["runs"][name]["wall_s"] = summary["wall_time_s"]
    out["pool"] = dict(vars(prep.data.stats))
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def settings(only: str | None, rounds: int) -> list[dict]:
    out = []
    for model in ("tiny", "smollm2"):
        if only and model != only:
            continue
        for k in SIZES[model]:
            for fraction in FRACTIONS:
                names = ["prelort", "zeropad"]
                if model == "tiny" and k == 1000 and fraction == 0.1:
                    names += ["hetlora", "zeropad+median"]
                out.append({"model": model, "clients": k, "fraction": fraction, "rounds": rounds, "methods": names})
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for model, marker in (("tiny", "o"), ("smollm2", "s")):  # one line per number sampled: flat is the target
        for sampled in sorted({r["sampled_per_round"] for r in result["settings"] if r["model"] == model}):
            rows = sorted(
                (r for r in result["settings"] if r["model"] == model and r["sampled_per_round"] == sampled),
                key=lambda r: r["clients"],
            )
            ks = [r["clients"] for r in rows]
            lab = f"{model}, {sampled} sampled"
            axes[0].plot(ks, [r["runs"]["prelort"]["round_s"] for r in rows], marker=marker, label=lab)
            axes[1].plot(ks, [r["peak_rss_mb"] for r in rows], marker=marker, label=lab)
            axes[2].plot(ks, [100 * r["runs"]["prelort"]["server_share"] for r in rows], marker=marker, label=lab)
    for ax, title in zip(axes, ("PreLort: seconds per round", "peak RSS (MB)", "server share of a round (%)")):
        ax.set_xscale("log")
        ax.set_xlabel("clients in the federation")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(result: dict) -> str:
    """The markdown table of a result (docs/results.md) (one row per setting)."""
    head = ["model", "clients", "fraction", "sampled / round", "prepare s", "peak RSS MB", "clients built"]
    head += ["PreLort s / round", "server share", "ZeroPad s / round", "server share", "MB / round"]
    rows = markdown_table(head)
    for r in result["settings"]:
        p, z = r["runs"]["prelort"], r["runs"]["zeropad"]
        setting = [f"{r['model']}", f"{r['clients']:,}", f"{r['fraction']:g}", f"{r['sampled_per_round']:,}"]
        cost = [f"{r['prepare_s']:.1f}", f"{r['peak_rss_mb']:,.0f}", f"{r['pool']['built']:,}"]
        rounds = [f"{p['round_s']:.3g}", f"{100 * p['server_share']:.1f}%", f"{z['round_s']:.3g}"]
        rounds += [f"{100 * z['server_share']:.1f}%", f"{p['bytes_per_round'] / 1e6:.2f}"]
        rows.append(markdown_row(setting + cost + rounds))
    extra = [
        (r, name, v) for r in result["settings"] for name, v in r["runs"].items() if name not in ("prelort", "zeropad")
    ]
    if extra:
        rows += ["", *markdown_table(["rule (setting)", "s / round", "server share", "aggregation s", "held MB"])]
        rows += [
            markdown_row(
                [f"{name} ({r['model']}, {r['clients']:,} x {r['fraction']:g})", f"{v['round_s']:.3g}"]
                + [f"{100 * v['server_share']:.1f}%", f"{v['aggregate_s']:.4f}", f"{v['held_bytes'] / 1e6:.2f}"]
            )
            for r, name, v in extra
        ]
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=("tiny", "smollm2"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--table", type=Path, help="print the markdown table of this result file and stop")
    args = parser.parse_args()
    if args.table:
        result = json.loads(args.table.read_text())
        print(table(result), end="")
        if args.plot:
            plot(result, args.plot)
        return
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return
    results = []
    for s in settings(args.only, args.rounds):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, __file__, "--one", json.dumps(s)], capture_output=True, text=True, cwd=ROOT)
        if r.returncode != 0:
            raise SystemExit(f"{s}: failed\n{r.stderr[-3000:]}")
        row = json.loads(r.stdout.strip().splitlines()[-1])
        row["process_s"] = time.perf_counter() - t0
        results.append(row)
        print(
            f"{s['model']} {s['clients']} x {s['fraction']}: prepare {row['prepare_s']:.1f} s, peak "
            f"{row['peak_rss_mb']:.0f} MB, prelort round {row['runs']['prelort']['round_s']:.2f} s "
            f"(server {100 * row['runs']['prelort']['server_share']:.1f}%)",
            file=sys.stderr,
        )
    result = {"bench": "scale", "settings": results}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
