"""A comparison of finished runs, four ways by its rows (by rank group with many clients, with 95%
intervals over seeds, both, or neither): the table the command prints with its bar plot, and the
Markdown of ``nestfed compare``'s comparison.md. Each is a function of the comparison rows
(comparison.json) and the reference label alone, so every committed table can be regenerated from
its results file (bench/tools/tables.py).
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from nestfed.experiments import generation_report, group_report, report, round_report, seed_report, tier_report


def table_and_plot(rows: list[dict[str, Any]], reference: str | None = None) -> tuple[Table, bytes]:
    """The comparison as a rich table and its bar plot.

    By rank group with many clients, with 95% intervals and paired differences against the
    reference over seeds.

    Args:
        rows: the comparison rows (nestfed.experiments.report.comparison_rows).
        reference: the label compared against; None for the first label.

    Returns:
        (the table, the bar plot's PNG bytes).

    Raises:
        ValueError: as ``seed_report.by_label`` does (two runs of one label and seed).
    """
    groups = seed_report.by_label(rows)
    over_seeds = any(len(g) > 1 for g in groups.values())
    many = report.many_clients(rows)
    if many and over_seeds:
        stats = group_report.seed_stats(rows, groups, reference or next(iter(groups)))
        return group_report.seeds_table(rows, stats), group_report.plot(rows)
    if many:
        return group_report.table(rows), group_report.plot(rows)
    if over_seeds:
        label_stats = seed_report.label_stats(rows, reference)
        return seed_report.seeds_table(rows, label_stats), seed_report.comparison_plot(rows, label_stats)
    return report.comparison_table(rows), report.comparison_plot(rows)


def markdown(rows: list[dict[str, Any]], reference: str | None = None) -> str:
    """comparison.md of the comparison rows.

    By rank group with many clients, with 95% intervals and paired differences against the
    reference over seeds, then by device tier where budgets chose the clients' precisions, then
    the truncation curve, its paired differences and the global
    held-out set's curve where the runs measured them, then the held-out perplexity by round with
    its last half's mean (nestfed.experiments.round_report).

    Args:
        rows: the comparison rows (nestfed.experiments.report.comparison_rows).
        reference: the label compared against; None for the first label.

    Returns:
        The Markdown.

    Raises:
        ValueError: as ``seed_report.by_label`` does (two runs of one label and seed).
    """
    groups = seed_report.by_label(rows)
    over_seeds = any(len(g) > 1 for g in groups.values())
    ref = reference or next(iter(groups))
    many = report.many_clients(rows)
    if many and over_seeds:
        text = group_report.seeds_markdown(rows, group_report.seed_stats(rows, groups, ref), ref)
    elif many:
        text = group_report.markdown(rows)
    elif over_seeds:
        text = seed_report.seeds_markdown(rows, seed_report.label_stats(rows, reference))
    else:
        text = report.comparison_markdown(rows)
    if tier_report.has_tiers(rows):
        text += (
            "\nFinal held-out perplexity by device tier (precision, rank; each label's own tiers): mean over "
            f"the tier's clients, mean ± 95% over seeds; against {ref} over the tier's seed x client pairs:\n\n"
        )
        text += tier_report.markdown(tier_report.tier_stats(rows, groups, ref), ref)
    curves = seed_report.truncation_stats(rows)
    if curves:
        text += "\nHeld-out perplexity of the final global adapter truncated to rank r (mean over clients):\n\n"
        text += seed_report.truncation_markdown(curves)
        if over_seeds and ref in curves and len(curves) > 1:
            text += (
                f"\nPaired difference of the truncated adapters' held-out perplexity against {ref} at the "
                "same r (%, 95% interval over seed x client pairs; bold: significant):\n\n"
            )
            text += seed_report.truncation_differences_markdown(seed_report.truncation_differences(rows, ref), ref)
    text += generation_report.markdown(rows, reference)
    on_global = seed_report.global_truncation_stats(rows)
    if on_global:
        text += (
            "\nHeld-out perplexity of the final global adapter truncated to rank r on the global held-out set "
            f"({'mean ± 95% over seeds' if over_seeds else 'one seed'}):\n\n"
            + seed_report.truncation_markdown(on_global)
        )
    return text + round_report.markdown(rows, reference)
