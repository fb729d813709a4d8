"""Comparisons over seeds: per method (or variant), the mean over seeds with 95% intervals per
client and overall, the paired difference against a reference method with its significance, the
truncation curve and the dimension importance (nestfed.experiments.intervals for the statistics,
nestfed.experiments.mechanisms for what the runs measured).

Input: the rows of nestfed.experiments.report.comparison_rows (one per finished run, with its
``seed`` and ``label``). Output: Markdown tables, a rich table and PNG bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from nestfed.experiments.intervals import (
    Interval,
    PairedDifference,
    mean_interval,
    paired_difference,
    relative_differences,
)
from nestfed.federation.plots import png, pyplot
from nestfed.io.markdown import markdown_row, markdown_table

plt = pyplot()  # matplotlib.pyplot on Agg


@dataclass
class LabelStats:
    """One method (or variant) over its seeds.

    Attributes:
        label: the compared label.
        ranks: its first run's ranks, as text.
        seeds: its runs' seeds, ascending.
        per_client: ``{cid: the client's final held-out perplexity, 95% interval over seeds}``.
        mean: the mean perplexity over clients, 95% interval over seeds.
        versus: the paired relative difference (%) against the reference over every (seed, client)
            pair; None for the reference.
        versus_seeds: the interval over seeds of the per-seed mean difference (%); None for the
            reference or without a common seed.
        bytes_per_client_round: bytes per client per round (both directions), mean over seeds.
        wall_time_s: seconds per run, mean over seeds.
    """

    label: str
    ranks: str
    seeds: list[int]
    per_client: dict[str, Interval]
    mean: Interval
    versus: PairedDifference | None
    versus_seeds: Interval | None
    bytes_per_client_round: float
    wall_time_s: float


def by_label(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Rows grouped by label.

    Args:
        rows: the rows of nestfed.experiments.report.comparison_rows (with ``seed`` and ``label``).

    Returns:
        ``{label: rows}`` in order of first appearance, each group sorted by seed.

    Raises:
        ValueError: when a label holds one seed twice (the same run listed twice).
    """
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["label"], []).append(r)
    for label, group in out.items():
        group.sort(key=lambda r: r["seed"])
        seeds = [r["seed"] for r in group]
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"{label}: seed listed twice ({seeds}); give each run once")
    return out


def _ppl(group: list[dict[str, Any]]) -> dict[tuple[int, str], float]:
    return {(r["seed"], c): v for r in group for c, v in r["ppl"].items()}


def label_stats(rows: list[dict[str, Any]], reference: str | None = None) -> list[LabelStats]:
    """One `LabelStats` per label.

    Args:
        rows: the rows of nestfed.experiments.report.comparison_rows (with ``seed`` and ``label``).
        reference: the label the others are paired against (its own ``versus`` is None); None: the
            first label.

    Returns:
        The stats, in `by_label`'s order; [] for no rows.

    Raises:
        ValueError: for an unknown reference, or a label holding one seed twice.
    """
    groups = by_label(rows)
    if not groups:
        return []
    ref = reference or next(iter(groups))
    if ref not in groups:
        raise ValueError(f"reference '{ref}' is not among the compared runs ({', '.join(groups)})")
    ref_ppl = _ppl(groups[ref])
    out = []
    for label, group in groups.items():
        cids = sorted({c for r in group for c in r["ppl"]}, key=int)
        per_client = {c: mean_interval([r["ppl"][c] for r in group if c in r["ppl"]]) for c in cids}
        mean = mean_interval([r["mean_ppl"] for r in group])
        versus = versus_seeds = None
        if label != ref:
            diffs = relative_differences(_ppl(group), ref_ppl)
            versus = paired_difference(diffs)
            ref_mean = {r["seed"]: r["mean_ppl"] for r in groups[ref]}
            per_seed = [100.0 * (r["mean_ppl"] / ref_mean[r["seed"]] - 1.0) for r in group if r["seed"] in ref_mean]
            versus_seeds = mean_interval(per_seed) if per_seed else None
        out.append(
            LabelStats(
                label,
                group[0]["ranks"],
                [r["seed"] for r in group],
                per_client,
                mean,
                versus,
                versus_seeds,
                sum(r["bytes_per_client_round"] for r in group) / len(group),
                sum(r["wall_time_s"] for r in group) / len(group),
            )
        )
    return out


def _versus_text(s: LabelStats) -> str:
    if s.versus is None:
        return "reference"
    v = s.versus
    p = "-" if math.isnan(v.p_value) else f"{v.p_value:.2g}"
    mark = " **significant**" if v.significant else ""
    return f"{v.interval.mean:+.2f}% [{v.interval.low:+.2f}, {v.interval.high:+.2f}] p={p}{mark}"


def seeds_markdown(rows: list[dict[str, Any]], stats: list[LabelStats]) -> str:
    """The comparison over seeds as a Markdown table.

    The backbone row, then per label each client's mean held-out perplexity ± the 95% half width
    over seeds, the mean, and the paired difference against the reference (mean [95% interval]
    over seed x client pairs, p-value, significance), bytes and time.

    Args:
        rows: the rows of nestfed.experiments.report.comparison_rows (with ``seed`` and ``label``).
        stats: `label_stats` of the rows.

    Returns:
        The table.
    """
    cids = sorted({c for r in rows for c in r["ppl"]}, key=int)
    labels = rows[0]["labels"] if rows else {}
    head = (
        ["method", "ranks", "seeds"]
        + [f"c{c} {labels.get(c, '')}".strip() for c in cids]
        + ["mean ppl", "vs reference (% ppl, pairs)", "vs reference (% mean, seeds)", "KB/client/round", "time s"]
    )
    out = markdown_table(head)
    if rows:
        r0 = rows[0]
        initial = [f"{r0['initial_ppl'][c]:.2f}" for c in cids]
        out.append(
            markdown_row([r0["round0"], "-", "-", *initial, f"{r0['initial_mean_ppl']:.2f}", "-", "-", "-", "-"])
        )
    for s in stats:
        seeds = ",".join(map(str, s.seeds))
        v = s.versus_seeds
        vs = (
            "-"
            if v is None
            else (f"{v.mean:+.2f}%" if math.isnan(v.half_width) else f"{v.mean:+.2f} ± {v.half_width:.2f}%")
        )
        per_client = [s.per_client[c].text() if c in s.per_client else "-" for c in cids]
        kb, secs = f"{s.bytes_per_client_round / 1024:.1f}", f"{s.wall_time_s:.0f}"
        out.append(markdown_row([s.label, s.ranks, seeds, *per_client, s.mean.text(), _versus_text(s), vs, kb, secs]))
    return "\n".join(out) + "\n"


def seeds_table(rows: list[dict[str, Any]], stats: list[LabelStats]) -> Table:
    """The same comparison as a rich Table for the terminal.

    Args:
        rows: the rows of nestfed.experiments.report.comparison_rows (with ``seed`` and ``label``).
        stats: `label_stats` of the rows.

    Returns:
        The rich Table.
    """
    cids = sorted({c for r in rows for c in r["ppl"]}, key=int)
    table = Table(
        title="held-out perplexity, mean ± 95% half width over seeds; difference vs the reference "
        "paired over seed x client (lower is better)"
    )
    for col in ["method", "seeds"] + [f"c{c}" for c in cids] + ["mean", "vs reference"]:
        table.add_column(col, justify="left" if col in ("method", "seeds", "vs reference") else "right")
    if rows:
        r0 = rows[0]
        table.add_row(
            r0["round0"], "-", *[f"{r0['initial_ppl'][c]:.2f}" for c in cids], f"{r0['initial_mean_ppl']:.2f}", "-"
        )
    for s in stats:
        table.add_row(
            s.label,
            ",".join(map(str, s.seeds)),
            *[s.per_client[c].text() if c in s.per_client else "-" for c in cids],
            s.mean.text(),
            _versus_text(s).replace("**", ""),
        )
    return table


def truncation_stats(rows: list[dict[str, Any]]) -> dict[str, dict[int, Interval]]:
    """The truncation curve over seeds, per label.

    Args:
        rows: the rows of nestfed.experiments.report.comparison_rows (with ``seed`` and ``label``).

    Returns:
        ``{label: {r: interval over seeds of the mean over clients of the held-out perplexity of
        the global adapter truncated to r}}`` for the labels whose runs measured a truncation curve.
    """
    out: dict[str, dict[int, Interval]] = {}
    for label, group in by_label(rows).items():
        curves = [r["truncation"] for r in group if r.get("truncation")]
        if not curves:
            continue
        ranks = sorted({int(k) for c in curves for k in c})
        out[label] = {}
        for rank in ranks:
            per_seed = [
                sum(v["ppl"] for v in c[str(rank)].values()) / len(c[str(rank)]) for c in curves if str(rank) in c
            ]
            out[label][rank] = mean_interval(per_seed)
    return out


def global_truncation_stats(rows: list[dict[str, Any]]) -> dict[str, dict[int, Interval]]:
    """The truncation curve on the global held-out set over seeds, per label.

    Args:
        rows: the rows of nestfed.experiments.report.comparison_rows (with ``seed`` and ``label``).

    Returns:
        ``{label: {r: interval over seeds of the truncated global adapter's perplexity on the global
        held-out set}}`` for the labels whose runs measured it (``truncation_global``).
    """
    out: dict[str, dict[int, Interval]] = {}
    for label, group in by_label(rows).items():
        curves = [r["truncation_global"] for r in group if r.get("truncation_global")]
        if curves:
            ranks = sorted({int(k) for c in curves for k in c})
            out[label] = {
                rank: mean_interval([c[str(rank)]["ppl"] for c in curves if str(rank) in c]) for rank in ranks
            }
    return out


def truncation_markdown(curves: dict[str, dict[int, Interval]]) -> str:
    """The truncation curve as a Markdown table.

    Args:
        curves: `truncation_stats` (or `global_truncation_stats`) of the rows.

    Returns:
        One row per label, one column per rank r: the perplexity at truncation r (mean over clients),
        ± the 95% half width over seeds.
    """
    ranks = sorted({r for c in curves.values() for r in c})
    body = [[label, *(c[r].text() if r in c else "-" for r in ranks)] for label, c in curves.items()]
    return "\n".join(markdown_table(["method", *(f"r = {r}" for r in ranks)], body)) + "\n"


def _half_widths(intervals: list[Interval]) -> list[float]:
    """Error-bar half widths for a plot: 0 where an interval has none (one seed)."""
    return [0.0 if math.isnan(i.half_width) else i.half_width for i in intervals]


def truncation_differences(rows: list[dict[str, Any]], reference: str) -> dict[str, dict[int, PairedDifference]]:
    """The truncation curves against a reference's, paired over (seed, client).

    Args:
        rows: the rows of nestfed.experiments.report.comparison_rows (with ``seed`` and ``label``).
        reference: the label the others are paired against.

    Returns:
        ``{label: {r: the paired relative difference (%) of the truncated adapter's held-out
        perplexity against the reference's at the same r, over every (seed, client) pair}}`` for
        the labels other than the reference that measured a truncation curve
        (nestfed.experiments.intervals).

    Raises:
        ValueError: when the reference measured no truncation curve.
    """
    groups = by_label(rows)
    ref = [r for r in groups.get(reference, []) if r.get("truncation")]
    if not ref:
        raise ValueError(f"reference '{reference}' has no truncation curve")

    def at(group: list[dict[str, Any]], rank: int) -> dict[tuple[int, str], float]:
        return {
            (r["seed"], c): v["ppl"]
            for r in group
            if r.get("truncation") and str(rank) in r["truncation"]
            for c, v in r["truncation"][str(rank)].items()
        }

    out: dict[str, dict[int, PairedDifference]] = {}
    for label, group in groups.items():
        if label == reference or not any(r.get("truncation") for r in group):
            continue
        ranks = sorted({int(k) for r in group if r.get("truncation") for k in r["truncation"]})
        out[label] = {}
        for rank in ranks:
            mine, theirs = at(group, rank), at(ref, rank)
            if set(mine) & set(theirs):
                out[label][rank] = paired_difference(relative_differences(mine, theirs))
    return out


def truncation_differences_markdown(diffs: dict[str, dict[int, PairedDifference]], reference: str) -> str:
    """The paired differences against a reference at each truncation rank as a Markdown table.

    Args:
        diffs: `truncation_differences` of the rows.
        reference: the reference's label (the table's heading).

    Returns:
        Per label and rank: mean % [95% interval], significant ones in bold (below zero: lower
        perplexity than the reference).
    """
    ranks = sorted({r for d in diffs.values() for r in d})
    out = markdown_table([f"vs {reference}", *(f"r = {r}" for r in ranks)])
    for label, d in diffs.items():
        cells = []
        for r in ranks:
            if r not in d:
                cells.append("-")
                continue
            i = d[r].interval
            text = f"{i.mean:+.2f}% [{i.low:+.2f}, {i.high:+.2f}]"
            cells.append(f"**{text}**" if d[r].significant else text)
        out.append(markdown_row([label, *cells]))
    return "\n".join(out) + "\n"


def truncation_plot(curves: dict[str, dict[int, Interval]]) -> bytes:
    """Perplexity vs truncation rank r (log2 axis), one line per label with 95% error bars.

    Args:
        curves: `truncation_stats` (or `global_truncation_stats`) of the rows.

    Returns:
        The figure as PNG bytes.
    """
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, c in curves.items():
        ranks = sorted(c)
        ax.errorbar(
            ranks,
            [c[r].mean for r in ranks],
            yerr=_half_widths([c[r] for r in ranks]),
            marker="o",
            capsize=3,
            label=label,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("truncation rank r of the global adapter")
    ax.set_ylabel("held-out perplexity, mean over clients")
    ax.set_title("truncation curve (mean ± 95% interval over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return png(fig)


def importance_stats(rows: list[dict[str, Any]]) -> dict[str, list[Interval]]:
    """The dimension importance's shares over seeds, per label.

    Args:
        rows: the rows of nestfed.experiments.report.comparison_rows (with ``seed`` and ``label``).

    Returns:
        ``{label: per index i, the interval over seeds of imp_i / sum_j imp_j}`` (the share of the
        adapter's component norms in each rank index; nestfed.experiments.mechanisms), for the
        labels whose runs measured it.
    """
    out = {}
    for label, group in by_label(rows).items():
        runs = [r["dimension_importance"] for r in group if r.get("dimension_importance")]
        if not runs:
            continue
        shares = [[v / (sum(imp) or 1.0) for v in imp] for imp in runs]
        out[label] = [mean_interval([s[i] for s in shares]) for i in range(min(map(len, shares)))]
    return out


def importance_plot(importance: dict[str, list[Interval]]) -> bytes:
    """Share of the global adapter's component norm per rank index, one line per label.

    Args:
        importance: `importance_stats` of the rows.

    Returns:
        The figure as PNG bytes.
    """
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, xs in importance.items():
        idx = list(range(len(xs)))
        ax.errorbar(idx, [x.mean for x in xs], yerr=_half_widths(xs), marker=".", capsize=2, label=label)
    ax.set_xlabel("rank index i")
    ax.set_ylabel("||s B[:, i] A[i, :]|| / sum over i")
    ax.set_title("dimension importance of the global adapter (mean ± 95% over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return png(fig)


def comparison_plot(rows: list[dict[str, Any]], stats: list[LabelStats]) -> bytes:
    """Grouped bars with 95% error bars over seeds: each client's perplexity relative to the backbone.

    One bar per label per client, plus the mean over clients.

    Args:
        rows: the rows of nestfed.experiments.report.comparison_rows (with ``seed`` and ``label``).
        stats: `label_stats` of the rows.

    Returns:
        The figure as PNG bytes (percent change; below zero is better).
    """
    cids = sorted({c for r in rows for c in r["ppl"]}, key=int)
    labels = rows[0]["labels"] if rows else {}
    initial = rows[0]["initial_ppl"] if rows else {}
    groups = by_label(rows)
    fig, ax = plt.subplots(figsize=(10, 4.8))
    width = 0.8 / max(len(stats), 1)
    for i, s in enumerate(stats):
        per_seed = [[100.0 * (r["ppl"][c] / initial[c] - 1.0) for c in cids] for r in groups[s.label]]
        cols = [mean_interval([p[j] for p in per_seed]) for j in range(len(cids))]
        cols.append(mean_interval([sum(p) / len(p) for p in per_seed]))
        ax.bar(
            [j + i * width for j in range(len(cols))],
            [x.mean for x in cols],
            width=width,
            yerr=_half_widths(cols),
            capsize=2,
            label=s.label,
        )
    ax.axhline(0.0, color="k", linewidth=0.8)
    ax.set_xticks([j + width * (len(stats) - 1) / 2 for j in range(len(cids) + 1)])
    ax.set_xticklabels([f"c{c}\n{labels.get(c, '')}" for c in cids] + ["mean"])
    ax.set_ylabel("held-out perplexity vs backbone (%)")
    ax.set_title("final round, per client, mean ± 95% interval over seeds (lower is better)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return png(fig)
