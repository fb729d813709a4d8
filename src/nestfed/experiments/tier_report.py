"""Comparisons by device tier: each client grouped by its backbone precision and LoRA rank
(``population.precisions``; docs/scale.md, device tiers), so a mixed-tier federation is read tier by
tier against another run of the same clients (all float32 at the same ranks, or FedSLM's compressed
clients at the same budgets).

Input: the rows of nestfed.experiments.report.comparison_rows (each with ``client_tiers``). Per label
and tier (its own: the same clients may sit in other tiers under another label): the clients, the
mean over seeds of the tier's mean final held-out perplexity with its 95% interval, and the paired
difference against the reference over the tier's (seed, client) pairs, 100 (ppl / ppl_reference - 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.table import Table

from nestfed.experiments.intervals import Interval, PairedDifference, mean_interval, paired_difference
from nestfed.federation.rank_groups import tier_key
from nestfed.io.markdown import markdown_row, markdown_table


@dataclass
class TierStats:
    """One label's tier over its seeds.

    Attributes:
        label: the compared label.
        tier: the tier's name (``"<precision> r<rank>"``).
        clients: the tier's client ids.
        seeds: the seeds it was run at.
        mean: the mean over seeds of the tier's mean final perplexity.
        versus: the paired difference (%) against the reference over the tier's (seed, client)
            pairs; None for the reference or without pairs.
    """

    label: str
    tier: str
    clients: list[str]
    seeds: list[int]
    mean: Interval
    versus: PairedDifference | None


def has_tiers(rows: list[dict[str, Any]]) -> bool:
    """Tell whether a comparison holds a run whose budgets chose its clients' precisions.

    Args:
        rows: the comparison rows.

    Returns:
        True when some row is ``tiered``.
    """
    return any(r.get("tiered") for r in rows)


def tier_stats(
    rows: list[dict[str, Any]], by_label: dict[str, list[dict[str, Any]]], reference: str
) -> list[TierStats]:
    """`TierStats` per label and tier.

    Args:
        rows: the comparison rows (each with ``client_tiers``).
        by_label: the rows by label (nestfed.experiments.seed_report.by_label).
        reference: the label the others are paired against.

    Returns:
        Label by label in ``by_label``'s order, its tiers the most precise first, then by rank.
    """
    ref = {(r["seed"], c): v for r in by_label[reference] for c, v in r["ppl"].items()}
    out = []
    for label, group in by_label.items():
        tiers = sorted({t for r in group for t in r.get("client_tiers", {}).values()}, key=tier_key)
        for tier in tiers:
            members = {r["seed"]: [c for c, t in r["client_tiers"].items() if t == tier] for r in group}
            per_seed = [
                float(np.mean([r["ppl"][c] for c in members[r["seed"]] if c in r["ppl"]]))
                for r in group
                if any(c in r["ppl"] for c in members[r["seed"]])
            ]
            if not per_seed:
                continue
            pairs = [
                100.0 * (r["ppl"][c] / ref[(r["seed"], c)] - 1.0)
                for r in group
                for c in members[r["seed"]]
                if c in r["ppl"] and (r["seed"], c) in ref
            ]
            versus = paired_difference(pairs) if label != reference and pairs else None
            clients = sorted({c for m in members.values() for c in m}, key=int)
            out.append(TierStats(label, tier, clients, [r["seed"] for r in group], mean_interval(per_seed), versus))
    return out


def _mean_text(i: Interval) -> str:
    return f"{i.mean:.2f}" if math.isnan(i.half_width) else f"{i.mean:.2f} ± {i.half_width:.2f}"


def _diff_text(d: PairedDifference | None, reference: bool) -> str:
    if reference:
        return "reference"
    return "-" if d is None else d.text(with_p=True)


def markdown(stats: list[TierStats], reference: str) -> str:
    """The per-tier rows as a Markdown table.

    Args:
        stats: `tier_stats`.
        reference: the reference label.

    Returns:
        The table.
    """
    out = markdown_table(["method", "tier", "clients", "seeds", "mean ppl", "vs reference (% ppl, pairs)"])
    for s in stats:
        cells = [s.label, s.tier, ",".join(s.clients), ",".join(map(str, s.seeds)), _mean_text(s.mean)]
        out.append(markdown_row(cells + [_diff_text(s.versus, s.label == reference)]))
    return "\n".join(out) + "\n"


def table(stats: list[TierStats], reference: str) -> Table:
    """`markdown`'s table for the terminal.

    Args:
        stats: `tier_stats`.
        reference: the reference label.

    Returns:
        The rich table.
    """
    t = Table(title="final held-out perplexity by device tier (precision, rank), mean ± 95% over seeds")
    for col in ("method", "tier", "clients", "mean ppl", f"vs {reference} (%)"):
        t.add_column(col, justify="left" if col in ("method", "tier") else "right")
    for s in stats:
        diff = _diff_text(s.versus, s.label == reference).replace("**", "")
        t.add_row(s.label, s.tier, ",".join(s.clients), _mean_text(s.mean), diff)
    return t
