"""Confidence intervals, paired tests and the comparison over seeds, against hand-computed values."""

from __future__ import annotations

import math
import warnings

import pytest

from nestfed.experiments.intervals import mean_interval, paired_difference, relative_differences
from nestfed.experiments.seed_report import (
    by_label,
    importance_stats,
    label_stats,
    seeds_markdown,
    truncation_differences,
    truncation_stats,
)

T_975_2 = 4.302652729749464  # Student's t quantile 0.975 with 2 degrees of freedom (tables)
T_975_3 = 3.182446305284263  # ... with 3


def test_mean_interval_by_hand():
    i = mean_interval([1.0, 2.0, 3.0])  # mean 2, sd 1
    assert i.mean == 2.0 and i.n == 3
    assert i.half_width == pytest.approx(T_975_2 / math.sqrt(3), rel=1e-12)
    assert i.text() == "2.00 ± 2.48"
    one = mean_interval([5.0])
    assert math.isnan(one.half_width) and one.text() == "5.00"
    with pytest.raises(ValueError, match="no values"):
        mean_interval([])
    with pytest.raises(ValueError, match="confidence"):
        mean_interval([1.0, 2.0], confidence=1.0)


def test_paired_difference_by_hand():
    d = paired_difference([1.0, 2.0, 3.0, 4.0])  # mean 2.5, sd sqrt(5/3), t = 2.5 / (sd / 2) = 3.873
    sd = math.sqrt(5 / 3)
    assert d.interval.half_width == pytest.approx(T_975_3 * sd / 2, rel=1e-12)
    t = 2.5 / (sd / 2)
    assert t > T_975_3 and d.significant and 0.02 < d.p_value < 0.05  # two-sided p of t = 3.87 at 3 dof is 0.030
    none = paired_difference([0.5, -0.5, 0.25, -0.25])
    assert none.p_value == pytest.approx(1.0) and not none.significant
    assert paired_difference([0.0, 0.0]).p_value == 1.0 and paired_difference([2.0, 2.0]).p_value == 0.0
    assert relative_differences(
        {(0, "0"): 11.0, (1, "0"): 9.0, (2, "0"): 1.0}, {(0, "0"): 10.0, (1, "0"): 10.0}
    ) == pytest.approx([10.0, -10.0])
    with pytest.raises(ValueError, match="cannot be paired"):
        relative_differences({(0, "0"): 1.0}, {(1, "0"): 1.0})


def row(label, seed, ppl, truncation=None, importance=None):
    return {
        "label": label,
        "seed": seed,
        "ranks": "2,4",
        "ppl": ppl,
        "mean_ppl": sum(ppl.values()) / len(ppl),
        "initial_ppl": {"0": 20.0, "1": 40.0},
        "initial_mean_ppl": 30.0,
        "round0": "backbone",
        "labels": {"0": "a", "1": "b"},
        "bytes_per_client_round": 2048.0,
        "wall_time_s": 10.0,
        "truncation": truncation,
        "dimension_importance": importance,
    }


def test_label_stats_pair_by_seed_and_client():
    rows = [
        row("ref", 0, {"0": 10.0, "1": 20.0}),
        row("ref", 1, {"0": 12.0, "1": 20.0}),
        row("m", 1, {"0": 13.2, "1": 22.0}),
        row("m", 0, {"0": 11.0, "1": 22.0}),
    ]
    with warnings.catch_warnings():  # differences equal up to rounding: scipy warns about precision
        warnings.simplefilter("ignore", RuntimeWarning)
        stats = {s.label: s for s in label_stats(rows)}
        md = seeds_markdown(rows, label_stats(rows))
    assert stats["ref"].versus is None and stats["m"].seeds == [0, 1]
    # pairs (seed, client): (0,0) +10%, (0,1) +10%, (1,0) +10%, (1,1) +10%: constant up to rounding, so p ~ 0
    assert stats["m"].versus.interval.mean == pytest.approx(10.0) and stats["m"].versus.p_value < 1e-10
    assert stats["m"].per_client["0"].mean == pytest.approx(12.1)
    assert stats["m"].mean.mean == pytest.approx((16.5 + 17.6) / 2)
    # per-seed mean differences: seed 0 16.5 / 15 -> +10%, seed 1 17.6 / 16 -> +10%
    assert stats["m"].versus_seeds.mean == pytest.approx(10.0)
    assert "| m | 2,4 | 0,1 |" in md and "**significant**" in md and "| backbone |" in md
    with pytest.raises(ValueError, match="seed listed twice"):
        by_label(rows + [row("m", 0, {"0": 1.0, "1": 1.0})])
    with pytest.raises(ValueError, match="reference 'x'"):
        label_stats(rows, "x")


def test_truncation_and_importance_over_seeds():
    def curve(a, b):
        return {"1": {"0": {"ppl": a}, "1": {"ppl": a}}, "2": {"0": {"ppl": b}, "1": {"ppl": b}}}

    rows = [
        row("ref", 0, {"0": 1.0, "1": 1.0}, curve(10.0, 8.0), [3.0, 1.0]),
        row("ref", 1, {"0": 1.0, "1": 1.0}, curve(10.0, 8.0), [1.0, 1.0]),
        row("m", 0, {"0": 1.0, "1": 1.0}, curve(11.0, 8.0), None),
        row("m", 1, {"0": 1.0, "1": 1.0}, curve(12.0, 8.0), None),
    ]
    curves = truncation_stats(rows)
    assert curves["m"][1].mean == pytest.approx(11.5) and curves["ref"][2].half_width == 0.0
    diffs = truncation_differences(rows, "ref")
    assert list(diffs) == ["m"]
    assert diffs["m"][1].interval.mean == pytest.approx(15.0)  # +10%, +10%, +20%, +20%
    assert diffs["m"][2].interval.mean == 0.0 and not diffs["m"][2].significant
    imp = importance_stats(rows)
    assert list(imp) == ["ref"] and imp["ref"][0].mean == pytest.approx((0.75 + 0.5) / 2)
