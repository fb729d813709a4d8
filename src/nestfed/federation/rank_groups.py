"""Per-client numbers summarised by rank group.

What a report of many clients shows instead of one column per client (docs/scale.md).

A rank group is the clients of one LoRA rank r_k; a tier, the clients of one backbone precision and
rank (device tiers, ``population.precisions``). For each group and for all clients together:
the count, mean, median, 10th and 90th percentiles (numpy's linear interpolation), the worst and
the best client (for perplexity and loss the worst is the highest; for accuracy the lowest).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

#: metrics for which a higher value is worse
HIGHER_IS_WORSE = ("ppl", "loss")
#: the backbone precisions, the most precise first (nestfed.config.population.PRECISIONS' order)
PRECISION_ORDER = ("none", "int8", "nf4")


def describe(values: list[float], higher_is_worse: bool = True) -> dict[str, float]:
    """Summarise a list of numbers.

    Args:
        values: the numbers.
        higher_is_worse: whether the worst is the highest (perplexity, loss) or the lowest
            (accuracy).

    Returns:
        n, mean, median, p10, p90 (numpy's linear interpolation), worst and best.

    Raises:
        ValueError: when ``values`` is empty.
    """
    if not values:
        raise ValueError("no values to describe")
    x = np.asarray(values, dtype=np.float64)
    worst, best = (x.max(), x.min()) if higher_is_worse else (x.min(), x.max())
    return {
        "n": int(x.size),
        "mean": float(x.mean()),
        "median": float(np.median(x)),
        "p10": float(np.percentile(x, 10)),
        "p90": float(np.percentile(x, 90)),
        "worst": float(worst),
        "best": float(best),
    }


def by_rank(
    values: Mapping[str, float], ranks: Mapping[str, int], higher_is_worse: bool = True
) -> dict[str, dict[str, float]]:
    """Summarise per-client values by rank group (`describe`).

    Args:
        values: {cid: value} of the clients summarised.
        ranks: {cid: r_k}, keyed like ``values``.
        higher_is_worse: see `describe`.

    Returns:
        {str(rank): the summary of its clients' values, ..., "all": that of every client}, ranks
        ascending ({} for no values).

    Raises:
        KeyError: naming a client without a rank.
    """
    groups: dict[int, list[float]] = {}
    for cid, v in values.items():
        groups.setdefault(int(ranks[cid]), []).append(float(v))
    out = {str(r): describe(groups[r], higher_is_worse) for r in sorted(groups)}
    if values:
        out["all"] = describe([float(v) for v in values.values()], higher_is_worse)
    return out


def summarise_metrics(evaluation: Mapping[str, Mapping[str, float]], ranks: Mapping[str, int]) -> dict[str, Any]:
    """Summarise an evaluation by rank group, metric by metric.

    What a metrics line keeps when its per-client numbers go to their own file.

    Args:
        evaluation: {cid: metrics}.
        ranks: {cid: r_k}.

    Returns:
        {metric: `by_rank`'s summary} for ``ppl``, ``loss`` and ``accuracy``, each when every
        client has it.
    """
    out: dict[str, Any] = {}
    for metric in ("ppl", "loss", "accuracy"):
        vals = {c: m[metric] for c, m in evaluation.items() if metric in m}
        if vals and len(vals) == len(evaluation):
            out[metric] = by_rank(vals, ranks, metric in HIGHER_IS_WORSE)
    return out


def tier_name(precision: str, rank: int) -> str:
    """Name a device tier.

    Args:
        precision: the backbone's precision (``model.quantization``'s values).
        rank: the LoRA rank r_k.

    Returns:
        ``"<precision> r<rank>"``, e.g. ``"nf4 r2"``.
    """
    return f"{precision} r{rank}"


def tier_key(name: str) -> tuple[int, int]:
    """Order tiers: the most precise backbone first, then the rank ascending.

    Args:
        name: a `tier_name`.

    Returns:
        A sort key.
    """
    precision, rank = name.split(" r")
    order = PRECISION_ORDER.index(precision) if precision in PRECISION_ORDER else len(PRECISION_ORDER)
    return order, int(rank)


def by_tier(
    values: Mapping[str, float], tiers: Mapping[str, str], higher_is_worse: bool = True
) -> dict[str, dict[str, float]]:
    """Summarise per-client values by device tier (`describe`), as `by_rank` does by rank group.

    Args:
        values: {cid: value} of the clients summarised.
        tiers: {cid: `tier_name`}, keyed like ``values``.
        higher_is_worse: see `describe`.

    Returns:
        {tier: the summary of its clients' values, ..., "all": that of every client}, in
        `tier_key`'s order ({} for no values).

    Raises:
        KeyError: naming a client without a tier.
    """
    groups: dict[str, list[float]] = {}
    for cid, v in values.items():
        groups.setdefault(tiers[cid], []).append(float(v))
    out = {t: describe(groups[t], higher_is_worse) for t in sorted(groups, key=tier_key)}
    if values:
        out["all"] = describe([float(v) for v in values.values()], higher_is_worse)
    return out
