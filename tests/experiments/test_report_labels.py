"""``nestfed compare`` tells apart runs of one method whose configs differ (a sweep) by the fields
in which they differ, and pairs the seeds of one experiment as before."""

from pathlib import Path

import pytest

from nestfed.experiments.report import differing_fields

ROOT = Path(__file__).resolve().parents[2]


def test_runs_sharing_a_label_are_told_apart_by_the_fields_that_differ():
    def cfg(lr, seed, name, label=""):
        return {
            "train": {"lr": lr, "threads": 2},
            "federation": {"seed": seed, "rounds": 2},
            "output": {"name": name, "label": label},
        }

    cfgs = [cfg(1e-3, 0, "a"), cfg(3e-4, 0, "b"), cfg(1e-3, 1, "c"), cfg(1e-3, 0, "d"), cfg(3e-4, 0, "e", "mine")]
    labels = ["prelort", "prelort", "prelort", "zeropad", "prelort"]
    assert differing_fields(cfgs, labels) == [["train.lr=0.001"], ["train.lr=0.0003"], ["train.lr=0.001"], [], []]
    # seeds, names, threads alone do not make runs different experiments
    assert differing_fields([cfg(1e-3, 0, "a"), cfg(1e-3, 1, "b")], ["prelort"] * 2) == [[], []]
    # a section one run records and another (made before the section existed) does not is no difference
    newer = {**cfg(1e-3, 0, "b"), "model": {"quantization": "nf4"}, "fedsvd": {"period": 1}}
    older = {**cfg(1e-3, 0, "a"), "model": {"quantization": "none"}}
    expected = [["model.quantization=none"], ["model.quantization=nf4"]]
    assert differing_fields([older, newer], ["zeropad"] * 2) == expected


@pytest.mark.slow
def test_compare_accepts_a_sweep_and_labels_it(tmp_path, cli):
    sets = [f"output.dir={tmp_path / 'runs'}", "federation.rounds=1", "data.num_clients=2", "lora.ranks=[2,4]"]
    sets.append("output.plots=false")
    base = [x for s in sets for x in ("--set", s)]
    for lr in ("0.001", "0.0003"):
        r = cli("run", ROOT / "configs" / "tiny.toml", *base, "--set", f"train.lr={lr}", cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
    runs = sorted((tmp_path / "runs").iterdir())
    r = cli("compare", *runs, "--plot", tmp_path / "c.png", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "prelort train.lr=0.001" in r.stdout and "prelort train.lr=0.0003" in r.stdout
