"""Read finished run directories back and set them side by side: rows, a terminal table, a Markdown
table and one comparison plot (PNG bytes, written atomically by the caller's run directory)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import tomllib
from pathlib import Path
from typing import Any

from rich.table import Table

from nestfed import methods
from nestfed.config import INLINE_CLIENTS
from nestfed.errors import DataError
from nestfed.experiments import round_report
from nestfed.federation.plots import png, pyplot
from nestfed.federation.rank_groups import tier_name
from nestfed.io.markdown import markdown_table

plt = pyplot()  # matplotlib.pyplot on Agg


def run_label(cfg: dict[str, Any], method: str) -> str:
    """What tells the variants of one method apart in a comparison.

    Args:
        cfg: the run's config, as its config.toml's dict.
        method: the method's name.

    Returns:
        ``output.label`` when set; else the method's name plus every option of its own sections that
        differs from the default and the server optimiser when it is not plain SGD at lr 1
        (``prelort objective=sampled``, ``prelort server=adam lr=0.01``).
    """
    if cfg.get("output", {}).get("label"):
        return str(cfg["output"]["label"])
    m = methods.get(method)
    changed = []
    for name, cls in m.sections.items():
        default = dataclasses.asdict(cls())
        for key, value in sorted(cfg.get(name, {}).items()):
            d = default.get(key)
            if (list(d) if isinstance(d, tuple) else d) != value:
                changed.append(f"{key}={value}")
    opt = cfg.get("server_optimizer", {})
    if opt and (opt.get("name", "sgd") != "sgd" or opt.get("lr", 1.0) != 1.0):
        changed.append(f"server={opt.get('name')} lr={opt.get('lr'):g}")
    return " ".join([method] + changed)


def load_summary(run_dir: Path) -> dict[str, Any]:
    """The summary of a finished run.

    Args:
        run_dir: the run directory.

    Returns:
        Its summary.json.

    Raises:
        DataError: when the run is unfinished or not a run, or the file is malformed JSON.
    """
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        raise DataError(f"{run_dir}: no summary.json (not a finished nestfed run)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}: malformed JSON: {exc}") from None


def per_client(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """A finished run's per-client numbers, wherever the run kept them.

    From clients.json when the run wrote one (many clients), else summary.json (and clients.csv's
    ranks).

    Args:
        run_dir: the run directory.
        summary: its summary (`load_summary`).

    Returns:
        ``final`` / ``initial`` ({cid: metrics}), ``ranks`` ({cid: r_k}; {} when unknown),
        ``precisions`` ({cid: backbone precision} where budgets chose it, device tiers; else {}),
        ``labels`` ({cid: label}), ``truncation`` and ``global_by_client`` (or None).

    Raises:
        DataError: for a malformed clients.json.
    """
    path = Path(run_dir) / "clients.json"
    rows, extra = None, summary
    if path.is_file():
        try:
            extra = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: malformed JSON: {exc}") from None
        rows = extra["clients"]
    elif (Path(run_dir) / "clients.csv").is_file():
        with open(Path(run_dir) / "clients.csv", newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    if rows is not None and "final" not in summary:
        metrics = ("loss", "ppl", "accuracy")
        final = {
            str(r["cid"]): {k: float(r[f"final_{k}"]) for k in metrics if r.get(f"final_{k}") not in (None, "")}
            for r in rows
        }
        initial = {
            str(r["cid"]): {k: float(r[f"initial_{k}"]) for k in metrics if r.get(f"initial_{k}") not in (None, "")}
            for r in rows
        }
        final = {c: v for c, v in final.items() if "ppl" in v}
        initial = {c: v for c, v in initial.items() if "ppl" in v}
    else:
        final, initial = summary["final"], summary["initial"]
    ranks = {str(r["cid"]): int(r["rank"]) for r in rows} if rows is not None else {}
    precisions = {str(r["cid"]): r["precision"] for r in rows or [] if r.get("precision")}
    labels = {str(r["cid"]): r.get("label", "") for r in rows} if rows is not None else summary.get("client_labels", {})
    return {
        "final": final,
        "initial": initial,
        "ranks": ranks,
        "precisions": summary.get("client_precisions") or precisions,
        "labels": summary.get("client_labels") or labels,
        "truncation": extra.get("truncation"),
        "global_by_client": extra.get("global_by_client"),
    }


def comparison_rows(run_dirs: list[Path]) -> list[dict[str, Any]]:
    """One comparison row per finished run.

    Args:
        run_dirs: the run directories.

    Returns:
        Per run: method, its label (`run_label`, with `differing_fields`), seed (federation.seed),
        ranks, per-client and mean final perplexity, each client's rank r_k and device tier
        (``client_tiers``: {cid: "<precision> r<rank>"}; ``tiered``: budgets chose the precisions), bytes, time, the
        truncation curve and dimension importance when the run measured them, the global held-out
        set's numbers when it had one, and the generated evaluation.

    Raises:
        DataError: for an unfinished run or a malformed summary or clients.json.
    """
    rows, cfgs = [], []
    for rd in run_dirs:
        s = load_summary(rd)
        cfg = tomllib.loads((Path(rd) / "config.toml").read_text())
        cfgs.append(cfg)
        pc = per_client(rd, s)
        if "client_ratio" in s:
            ranks = f"rho {','.join(f'{x:g}' for x in s['client_ratio'].values())}"
        elif "rank_counts" in s and len(pc["ranks"]) > INLINE_CLIENTS:
            ranks = ",".join(f"{r}x{n}" for r, n in s["rank_counts"].items())
        else:
            ranks = ",".join(map(str, s["ranks"]))
        rows.append(
            {
                "run": Path(rd).name,
                "method": s["method"],
                "ranks": ranks,
                "round0": s.get("round0", "backbone"),
                "ppl": {c: v["ppl"] for c, v in pc["final"].items()},
                "initial_ppl": {c: v["ppl"] for c, v in pc["initial"].items()},
                "accuracy": {c: v["accuracy"] for c, v in pc["final"].items() if "accuracy" in v},
                "mean_ppl": s["mean_ppl"],
                "initial_mean_ppl": s["initial_mean_ppl"],
                "mean_accuracy": s.get("mean_accuracy"),
                "bytes_per_client_round": s["bytes_down_per_client_round"] + s["bytes_up_per_client_round"],
                "wall_time_s": s.get("wall_time_s", 0.0),
                "labels": pc["labels"],
                "client_ranks": pc["ranks"],
                "client_tiers": {
                    c: tier_name(pc["precisions"].get(c, cfg["model"].get("quantization", "none")), r)
                    for c, r in pc["ranks"].items()
                },
                "tiered": bool(pc["precisions"]),
                "rounds": cfg["federation"]["rounds"],
                "seed": cfg["federation"]["seed"],
                "label": run_label(cfg, s["method"]),
                "truncation": pc["truncation"],
                "dimension_importance": s.get("dimension_importance"),
                "global_eval": s.get("global_eval"),
                "truncation_global": s.get("truncation_global"),
                "global_by_client": pc["global_by_client"],
                "generation": s.get("generation"),
                "by_round": round_report.trajectory(Path(rd)),
            }
        )
    for row, extra in zip(rows, differing_fields(cfgs, [r["label"] for r in rows])):
        row["label"] = " ".join([row["label"], *extra])
    return rows


#: fields that tell runs of one experiment apart without making them different experiments: the
#: seeds (the axis a comparison over seeds pairs), where the run was written, what watched it
SAME_EXPERIMENT = ("federation.seed", "lora.init_seed", "output.", "tracking.", "train.threads")


def differing_fields(cfgs: list[dict[str, Any]], labels: list[str]) -> list[list[str]]:
    """The config fields that tell apart runs sharing a label.

    Two PreLort runs differing only in ``train.lr`` become ``prelort train.lr=0.001`` and
    ``prelort train.lr=0.0003``. Fields of `SAME_EXPERIMENT` do not count, nor do fields some such
    run does not record (a run made before a section existed does not record it).

    Args:
        cfgs: the runs' configs, as config.toml's dicts.
        labels: the runs' labels (`run_label`).

    Returns:
        For each run, ``key=value`` of every field in which the runs sharing its label (and no
        ``output.label``) differ; ``[]`` for a run whose label already tells it apart.
    """
    flat = [
        {f"{sec}.{k}": v for sec, table in c.items() if isinstance(table, dict) for k, v in table.items()} for c in cfgs
    ]
    out: list[list[str]] = [[] for _ in cfgs]
    for label in dict.fromkeys(labels):
        idx = [i for i, lab in enumerate(labels) if lab == label and not cfgs[i].get("output", {}).get("label")]
        # fields every run records: a run written before a section existed lacks it, which says
        # nothing of a difference (the section was at its default then)
        keys = sorted(set.intersection(*(set(flat[i]) for i in idx))) if idx else []
        varying = [
            k for k in keys if not k.startswith(SAME_EXPERIMENT) and len({json.dumps(flat[i].get(k)) for i in idx}) > 1
        ]
        for i in idx:
            out[i] = [f"{k}={flat[i].get(k)}" for k in varying]
    return out


def many_clients(rows: list[dict[str, Any]]) -> bool:
    """Whether a comparison summarises by rank group rather than showing a column per client.

    Args:
        rows: the rows of `comparison_rows`.

    Returns:
        True when a run has more than INLINE_CLIENTS clients, each of known rank.
    """
    return any(len(r["ppl"]) > INLINE_CLIENTS and r["client_ranks"] for r in rows)


def comparison_table(rows: list[dict[str, Any]]):
    """The comparison for the terminal; the best mean is starred.

    Args:
        rows: the rows of `comparison_rows`.

    Returns:
        A rich Table: one column per client (final held-out perplexity), mean, bytes, time; the
        first run's round 0 first.
    """
    cids = sorted({c for r in rows for c in r["ppl"]}, key=int)
    labels = rows[0]["labels"] if rows else {}
    table = Table(title="held-out perplexity per client (lower is better); the first run's round 0 in the first row")
    table.add_column("method")
    table.add_column("ranks")
    for c in cids:
        table.add_column(f"c{c} {labels.get(c, '')[:13]}".strip(), justify="right")
    table.add_column("mean", justify="right")
    table.add_column("KB/client/round", justify="right")
    table.add_column("time s", justify="right")
    if rows:
        r0 = rows[0]
        table.add_row(
            r0["round0"], "-", *[f"{r0['initial_ppl'][c]:.2f}" for c in cids], f"{r0['initial_mean_ppl']:.2f}", "-", "-"
        )
    best = min(r["mean_ppl"] for r in rows) if rows else math.inf
    for r in rows:
        mean = f"{r['mean_ppl']:.2f}" + (" *" if r["mean_ppl"] == best else "")
        table.add_row(
            r["label"],
            r["ranks"],
            *[f"{r['ppl'][c]:.2f}" for c in cids],
            mean,
            f"{r['bytes_per_client_round'] / 1024:.1f}",
            f"{r['wall_time_s']:.0f}",
        )
    return table


def comparison_markdown(rows: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table (for notes and READMEs).

    Args:
        rows: the rows of `comparison_rows`.

    Returns:
        The table, the first run's round 0 first.
    """
    cids = sorted({c for r in rows for c in r["ppl"]}, key=int)
    labels = rows[0]["labels"] if rows else {}
    head = (
        ["method", "ranks"]
        + [f"c{c} {labels.get(c, '')}".strip() for c in cids]
        + ["mean ppl", "KB/client/round", "time s"]
    )
    body = []
    if rows:
        r0 = rows[0]
        initial = [f"{r0['initial_ppl'][c]:.2f}" for c in cids]
        body.append([r0["round0"], "-", *initial, f"{r0['initial_mean_ppl']:.2f}", "-", "-"])
    for r in rows:
        kb, secs = f"{r['bytes_per_client_round'] / 1024:.1f}", f"{r['wall_time_s']:.0f}"
        body.append([r["label"], r["ranks"], *(f"{r['ppl'][c]:.2f}" for c in cids), f"{r['mean_ppl']:.2f}", kb, secs])
    return "\n".join(markdown_table(head, body)) + "\n"


def comparison_plot(rows: list[dict[str, Any]]) -> bytes:
    """Grouped bars of each client's held-out perplexity relative to the backbone alone.

    One bar per method per client, plus the mean over clients.

    Args:
        rows: the rows of `comparison_rows`.

    Returns:
        The figure as PNG bytes (percent change; below zero is better).
    """
    cids = sorted({c for r in rows for c in r["ppl"]}, key=int)
    labels = rows[0]["labels"] if rows else {}
    groups = cids + ["mean"]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        rel = [100.0 * (r["ppl"][c] / r["initial_ppl"][c] - 1.0) for c in cids]
        rel.append(sum(rel) / len(rel))
        ax.bar([j + i * width for j in range(len(groups))], rel, width=width, label=r["label"])
    ax.axhline(0.0, color="k", linewidth=0.8)
    ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"c{c}\n{labels.get(c, '')}" for c in cids] + ["mean"])
    ax.set_ylabel("held-out perplexity vs backbone (%)")
    ax.set_title("final round, per client (lower is better)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return png(fig)
