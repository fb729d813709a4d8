"""A run of many clients stays readable and small: the evaluation plan (a fixed panel between the
first and last rounds), per-client numbers in clients.jsonl with summaries by rank group in the
metrics lines (checked against the per-client numbers by hand), the per-client table, grouped
plots, and the comparison by rank group with its collaboration gain."""

import csv
import json

import numpy as np
import pytest
from tiny_federation import tiny_config, tiny_prepared

from nestfed.experiments import group_report, round_report
from nestfed.experiments.run import run_method
from nestfed.federation.evaluation_plan import EvalPlan
from nestfed.federation.rank_groups import by_rank, describe
from nestfed.federation.run_dir import RunDir

SIXTEEN = (
    "data.num_clients=16",
    "lora.ranks=[2]",
    "population.rank_shares={2=0.5,8=0.5}",
    "federation.fraction=0.25",
    "federation.rounds=3",
)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def test_describe_and_by_rank_by_hand():
    d = describe([1.0, 2.0, 3.0, 4.0, 10.0])
    # p10: 1 + 0.4 (2 - 1); p90: 4 + 0.6 (10 - 4) (linear interpolation between order statistics)
    assert d == pytest.approx({"n": 5, "mean": 4.0, "median": 3.0, "p10": 1.4, "p90": 7.6, "worst": 10.0, "best": 1.0})
    assert describe([0.2, 0.9], higher_is_worse=False)["worst"] == 0.2
    g = by_rank({"0": 1.0, "1": 3.0, "2": 10.0}, {"0": 2, "1": 2, "2": 8})
    assert list(g) == ["2", "8", "all"] and g["2"]["mean"] == 2.0 and g["8"]["n"] == 1 and g["all"]["worst"] == 10.0


def test_the_panel_is_fixed_by_the_data_seed_and_the_first_and_last_rounds_see_everyone():
    cfg = tiny_config(*SIXTEEN, "evaluation.clients=4")
    plan = EvalPlan.from_config(cfg)
    assert (
        len(plan.panel) == 4
        and plan.panel == EvalPlan.from_config(tiny_config(*SIXTEEN, "evaluation.clients=4", "federation.seed=9")).panel
    )
    assert plan.clients(0, 3, range(16)) == list(range(16)) == plan.clients(3, 3, range(16))
    assert plan.clients(1, 3, range(16)) == list(plan.panel)
    sparse = EvalPlan.from_config(
        tiny_config(*SIXTEEN, "evaluation.clients=4", "evaluation.every=2", "evaluation.final=panel")
    )
    assert sparse.clients(1, 3, range(16)) == [] and sparse.clients(3, 3, range(16)) == list(sparse.panel)


def test_a_run_of_many_clients_writes_small_lines_and_its_numbers_by_rank_group(tmp_path):
    cfg = tiny_config(*SIXTEEN, "evaluation.clients=4", "output.plots=true")
    prep = tiny_prepared(cfg, (4,) * 16)
    summary = run_method(prep, cfg, tmp_path / "run")
    rd = RunDir(tmp_path / "run")
    assert not rd.inline
    small = rd.read_metrics()
    assert all(not {"eval", "clients", "sampled"} & set(ln) for ln in small)
    full = rd.read_rounds()
    assert [len(ln["eval"]) for ln in full] == [16, 4, 4, 16]  # everyone, the panel twice, everyone
    ranks = {str(c.cid): c.rank for c in prep.clients}
    assert sorted(ranks.values()) == [2] * 8 + [8] * 8
    for ln, detail in zip(small, full):
        want = by_rank({c: m["ppl"] for c, m in detail["eval"].items()}, ranks)
        assert ln["eval_summary"]["ppl"] == want
        if ln["round"]:
            assert ln["num_sampled"] == 4 and ln["statuses"] == {"accepted": 4}
    assert "final" not in summary and summary["per_client"] == "clients.json"
    assert summary["rank_counts"] == {"2": 8, "8": 8} and summary["by_rank"]["final"]["ppl"]["all"]["n"] == 16
    rows = list(csv.DictReader(open(tmp_path / "run" / "clients.csv")))
    assert [int(r["cid"]) for r in rows] == list(range(16))
    assert sum(int(r["rounds_sampled"]) for r in rows) == 12  # 3 rounds x 4 sampled
    final = full[-1]["eval"]
    assert all(float(r["final_ppl"]) == final[r["cid"]]["ppl"] for r in rows)
    stored = json.loads((tmp_path / "run" / "clients.json").read_text())
    assert set(stored["truncation"]["2"]) == {str(c) for c in EvalPlan.from_config(cfg).panel}  # on the panel
    assert {p.name for p in (tmp_path / "run" / "plots").iterdir()} == {"eval_ppl.png", "ppl_ecdf.png", "bytes.png"}
    t = round_report.trajectory(tmp_path / "run")  # the by-round report keeps the panel, read from clients.jsonl
    panel = [str(c) for c in EvalPlan.from_config(cfg).panel]
    assert t["rounds"] == [0, 1, 2, 3] and t["clients"] == 4 and set(t["last_half"]) == set(panel)
    assert t["panel"] == pytest.approx([np.mean([ln["eval"][c]["ppl"] for c in panel]) for ln in full])


def rows_of(label, seed, ppl, ranks):
    return {
        "label": label,
        "seed": seed,
        "ppl": ppl,
        "initial_ppl": {c: 10.0 for c in ppl},
        "client_ranks": ranks,
        "round0": "backbone",
        "ranks": "",
        "bytes_per_client_round": 0.0,
        "wall_time_s": 0.0,
    }


def test_the_comparison_by_rank_group_and_the_collaboration_gain_by_hand():
    ranks = {str(c): (2 if c < 10 else 8) for c in range(20)}
    rows, groups = [], {}
    for seed in (0, 1):
        fed = rows_of("prelort", seed, {str(c): (8.0 if c < 10 else 5.0) + seed for c in range(20)}, ranks)
        local = rows_of("local_only", seed, {str(c): 10.0 + seed for c in range(20)}, ranks)
        rows += [fed, local]
        groups.setdefault("prelort", []).append(fed)
        groups.setdefault("local_only", []).append(local)
    stats = {s.label: s for s in group_report.seed_stats(rows, groups, "prelort")}
    p = stats["prelort"]
    assert p.mean["2"].mean == 8.5 and p.mean["8"].mean == 5.5 and p.mean["all"].mean == 7.0
    # gain = 100 (1 - fed / local): rank 2: 100 (1 - 8/10) = 20 (seed 0), 100 (1 - 9/11) = 18.18 (seed 1)
    g = p.gain["2"].interval
    assert g.mean == pytest.approx((20.0 + 100 * (1 - 9 / 11)) / 2) and p.gain["2"].significant
    assert stats["local_only"].versus["8"].interval.mean == pytest.approx(
        np.mean([100 * (10 / 5 - 1), 100 * (11 / 6 - 1)])
    )
    text = group_report.seeds_markdown(rows, list(stats.values()), "prelort")
    assert "Collaboration gain" in text and "r = 2 (10)" in text and "**" in text
    single = group_report.markdown([rows[0], rows[1]])
    assert "| prelort |  | 20 | 6.50 |" in single  # mean of 10 x 8 and 10 x 5
