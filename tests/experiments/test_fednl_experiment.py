"""FedNL and its baselines through the recipe (config -> prepare -> run) on a tiny model with
the real MMLU domains: the memory is installed for FedNL only, leaves the other methods exact,
the aggregation drop is reported, the rules are exported; the shipped FedNL configs load."""

import json
from pathlib import Path

import pytest

from nestfed import methods
from nestfed.config import ConfigError
from nestfed.data.mmlu_domains import DOMAINS, TEST_FRACTION, domain_items
from nestfed.data.partition import train_test_split
from nestfed.experiments.prepare import prepare
from nestfed.experiments.run import run_method
from nestfed.federation.run_dir import RunDir
from nestfed.nn.memory import memory_rules

ROOT = Path(__file__).resolve().parents[2]
MMLU = ROOT.parent / "shared" / "data" / "mmlu"
pytestmark = pytest.mark.skipif(not (MMLU / "test").is_dir(), reason="../shared/data/mmlu missing")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def tiny_cfg(tmp_path, name="fednl", travel="all"):
    base = methods.load_config(ROOT / "configs" / "fednl" / "mmlu.toml")
    return methods.replace_config(
        base,
        model={"name": "tiny-llama"},
        data={"path": str(MMLU), "max_train": 6, "max_test": 4, "block_size": 96},
        lora={"ranks": (4,), "lora_alpha": 8.0, "layers": (-1,)},
        train={"local_steps": 2, "batch_size": 2, "lr": 1e-2, "threads": 0},
        federation={"rounds": 2},
        output={"dir": str(tmp_path), "plots": False},
        strategy={"name": name},
        fednl={"travel": travel},
    )


def test_domains_match_the_paper():
    subjects = [s for subs in DOMAINS.values() for s in subs]
    assert len(subjects) == len(set(subjects)) == 56  # every MMLU subject but professional_accounting
    items, labels = domain_items(MMLU)
    math_cs = [i for i, lab in enumerate(labels) if lab == "math_cs"]
    train, test = train_test_split(math_cs, TEST_FRACTION, 0)
    assert (len(train), len(test)) == (915, 183)  # the paper's Math/CS split
    assert {items[i].subject for i in math_cs} == set(DOMAINS["math_cs"])


@pytest.mark.slow
def test_fednl_then_fedavg_on_one_preparation(tmp_path):
    cfg = tiny_cfg(tmp_path, travel="rules")
    prep = prepare(cfg)
    assert [d.label for d in prep.data.values()] == [
        "law_ethics",
        "humanities",
        "stem",
        "math_cs",
        "medical_psychology",
    ]
    assert not memory_rules(prep.backbone.model)  # prepare installs no memory
    s_nl = run_method(prep, cfg, tmp_path / "fednl")
    assert set(memory_rules(prep.backbone.model)) == {1}  # FedNL put it on the LoRA layer
    assert (tmp_path / "fednl" / "memory_rules.safetensors").is_file()
    assert not (tmp_path / "fednl" / "adapter").exists()  # rules only: no global LoRA to export
    assert set(s_nl["aggregation_drop"]) == {"0", "1", "2", "3", "4"}
    for c, drop in s_nl["aggregation_drop"].items():
        assert drop == pytest.approx(s_nl["local_accuracy"][c] - s_nl["federated_accuracy"][c])
    line = json.loads((tmp_path / "fednl" / "metrics.jsonl").read_text().splitlines()[-1])
    # configs/fednl/mmlu.toml pins issue 24's layer: beta from the keys (H x D), its bias, one gate
    assert line["clients"]["0"]["params_up"] == 4 * 16 + 4 + 1
    # FedAvg after FedNL on the same (now memory-carrying) model equals FedAvg on a fresh one
    cfg_avg = methods.with_method(cfg, "fedavg")
    s_a = run_method(prep, cfg_avg, tmp_path / "fedavg_after")
    s_b = run_method(prepare(cfg_avg), cfg_avg, tmp_path / "fedavg_fresh")
    assert s_a["final"] == s_b["final"]
    assert s_a["initial"] == s_b["initial"] == s_nl["initial"]  # round 0: the backbone alone


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fedprox", "fedala", "fedssi"])
def test_baselines_run_through_the_recipe(tmp_path, name):
    """The aggregation drop is local minus federated accuracy from the last round's own lines,
    and only FedALA's clients keep state, which its checkpoints carry."""
    cfg = tiny_cfg(tmp_path, name=name)
    summary = run_method(prepare(cfg), cfg, tmp_path / name)
    rd = RunDir(tmp_path / name)
    last = rd.read_metrics()[-1]
    drops = [last["clients"][c]["metrics"]["local_accuracy"] - last["eval"][c]["accuracy"] for c in "01234"]
    assert summary["mean_aggregation_drop"] == pytest.approx(sum(drops) / 5)
    assert summary["mean_accuracy"] == pytest.approx(sum(last["eval"][c]["accuracy"] for c in "01234") / 5)
    kept = rd.load_checkpoint(rd.checkpoints()[-1][1]).client_state
    assert bool(any(kept.values())) == (name == "fedala")


def test_shipped_fednl_configs_load():
    files = sorted((ROOT / "configs" / "fednl").glob("*.toml"))
    names = {methods.load_config(f).strategy.name for f in files}
    assert names >= {"fednl", "fedavg", "fedprox", "fedala", "fedssi", "ffa_lora"}
    rules = methods.load_config(ROOT / "configs" / "fednl" / "mmlu_rules_only.toml")
    assert rules.section("fednl").travel == "rules" and rules.data.source == "mmlu_domains"
    with pytest.raises(ConfigError, match="o_proj"):
        methods.replace_config(rules, lora={"target_modules": ("q_proj", "o_proj")})
    with pytest.raises(ConfigError, match="fednl.travel"):
        methods.replace_config(rules, fednl={"travel": "some"})
