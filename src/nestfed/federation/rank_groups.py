"""Per-client numbers summarised by rank group: what a report of many clients shows instead of one
column per client (docs/scale.md).

A rank group is the clients of one LoRA rank r_k. For each group and for all clients together:
the count, mean, median, 10th and 90th percentiles (numpy's linear interpolation), the worst and
the best client (for perplexity and loss the worst is the highest; for accuracy the lowest).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

#: metrics for which a higher value is worse
HIGHER_IS_WORSE = ("ppl", "loss")


def describe(values: list[float], higher_is_worse: bool = True) -> dict[str, float]:
    """n, mean, median, p10, p90, worst and best of ``values``. Raises ValueError when empty."""
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
    """{str(rank): :func:`describe` of its clients' values, ..., "all": of every client} over the
    clients in ``values`` ({cid: value}; ``ranks``: {cid: r_k}, keyed alike), ranks ascending.
    Raises KeyError naming a client without a rank."""
    groups: dict[int, list[float]] = {}
    for cid, v in values.items():
        groups.setdefault(int(ranks[cid]), []).append(float(v))
    out = {str(r): describe(groups[r], higher_is_worse) for r in sorted(groups)}
    if values:
        out["all"] = describe([float(v) for v in values.values()], higher_is_worse)
    return out


def summarise_metrics(evaluation: Mapping[str, Mapping[str, float]], ranks: Mapping[str, int]) -> dict[str, Any]:
    """{metric: :func:`by_rank`} for ``ppl``, ``loss`` and (when every client has it) ``accuracy``
    of an evaluation {cid: metrics}: what a metrics line keeps when its per-client numbers go to
    their own file."""
    out: dict[str, Any] = {}
    for metric in ("ppl", "loss", "accuracy"):
        vals = {c: m[metric] for c, m in evaluation.items() if metric in m}
        if vals and len(vals) == len(evaluation):
            out[metric] = by_rank(vals, ranks, metric in HIGHER_IS_WORSE)
    return out
