"""The held-out perplexity by round over seeds (nestfed.experiments.round_report): a run's
trajectory read back from its metrics lines, the statistics over seeds and the last half's paired
difference, all against values computed by hand."""

import json

import numpy as np
import pytest
from scipy import stats

from nestfed.experiments import round_report


def write_run(path, evals, on_global=None):
    """A run directory of inline metrics lines: ``evals[i]`` is round i's {cid: ppl} (None: no evaluation)."""
    path.mkdir()
    lines = []
    for t, ev in enumerate(evals):
        line = {"round": t}
        if ev is not None:
            line["eval"] = {c: {"ppl": v, "loss": float(np.log(v))} for c, v in ev.items()}
            if on_global is not None:
                line["eval_global"] = {"ppl": on_global[t]}
        lines.append(json.dumps(line))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_a_trajectory_keeps_the_clients_of_every_evaluated_round_and_the_rounds_after_the_halfway_round(tmp_path):
    evals = [
        {"0": 10.0, "1": 20.0, "2": 30.0},
        {"0": 8.0, "1": 16.0},  # client 2 left out: the panel is clients 0 and 1
        None,  # round 2 not evaluated
        {"0": 6.0, "1": 12.0, "2": 1.0},
        {"0": 4.0, "1": 10.0, "2": 1.0},
    ]
    t = round_report.trajectory(write_run(tmp_path / "run", evals, on_global=[40.0, 30.0, 0.0, 20.0, 25.0]))
    assert t["rounds"] == [0, 1, 3, 4] and t["clients"] == 2
    assert t["panel"] == [15.0, 12.0, 9.0, 7.0]
    assert t["global"] == [40.0, 30.0, 20.0, 25.0]
    assert t["last_half"] == {"0": 5.0, "1": 11.0}  # rounds 3 and 4 (2 t > 4)
    no_global = round_report.trajectory(write_run(tmp_path / "bare", evals))
    assert no_global["global"] is None and no_global["panel"] == t["panel"]
    assert round_report.trajectory(write_run(tmp_path / "one", [{"0": 1.0}, None])) is None
    (tmp_path / "stored").mkdir()  # a run kept with its summary alone (bench/results/cross_device_neighbours)
    assert round_report.trajectory(tmp_path / "stored") is None


def row(label, seed, panel, on_global, last):
    return {
        "label": label,
        "seed": seed,
        "by_round": {"rounds": [0, 1, 2], "clients": 2, "panel": panel, "global": on_global, "last_half": last},
    }


def test_statistics_over_seeds_and_the_last_half_against_the_reference_by_hand():
    rows = [
        row("prelort", 0, [10.0, 8.0, 6.0], [12.0, 9.0, 7.0], {"0": 5.0, "1": 7.0}),
        row("prelort", 1, [10.0, 9.0, 7.0], [12.0, 10.0, 8.0], {"0": 6.0, "1": 8.0}),
        row("fed_plora", 0, [10.0, 9.0, 9.0], [12.0, 11.0, 8.4], {"0": 6.0, "1": 9.8}),
        row("fed_plora", 1, [10.0, 11.0, 8.0], [12.0, 12.0, 9.6], {"0": 7.2, "1": 8.8}),
        {"label": "old", "seed": 0},  # a row of an older comparison.json: no trajectory, left out
    ]
    panel = round_report.round_stats(rows)
    assert list(panel) == ["prelort", "fed_plora"]
    i = panel["fed_plora"][1]
    assert i.mean == 10.0 and i.half_width == pytest.approx(stats.t.ppf(0.975, 1) * np.std([9, 11], ddof=1) / 2**0.5)
    assert round_report.round_stats(rows, "global")["prelort"][2].mean == 7.5
    half = round_report.last_half(rows, "prelort")
    assert half["prelort"][0].mean == 6.5 and half["prelort"][1] is None  # (6 + 7) / 2 over seeds
    mean, versus = half["fed_plora"]
    assert mean.mean == pytest.approx(7.95)  # seeds: (6 + 9.8) / 2 = 7.9, (7.2 + 8.8) / 2 = 8.0
    # pairs (seed, client): 6/5, 9.8/7, 7.2/6, 8.8/8 -> +20%, +40%, +20%, +10%
    assert versus.interval.mean == pytest.approx(22.5) and versus.interval.n == 4
    on_global = round_report.last_half(rows, "prelort", "global")["fed_plora"]
    # last half = round 2 (2 t > 2): 8.4 / 7 and 9.6 / 8, both +20%, paired over the two seeds
    assert on_global[0].mean == pytest.approx(9.0) and on_global[1].interval.mean == pytest.approx(20.0)
    assert on_global[1].p_value == 0.0 and on_global[1].interval.half_width == pytest.approx(0.0, abs=1e-9)
    text = round_report.markdown(rows, "prelort")
    # 22.5 ± t(0.975, 3) sd([20, 40, 20, 10]) / 2 = 22.5 ± 3.182 x 12.58 / 2: significant, in bold
    assert (
        "| fed_plora | 10.00 ± 0.00 | 10.00 ± 12.71 | 8.50 ± 6.35 | 7.95 ± 0.64 | **+22.50% [+2.48, +42.52]** |" in text
    )
    assert text.count("| prelort |") == 2 and "| old |" not in text
    assert "mean ± 95% over seeds" in text and "one seed" in round_report.markdown(rows[::2], "prelort")
    assert round_report.markdown([{"label": "old", "seed": 0}]) == ""
    assert round_report.plot([{"label": "old", "seed": 0}]) is None
    assert round_report.plot(rows)[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("rounds", "shown"),
    [
        (list(range(5)), list(range(5))),
        (list(range(101)), list(range(0, 101, 10))),
        (list(range(0, 41, 2)), [0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40]),
        (list(range(13)), [0, 1, 2, 4, 5, 6, 7, 8, 10, 11, 12]),
    ],
)
def test_the_table_shows_at_most_eleven_rounds_with_the_first_and_the_last(rounds, shown):
    assert round_report.shown_rounds(rounds) == shown
