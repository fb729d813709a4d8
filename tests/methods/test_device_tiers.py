"""Device tiers end to end: memory budgets put some clients on a float32 backbone and others on an
nf4 one in one federation; each client trains and evaluates on its own tier's backbone (its
round-1 training equals the same client's in a federation all at its precision), the run's
summary and clients.csv carry the tiers, and the aggregation is the one rule whatever the clients'
precisions (the same replies give the same global state), for every method declaring
QUANTIZED_BACKBONE."""

import csv
import dataclasses

import pytest
import torch
from tiny_federation import lines, same_arrays, tiny_prepared, tiny_run

pytest.importorskip("bitsandbytes")

from test_capabilities import config, declaring  # noqa: E402

from nestfed import methods  # noqa: E402
from nestfed.config.capabilities import Capability  # noqa: E402
from nestfed.errors import ConfigError  # noqa: E402
from nestfed.experiments.prepare import prepare  # noqa: E402
from nestfed.experiments.run import run_method  # noqa: E402
from nestfed.federation.population import read_trace  # noqa: E402
from nestfed.nn.backbone import load_backbone  # noqa: E402
from nestfed.nn.footprint import Footprint  # noqa: E402
from nestfed.nn.frozen_prefix import first_adapted_layer  # noqa: E402
from nestfed.nn.lora import inject_lora, lora_modules  # noqa: E402
from nestfed.nn.quantization import is_quantized  # noqa: E402

MIB = 2**20


def fake_measure(cls, model, *args, **kw):
    """Footprints by hand: W = 100 MiB in float32, 40 MiB in nf4; 1 MiB per rank of trainable
    state and 1 MiB per rank step of saved activations, so bytes(r) = W - 1 + 2 r MiB."""
    quantised = any(is_quantized(m) for m in model.modules())
    return Footprint(weights=(40 if quantised else 100) * MIB, per_rank=MIB // 16, saved_at_1=0, saved_slope=MIB)


BASE = [
    "model.name=tiny-llama",
    "data.num_clients=4",
    "lora.layers=[-1]",
    "train.threads=1",
    "train.client_cache=off",
    "federation.rounds=1",
    "output.plots=false",
    "strategy.name=zeropad",
]
#: 108 MiB holds float32 at rank 4 (107) not 8 (115); 56 MiB holds no float32 rank (101 at r1) and
#: nf4 at rank 8 (55): the low-memory clients take nf4 at rank 8, the others float32 at rank 4
TIERS = [
    "lora.ranks=[8]",
    "population.memory_mib={56=0.5,108=0.5}",
    "population.rank_choices=[1,2,4,8]",
    'population.precisions=["none","nf4"]',
]


@pytest.mark.slow
def test_a_mixed_federation_trains_each_client_on_its_tiers_backbone(keep_threads, monkeypatch, tmp_path):
    monkeypatch.setattr(Footprint, "measure", classmethod(fake_measure))
    cfg = methods.load_config("configs/tiny.toml", BASE + TIERS)
    prep = prepare(cfg)
    tiers = {cid: (prep.precision(cid), prep.ranks[cid]) for cid in range(4)}
    assert {b: {tiers[c] for c in range(4) if prep.budgets[c] == b} for b in (56, 108)} == {
        56: {("nf4", 8)},
        108: {("none", 4)},
    }
    assert set(prep.backbones) == {"none", "nf4"} and prep.backbones["none"] is prep.backbone
    summary = run_method(prep, cfg, tmp_path / "mixed")
    mr = methods.get("zeropad").build(prep, cfg)
    for cid, (q, _) in tiers.items():  # each client's model is its tier's: packed nf4 or float32, LoRA float32
        modules = lora_modules(mr.trainer.model_of(cid)).values()
        assert all(is_quantized(m.base_layer) == (q == "nf4") for m in modules)
        assert all(m.lora_A.weight.dtype == torch.float32 for m in modules)
    assert summary["client_precisions"] == {str(c): q for c, (q, _) in tiers.items()}
    low = sorted(c for c in tiers if tiers[c][0] == "nf4")
    assert summary["tiers"] == {
        "none r4": {"precision": "none", "rank": 4, "clients": sorted(set(tiers) - set(low))},
        "nf4 r8": {"precision": "nf4", "rank": 8, "clients": low},
    }
    assert summary["by_tier"]["final"]["ppl"]["nf4 r8"]["n"] == len(low)
    with open(tmp_path / "mixed" / "clients.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["precision"], int(r["rank"])) for r in rows] == [tiers[c] for c in range(4)]
    # every client's round 1 equals its own in a federation all at its precision, at the same ranks
    ranks = ",".join(str(prep.ranks[c]) for c in range(4))
    losses = {}
    for q in ("none", "nf4"):
        one = methods.load_config(
            "configs/tiny.toml", BASE + [f"lora.ranks=[{ranks}]", "lora.r_max=8", f"model.quantization={q}"]
        )
        run_method(prepare(one), one, tmp_path / q)
        losses[q] = {c: v["metrics"]["train_loss"] for c, v in lines(tmp_path / q)[1]["clients"].items()}
    mixed = {c: v["metrics"]["train_loss"] for c, v in lines(tmp_path / "mixed")[1]["clients"].items()}
    for cid, (q, _) in tiers.items():
        other = "none" if q == "nf4" else "nf4"
        assert mixed[str(cid)] == losses[q][str(cid)], cid
        assert mixed[str(cid)] != losses[other][str(cid)], cid


def tiered_prepared(cfg, precisions):
    """The tiny federation with client k on a backbone at ``precisions[k]`` (its LoRA injected alike,
    its frozen prefix cached by its own tier's backbone)."""
    prep = tiny_prepared(cfg)
    backbones = {"none": prep.backbone}
    for q in set(precisions) - {"none"}:
        bb = load_backbone(dataclasses.replace(cfg.model, quantization=q))
        inject_lora(bb.model, cfg.lora.target_modules, 8, cfg.lora.lora_alpha / 8, cfg.lora.layers)
        backbones[q] = bb
    for cid, q in enumerate(precisions):
        prep.data[cid].cache_prefix(backbones[q].model, first_adapted_layer(backbones[q].model))
    return dataclasses.replace(prep, backbones=backbones, precisions=list(precisions))


@pytest.mark.parametrize("name", declaring(Capability.QUANTIZED_BACKBONE))
def test_the_aggregation_of_a_mixed_federation_is_the_one_precision_rule(tmp_path, name, one_thread):
    """Clients 1 and 2 train over nf4, client 0 over float32; their replies, replayed into the same
    method over a federation all at float32, give the same global state bit for bit."""
    cfg = config(name, "federation.rounds=2")
    replies, fp32 = {}, {}

    def record(into):
        def wrap(trainer):
            real = trainer.fit

            def fit(cid, ins):
                reply = real(cid, ins)
                into[(ins.config["round"], cid)] = reply
                assert all(v.dtype == torch.float32 for v in reply.arrays.values() if v.is_floating_point())
                return reply

            trainer.fit = fit
            return trainer

        return wrap

    def replay(trainer):
        trainer.fit = lambda cid, ins: replies[(ins.config["round"], cid)]
        return trainer

    mixed, _, _ = tiny_run(tmp_path / "mixed", cfg, tiered_prepared(cfg, ["none", "nf4", "nf4"]), wrap=record(replies))
    single, _, _ = tiny_run(tmp_path / "single", cfg, tiny_prepared(cfg), wrap=replay)
    assert same_arrays(mixed.arrays, single.arrays)
    assert mixed.meta == single.meta
    tiny_run(tmp_path / "fp32", cfg, tiny_prepared(cfg), wrap=record(fp32))  # the tiers did train apart
    assert same_arrays(replies[(1, 0)].arrays, fp32[(1, 0)].arrays)  # client 0 is float32 in both
    assert not same_arrays(replies[(1, 1)].arrays, fp32[(1, 1)].arrays)  # client 1 trained over nf4


def test_a_budget_trace_that_needs_a_lower_precision_is_refused_in_one_line(tmp_path):
    f = {"none": lambda r: (99 + 2 * r) * MIB, "nf4": lambda r: (39 + 2 * r) * MIB}
    trace = tmp_path / "budgets.csv"
    trace.write_text("round,client,memory_mib\n1,0,103\n1,1,60\n2,0,20\n")
    # client 0 (float32, rank 4): 103 MiB holds float32 at rank 2 (107 at 4); client 1 (nf4, rank 2)
    # at 60 MiB its own rank; 20 MiB holds nothing at either precision: client 0 sits round 2 out
    own, tiers = {0: 4, 1: 2}, {0: "none", 1: "nf4"}
    assert read_trace(trace, own, f, tiers) == {(1, 0): 2, (1, 1): 2, (2, 0): 0}
    trace.write_text("round,client,memory_mib\n1,0,60\n")  # 60 MiB: no float32 rank, nf4 at rank 2 (43)
    with pytest.raises(ConfigError) as err:
        read_trace(trace, own, f, tiers)
    assert str(err.value) == (
        f"{trace}:2: client 0's budget of 60 MiB holds no rank at its precision none but would at nf4; a round "
        "at a lower precision than the client's tier is not built (its data and state live on its tier's "
        "backbone; docs/scale.md, device tiers)"
    )


@pytest.mark.slow
def test_a_budget_that_holds_no_tier_is_refused_naming_the_client(keep_threads, monkeypatch):
    monkeypatch.setattr(Footprint, "measure", classmethod(fake_measure))
    cfg = methods.load_config("configs/tiny.toml", BASE + TIERS[:1] + TIERS[2:] + ["population.memory_mib={40=1.0}"])
    with pytest.raises(ConfigError) as err:
        prepare(cfg)
    assert str(err.value) == (
        "population.memory_mib: client 0's budget of 40 MiB holds no rank of [1, 2, 4, 8] at any precision of "
        "['none', 'nf4'] (rank 1 at nf4 needs 41 MiB; nestfed.nn.footprint)"
    )
