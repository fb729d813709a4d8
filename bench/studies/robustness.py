"""Robust aggregation and differential privacy, measured (issue 11, part 6).

The main job's data with 10 clients (configs/robustness.toml, PreLort): every attack x every rule
with 2 attackers, the final mean held-out perplexity against the clean run of the plain rule; then
a privacy-utility curve (central DP, noise multipliers 0, 0.5, 1, 2, epsilon at delta 1e-5 from
dp-accounting's PLD accountant). One seed; prints one JSON object and writes
bench/results/robustness.{json,md,png}.

    python bench/studies/robustness.py [--config configs/robustness.toml] [--method prelort] [--quick]
    python bench/studies/robustness.py --privacy-only   # add missing noise multipliers to the saved results
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from nestfed import methods  # noqa: E402
from nestfed.experiments.prepare import prepare  # noqa: E402
from nestfed.experiments.run import run_method  # noqa: E402
from nestfed.io.markdown import markdown_table  # noqa: E402

ATTACKS = {
    "none": {"kind": "none"},
    "sign flip": {"kind": "sign_flip"},
    "x100 scaling": {"kind": "scale", "scale": 100.0},
    "noise": {"kind": "noise", "noise_std": 1.0},
    "free-rider": {"kind": "free_rider"},
    "poisoning (shuffled text)": {"kind": "shuffle"},
}
RULES = {
    "plain": {"rule": "mean"},
    "median": {"rule": "median"},
    "trimmed mean": {"rule": "trimmed_mean", "trim_fraction": 0.2},
    "krum": {"rule": "krum", "byzantine": 2},
    "norm bound": {"rule": "mean"},
}
NOISE = (0.0, 0.01, 0.03, 0.1, 0.5, 1.0, 2.0)
OUT = Path(__file__).parents[1] / "results"


def update_norms(run_dir: Path) -> list[float]:
    """The accepted clients' update norms of every round of a run."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [c["update_norm"] for ln in lines[1:] for c in ln["clients"].values() if "update_norm" in c]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(Path(__file__).parents[2] / "configs" / "robustness.toml"))
    ap.add_argument("--method", default="prelort")
    ap.add_argument("--quick", action="store_true", help="one round, two attacks, two rules (a smoke test)")
    ap.add_argument(
        "--privacy-only",
        action="store_true",
        help="run only the noise multipliers missing from bench/results/robustness.json",
    )
    args = ap.parse_args()
    if args.privacy_only:
        return privacy_only(args)
    base = methods.load_config(
        args.config, [f"strategy.name={args.method}"] + (["federation.rounds=1"] if args.quick else [])
    )
    attacks = dict(list(ATTACKS.items())[:3]) if args.quick else ATTACKS
    rules = dict(list(RULES.items())[:2]) if args.quick else RULES
    tmp = Path(tempfile.mkdtemp(prefix="nestfed-robustness-"))
    t0 = time.perf_counter()
    clean_prep = prepare(base)
    results: dict[str, dict[str, dict]] = {}
    bound = None
    for attack, a in attacks.items():
        prep = (
            clean_prep
            if a["kind"] not in ("shuffle", "random_text")
            else prepare(methods.replace_config(base, attack=a))
        )
        for rule, r in rules.items():
            overrides = {"attack": a if a["kind"] != "none" else {"kind": "none", "clients": []}, "robust": r}
            if rule == "norm bound":
                overrides["validation"] = {"max_update_norm": bound, "on_norm": "clip"}
            cfg = methods.replace_config(base, **overrides)
            t = time.perf_counter()
            run_dir = tmp / f"{attack}-{rule}".replace(" ", "_")
            s = run_method(prep, cfg, run_dir)
            if attack == "none" and rule == "plain":  # the norm bound: the clean run's median update norm
                bound = statistics.median(update_norms(run_dir))
            results.setdefault(attack, {})[rule] = {
                "mean_ppl": s["mean_ppl"],
                "rejected": s["rejected_updates"],
                "time_s": time.perf_counter() - t,
            }
            print(f"{attack:>28} | {rule:>12} | ppl {s['mean_ppl']:.2f} | {time.perf_counter() - t:.0f} s", flush=True)
    clean = results["none"]["plain"]["mean_ppl"]
    for row in results.values():
        for v in row.values():
            v["vs_clean"] = v["mean_ppl"] / clean - 1
    privacy = privacy_curve(base, clean_prep, bound, tmp, NOISE[:2] if args.quick else NOISE)
    report = {
        "config": args.config,
        "method": args.method,
        "attackers": list(base.attack.clients),
        "ranks": list(base.lora.ranks),
        "rounds": base.federation.rounds,
        "norm_bound": bound,
        "clean_mean_ppl": clean,
        "backbone_mean_ppl": None,
        "results": results,
        "privacy": privacy,
        "delta": 1e-5,
        "wall_s": time.perf_counter() - t0,
        "quick": args.quick,
    }
    first = json.loads((tmp / "none-plain" / "metrics.jsonl").read_text().splitlines()[0])
    report["backbone_mean_ppl"] = statistics.mean(v["ppl"] for v in first["eval"].values())
    print(json.dumps(report, indent=1))
    if not args.quick:
        write(report)


def privacy_curve(base, prep, bound: float, tmp: Path, noise: tuple[float, ...]) -> list[dict]:
    """Central DP runs (clip = ``bound``) at each noise multiplier: epsilon and final mean ppl."""
    out = []
    for z in noise:
        cfg = methods.replace_config(
            base,
            privacy={"mode": "central", "clip_norm": bound, "noise_multiplier": z, "delta": 1e-5},
            attack={"kind": "none", "clients": []},
        )
        s = run_method(prep, cfg, tmp / f"dp-{z}")
        out.append({"noise_multiplier": z, "epsilon": s["privacy"]["epsilon"], "mean_ppl": s["mean_ppl"]})
        print(f"DP z={z}: epsilon {s['privacy']['epsilon']} ppl {s['mean_ppl']:.2f}", flush=True)
    return out


def privacy_only(args: argparse.Namespace) -> None:
    """Add the noise multipliers of NOISE missing from the saved report, with its norm bound."""
    report = json.loads((OUT / "robustness.json").read_text())
    base = methods.load_config(report["config"], [f"strategy.name={report['method']}"])
    have = {p["noise_multiplier"] for p in report["privacy"]}
    missing = tuple(z for z in NOISE if z not in have)
    tmp = Path(tempfile.mkdtemp(prefix="nestfed-privacy-"))
    report["privacy"] = sorted(
        report["privacy"] + privacy_curve(base, prepare(base), report["norm_bound"], tmp, missing),
        key=lambda p: p["noise_multiplier"],
    )
    print(json.dumps(report["privacy"], indent=1))
    write(report)


def ppl(x: float) -> str:
    """A perplexity for the table: two decimals, or three significant digits when it exploded."""
    return f"{x:.2f}" if x < 1e4 else f"{x:.2e}"


def cell(v: dict) -> str:
    """One table cell: the perplexity and its change against the clean plain run."""
    change = f"{100 * v['vs_clean']:+.1f}%" if abs(v["vs_clean"]) < 10 else f"x{1 + v['vs_clean']:.2g}"
    return f"{ppl(v['mean_ppl'])} ({change})"


def table(report: dict) -> str:
    """The markdown tables of docs/trust.md: one row per attack, one column per rule; then the
    privacy curve (bench/tools/tables.py regenerates the docs' copy from robustness.json)."""
    res = report["results"]
    rules = list(next(iter(res.values())))
    rows = markdown_table(
        [f"attack (clients {', '.join(map(str, report['attackers']))})", *rules],
        [[attack, *(cell(row[r]) for r in rules)] for attack, row in res.items()],
    )
    privacy = [
        [p["noise_multiplier"], "inf" if p["epsilon"] is None else f"{p['epsilon']:.1f}", ppl(p["mean_ppl"])]
        for p in report["privacy"]
    ]
    rows += ["", *markdown_table(["noise multiplier z", "epsilon (delta 1e-5)", "mean ppl"], privacy)]
    return "\n".join(rows) + "\n"


def write(report: dict) -> None:
    """bench/results/robustness.json, its markdown table and the two plots."""
    OUT.mkdir(exist_ok=True)
    (OUT / "robustness.json").write_text(json.dumps(report, indent=1) + "\n")
    (OUT / "robustness.md").write_text(table(report))
    res = report["results"]
    rules = list(next(iter(res.values())))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    attacks = list(res)
    width = 0.8 / len(rules)
    for i, r in enumerate(rules):
        ax1.bar(
            [j + i * width for j in range(len(attacks))],
            [min(res[a][r]["mean_ppl"], 1000) for a in attacks],
            width,
            label=r,
        )
    ax1.axhline(report["clean_mean_ppl"], color="k", ls="--", lw=1, label="clean, plain")
    ax1.set_yscale("log")
    ax1.set_xticks([j + 0.4 - width / 2 for j in range(len(attacks))], attacks, rotation=20, fontsize=8)
    ax1.set_ylabel("final mean held-out perplexity (capped at 1000)")
    ax1.set_title(f"{report['method']}, 10 clients, 2 attackers")
    ax1.legend(fontsize=7)
    pts = [p for p in report["privacy"] if p["epsilon"] is not None]
    ax2.plot([p["epsilon"] for p in pts], [p["mean_ppl"] for p in pts], "o-")
    for p in pts:
        ax2.annotate(f"z={p['noise_multiplier']}", (p["epsilon"], p["mean_ppl"]), fontsize=8)
    nodp = [p for p in report["privacy"] if p["epsilon"] is None]
    if nodp:
        ax2.axhline(nodp[0]["mean_ppl"], color="k", ls="--", lw=1, label="z = 0 (epsilon = inf)")
        ax2.legend(fontsize=8)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("epsilon at delta 1e-5 (PLD accountant)")
    ax2.set_ylabel("final mean held-out perplexity")
    ax2.set_title("privacy-utility, central DP")
    fig.tight_layout()
    fig.savefig(OUT / "robustness.png", dpi=110)


if __name__ == "__main__":
    main()
