"""Robust rules and central DP against arrays computed by hand, at heterogeneous ranks.

One LoRA module with out = in = 1, r_max = 2, global state all zero. Five clients, n_k = 1:

    client  rank  A (rows)        B (columns)
    0       1     [1]             [10]
    1       2     [2, 20]         [20, 200]
    2       2     [3, 30]         [30, 300]
    3       2     [4, 40]         [40, 400]
    4       2     [1000, 1000]    [1000, 1000]   (the attacker)

PreLort's segments: [0, 1) held by all five, [1, 2) by clients 1-4. ZeroPad pads client 0 with a
zero row / column.
"""

import math

import pytest
import torch

from nestfed.config import PrivacyConfig, RobustConfig
from nestfed.federation.messages import ClientInfo, GlobalState, Reply
from nestfed.federation.robust import BlockRule, coordinate_median, krum_scores, trimmed_mean
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.prelort.strategy import PreLort
from nestfed.methods.zeropad.strategy import ZeroPad

A, B = "m.lora_A.weight", "m.lora_B.weight"
ROWS = {0: [1.0], 1: [2.0, 20.0], 2: [3.0, 30.0], 3: [4.0, 40.0], 4: [1000.0, 1000.0]}
COLS = {0: [10.0], 1: [20.0, 200.0], 2: [30.0, 300.0], 3: [40.0, 400.0], 4: [1000.0, 1000.0]}
RANKS = {0: 1, 1: 2, 2: 2, 3: 2, 4: 2}


def replies():
    return {
        c: Reply({A: torch.tensor(ROWS[c]).reshape(-1, 1), B: torch.tensor(COLS[c]).reshape(1, -1)}, 1) for c in ROWS
    }


def start(strategy):
    """The all-zero global state of rank 2 with the five clients' ranks."""
    return GlobalState({A: torch.zeros(2, 1), B: torch.zeros(1, 2)}, {"ranks": {str(c): r for c, r in RANKS.items()}})


def run(strategy, **robust):
    rule = BlockRule(RobustConfig(**robust), PrivacyConfig())
    rule.start_round(1)
    new = strategy.robust_aggregate(1, start(strategy), replies(), rule)
    return new.arrays[A].flatten().tolist(), new.arrays[B].flatten().tolist(), rule.notes


SETTINGS = LoraSettings(r_max=2, lora_alpha=2.0)


def test_primitives_by_hand():
    assert coordinate_median(torch.tensor([[1.0], [5.0], [2.0]])).item() == 2.0
    assert coordinate_median(torch.tensor([[1.0], [5.0], [2.0], [10.0]])).item() == 3.5  # mean of the middle two
    assert trimmed_mean(torch.tensor([[1.0], [2.0], [3.0], [100.0], [-50.0]]), 0.2).item() == 2.0
    # points 0, 1, 3, 100 on a line, f = 0: each score sums the m - 2 = 2 nearest squared distances
    scores = krum_scores(torch.tensor([[0.0], [1.0], [3.0], [100.0]]), 0)
    assert scores.tolist() == [1.0 + 9.0, 1.0 + 4.0, 4.0 + 9.0, 97.0**2 + 99.0**2]


def test_prelort_median_per_segment():
    a, b, notes = run(PreLort(SETTINGS), rule="median")
    assert a == [3.0, 35.0] and b == [30.0, 350.0]  # segment 1:2 has four members: (30 + 40) / 2
    assert notes["rank 0:1"]["members"] == [0, 1, 2, 3, 4] and notes["rank 1:2"]["members"] == [1, 2, 3, 4]


def test_zeropad_median_over_padded_updates():
    a, b, _ = run(ZeroPad(SETTINGS), rule="median")
    assert a == [3.0, 30.0] and b == [30.0, 300.0]  # client 0's padded zero joins the second row's median


def test_trimmed_mean_trims_per_segment():
    a, b, notes = run(PreLort(SETTINGS), rule="trimmed_mean", trim_fraction=0.25)
    assert a == [3.0, 35.0] and b == [30.0, 350.0]  # one dropped at each end in both segments
    # at 0.2 the four-member segment trims nothing: floor(0.2 * 4) = 0, the attacker stays in
    a, b, notes = run(PreLort(SETTINGS), rule="trimmed_mean", trim_fraction=0.2)
    assert a == [3.0, (20 + 30 + 40 + 1000) / 4] and notes["rank 1:2"]["trimmed_each_end"] == 0


def test_krum_selects_per_segment_with_the_f_the_segment_allows():
    a, b, notes = run(PreLort(SETTINGS), rule="krum", byzantine=1)
    # segment 0:1: f = 1, scores c0 505, c1 202, c2 202, c3 505 -> c1 (ties by id)
    # segment 1:2: four members allow f = 0, scores c1 50500, c2 20200, c3 50500 -> c2
    assert a == [2.0, 30.0] and b == [20.0, 300.0]
    assert notes["rank 0:1"]["selected"] == [1] and notes["rank 0:1"]["byzantine_assumed"] == 1
    assert notes["rank 1:2"]["selected"] == [2] and notes["rank 1:2"]["byzantine_assumed"] == 0


def test_multi_krum_averages_the_best():
    a, b, notes = run(PreLort(SETTINGS), rule="multi_krum", byzantine=1, multi_krum_keep=3)
    assert a == pytest.approx([2.0, 30.0]) and b == pytest.approx([20.0, 300.0])
    assert notes["rank 0:1"]["selected"] == [0, 1, 2] and notes["rank 1:2"]["selected"] == [1, 2, 3]


def test_a_segment_of_two_falls_back_to_the_median():
    strategy = PreLort(SETTINGS)
    st = start(strategy)
    rs = {c: r for c, r in replies().items() if c in (0, 1, 4)}  # segment 1:2 held by clients 1 and 4 only
    rule = BlockRule(RobustConfig(rule="krum", byzantine=1), PrivacyConfig())
    rule.start_round(1)
    new = strategy.robust_aggregate(1, st, rs, rule)
    assert rule.notes["rank 1:2"]["rule"] == "median"
    assert new.arrays[A][1].item() == (20.0 + 1000.0) / 2


def test_central_dp_noise_is_calibrated_per_segment():
    """Without noise the DP mean is sum / (q * holders); with it, the noise std of each segment's
    mean is z C / (q M_l), M_l the federation's clients holding the segment (docs/trust.md)."""
    strategy = PreLort(SETTINGS)
    rs = {c: r for c, r in replies().items() if c != 4}
    rule = BlockRule(RobustConfig(), PrivacyConfig(mode="central", clip_norm=1.0, noise_multiplier=0.0), 1.0)
    rule.start_round(1)
    new = strategy.robust_aggregate(1, start(strategy), rs, rule)
    # segment 0:1 held by 5 clients in the federation (4 replied): sum / 5; segment 1:2 by 4: sum / 4
    assert new.arrays[A].flatten().tolist() == pytest.approx([(1 + 2 + 3 + 4) / 5, (20 + 30 + 40) / 4])
    rule = BlockRule(RobustConfig(), PrivacyConfig(mode="central", clip_norm=2.0, noise_multiplier=1.5), 0.5)
    rule.start_round(1)
    strategy.robust_aggregate(1, start(strategy), rs, rule)
    assert rule.notes["rank 0:1"]["noise_std_of_mean"] == pytest.approx(1.5 * 2.0 / (0.5 * 5))
    assert rule.notes["rank 1:2"]["noise_std_of_mean"] == pytest.approx(1.5 * 2.0 / (0.5 * 4))


def test_central_dp_noise_has_the_stated_std_and_is_seeded():
    settings = LoraSettings(r_max=2, lora_alpha=2.0)
    strategy = ZeroPad(settings)
    clients = [ClientInfo(c, 2, 1) for c in range(4)]
    st = strategy.initialize({"m": (1, 4000)}, clients)
    st.arrays = {k: torch.zeros_like(v) for k, v in st.arrays.items()}
    rs = {c: Reply({k: torch.zeros_like(v) for k, v in st.arrays.items()}, 1) for c in range(4)}

    def once(rnd):
        rule = BlockRule(RobustConfig(), PrivacyConfig(mode="central", clip_norm=0.5, noise_multiplier=2.0), 1.0, 7)
        rule.start_round(rnd)
        return strategy.robust_aggregate(rnd, st, rs, rule).arrays[next(k for k in st.arrays if "lora_A" in k)]

    a = once(1)
    assert a.std().item() == pytest.approx(2.0 * 0.5 / 4, rel=0.05)  # z C / (q M), M = 4
    assert torch.equal(a, once(1)) and not torch.equal(a, once(2))
    assert math.isfinite(a.sum().item())
