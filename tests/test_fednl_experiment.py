"""FedNL and its baselines through the recipe (config -> prepare -> run) on a tiny model with
the real MMLU domains: the memory is installed for FedNL only, leaves the other methods exact,
the aggregation drop is reported, the rules are exported; the shipped FedNL configs load."""

import json
from pathlib import Path

import pytest
import torch

from nestfed import config as C
from nestfed.adapters.memory import memory_rules
from nestfed.data.mmlu_domains import DOMAINS, TEST_FRACTION, domain_items
from nestfed.data.partition import train_test_split
from nestfed.experiment import prepare, run_experiment

SHARED = Path(__file__).resolve().parents[2] / "shared"

MMLU = SHARED / "data" / "mmlu"
pytestmark = pytest.mark.skipif(not (MMLU / "test").is_dir(), reason="../shared/data/mmlu missing")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_cfg(tmp_path, **strategy):
    base = C.load(ROOT / "configs" / "fednl" / "mmlu.toml")
    return C.replace(base, model={"name": "tiny-llama"}, data={"path": str(MMLU), "max_train": 6, "max_test": 4,
                                                                  "block_size": 96},
                     lora={"ranks": (4,), "lora_alpha": 8.0, "layers": (-1,)},
                     train={"local_steps": 2, "batch_size": 2, "lr": 1e-2, "threads": 0},
                     federation={"rounds": 2}, output={"dir": str(tmp_path), "plots": False},
                     strategy={"name": "fednl", **strategy})


def test_domains_match_the_paper():
    subjects = [s for subs in DOMAINS.values() for s in subs]
    assert len(subjects) == len(set(subjects)) == 56  # every MMLU subject but professional_accounting
    items, labels = domain_items(MMLU)
    math_cs = [i for i, lab in enumerate(labels) if lab == "math_cs"]
    train, test = train_test_split(math_cs, TEST_FRACTION, 0)
    assert (len(train), len(test)) == (915, 183)  # the paper's Math/CS split
    assert {items[i].subject for i in math_cs} == set(DOMAINS["math_cs"])


def test_fednl_then_fedavg_on_one_preparation(tmp_path):
    cfg = tiny_cfg(tmp_path, fednl_travel="rules")
    prep = prepare(cfg)
    assert [d.label for d in prep.data.values()] == ["law_ethics", "humanities", "stem", "math_cs",
                                                     "medical_psychology"]
    assert not memory_rules(prep.backbone.model)  # prepare installs no memory
    s_nl = run_experiment(prep, cfg, tmp_path / "fednl")
    assert set(memory_rules(prep.backbone.model)) == {1}  # FedNL put it on the LoRA layer
    assert (tmp_path / "fednl" / "memory_rules.safetensors").is_file()
    assert not (tmp_path / "fednl" / "adapter").exists()  # rules only: no global LoRA to export
    assert set(s_nl["aggregation_drop"]) == {"0", "1", "2", "3", "4"}
    for c, drop in s_nl["aggregation_drop"].items():
        assert drop == pytest.approx(s_nl["local_accuracy"][c] - s_nl["federated_accuracy"][c])
    line = json.loads((tmp_path / "fednl" / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["clients"]["0"]["params_up"] == 4 * 16 + 4 + 1  # beta (H x D), its bias, the gate
    # FedAvg after FedNL on the same (now memory-carrying) model equals FedAvg on a fresh one
    cfg_avg = C.replace(cfg, strategy={"name": "fedavg"})
    s_a = run_experiment(prep, cfg_avg, tmp_path / "fedavg_after")
    s_b = run_experiment(prepare(cfg_avg), cfg_avg, tmp_path / "fedavg_fresh")
    assert s_a["final"] == s_b["final"]
    assert s_a["initial"] == s_b["initial"] == s_nl["initial"]  # round 0: the backbone alone


@pytest.mark.parametrize("name", ["fedprox", "fedala", "fedssi"])
def test_baselines_run_through_the_recipe(tmp_path, name):
    cfg = tiny_cfg(tmp_path, name=name)
    summary = run_experiment(prepare(cfg), cfg, tmp_path / name)
    assert summary["rejected_updates"] == 0 and "mean_aggregation_drop" in summary
    assert 0 <= summary["mean_accuracy"] <= 1


def test_shipped_fednl_configs_load():
    files = sorted((ROOT / "configs" / "fednl").glob("*.toml"))
    names = {C.load(f).strategy.name for f in files}
    assert names >= {"fednl", "fedavg", "fedprox", "fedala", "fedssi", "ffa_lora"}
    rules = C.load(ROOT / "configs" / "fednl" / "mmlu_rules_only.toml")
    assert rules.strategy.fednl_travel == "rules" and rules.data.source == "mmlu_domains"
    with pytest.raises(C.ConfigError, match="o_proj"):
        C.replace(rules, lora={"target_modules": ("q_proj", "o_proj")})
    with pytest.raises(C.ConfigError, match="fednl_travel"):
        C.replace(rules, strategy={"fednl_travel": "some"})
