"""Compression ratios chosen by memory budgets (FedSLM's and FedMKT's ``compression.ratio_choices``
with ``population.memory_mib``): the choice against hand-set footprints, the footprint of a derived
compressed model against its shapes, the one-line refusals, and the budgets the preparation draws
alike for a LoRA method and a compressed one."""

import csv
import json

import pytest

from nestfed import methods
from nestfed.config import ModelConfig, TrainConfig
from nestfed.errors import ConfigError
from nestfed.experiments.compressed_comparison import compare
from nestfed.experiments.prepare import prepare
from nestfed.methods.compressed import ratio_choice
from nestfed.methods.compressed.ratio_choice import choose_ratio, choose_ratios, ratio_footprints
from nestfed.nn.backbone import load_backbone
from nestfed.nn.footprint import TrainedFootprint, weight_bytes
from nestfed.nn.svd import compute_bases, derive_compressed

MIB = 2**20
TINY = "configs/fedslm/tiny.toml"
COMPRESSED = ["fedslm", "fedmkt"]


def budget_config(method: str, *extra: str):
    """The tiny compressed experiment with budgets of 13 and 17 MiB (shares 0.4 / 0.6) and ratio choices."""
    return methods.load_config(
        TINY,
        [
            f"strategy.name={method}",
            "compression.client_ratios=[]",
            "compression.ratio_choices=[0.3,0.5,0.7]",
            "population.memory_mib={13=0.4,17=0.6}",
            "lora.ranks=[8]",
            "lora.r_max=8",
            "train.client_cache=off",
            *extra,
        ],
    )


# -- the choice, by hand -------------------------------------------------------------------------
HAND = {0.3: 13 * MIB, 0.5: 15 * MIB, 0.7: 17 * MIB}


@pytest.mark.parametrize(
    "mib, rho",
    [(13, 0.3), (14, 0.3), (15, 0.5), (16, 0.5), (17, 0.7), (400, 0.7), (12, None)],
)
def test_a_budget_takes_the_largest_ratio_whose_footprint_fits(mib, rho):
    assert choose_ratio(mib, HAND) == rho


def test_a_footprint_one_byte_above_the_budget_does_not_fit():
    assert choose_ratio(15, {0.3: 13 * MIB, 0.5: 15 * MIB + 1}) == 0.3
    assert choose_ratio(15, {0.3: 13 * MIB, 0.5: 15 * MIB}) == 0.5


def test_a_budget_that_holds_no_ratio_is_one_line_naming_the_client_budget_and_need():
    assert choose_ratios({0: 17, 1: 13}, HAND) == {0: 0.7, 1: 0.3}
    with pytest.raises(ConfigError) as e:
        choose_ratios({0: 17, 1: 12, 2: 11}, HAND)
    line = str(e.value)
    assert "\n" not in line
    assert line.startswith("population.memory_mib: client 1's budget of 12 MiB holds no compression ratio")
    assert "rho = 0.3 needs 13.0 MiB" in line


# -- the footprint of a derived compressed model, against its shapes ----------------------------
def test_the_footprint_of_a_compressed_model_counts_its_bases_and_cores_by_hand():
    model = load_backbone(ModelConfig(name="tiny-llama")).model
    pattern = r"(.*\.)?layers\.1\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
    bases = compute_bases(model, [0.7], pattern)
    names = sorted(bases)
    assert len(names) == 7
    trained = [n for n in names if "mlp" in n]  # the MLP's three cores train
    dense = weight_bytes(model)
    train = TrainConfig(batch_size=2)
    got = {}
    for rho in (0.3, 0.7):
        m = derive_compressed(model, bases, rho)
        fp = ratio_footprints({rho: m}, trained, _cfg(train), 1)[rho]
        shapes = {n: tuple(model.get_submodule(n).weight.shape) for n in names}
        rank = {n: int(rho * o * i / (o + i) + 1e-9) for n, (o, i) in shapes.items()}
        # the dense projections go, U [out, r] and V [in, r] come, float32; the frozen cores stay in W
        weights = dense - 4 * sum(o * i for o, i in shapes.values())
        weights += 4 * sum((o + i) * rank[n] + (0 if n in trained else rank[n] ** 2) for n, (o, i) in shapes.items())
        assert fp.weights == weights
        assert fp.trainable == sum(rank[n] ** 2 for n in trained)
        assert fp.saved > 0 and fp.bytes == fp.weights + 16 * fp.trainable + fp.saved
        got[rho] = fp
    assert got[0.3].bytes < got[0.7].bytes
    # one micro-batch row saves less than the batch of two
    m = derive_compressed(model, bases, 0.7)
    micro = ratio_footprints({0.7: m}, trained, _cfg(TrainConfig(batch_size=2, micro_batch_size=1)), 1)[0.7]
    assert micro.weights == got[0.7].weights and micro.saved < got[0.7].saved
    assert all(not p.requires_grad for p in m.parameters())  # the probe leaves the cores frozen


def _cfg(train: TrainConfig):
    """The tiny config (32-token blocks) with the step's batch and micro-batch of ``train``."""
    return methods.load_config(
        TINY, [f"train.batch_size={train.batch_size}", f"train.micro_batch_size={train.micro_batch_size}"]
    )


# -- refusals, one line each ---------------------------------------------------------------------
@pytest.mark.parametrize("method", COMPRESSED)
@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["compression.ratio_choices=[0.3,0.5]"],
            "compression.ratio_choices: only population.memory_mib chooses from it",
        ),
        (
            ["population.memory_mib={13=1.0}", "lora.ranks=[8]", "lora.r_max=8"],
            "population.memory_mib: {method} chooses each client's compression ratio from compression.ratio_choices",
        ),
        (
            ["population.memory_mib={13=1.0}", "lora.ranks=[8]", "lora.r_max=8", "compression.client_ratios=[0.5]"],
            "compression.client_ratios and population.memory_mib: set one",
        ),
        (
            ["compression.client_ratios=[0.5]", "compression.ratio_choices=[0.3]"],
            "client_ratios and ratio_choices: set one",
        ),
        (["compression.ratio_choices=[0.3,0.3]"], "ratio_choices: distinct ratios > 0"),
    ],
)
def test_bad_ratio_settings_are_refused_in_one_line(method, extra, message):
    base = [f"strategy.name={method}", "compression.client_ratios=[]"]
    with pytest.raises(ConfigError) as e:
        methods.load_config(TINY, base + extra)
    assert message.format(method=method) in str(e.value) and "\n" not in str(e.value)


def test_the_comparison_of_compressed_clients_refuses_lora_baselines_at_budgets():
    with pytest.raises(ConfigError, match="--methods: with population.memory_mib .* run fedavg, hetlora at the same"):
        compare(budget_config("fedslm"), ["fedslm", "fedavg", "hetlora"])


def test_without_settings_every_client_holds_the_default_ratio():
    from nestfed.methods.compressed.setup import client_ratios, largest_ratio

    cfg = methods.load_config(TINY, ["strategy.name=fedslm", "compression.client_ratios=[]"])
    assert client_ratios(cfg) == [0.5] * 5 and largest_ratio(cfg) == 0.5
    assert largest_ratio(budget_config("fedslm")) == 0.7  # the bases serve the largest choice


# -- the preparation: the same budgets for every method, no LoRA tier for a compressed one -------
@pytest.mark.parametrize("method", COMPRESSED)
def test_a_lora_method_and_a_compressed_one_draw_the_same_budgets(method, keep_threads):
    lora = methods.load_config(
        TINY,
        [
            "strategy.name=zeropad",
            "population.memory_mib={13=0.4,17=0.6}",
            "population.rank_choices=[2,4,8]",
            "lora.ranks=[8]",
            "train.client_cache=off",
        ],
    )
    p_lora, p_slm = prepare(lora), prepare(budget_config(method))
    assert p_slm.budgets == p_lora.budgets
    assert sorted(p_slm.budgets.values()) == [13, 13, 17, 17, 17]  # 0.4 and 0.6 of 5 clients
    assert p_lora.footprints is not None and p_lora.ranks == [8] * 5  # the tiny model's LoRA fits either budget
    assert p_slm.footprints is None and p_slm.footprint is None  # no LoRA tier measured or chosen
    assert p_slm.ranks == [8] * 5 and p_slm.precisions == ["none"] * 5
    assert {r["memory_mib"] for r in p_slm.roster().values()} == {13, 17}


# -- the compressed setup chooses each client's ratio (slow: the server text and SVD of a real corpus)
def fake_footprints(sizes):
    def measure(models, trained, cfg, start):
        return {rho: TrainedFootprint(sizes[rho], 0, 0) for rho in models}

    return measure


@pytest.mark.slow
@pytest.mark.parametrize("method", COMPRESSED)
@pytest.mark.parametrize(
    "top, expected",
    [(17 * MIB, {13: 0.3, 17: 0.7}), (17 * MIB + 1, {13: 0.3, 17: 0.5})],
)
def test_the_compressed_setup_groups_clients_by_the_ratio_their_budget_holds(
    method, top, expected, monkeypatch, keep_threads
):
    from nestfed.methods.compressed.setup import prepare_compressed

    monkeypatch.setattr(ratio_choice, "ratio_footprints", fake_footprints({0.3: 13 * MIB, 0.5: 15 * MIB, 0.7: top}))
    cfg = budget_config(method, "compression.whitening=none")
    prep = prepare(cfg)
    setup = prepare_compressed(prep, cfg)
    chosen = {cid: setup.ratios[g] for cid, g in setup.client_group.items()}
    assert chosen == {cid: expected[b] for cid, b in prep.budgets.items()}
    assert setup.ratios == sorted(set(expected.values())) and set(setup.models) == {0, 1}
    assert set(setup.footprints) == {0.3, 0.5, 0.7}  # every choice measured, chosen or not
    assert setup.budgets == prep.budgets


def test_a_budget_below_every_choice_fails_before_the_run_directory(monkeypatch, tmp_path, keep_threads):
    from nestfed.experiments.run import run_method

    sizes = {0.3: 14 * MIB, 0.5: 15 * MIB, 0.7: 16 * MIB}
    monkeypatch.setattr(ratio_choice, "ratio_footprints", fake_footprints(sizes))
    cfg = budget_config("fedslm", "compression.whitening=none")
    prep = prepare(cfg)
    with pytest.raises(ConfigError, match=r"population.memory_mib: client \d's budget of 13 MiB holds no compression"):
        run_method(prep, cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("method", COMPRESSED)
def test_the_run_records_each_clients_budget_and_ratio(method, monkeypatch, tmp_path, keep_threads):
    from nestfed.experiments.run import run_method

    sizes = {0.3: 13 * MIB, 0.5: 15 * MIB, 0.7: 17 * MIB + 1}
    monkeypatch.setattr(ratio_choice, "ratio_footprints", fake_footprints(sizes))
    cfg = budget_config(method, "compression.whitening=none", "federation.rounds=1")
    prep = prepare(cfg)
    summary = run_method(prep, cfg, tmp_path / "run")
    want = {str(c): (b, 0.3 if b == 13 else 0.5) for c, b in prep.budgets.items()}
    assert {c: (summary["client_memory_mib"][c], summary["client_ratio"][c]) for c in want} == want
    assert summary["ratio_footprints"]["0.7"]["bytes"] == 17 * MIB + 1
    groups = summary["client_memory"]["groups"]
    assert {g["ratio"]: (g["clients"], g["train_footprint_bytes"]) for g in groups.values()} == {
        0.3: (sorted(int(c) for c, (b, _) in want.items() if b == 13), 13 * MIB),
        0.5: (sorted(int(c) for c, (b, _) in want.items() if b == 17), 15 * MIB),
    }
    with open(tmp_path / "run" / "clients.csv", newline="") as f:
        rows = {r["cid"]: r for r in csv.DictReader(f)}
    assert {c: (int(r["memory_mib"]), float(r["ratio"])) for c, r in rows.items()} == want
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["client_ratio"] == summary["client_ratio"]


def test_the_probe_restores_requires_grad_flags():
    model = load_backbone(ModelConfig(name="tiny-llama")).model
    bases = compute_bases(model, [0.5], r"(.*\.)?layers\.1\.mlp\.up_proj")
    m = derive_compressed(model, bases, 0.5)
    core = m.get_submodule("model.layers.1.mlp.up_proj").sigma
    core.requires_grad_(True)
    ratio_footprints({0.5: m}, ["model.layers.1.mlp.up_proj"], _cfg(TrainConfig(batch_size=1)), 0)
    assert core.requires_grad
