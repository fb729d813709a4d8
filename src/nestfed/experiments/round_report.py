"""Held-out perplexity round by round over seeds, and its mean over the last half of the rounds.

A comparison at the final round alone ranks a method whose global model swings from round to
round by where the swing stands when the run stops. This report reads every run's trajectory: the
mean held-out perplexity of the clients evaluated in every evaluated round (the fixed panel with
many clients, everyone with few), and the global held-out set's where the run has one. Per label it
gives the mean ± 95% interval over seeds at each round, and the mean over the rounds of the last
half (r > R / 2, R the last round) with its paired relative difference against the reference over
(seed, client) pairs (nestfed.experiments.intervals).

Input: the rows of nestfed.experiments.report.comparison_rows (``by_round``: `trajectory` of each
run). Output: a Markdown table and PNG bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nestfed.experiments import seed_report
from nestfed.experiments.intervals import (
    Interval,
    PairedDifference,
    mean_interval,
    paired_difference,
    relative_differences,
)
from nestfed.federation.plots import png, pyplot
from nestfed.federation.run_files import RunFiles
from nestfed.io.markdown import markdown_table

plt = pyplot()  # matplotlib.pyplot on Agg

MAX_COLUMNS = 11
"""The most rounds the Markdown table shows (evenly spaced, always the first and the last)."""


def trajectory(run_dir: Path) -> dict[str, Any] | None:
    """A run's held-out perplexity at every evaluated round.

    Args:
        run_dir: a run directory (metrics.jsonl, and clients.jsonl with many clients).

    Returns:
        ``{"rounds": [t, ...], "clients": n, "panel": [mean over the n clients evaluated in every
        evaluated round, per round], "global": [the global held-out set's perplexity per round] or
        None, "last_half": {cid: that client's mean over the rounds t > R / 2}}``; None when the
        directory keeps no metrics.jsonl (a run stored with its summary alone), fewer than two
        rounds were evaluated or no client was evaluated in all of them.

    Raises:
        DataError: as nestfed.federation.run_files.RunFiles.read_rounds.
    """
    files = RunFiles(run_dir)
    if not files.metrics_path.is_file():
        return None
    lines = [ln for ln in files.read_rounds() if ln.get("eval")]
    if len(lines) < 2:
        return None
    common = set.intersection(*(set(ln["eval"]) for ln in lines))
    if not common:
        return None
    cids = sorted(common, key=int)
    rounds = [int(ln["round"]) for ln in lines]
    late = [ln for ln in lines if 2 * int(ln["round"]) > rounds[-1]]
    on_global = all("eval_global" in ln for ln in lines)
    return {
        "rounds": rounds,
        "clients": len(cids),
        "panel": [sum(ln["eval"][c]["ppl"] for c in cids) / len(cids) for ln in lines],
        "global": [ln["eval_global"]["ppl"] for ln in lines] if on_global else None,
        "last_half": {c: sum(ln["eval"][c]["ppl"] for ln in late) / len(late) for c in cids},
    }


def _by_label(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """seed_report.by_label of the rows that have a trajectory."""
    return seed_report.by_label([r for r in rows if r.get("by_round")])


def round_stats(rows: list[dict[str, Any]], series: str = "panel") -> dict[str, dict[int, Interval]]:
    """One series round by round over seeds, per label.

    Args:
        rows: the comparison rows.
        series: "panel" (mean over the clients evaluated every round) or "global" (the global
            held-out set).

    Returns:
        ``{label: {round: interval over seeds}}`` over the rounds every seed of the label
        evaluated, for the labels whose runs all have the series.
    """
    out: dict[str, dict[int, Interval]] = {}
    for label, group in _by_label(rows).items():
        runs = [dict(zip(r["by_round"]["rounds"], r["by_round"][series] or [])) for r in group]
        if not all(runs):
            continue
        common = sorted(set.intersection(*(set(x) for x in runs)))
        out[label] = {t: mean_interval([x[t] for x in runs]) for t in common}
    return out


def last_half(
    rows: list[dict[str, Any]], reference: str, series: str = "panel"
) -> dict[str, tuple[Interval, PairedDifference | None]]:
    """The mean over the last half of the rounds (t > R / 2), against the reference.

    Args:
        rows: the comparison rows.
        reference: the label the others are paired against.
        series: "panel" (paired over (seed, client): each client's own last-half mean) or "global"
            (paired over seeds: the global held-out set's last-half mean).

    Returns:
        ``{label: (interval over seeds of the per-seed last-half mean, the paired relative
        difference (%) against the reference)}`` for the labels whose runs all have the series; the
        difference is None for the reference itself and where no pair is shared.
    """
    groups = {label: group for label, group in _by_label(rows).items() if all(r["by_round"][series] for r in group)}
    pairs = {label: _late_pairs(group, series) for label, group in groups.items()}
    ref = pairs.get(reference, {})
    out = {}
    for label, group in groups.items():
        mine = pairs[label]
        means = [_mean([v for (seed, _), v in mine.items() if seed == r["seed"]]) for r in group]
        versus = None
        if label != reference and set(mine) & set(ref):
            versus = paired_difference(relative_differences(mine, ref))
        out[label] = (mean_interval(means), versus)
    return out


def _late_pairs(group: list[dict[str, Any]], series: str) -> dict[tuple[int, str], float]:
    """``{(seed, client): last-half mean}`` of the panel, or ``{(seed, "global"): ...}``."""
    if series == "panel":
        return {(r["seed"], c): v for r in group for c, v in r["by_round"]["last_half"].items()}
    out = {}
    for r in group:
        t = r["by_round"]
        late = [v for rnd, v in zip(t["rounds"], t[series]) if 2 * rnd > t["rounds"][-1]]
        out[(r["seed"], series)] = _mean(late)
    return out


def _mean(values: list[float]) -> float:
    """The mean of a non-empty list."""
    return sum(values) / len(values)


def shown_rounds(rounds: list[int]) -> list[int]:
    """At most `MAX_COLUMNS` of the rounds, evenly spaced, with the first and the last.

    Args:
        rounds: the evaluated rounds, ascending.

    Returns:
        The rounds the table shows, ascending.
    """
    if len(rounds) <= MAX_COLUMNS:
        return rounds
    step = (len(rounds) - 1) / (MAX_COLUMNS - 1)
    return sorted({rounds[round(i * step)] for i in range(MAX_COLUMNS)})


def markdown(rows: list[dict[str, Any]], reference: str | None = None) -> str:
    """The by-round section of comparison.md.

    Args:
        rows: the comparison rows.
        reference: the label compared against; None for the first label with a trajectory.

    Returns:
        The panel's table (per label, the mean ± 95% over seeds at each shown round, the last half's
        mean and its paired difference against the reference, bold where significant), then the
        global held-out set's table where the runs have one; "" when no run has a trajectory.
    """
    panel = round_stats(rows, "panel")
    if not panel:
        return ""
    ref = reference if reference in panel else next(iter(panel))
    half = last_half(rows, ref)
    n = sorted({r["by_round"]["clients"] for r in rows if r.get("by_round")})
    over = _over_seeds(rows)
    text = (
        f"\nHeld-out perplexity by round: mean over the {'/'.join(map(str, n))} clients evaluated in every "
        f"evaluated round, {over}; last half: the mean over the rounds after the halfway round, "
        f"paired against {ref} over seed x client pairs (bold: significant):\n\n"
    )
    text += _table(panel, half, ref)
    on_global = round_stats(rows, "global")
    if on_global:
        text += (
            f"\nThe global held-out set's perplexity by round ({over}; last half paired against {ref} over seeds):\n\n"
        )
        text += _table(on_global, last_half(rows, ref, "global"), ref)
    return text


def _over_seeds(rows: list[dict[str, Any]]) -> str:
    """What the figures are over: "mean ± 95% over seeds" when a label ran several, else "one seed"."""
    several = any(len({r["seed"] for r in g}) > 1 for g in _by_label(rows).values())
    return "mean ± 95% over seeds" if several else "one seed"


def _table(
    stats: dict[str, dict[int, Interval]],
    half: dict[str, tuple[Interval, PairedDifference | None]],
    reference: str,
) -> str:
    """One series' table: a row per label, a column per shown round, the last half's two."""
    shown = shown_rounds(sorted({t for s in stats.values() for t in s}))
    head = ["method", *(f"round {t}" for t in shown), "last half", f"vs {reference}"]
    body = []
    for label, s in stats.items():
        mean, versus = half[label]
        cells = [label, *(s[t].text() if t in s else "-" for t in shown)]
        body.append([*cells, mean.text(), versus.text() if versus is not None else ""])
    return "\n".join(markdown_table(head, body)) + "\n"


def plot(rows: list[dict[str, Any]]) -> bytes | None:
    """Held-out perplexity against the round, one line per label with its 95% band over seeds.

    Args:
        rows: the comparison rows.

    Returns:
        The figure as PNG bytes (the panel's series; dashed: the global held-out set's); None when
        no run has a trajectory.
    """
    panel, on_global = round_stats(rows, "panel"), round_stats(rows, "global")
    if not panel:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, s in panel.items():
        (line,) = ax.plot(list(s), [i.mean for i in s.values()], marker=".", label=label)
        low = [i.low if i.n > 1 else i.mean for i in s.values()]
        high = [i.high if i.n > 1 else i.mean for i in s.values()]
        ax.fill_between(list(s), low, high, color=line.get_color(), alpha=0.15)
        if label in on_global:
            g = on_global[label]
            ax.plot(list(g), [i.mean for i in g.values()], linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xlabel("round")
    ax.set_ylabel("held-out perplexity")
    ax.set_title(f"by round: clients evaluated every round (dashed: global held-out set), {_over_seeds(rows)}")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return png(fig)
