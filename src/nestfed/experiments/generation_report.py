"""The generated evaluation in a comparison (``nestfed compare``, comparison.md): per label the
answers' ROUGE-L, exact match, accuracy and the references' perplexity (the mean over clients of
each run; over seeds, the mean with its 95% interval), each label against the reference paired
over (seed, client) in points, and the global adapter's ROUGE-L at each truncation rank.
"""

from __future__ import annotations

from typing import Any

from nestfed.experiments import seed_report
from nestfed.experiments.intervals import mean_interval, paired_difference
from nestfed.io.markdown import markdown_row, markdown_table

#: (summary key, column heading, shown in percent)
COLUMNS = (
    ("rouge_l", "ROUGE-L", True),
    ("exact_match", "exact match", True),
    ("accuracy", "accuracy", True),
    ("ppl", "reference ppl", False),
)


def has_generation(rows: list[dict[str, Any]]) -> bool:
    """Whether any compared run holds a generated evaluation.

    Args:
        rows: the compared runs' summaries.

    Returns:
        True when one has a ``generation`` with ``clients``.
    """
    return any(r.get("generation") and r["generation"].get("clients") for r in rows)


def _mean(run: dict[str, Any], key: str) -> float | None:
    vals = [c[key] for c in run["generation"]["clients"].values() if key in c]
    return sum(vals) / len(vals) if vals else None


def _cell(values: list[float], percent: bool) -> str:
    k = 100.0 if percent else 1.0
    if len(values) == 1:
        return f"{k * values[0]:.1f}" if percent else f"{values[0]:.2f}"
    i = mean_interval(values)
    return f"{k * i.mean:.1f} ± {k * i.half_width:.1f}" if percent else f"{i.mean:.2f} ± {i.half_width:.2f}"


def markdown(rows: list[dict[str, Any]], reference: str | None = None) -> str:
    """The Markdown tables (module docstring).

    Args:
        rows: the compared runs' summaries (with ``seed`` and ``labels``).
        reference: the label the others are paired against; None or unknown: the first label.

    Returns:
        The tables; "" when no run generated.
    """
    runs = [r for r in rows if r.get("generation") and r["generation"].get("clients")]
    if not runs:
        return ""
    groups = seed_report.by_label(runs)
    ref = reference if reference in groups else next(iter(groups))
    cols = [c for c in COLUMNS if any(_mean(r, c[0]) is not None for r in runs)]
    out = [
        "\nGenerated answers (the mean over clients; over seeds, mean ± 95%; ROUGE-L, exact match and "
        "accuracy in %):\n",
        *markdown_table(["method", "seeds", *(c[1] for c in cols)]),
    ]
    for label, group in groups.items():
        cells = [_cell([_mean(r, key) for r in group], pct) for key, _, pct in cols]
        out.append(markdown_row([label, len(group), *cells]))
    text = "\n".join(out) + "\n"
    if any(len(g) > 1 for g in groups.values()) and len(groups) > 1:
        text += _versus(groups, ref, [c for c in cols if c[2]])
    for key, heading, pct in cols:
        if pct and key != "exact_match":
            text += _by_client(groups, runs[0].get("labels", {}), key, heading)
    return text + _truncation(groups)


def _by_client(groups: dict[str, list[dict[str, Any]]], labels: dict[str, str], key: str, heading: str) -> str:
    """{heading} (%) per client: each client's mean over seeds with its 95% interval."""
    cids = sorted({c for g in groups.values() for r in g for c in r["generation"]["clients"]}, key=int)
    cids = [c for c in cids if any(key in r["generation"]["clients"].get(c, {}) for g in groups.values() for r in g)]
    if not cids:
        return ""
    out = [
        f"\n{heading} (%) per client (over seeds, mean ± 95%):\n",
        *markdown_table(["method", *(f"c{c} {labels.get(c, '')}".strip() for c in cids)]),
    ]
    for label, group in groups.items():
        cells = []
        for c in cids:
            vals = [r["generation"]["clients"][c][key] for r in group if key in r["generation"]["clients"].get(c, {})]
            cells.append(_cell(vals, True) if vals else "-")
        out.append(markdown_row([label, *cells]))
    return "\n".join(out) + "\n"


def _pairs(group: list[dict[str, Any]], key: str) -> dict[tuple[int, str], float]:
    return {(r["seed"], c): v[key] for r in group for c, v in r["generation"]["clients"].items() if key in v}


def _versus(groups: dict[str, list[dict[str, Any]]], ref: str, cols: list[tuple[str, str, bool]]) -> str:
    out = [
        f"\nAgainst {ref} (points, paired over seed x client; bold: the 95% interval excludes 0):\n",
        *markdown_table([f"vs {ref}", *(c[1] for c in cols)]),
    ]
    for label, group in groups.items():
        if label == ref:
            continue
        cells = []
        for key, _, _ in cols:
            mine, theirs = _pairs(group, key), _pairs(groups[ref], key)
            diffs = [100.0 * (mine[k] - theirs[k]) for k in mine if k in theirs]
            if len(diffs) < 2:
                cells.append("-")
                continue
            d = paired_difference(diffs)
            s = f"{d.interval.mean:+.1f} [{d.interval.low:+.1f}, {d.interval.high:+.1f}]"
            cells.append(f"**{s}**" if d.interval.low > 0 or d.interval.high < 0 else s)
        out.append(markdown_row([label, *cells]))
    return "\n".join(out) + "\n"


def _truncation(groups: dict[str, list[dict[str, Any]]]) -> str:
    ranks = sorted({int(r) for g in groups.values() for run in g for r in run["generation"].get("truncation", {})})
    if not ranks:
        return ""
    out = [
        "\nROUGE-L (%) of the global adapter truncated to rank r, every client's prompts (mean over clients; "
        "over seeds, mean ± 95%):\n",
        *markdown_table(["method", *(f"r = {r}" for r in ranks)]),
    ]
    for label, group in groups.items():
        cells = []
        for r in ranks:
            vals = [
                run["generation"]["truncation"][str(r)]["rouge_l"]["mean"]
                for run in group
                if str(r) in run["generation"].get("truncation", {})
            ]
            cells.append(_cell(vals, True) if vals else "-")
        if any(c != "-" for c in cells):
            out.append(markdown_row([label, *cells]))
    return "\n".join(out) + "\n"
