"""PreLort's ``[prelort] dilution`` (or another option) over 3 seeds, against PreLort and ZeroPad.

The runs of the diluted variant come from::

    ATEN_CPU_CAPABILITY=avx2 .venv/bin/nestfed run configs/bbc_news.toml --methods prelort --seeds 3 \\
        --set prelort.dilution=1.0 --set output.dir=OUT

(avx2: the kernels the stored PreLort and ZeroPad seeds of bench/results/main_job_seeds were run
under, so the clients, seeds and kernels are the same and every (seed, client) pairs exactly).
This script pairs them with those stored seeds and prints JSON (also written to dilution.json
beside the stored comparison, with a markdown table)::

    .venv/bin/python bench/studies/prelort_dilution.py 1.0=OUT1/<run>/comparison.json 0.5=OUT2/<run>/comparison.json

Another ``[prelort]`` variant the same way, named by its spec (``deploy_rank=validated=PATH``,
``--name deploy_rank``). The protocol (configs/bbc_news_protocol.toml), paired with its stored seeds::

    .venv/bin/python bench/studies/prelort_dilution.py 1.0=... 0.5=... \
        --stored bench/results/bbc_news_protocol/comparison.json --config configs/bbc_news_protocol.toml

Reported: per client and mean held-out perplexity (mean ± 95% t half width over seeds), the paired
relative difference against PreLort and against ZeroPad over the 15 (seed, client) pairs, and the
truncation curve of the global adapter (mean perplexity at r = 1, 2, 4, 8, 16), each r paired too.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nestfed.experiments.intervals import mean_interval, paired_difference, relative_differences
from nestfed.io.markdown import markdown_row, markdown_table

ROOT = Path(__file__).resolve().parents[2]
STORED = ROOT / "bench" / "results" / "main_job_seeds" / "comparison.json"
RANKS = ("1", "2", "4", "8", "16")


def rows(path: Path, label: str) -> list[dict]:
    return [r for r in json.loads(path.read_text()) if r["label"] == label]


def per_pair(runs: list[dict], rank: str | None = None) -> dict[tuple[int, str], float]:
    """{(seed, client): ppl} under what each client runs, or the global adapter cut to ``rank``."""
    if rank is None:
        return {(r["seed"], c): v for r in runs for c, v in r["ppl"].items()}
    return {(r["seed"], c): v["ppl"] for r in runs for c, v in r["truncation"][rank].items()}


def versus(method: dict, reference: dict) -> dict:
    d = paired_difference(relative_differences(method, reference))
    return {
        "mean_pct": d.interval.mean,
        "low_pct": d.interval.low,
        "high_pct": d.interval.high,
        "p": d.p_value,
        "significant": d.significant,
    }


def summary(runs: list[dict]) -> dict:
    clients = sorted(runs[0]["ppl"], key=int)
    out = {"clients": {}, "mean": None, "truncation": {}}
    for c in clients:
        i = mean_interval([r["ppl"][c] for r in runs])
        out["clients"][c] = {"label": runs[0]["labels"][c], "mean": i.mean, "half": i.half_width}
    i = mean_interval([r["mean_ppl"] for r in runs])
    out["mean"] = {"mean": i.mean, "half": i.half_width}
    for r in RANKS:
        i = mean_interval([sum(v["ppl"] for v in run["truncation"][r].values()) / len(clients) for run in runs])
        out["truncation"][r] = {"mean": i.mean, "half": i.half_width}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="DILUTION=PATH: a diluted variant's comparison.json (3 seeds)")
    ap.add_argument("--stored", type=Path, default=STORED, help="the comparison.json holding PreLort and ZeroPad")
    ap.add_argument("--config", default="configs/bbc_news.toml", help="the config the runs are of (recorded)")
    ap.add_argument("--name", default="dilution", help="the results files' stem beside the stored comparison")
    a = ap.parse_args()
    runs = {"prelort": rows(a.stored, "prelort"), "zeropad": rows(a.stored, "zeropad")}
    names = []
    for spec in a.runs:
        d, _, path = spec.rpartition("=")
        try:
            name = f"dilution={float(d):g}"
        except ValueError:  # another [prelort] variant, named as given (e.g. deploy_rank=validated)
            name = d
        runs[name] = [r for r in json.loads(Path(path).read_text()) if r["method"] == "prelort"]
        assert [r["seed"] for r in runs[name]] == [0, 1, 2], f"{path}: 3 seeds (0, 1, 2) of the diluted variant"
        names.append(name)
    res = {
        "bench": "prelort_dilution",
        "config": a.config,
        "stored": str(a.stored.resolve().relative_to(ROOT)),
        "seeds": [0, 1, 2],
        "methods": {m: summary(v) for m, v in runs.items()},
        "wall_time_s": {m: [r["wall_time_s"] for r in v] for m, v in runs.items()},
        "versus": {},
    }
    for name in names:
        res["versus"][name] = {}
        for ref in ("prelort", "zeropad"):
            res["versus"][name][ref] = {"deployed": versus(per_pair(runs[name]), per_pair(runs[ref]))}
            for r in RANKS:
                res["versus"][name][ref][f"r{r}"] = versus(per_pair(runs[name], r), per_pair(runs[ref], r))
    out = a.stored.parent
    (out / f"{a.name}.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / f"{a.name}.md").write_text(table(res) + "\n")
    print(json.dumps(res, indent=1))


def table(res: dict) -> str:
    def cell(d):
        star = "**" if d["significant"] else ""
        return f"{star}{d['mean_pct']:+.2f}% [{d['low_pct']:+.2f}, {d['high_pct']:+.2f}] p={d['p']:.2g}{star}"

    clients = [f"c{c} {v['label']}" for c, v in res["methods"]["prelort"]["clients"].items()]
    lines = markdown_table(["method", *clients, "mean ppl", "truncation r = 1 / 2 / 4 / 8 / 16"])
    for m, s in res["methods"].items():
        cl = [f"{v['mean']:.2f} ± {v['half']:.2f}" for v in s["clients"].values()]
        tr = " / ".join(f"{s['truncation'][r]['mean']:.2f}" for r in RANKS)
        lines.append(markdown_row([m, *cl, f"{s['mean']['mean']:.2f} ± {s['mean']['half']:.2f}", tr]))
    lines += ["", *markdown_table(["variant against", "deployed (15 pairs)", *(f"r = {r}" for r in RANKS)])]
    for name, refs in res["versus"].items():
        for ref, v in refs.items():
            lines.append(markdown_row([f"{name} vs {ref}", cell(v["deployed"]), *(cell(v[f"r{r}"]) for r in RANKS)]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
