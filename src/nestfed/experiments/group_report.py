"""Comparisons of runs with many clients, by rank group: what a table shows instead of one column per
client once a federation has more than nestfed.config.INLINE_CLIENTS clients (docs/scale.md).

Input: the rows of nestfed.experiments.report.comparison_rows (each with its clients' ranks). One
seed per label: per method the distribution of the clients' final held-out perplexity (mean,
median, 10th / 90th percentile, worst) and each rank group's mean. Several seeds: per rank group
the mean over seeds with its 95% interval, the paired difference against the reference over the
group's (seed, client) pairs, and the **collaboration gain** against local-only training
(``local_only``, when compared): 100 (1 - ppl_federated / ppl_local) per (seed, client) pair, its
mean with a 95% interval (positive: the federation lowers that group's perplexity). The global
held-out set (``evaluation.global_test``) adds the server model's perplexity on it and, per rank
group, that of what each panel client runs (nestfed.experiments.mechanisms).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.table import Table

from nestfed.experiments.intervals import Interval, PairedDifference, mean_interval, paired_difference
from nestfed.federation.plots import png, pyplot
from nestfed.federation.rank_groups import describe
from nestfed.io.markdown import markdown_row, markdown_table

#: the label whose runs are the local-only baseline of the collaboration gain
LOCAL = "local_only"


def groups_of(rows: list[dict[str, Any]]) -> list[int]:
    """The rank groups present, ascending.

    Args:
        rows: the rows of nestfed.experiments.report.comparison_rows (each with ``client_ranks``).

    Returns:
        The clients' distinct ranks, ascending.
    """
    return sorted({int(r) for row in rows for r in row["client_ranks"].values()})


def _members(row: dict[str, Any], rank: int, key: str = "ppl") -> dict[str, float]:
    return {c: v for c, v in row[key].items() if row["client_ranks"].get(c) == rank}


def _global_ppl(row: dict[str, Any]) -> float | None:
    g = (row.get("global_eval") or {}).get("final")
    return None if not g else float(g["ppl"])


def markdown(rows: list[dict[str, Any]]) -> str:
    """The one-seed-per-label comparison as a Markdown table.

    Per label: the final held-out perplexity's distribution over clients, each rank group's mean
    (n clients), the global held-out set's perplexity, bytes and time; the first run's round 0 first.

    Args:
        rows: the rows of nestfed.experiments.report.comparison_rows (each with ``client_ranks``).

    Returns:
        The table.
    """
    ranks = groups_of(rows)
    head = ["method", "ranks", "clients", "mean ppl", "median", "p10", "p90", "worst"]
    head += [f"r={r} mean" for r in ranks] + ["global ppl", "KB/client/round", "time s"]
    out = markdown_table(head)
    if rows:
        out.append(_row(rows[0]["round0"], "-", rows[0]["initial_ppl"], rows[0], ranks, "initial_ppl", None, "-", "-"))
    for r in rows:
        g = _global_ppl(r)
        out.append(
            _row(
                r["label"],
                r["ranks"],
                r["ppl"],
                r,
                ranks,
                "ppl",
                g,
                f"{r['bytes_per_client_round'] / 1024:.1f}",
                f"{r['wall_time_s']:.0f}",
            )
        )
    return "\n".join(out) + "\n"


def _row(
    name: str,
    ranks_text: str,
    values: dict[str, float],
    row: dict[str, Any],
    ranks: list[int],
    key: str,
    glob: float | None,
    kb: str,
    secs: str,
) -> str:
    d = describe(list(values.values()))
    cells = [name, ranks_text, str(d["n"])] + [f"{d[k]:.2f}" for k in ("mean", "median", "p10", "p90", "worst")]
    for rank in ranks:
        m = _members(row, rank, key)
        cells.append(f"{np.mean(list(m.values())):.2f} ({len(m)})" if m else "-")
    cells += ["-" if glob is None else f"{glob:.2f}", kb, secs]
    return markdown_row(cells)


def table(rows: list[dict[str, Any]]) -> Table:
    """`markdown`'s table for the terminal.

    Args:
        rows: the rows of nestfed.experiments.report.comparison_rows (each with ``client_ranks``).

    Returns:
        The rich table.
    """
    ranks = groups_of(rows)
    t = Table(
        title="final held-out perplexity over clients (lower is better): distribution and rank-group means; "
        "the first run's round 0 first"
    )
    for col in ["method", "clients", "mean", "median", "p10", "p90", "worst"] + [f"r={r}" for r in ranks] + ["global"]:
        t.add_column(col, justify="left" if col == "method" else "right")
    for name, values, key, row in (
        [(rows[0]["round0"], rows[0]["initial_ppl"], "initial_ppl", rows[0])] if rows else []
    ) + [(r["label"], r["ppl"], "ppl", r) for r in rows]:
        d = describe(list(values.values()))
        cells = [f"{d[k]:.2f}" for k in ("mean", "median", "p10", "p90", "worst")]
        means = []
        for rank in ranks:
            m = _members(row, rank, key)
            means.append(f"{np.mean(list(m.values())):.2f}" if m else "-")
        g = _global_ppl(row) if key == "ppl" else None
        t.add_row(name, str(d["n"]), *cells, *means, "-" if g is None else f"{g:.2f}")
    return t


def plot(rows: list[dict[str, Any]]) -> bytes:
    """Box plots of each client's final perplexity relative to its round 0 (%).

    One box per method within each rank group.

    Args:
        rows: the rows of nestfed.experiments.report.comparison_rows (each with ``client_ranks``).

    Returns:
        The figure as PNG bytes.
    """
    plt = pyplot()
    ranks = groups_of(rows)
    fig, ax = plt.subplots(figsize=(max(7, 2.2 * len(ranks)), 4.8))
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        data, pos = [], []
        for j, rank in enumerate(ranks):
            rel = [
                100.0 * (v / r["initial_ppl"][c] - 1.0) for c, v in _members(r, rank).items() if c in r["initial_ppl"]
            ]
            if rel:
                data.append(rel)
                pos.append(j + i * width)
        if data:
            b = ax.boxplot(data, positions=pos, widths=width * 0.9, patch_artist=True, showfliers=False)
            colour = f"C{i % 10}"
            for patch in b["boxes"]:
                patch.set_facecolor(colour)
                patch.set_alpha(0.5)
            ax.plot([], [], color=colour, linewidth=6, alpha=0.5, label=r["label"])
    ax.axhline(0.0, color="k", linewidth=0.8)
    ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(ranks))])
    ax.set_xticklabels([f"rank {r}" for r in ranks])
    ax.set_ylabel("final held-out perplexity vs round 0 (%)")
    ax.set_title("per client, by rank group (boxes: quartiles, whiskers: 1.5 IQR)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return png(fig)


@dataclass
class GroupStats:
    """One label over its seeds, per rank group.

    The dicts are keyed by rank group: ``str(rank)``, and ``"all"``.

    Attributes:
        label: the compared label.
        seeds: its runs' seeds.
        mean: the mean over seeds of the group's mean perplexity.
        versus: the paired difference (%) against the reference over the group's (seed, client)
            pairs (none for the reference).
        gain: the collaboration gain (%) against local-only (empty without local-only).
        global_server: the server model's perplexity on the global held-out set over seeds; None
            without one.
        global_mean: the panel clients' own models' perplexity on the global held-out set.
        global_gain: their collaboration gain (%) on it.
    """

    label: str
    seeds: list[int]
    mean: dict[str, Interval]
    versus: dict[str, PairedDifference]
    gain: dict[str, PairedDifference]
    global_server: Interval | None
    global_mean: dict[str, Interval]
    global_gain: dict[str, PairedDifference]


def _pairs(group: list[dict[str, Any]], rank: int | None, key: str = "ppl") -> dict[tuple[int, str], float]:
    out = {}
    for r in group:
        for c, v in (r.get(key) or {}).items():
            v = v["ppl"] if isinstance(v, dict) else v
            if rank is None or r["client_ranks"].get(c) == rank:
                out[(r["seed"], c)] = v
    return out


def _paired(mine: dict, theirs: dict, fn) -> PairedDifference | None:
    keys = sorted(set(mine) & set(theirs))
    return paired_difference([fn(mine[k], theirs[k]) for k in keys]) if keys else None


def seed_stats(
    rows: list[dict[str, Any]], by_label: dict[str, list[dict[str, Any]]], reference: str
) -> list[GroupStats]:
    """`GroupStats` per label.

    Args:
        rows: the rows of nestfed.experiments.report.comparison_rows (each with ``client_ranks``).
        by_label: the rows by label (nestfed.experiments.seed_report.by_label).
        reference: the label the others are paired against.

    Returns:
        One `GroupStats` per label, in ``by_label``'s order.
    """
    ranks = [str(r) for r in groups_of(rows)] + ["all"]
    ref, local = by_label[reference], by_label.get(LOCAL)
    out = []
    for label, group in by_label.items():
        mean, versus, gain, gmean, ggain = {}, {}, {}, {}, {}
        for key in ranks:
            rank = None if key == "all" else int(key)
            members = [
                [v for c, v in r["ppl"].items() if rank is None or r["client_ranks"].get(c) == rank] for r in group
            ]
            per_seed = [float(np.mean(m)) for m in members if m]  # a seed whose evaluation held none is left out
            if per_seed:
                mean[key] = mean_interval(per_seed)
            mine = _pairs(group, rank)
            if label != reference and (d := _paired(mine, _pairs(ref, rank), lambda a, b: 100.0 * (a / b - 1.0))):
                versus[key] = d
            if (
                local is not None
                and label != LOCAL
                and (g := _paired(mine, _pairs(local, rank), lambda a, b: 100.0 * (1.0 - a / b)))
            ):
                gain[key] = g
            mine_g = _pairs(group, rank, "global_by_client")
            gvals = [
                np.mean([v for (s, _), v in mine_g.items() if s == r["seed"]])
                for r in group
                if any(s == r["seed"] for s, _ in mine_g)
            ]
            if gvals:
                gmean[key] = mean_interval(gvals)
            if (
                local is not None
                and label != LOCAL
                and (g := _paired(mine_g, _pairs(local, rank, "global_by_client"), lambda a, b: 100.0 * (1.0 - a / b)))
            ):
                ggain[key] = g
        server = [g for g in (_global_ppl(r) for r in group) if g is not None]
        out.append(
            GroupStats(
                label,
                [r["seed"] for r in group],
                mean,
                versus,
                gain,
                mean_interval(server) if server else None,
                gmean,
                ggain,
            )
        )
    return out


def _diff_text(d: PairedDifference | None) -> str:
    return "-" if d is None else d.text()


def seeds_markdown(rows: list[dict[str, Any]], stats: list[GroupStats], reference: str) -> str:
    """Markdown tables over seeds, by rank group.

    The mean perplexity (± 95% over seeds), the paired difference against ``reference`` and the
    collaboration gain against local-only (significant ones in bold); with the global held-out set,
    the server model's and, per group, the panel clients' own models' perplexity on it with their
    collaboration gain; then traffic and time.

    Args:
        rows: the rows of nestfed.experiments.report.comparison_rows (each with ``client_ranks``).
        stats: `seed_stats` of the rows.
        reference: the label the others are paired against.

    Returns:
        The tables.
    """
    ranks = [str(r) for r in groups_of(rows)] + ["all"]
    names = [f"r = {k}" if k != "all" else "all clients" for k in ranks]
    counts = {k: len({c for r in rows for c, rk in r["client_ranks"].items() if str(rk) == k}) for k in ranks[:-1]}
    names = [f"{n} ({counts[k]})" if k in counts else n for n, k in zip(names, ranks)]
    out = [
        "Final held-out perplexity per rank group (clients in brackets): mean over clients, then mean ± 95% "
        "interval over seeds\n",
        *markdown_table(["method", "seeds", *names]),
    ]
    if rows:
        r0 = rows[0]
        cells = []
        for k in ranks:
            v = [x for c, x in r0["initial_ppl"].items() if k == "all" or str(r0["client_ranks"].get(c)) == k]
            cells.append(f"{np.mean(v):.2f}" if v else "-")
        out.append(markdown_row([r0["round0"], "-", *cells]))
    for s in stats:
        out.append(
            markdown_row(
                [s.label, ",".join(map(str, s.seeds)), *(s.mean[k].text() if k in s.mean else "-" for k in ranks)]
            )
        )
    out += [
        "",
        f"Paired difference against {reference} (% perplexity over the group's seed x client pairs, 95% "
        "interval; bold: significant; below zero: lower perplexity)\n",
        *markdown_table(["method", *names]),
    ]
    for s in stats:
        if s.label != reference:
            out.append(markdown_row([s.label, *(_diff_text(s.versus.get(k)) for k in ranks)]))
    if any(s.gain for s in stats):
        out += [
            "",
            "Collaboration gain against local-only training: 100 (1 - ppl_federated / ppl_local) over the "
            "group's seed x client pairs (95% interval; bold: significant; positive: the federation helps)\n",
            *markdown_table(["method", *names]),
        ]
        for s in stats:
            if s.gain:
                out.append(markdown_row([s.label, *(_diff_text(s.gain.get(k)) for k in ranks)]))
    if any(s.global_mean or s.global_server for s in stats):
        out += [
            "",
            "Global held-out set: the server model (the global adapter at r_max) and, per rank group, what "
            "each panel client runs (mean ± 95% over seeds); then the collaboration gain on it\n",
            *markdown_table(["method", "server model", *names, *(f"gain {n}" for n in names)]),
        ]
        for s in stats:
            server = "-" if s.global_server is None else s.global_server.text()
            means = [s.global_mean[k].text() if k in s.global_mean else "-" for k in ranks]
            out.append(markdown_row([s.label, server, *means, *(_diff_text(s.global_gain.get(k)) for k in ranks)]))
    out += [
        "",
        "Traffic and time: KB per client per round (both directions) and wall time of one seed, mean over seeds\n",
        *markdown_table(["method", "KB/client/round", "time s"]),
    ]
    for s in stats:
        group = [r for r in rows if r["label"] == s.label]
        kb = np.mean([r["bytes_per_client_round"] for r in group]) / 1024
        out.append(markdown_row([s.label, f"{kb:,.0f}", f"{np.mean([r['wall_time_s'] for r in group]):,.0f}"]))
    return "\n".join(out) + "\n"


def seeds_table(rows: list[dict[str, Any]], stats: list[GroupStats]) -> Table:
    """The mean perplexity per rank group over seeds, and the collaboration gain, for the terminal.

    Args:
        rows: the rows of nestfed.experiments.report.comparison_rows (each with ``client_ranks``).
        stats: `seed_stats` of the rows.

    Returns:
        The rich table.
    """
    ranks = [str(r) for r in groups_of(rows)] + ["all"]
    t = Table(title="final held-out perplexity by rank group, mean ± 95% over seeds; gain vs local-only (%)")
    t.add_column("method")
    for k in ranks:
        t.add_column(f"r={k}" if k != "all" else "all", justify="right")
    for k in ranks:
        t.add_column(f"gain r={k}" if k != "all" else "gain all", justify="right")
    for s in stats:
        t.add_row(
            s.label,
            *[s.mean[k].text() if k in s.mean else "-" for k in ranks],
            *[_diff_text(s.gain.get(k)).replace("**", "") for k in ranks],
        )
    return t
