"""Read run directories back: summaries, a comparison table, and PNG plots (matplotlib, Agg)."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any

from nestfed.errors import DataError


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The metrics lines of a run, in round order. Raises DataError when missing or malformed."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"{path}: not found (is {run_dir} a nestfed run directory?)")
    lines = []
    for i, text in enumerate(path.read_text().splitlines(), 1):
        if text.strip():
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{i}: malformed JSON line: {exc}") from None
    return lines


def summarise(lines: list[dict[str, Any]], cfg) -> dict[str, Any]:
    """Final and initial held-out metrics per client, their means, and bytes per client per round.

    ``mean_ppl`` is the mean over clients of exp(loss); bytes are serialised payload bytes.
    """
    first, last = lines[0]["eval"], lines[-1]["eval"]
    rounds = [ln for ln in lines if ln["round"] > 0]
    fits = [c for ln in rounds for c in ln["clients"].values()]
    out: dict[str, Any] = {
        "method": cfg.strategy.name,
        "rounds": len(rounds),
        "ranks": list(cfg.lora.ranks),
        "final": last,
        "initial": first,
        "mean_ppl": sum(v["ppl"] for v in last.values()) / len(last),
        "mean_loss": sum(v["loss"] for v in last.values()) / len(last),
        "initial_mean_ppl": sum(v["ppl"] for v in first.values()) / len(first),
        "bytes_down_total": sum(ln["bytes_down"] for ln in rounds),
        "bytes_up_total": sum(ln["bytes_up"] for ln in rounds),
        "bytes_down_per_client_round": sum(c["bytes_down"] for c in fits) / max(len(fits), 1),
        "bytes_up_per_client_round": sum(c["bytes_up"] for c in fits) / max(len(fits), 1),
        "rejected_updates": sum(len(ln["rejected"]) for ln in rounds),
        "train_time_s": sum(c.get("train_time_s", 0.0) for c in fits),
    }
    if all("accuracy" in v for v in last.values()):
        out["mean_accuracy"] = sum(v["accuracy"] for v in last.values()) / len(last)
    out.update(aggregation_drop(lines))
    out.update(group_accuracy(last))
    return out


def aggregation_drop(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """FedNL's "aggregation drop" (arXiv 2605.16350, section 5.1): per client, the accuracy of
    its own model right after local training in the last round (``local_accuracy``, from
    ``train.eval_local``) minus the accuracy of the model it runs after aggregation (the final
    evaluation). Empty when the run did not evaluate locally or has no accuracy."""
    rounds = [ln for ln in lines if ln["round"] > 0]
    if not rounds:
        return {}
    last = rounds[-1]
    local = {c: v["local_accuracy"] for c, v in last["clients"].items() if "local_accuracy" in v}
    fed = {c: last["eval"][c]["accuracy"] for c in local if "accuracy" in last["eval"].get(c, {})}
    if not fed:
        return {}
    drop = {c: local[c] - fed[c] for c in fed}
    return {"local_accuracy": local, "federated_accuracy": fed, "aggregation_drop": drop,
            "mean_aggregation_drop": sum(drop.values()) / len(drop)}


def group_accuracy(evaluation: dict[str, dict[str, float]]) -> dict[str, Any]:
    """NIAH's accuracy per context length and per needle depth, from evaluation metrics named
    ``accuracy@<length>@<depth>`` (ClientData.test_groups): for each client and over all
    clients, the unweighted mean over the groups sharing a length or a depth (the generator
    gives every group the same number of rows). Empty when there are no such metrics."""
    by_len: dict[str, dict[str, list[float]]] = {}
    by_depth: dict[str, dict[str, list[float]]] = {}
    for cid, metrics in evaluation.items():
        for key, v in metrics.items():
            parts = key.split("@")
            if parts[0] != "accuracy" or len(parts) != 3:
                continue
            by_len.setdefault(parts[1], {}).setdefault(cid, []).append(v)
            by_depth.setdefault(parts[2], {}).setdefault(cid, []).append(v)
    if not by_len:
        return {}

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    def table(d: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
        return {g: {"clients": {c: mean(v) for c, v in sorted(per.items(), key=lambda kv: int(kv[0]))},
                    "mean": mean([x for v in per.values() for x in v])} for g, per in d.items()}

    return {"accuracy_by_length": table(by_len), "accuracy_by_depth": table(by_depth)}


def load_summary(run_dir: Path) -> dict[str, Any]:
    """summary.json of a finished run. Raises DataError when the run is unfinished or not a run."""
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        raise DataError(f"{run_dir}: no summary.json (not a finished nestfed run)")
    return json.loads(path.read_text())


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(run_dir: Path) -> list[Path]:
    """Write plots/eval_ppl.png (held-out perplexity per client per round) and plots/bytes.png
    (bytes sent down and up per round). Returns the written paths."""
    plt = _plt()
    run_dir = Path(run_dir)
    lines = read_metrics(run_dir)
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    cids = sorted(lines[0]["eval"], key=int)
    fig, ax = plt.subplots(figsize=(6, 4))
    for cid in cids:
        xs = [ln["round"] for ln in lines if cid in ln["eval"]]
        ys = [ln["eval"][cid]["ppl"] for ln in lines if cid in ln["eval"]]
        ax.plot(xs, ys, marker="o", label=f"client {cid}")
    ax.set_xlabel("round")
    ax.set_ylabel("held-out perplexity")
    ax.set_title(f"{run_dir.name}: perplexity per client")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    p1 = out_dir / "eval_ppl.png"
    fig.tight_layout()
    fig.savefig(p1, dpi=110)
    plt.close(fig)
    rounds = [ln for ln in lines if ln["round"] > 0]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [ln["round"] for ln in rounds]
    ax.bar([x - 0.2 for x in xs], [ln["bytes_down"] / 1e6 for ln in rounds], width=0.4, label="server -> clients")
    ax.bar([x + 0.2 for x in xs], [ln["bytes_up"] / 1e6 for ln in rounds], width=0.4, label="clients -> server")
    ax.set_xlabel("round")
    ax.set_ylabel("MB per round (all clients)")
    ax.set_title(f"{run_dir.name}: communication")
    ax.legend()
    p2 = out_dir / "bytes.png"
    fig.tight_layout()
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    return [p1, p2]


def comparison_rows(run_dirs: list[Path]) -> list[dict[str, Any]]:
    """One row per finished run: method, ranks, per-client and mean final perplexity, bytes, time."""
    rows = []
    for rd in run_dirs:
        s = load_summary(rd)
        cfg = tomllib.loads((Path(rd) / "config.toml").read_text())
        rows.append({"run": Path(rd).name, "method": s["method"], "ranks": s["ranks"],
                     "ppl": {c: v["ppl"] for c, v in s["final"].items()},
                     "initial_ppl": {c: v["ppl"] for c, v in s["initial"].items()},
                     "accuracy": {c: v["accuracy"] for c, v in s["final"].items() if "accuracy" in v},
                     "mean_ppl": s["mean_ppl"], "initial_mean_ppl": s["initial_mean_ppl"],
                     "mean_accuracy": s.get("mean_accuracy"),
                     "bytes_per_client_round": s["bytes_down_per_client_round"] + s["bytes_up_per_client_round"],
                     "wall_time_s": s.get("wall_time_s", 0.0), "labels": s.get("client_labels", {}),
                     "rounds": cfg["federation"]["rounds"]})
    return rows


def comparison_table(rows: list[dict[str, Any]]):
    """A rich Table: one column per client (final held-out perplexity), mean, bytes, time."""
    from rich.table import Table

    cids = sorted({c for r in rows for c in r["ppl"]}, key=int)
    labels = rows[0]["labels"] if rows else {}
    table = Table(title="held-out perplexity per client (lower is better); backbone alone in the first row")
    table.add_column("method")
    table.add_column("ranks")
    for c in cids:
        table.add_column(f"c{c} {labels.get(c, '')[:13]}".strip(), justify="right")
    table.add_column("mean", justify="right")
    table.add_column("KB/client/round", justify="right")
    table.add_column("time s", justify="right")
    if rows:
        r0 = rows[0]
        table.add_row("backbone", "-", *[f"{r0['initial_ppl'][c]:.2f}" for c in cids],
                      f"{r0['initial_mean_ppl']:.2f}", "-", "-")
    best = min(r["mean_ppl"] for r in rows) if rows else math.inf
    for r in rows:
        mean = f"{r['mean_ppl']:.2f}" + (" *" if r["mean_ppl"] == best else "")
        table.add_row(r["method"], ",".join(map(str, r["ranks"])), *[f"{r['ppl'][c]:.2f}" for c in cids], mean,
                      f"{r['bytes_per_client_round'] / 1024:.1f}", f"{r['wall_time_s']:.0f}")
    return table


def comparison_markdown(rows: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table (for notes and READMEs)."""
    cids = sorted({c for r in rows for c in r["ppl"]}, key=int)
    labels = rows[0]["labels"] if rows else {}
    head = ["method", "ranks"] + [f"c{c} {labels.get(c, '')}".strip() for c in cids] + ["mean ppl", "KB/client/round", "time s"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if rows:
        r0 = rows[0]
        out.append("| backbone | - | " + " | ".join(f"{r0['initial_ppl'][c]:.2f}" for c in cids)
                   + f" | {r0['initial_mean_ppl']:.2f} | - | - |")
    for r in rows:
        out.append(f"| {r['method']} | {','.join(map(str, r['ranks']))} | "
                   + " | ".join(f"{r['ppl'][c]:.2f}" for c in cids)
                   + f" | {r['mean_ppl']:.2f} | {r['bytes_per_client_round'] / 1024:.1f} | {r['wall_time_s']:.0f} |")
    return "\n".join(out) + "\n"


def comparison_plot(rows: list[dict[str, Any]], out: Path) -> Path:
    """Grouped bars: change of each client's held-out perplexity relative to the backbone alone
    (percent; below zero is better), one bar per method, plus the mean over clients."""
    plt = _plt()
    cids = sorted({c for r in rows for c in r["ppl"]}, key=int)
    labels = rows[0]["labels"] if rows else {}
    groups = cids + ["mean"]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        rel = [100.0 * (r["ppl"][c] / r["initial_ppl"][c] - 1.0) for c in cids]
        rel.append(sum(rel) / len(rel))
        ax.bar([j + i * width for j in range(len(groups))], rel, width=width, label=r["method"])
    ax.axhline(0.0, color="k", linewidth=0.8)
    ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"c{c}\n{labels.get(c, '')}" for c in cids] + ["mean"])
    ax.set_ylabel("held-out perplexity vs backbone (%)")
    ax.set_title("final round, per client (lower is better)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
