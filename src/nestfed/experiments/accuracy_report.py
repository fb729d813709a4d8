"""Accuracy by test group over seeds: what a benchmark reports when each client is tested on named
groups of rows (``accuracy@<group>``: own / held-out kinds or vocabularies, distances).

Input per method: one ``{client: {group: accuracy}}`` per seed (the same clients and groups every
seed).

- `by_group`: the mean over clients per seed, then the mean over seeds with its 95% t interval.
- `paired_points`: a method against a reference in accuracy points, paired over the (seed, client)
  pairs, with its 95% interval and p-value (nestfed.experiments.intervals).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from nestfed.experiments.intervals import mean_interval, paired_difference

Seeds = list[dict[str, dict[str, float]]]


def final_groups(run_dir: str | Path, metric: str = "accuracy") -> dict[str, dict[str, float]]:
    """Each client's metric per test group in a finished run's last evaluation.

    Args:
        run_dir: the run directory (its ``summary.json``'s ``final``).
        metric: ``accuracy`` (a fraction) or ``loss`` (the answer's mean NLL, nats).

    Returns:
        ``{client: {group: metric}}``.
    """
    import json

    s = json.loads((Path(run_dir) / "summary.json").read_text())
    return of_groups(s["final"], metric)


def of_groups(evaluations: dict[str, dict[str, float]], metric: str = "accuracy") -> dict[str, dict[str, float]]:
    """Each client's metric per test group, from its ``<metric>@<group>`` metrics.

    Args:
        evaluations: ``{client: {metric name: value}}``.
        metric: the metric's name before ``@``.

    Returns:
        ``{client: {group: metric}}``.
    """
    tag = f"{metric}@"
    return {c: {k[len(tag) :]: v for k, v in m.items() if k.startswith(tag)} for c, m in evaluations.items()}


def by_group(per_seed: Seeds, order: Callable[[str], Any] = str) -> dict[str, dict[str, Any]]:
    """Each group's mean over clients per seed, then over seeds with its 95% t interval.

    Args:
        per_seed: one ``{client: {group: value}}`` per seed.
        order: the sort key of the group names.

    Returns:
        ``{group: {"mean", "half" (95% half width over seeds), "seeds" (each seed's mean over
        clients)}}``, groups sorted by ``order``.
    """
    groups = sorted({g for s in per_seed for c in s.values() for g in c}, key=order)
    out = {}
    for g in groups:
        means = [sum(c[g] for c in s.values()) / len(s) for s in per_seed]
        i = mean_interval(means)
        out[g] = {"mean": i.mean, "half": i.half_width, "seeds": means}
    return out


def paired_points(
    method: Seeds, reference: Seeds, order: Callable[[str], Any] = str, scale: float = 100.0
) -> dict[str, dict[str, float]]:
    """A method minus a reference per group, paired over the (seed, client) pairs.

    Args:
        method: one ``{client: {group: value}}`` per seed.
        reference: the same, for the reference (same seeds and clients).
        order: the sort key of the group names.
        scale: the factor on each difference (100: accuracy points; 1: a loss's own units).

    Returns:
        ``{group: {"mean_pts", "low", "high", "p"}}``: the mean difference, its 95% interval and
        p-value (nestfed.experiments.intervals).

    Raises:
        ValueError: when the two differ in seeds or clients.
    """
    if len(method) != len(reference) or any(m.keys() != r.keys() for m, r in zip(method, reference)):
        raise ValueError("paired_points: the two methods need the same seeds and clients")
    out = {}
    for g in sorted(method[0][next(iter(method[0]))], key=order):
        diffs = [scale * (m[c][g] - r[c][g]) for m, r in zip(method, reference) for c in m]
        d = paired_difference(diffs)
        out[g] = {"mean_pts": d.interval.mean, "low": d.interval.low, "high": d.interval.high, "p": d.p_value}
    return out


def cell(x: dict[str, Any]) -> str:
    """One `by_group` entry as a table cell.

    Args:
        x: ``{"mean", "half", "seeds"}`` (fractions).

    Returns:
        ``57.3 ± 4.5`` (percent; no interval for a single seed).
    """
    return f"{100 * x['mean']:.1f}" + (f" ± {100 * x['half']:.1f}" if len(x["seeds"]) > 1 else "")


def points(d: dict[str, float], digits: int = 1) -> str:
    """One `paired_points` entry as a table cell.

    Args:
        d: ``{"mean_pts", "low", "high", ...}``.
        digits: the decimals shown.

    Returns:
        ``+6.2 [-1.7, +14.2]``, bold when the interval excludes 0.
    """
    f = f"+.{digits}f"
    s = f"{d['mean_pts']:{f}} [{d['low']:{f}}, {d['high']:{f}}]"
    return f"**{s}**" if d["low"] > 0 or d["high"] < 0 else s
