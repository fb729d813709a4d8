"""``nestfed compare`` by device tier: each label's own tiers, the mean over the tier's clients with
its interval over seeds, and the paired difference against the reference over the tier's
(seed, client) pairs, by hand."""

import pytest

from nestfed.experiments import seed_report, tier_report


def row(label, seed, ppl, tiers, tiered):
    return {"label": label, "seed": seed, "ppl": ppl, "client_tiers": tiers, "tiered": tiered}


MIXED = {"0": "none r8", "1": "nf4 r4"}
FP32 = {"0": "none r8", "1": "none r4"}
ROWS = [
    row("mixed", 0, {"0": 10.0, "1": 22.0}, MIXED, True),
    row("mixed", 1, {"0": 12.0, "1": 24.0}, MIXED, True),
    row("fp32", 0, {"0": 10.0, "1": 20.0}, FP32, False),
    row("fp32", 1, {"0": 12.0, "1": 20.0}, FP32, False),
]


def test_each_labels_tiers_against_the_reference_over_the_tiers_pairs():
    stats = tier_report.tier_stats(ROWS, seed_report.by_label(ROWS), "fp32")
    got = {(s.label, s.tier): s for s in stats}
    assert [(s.label, s.tier) for s in stats] == [  # the most precise first, then by rank
        ("mixed", "none r8"),
        ("mixed", "nf4 r4"),
        ("fp32", "none r4"),
        ("fp32", "none r8"),
    ]
    low = got[("mixed", "nf4 r4")]
    assert low.clients == ["1"] and low.mean.mean == pytest.approx(23.0)  # seeds' means 22 and 24
    # pairs: 100 (22 / 20 - 1) = 10 and 100 (24 / 20 - 1) = 20
    assert low.versus.interval.mean == pytest.approx(15.0) and low.versus.interval.n == 2
    assert got[("mixed", "none r8")].versus.interval.mean == pytest.approx(0.0)
    assert got[("fp32", "none r4")].versus is None  # the reference
    text = tier_report.markdown(stats, "fp32")
    assert (
        "| mixed | nf4 r4 | 1 | 0,1 | 23.00 ± " in text
        and "| fp32 | none r4 | 1 | 0,1 | 20.00 ± 0.00 | reference |" in text
    )


def test_only_a_comparison_with_a_tiered_run_shows_tiers():
    assert tier_report.has_tiers(ROWS) and not tier_report.has_tiers(ROWS[2:])
