"""The FedNL issue's tables from finished run directories (a multi-method parent or several runs):
accuracy per client and method (federated, local before aggregation, the aggregation drop),
NIAH accuracy per template, per context length and per depth, and the bytes per client per round.

    .venv/bin/python bench/studies/fednl_tables.py runs/fednl_mmlu-... [more run dirs] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tomllib
from pathlib import Path

from nestfed.io.markdown import markdown_row, markdown_table


def run_dirs(paths: list[Path]) -> list[Path]:
    out = []
    for p in paths:
        out += [p] if (p / "summary.json").is_file() else sorted(q.parent for q in p.glob("*/summary.json"))
    return out


def tables(dirs: list[Path]) -> dict:
    rows = []
    for d in dirs:
        s = json.loads((d / "summary.json").read_text())
        cfg_travel = ""
        cfg = (d / "config.toml").read_text()
        if s["method"] == "fednl":
            table = tomllib.loads(cfg)  # [fednl] travel (runs before the spine redesign: strategy.fednl_travel)
            travel = table.get("fednl", {}).get("travel") or table.get("strategy", {}).get("fednl_travel", "all")
            cfg_travel = "rules" if travel == "rules" else "all"
        rows.append(
            {
                "run": str(d),
                "method": s["method"] + (f" ({cfg_travel})" if cfg_travel else ""),
                "labels": s.get("client_labels", {}),
                "federated": {c: v.get("accuracy") for c, v in s["final"].items()},
                "backbone": {c: v.get("accuracy") for c, v in s["initial"].items()},
                "local": s.get("local_accuracy", {}),
                "drop": s.get("aggregation_drop", {}),
                "mean_accuracy": s.get("mean_accuracy"),
                "mean_drop": s.get("mean_aggregation_drop"),
                "by_length": s.get("accuracy_by_length", {}),
                "by_depth": s.get("accuracy_by_depth", {}),
                "bytes_down_per_client_round": s["bytes_down_per_client_round"],
                "bytes_up_per_client_round": s["bytes_up_per_client_round"],
                "train_time_s": s.get("train_time_s"),
                "wall_time_s": s.get("wall_time_s"),
            }
        )
    return {"runs": rows}


def single_run(t: dict) -> str:
    """The accuracy table of one run's summary (``accuracy_final``, ``local_accuracy``,
    ``aggregation_drop`` per client: e.g. ``fednl_mmlu_local_only.json``), in :func:`markdown`'s
    columns, its row named after the run's overrides."""
    cids = sorted(t["accuracy_final"], key=int)
    labels = t.get("client_labels", {})
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
    name = "fednl, " + ", ".join(t.get("overrides", [])) if t.get("overrides") else "fednl"
    if "fednl.travel=none" in t.get("overrides", []):
        name = 'fednl, local-only (`travel = "none"`)'
    cells = [
        f"{pct(t['accuracy_final'][c])} / {pct(t['local_accuracy'][c])} / {pct(t['aggregation_drop'][c])}" for c in cids
    ]
    drop = sum(t["aggregation_drop"][c] for c in cids) / len(cids)
    head = ["method", *(f"c{c} {labels.get(c, '')}" for c in cids), "mean", "mean drop"]
    return "\n".join(markdown_table(head, [[name, *cells, pct(t["mean_accuracy"]), pct(drop)]])) + "\n"


def markdown(t: dict) -> str:
    rows = t["runs"]
    if not rows:
        return "no finished runs\n"
    cids = sorted(rows[0]["federated"], key=int)
    labels = rows[0]["labels"]
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}"  # noqa: E731
    out = ["accuracy (%) per client: federated / local before aggregation / drop (local - federated)", ""]
    out += markdown_table(["method", *(f"c{c} {labels.get(c, '')}" for c in cids), "mean", "mean drop"])
    backbone = [pct(rows[0]["backbone"][c]) for c in cids]
    out.append(
        markdown_row(["backbone", *backbone, pct(sum(rows[0]["backbone"][c] or 0 for c in cids) / len(cids)), "-"])
    )
    for r in rows:
        cells = []
        for c in cids:
            f, lo, dr = r["federated"].get(c), r["local"].get(c), r["drop"].get(c)
            cells.append(f"{pct(f)} / {pct(lo)} / {pct(dr)}" if lo is not None else pct(f))
        out.append(markdown_row([r["method"], *cells, pct(r["mean_accuracy"]), pct(r["mean_drop"])]))
    if any(r["by_length"] for r in rows):
        lengths = sorted({k for r in rows for k in r["by_length"]}, key=int)
        depths = sorted({k for r in rows for k in r["by_depth"]}, key=float)
        out += ["", "NIAH accuracy (%) by context length and by gold depth (mean over clients)", ""]
        out += markdown_table(["method", *(f"{L} tok" for L in lengths), *(f"depth {d}" for d in depths)])
        for r in rows:
            by_length = [pct(r["by_length"].get(L, {}).get("mean")) for L in lengths]
            out.append(
                markdown_row([r["method"], *by_length, *(pct(r["by_depth"].get(d, {}).get("mean")) for d in depths)])
            )
    head = ["method", "bytes down / client / round", "bytes up / client / round", "train s", "wall s"]
    out += ["", *markdown_table(head)]
    for r in rows:
        traffic = [f"{r['bytes_down_per_client_round']:.0f}", f"{r['bytes_up_per_client_round']:.0f}"]
        out.append(
            markdown_row([r["method"], *traffic, f"{r['train_time_s'] or 0:.0f}", f"{r['wall_time_s'] or 0:.0f}"])
        )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("paths", type=Path, nargs="+")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    t = tables(run_dirs(a.paths))
    print(markdown(t))
    if a.json:
        a.json.write_text(json.dumps(t, indent=2) + "\n")


if __name__ == "__main__":
    main()
