"""Accuracy and loss tables per test group: groups read from evaluation metrics, means and 95%
intervals over seeds, and paired differences over (seed, client) against hand-computed values."""

import pytest

from nestfed.experiments.accuracy_report import by_group, of_groups, paired_points, points

EVALS = {"0": {"accuracy@own@96": 0.5, "loss@own@96": 2.0, "accuracy": 0.5, "ppl": 7.4}}


def test_groups_are_read_per_metric():
    assert of_groups(EVALS) == {"0": {"own@96": 0.5}}
    assert of_groups(EVALS, "loss") == {"0": {"own@96": 2.0}}


def test_by_group_means_clients_then_seeds():
    seeds = [{"0": {"g": 0.2}, "1": {"g": 0.4}}, {"0": {"g": 0.5}, "1": {"g": 0.5}}]
    g = by_group(seeds)["g"]
    assert g["seeds"] == pytest.approx([0.3, 0.5])
    assert g["mean"] == pytest.approx(0.4)
    assert g["half"] == pytest.approx(12.706204736 * 0.02**0.5 / 2**0.5)  # t(0.975, 1) * sd / sqrt(2)


def test_paired_points_scale_accuracy_to_points_and_keep_losses_in_nats():
    m = [{"0": {"g": 2.0}, "1": {"g": 3.0}}]
    r = [{"0": {"g": 1.0}, "1": {"g": 1.0}}]  # differences 1 and 2: mean 1.5, sd 0.7071
    half = 12.706204736 * 0.70710678 / 2**0.5
    assert paired_points(m, r)["g"]["mean_pts"] == pytest.approx(150.0)
    d = paired_points(m, r, scale=1.0)["g"]
    assert (d["mean_pts"], d["low"], d["high"]) == pytest.approx((1.5, 1.5 - half, 1.5 + half))
    assert points(d, 2) == f"+1.50 [{1.5 - half:+.2f}, {1.5 + half:+.2f}]"
    with pytest.raises(ValueError, match="same seeds and clients"):
        paired_points(m, [{"0": {"g": 1.0}}])


def test_a_significant_difference_is_bold():
    assert points({"mean_pts": 1.0, "low": 0.5, "high": 1.5, "p": 0.01}) == "**+1.0 [+0.5, +1.5]**"
