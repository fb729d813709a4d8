"""The footprint memory model: W counts the frozen weights once, P(r) the LoRA parameters exactly, the
saved activations are linear in r (a probe at a middle rank equals the line through the two
probes), the levers lower them, and prepare turns memory budgets into ranks with it."""

import pytest

from nestfed import methods
from nestfed.config import TrainConfig
from nestfed.experiments.prepare import prepare
from nestfed.experiments.run import run_method
from nestfed.nn.footprint import Footprint, saved_bytes, weight_bytes
from nestfed.nn.frozen_prefix import first_adapted_layer
from nestfed.nn.lora import inject_lora, lora_modules


@pytest.fixture
def model(tiny_llama):
    inject_lora(tiny_llama.model, ("q_proj", "v_proj"), 8, 2.0, (-1,))
    return tiny_llama.model


def test_the_footprint_counts_weights_parameters_and_a_linear_saved_activation(model, one_thread):
    start = first_adapted_layer(model)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    fp = Footprint.measure(model, TrainConfig(batch_size=4), 32, start)
    mods = lora_modules(model)
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in list(model.parameters()) + list(model.buffers())
    }
    lora = sum(p.numel() * 4 for m in mods.values() for p in (m.lora_A.weight, m.lora_B.weight))
    assert fp.weights == weight_bytes(model) == sum(storages.values()) - lora  # each storage once, LoRA apart
    assert fp.per_rank == sum(m.in_features + m.out_features for m in mods.values())
    middle = saved_bytes(model, 4, 32, start, 4)
    assert middle == fp.saved_at_1 + 3 * fp.saved_slope  # linear between the probes at 1 and 8
    assert fp.saved_slope > 0  # the [B, T, r] LoRA intermediates
    assert fp.bytes(4) - fp.bytes(2) == 16 * fp.per_rank * 2 + 2 * fp.saved_slope
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags  # the probe leaves them as they were
    smaller = Footprint.measure(model, TrainConfig(batch_size=4, micro_batch_size=1), 32, start)
    assert smaller.saved_at_1 < fp.saved_at_1 and smaller.weights == fp.weights


@pytest.mark.slow
def test_memory_budgets_become_ranks_through_the_footprint(keep_threads, monkeypatch, tmp_path):
    """prepare measures the footprint and gives each client the largest rank its budget holds:
    with bytes(r) = 99 MiB + 2 r MiB, a 104 MiB budget holds rank 2 and 115 MiB rank 4 (of 1, 2, 4, 8)."""
    mib = 2**20
    fake = Footprint(weights=100 * mib, per_rank=mib // 16, saved_at_1=0, saved_slope=float(mib))
    assert [fake.bytes(r) // mib for r in (1, 2, 4, 8)] == [101, 103, 107, 115]
    monkeypatch.setattr(Footprint, "measure", classmethod(lambda cls, *a, **kw: fake))
    base = [
        "model.name=tiny-llama",
        "data.num_clients=4",
        "lora.ranks=[8]",
        "lora.layers=[-1]",
        "train.threads=1",
        "population.rank_choices=[1,2,4,8]",
        "train.client_cache=off",
    ]
    prep = prepare(methods.load_config("configs/tiny.toml", base + ["population.memory_mib={104=0.5,112=0.5}"]))
    assert sorted(c.rank for c in prep.clients) == [2, 2, 4, 4]
    assert all(prep.budgets[c.cid] == {2: 104, 4: 112}[c.rank] for c in prep.clients)
    assert prep.roster()["0"]["memory_mib"] == prep.budgets[0] and prep.footprint is fake
    cfg = methods.load_config(
        "configs/tiny.toml",
        base + ["population.memory_mib={104=0.5,112=0.5}", "federation.rounds=1", "output.plots=false"],
    )
    summary = run_method(prep, cfg, tmp_path / "run")  # the method's clients get the budgets' ranks
    assert summary["rank_counts"] == {"2": 2, "4": 2}
    with pytest.raises(
        Exception,
        match="population.memory_mib: client 0's budget of 100 MiB holds no rank of "
        "\\[1, 2, 4, 8\\] \\(rank 1 needs 101 MiB",
    ):
        prepare(methods.load_config("configs/tiny.toml", base + ["population.memory_mib={100=1.0}"]))
