"""FedProx, FedALA and FedSSI through their homes on the tiny federation: each reduces to FedAvg
exactly when its extra term is off, and its term does what its paper says when on."""

import pytest
import torch
from tiny_federation import lines, same_arrays, tiny_config, tiny_prepared, tiny_run

from nestfed import methods
from nestfed.federation.hooks import FitContext
from nestfed.federation.training import Batch
from nestfed.methods.fedala.strategy import ala_keys, ala_mix
from nestfed.methods.fedprox.strategy import ProxHooks
from nestfed.methods.fedssi import FedSSIOptions
from nestfed.methods.fedssi.strategy import SSIHooks, surrogate_importance
from nestfed.nn.arrays import apply_arrays
from nestfed.nn.lora import lora_modules

BASE = (
    'lora.target_modules=["q_proj","k_proj","v_proj"]',
    "lora.ranks=[4]",
    "lora.lora_alpha=8.0",
    "lora.layers=[-2,-1]",
    "train.local_steps=3",
    "federation.rounds=2",
)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def cfg_of(name, *options):
    return tiny_config(*BASE, f"strategy.name={name}", *options)


def built(name, *options):
    cfg = cfg_of(name, *options)
    return methods.get(name).build(tiny_prepared(cfg), cfg)


@pytest.mark.slow
def test_off_switches_reduce_to_fedavg_exactly(tmp_path):
    ref, _, _ = tiny_run(tmp_path / "avg", cfg_of("fedavg"))
    prox_state, _, _ = tiny_run(tmp_path / "prox", cfg_of("fedprox", "fedprox.mu=0.0"))
    ssi_state, _, _ = tiny_run(
        tmp_path / "ssi", cfg_of("fedssi", "fedssi.c=0.0", "fedssi.psm_steps=2")
    )  # PSM runs, leaves no trace
    ala_state, _, _ = tiny_run(tmp_path / "ala", cfg_of("fedala", "fedala.layers=1", "fedala.steps=0"))  # W stays 1
    assert same_arrays(prox_state.arrays, ref.arrays)
    assert same_arrays(ssi_state.arrays, ref.arrays)
    assert same_arrays(ala_state.arrays, ref.arrays)
    assert lines(tmp_path / "ssi")[-1]["clients"]["0"]["metrics"]["psm_loss"] > 0


def update_norm(name, *options):
    mr = built(name, *options)
    state = mr.strategy.initialize(mr.shapes, mr.clients)
    ins = mr.strategy.configure(1, state, mr.clients)[0]
    reply = mr.trainer.fit(0, ins)
    return sum(float((reply.arrays[k] - ins.arrays[k]).norm() ** 2) for k in reply.arrays) ** 0.5


def test_proximal_and_importance_terms_pull_towards_the_global_model():
    free = update_norm("fedavg")
    assert update_norm("fedprox", "fedprox.mu=1e4") < 0.5 * free
    assert update_norm("fedssi", "fedssi.c=1e4", "fedssi.psm_steps=2") < 0.5 * free


def test_prox_and_ssi_losses_add_their_terms():
    trainer = built("fedavg").trainer
    d = trainer.data[0]
    ctx = FitContext(0, {}, {}, trainer.model, d, trainer.train)
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    a = torch.tensor([0.0, 0.0])
    batch = Batch(d.train_labels[:2], input_ids=d.train_ids[:2])
    ctx.scratch["anchor"] = [(p, a)]
    ce = ProxHooks(0.0).step_loss(ctx, batch)
    p.grad = None
    assert ProxHooks(2.0).step_loss(ctx, batch) == pytest.approx(ce)
    assert torch.allclose(p.grad, torch.tensor([2.0, 4.0]))  # d/dp mu/2 ||p - a||^2 = mu (p - a)
    p.grad = None
    ctx.scratch["importance"] = [torch.tensor([1.0, 3.0])]
    SSIHooks(FedSSIOptions(c=0.5)).step_loss(ctx, batch)
    assert torch.allclose(p.grad, torch.tensor([1.0, 6.0]))  # d/dp c sum w (p - a)^2 = 2 c w (p - a)


def test_surrogate_importance_is_nonnegative_mean_one_and_restores_theta():
    mr = built("fedssi", "fedssi.c=0.1", "fedssi.psm_steps=3")
    state = mr.strategy.initialize(mr.shapes, mr.clients)
    ins = mr.strategy.configure(1, state, mr.clients)[0]
    trainer = mr.trainer
    apply_arrays(trainer.model, ins.arrays, 2.0)
    params = [w for m in lora_modules(trainer.model).values() for w in (m.lora_A.weight, m.lora_B.weight)]
    for p in params:
        p.requires_grad_(True)
    before = [p.detach().clone() for p in params]
    ctx = FitContext(0, dict(ins.config), {}, trainer.model, trainer.data[0], trainer.train)
    omega, metrics = surrogate_importance(ctx, params, [p.detach().clone() for p in params], FedSSIOptions(psm_steps=3))
    assert all((o >= 0).all() for o in omega) and metrics["psm_loss"] > 0
    total = sum(float(o.sum()) for o in omega) / sum(o.numel() for o in omega)
    assert total == pytest.approx(1.0, rel=1e-5)
    assert max(float(o.max()) for o in omega) > 2.0  # importance is not uniform
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    ones, none = surrogate_importance(ctx, params, before, FedSSIOptions(psm_steps=0))
    assert all(torch.equal(o, torch.ones_like(o)) for o in ones) and none == {}


def test_fedala_mixes_top_layers_with_learned_weights(tmp_path):
    state, _, mr = tiny_run(
        tmp_path, cfg_of("fedala", "fedala.layers=1", "fedala.steps=3", "fedala.eta=1.0", "federation.rounds=3")
    )
    st = mr.trainer.client_state[0]
    w = st["ala_weights"]
    assert w and all(k.split(".layers.")[1].startswith("1.") for k in w)  # only the top LoRA layer
    allw = torch.cat([v.flatten() for v in w.values()])
    assert allw.min() >= 0 and allw.max() <= 1 and allw.min() < 1  # learned, clipped to [0, 1]
    # the client evaluates the mix of the new global and its local model
    arrays = mr.trainer.hooks.evaluation_arrays(st, state.arrays)
    k = next(iter(w))
    assert torch.allclose(arrays[k], st["ala_local"][k] + (state.arrays[k] - st["ala_local"][k]) * w[k], atol=1e-7)
    low = next(x for x in state.arrays if ".layers.0." in x)
    assert torch.equal(arrays[low], state.arrays[low])  # lower layers: the global model


def test_ala_keys_and_mix_arithmetic():
    arrays = {
        f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{m}.weight": torch.ones(2)
        for i in range(3)
        for m in "AB"
    }
    assert [k.split(".layers.")[1][0] for k in ala_keys(arrays, 2)] == ["1", "1", "2", "2"]
    g, loc = {"k": torch.tensor([1.0, 3.0])}, {"k": torch.tensor([5.0, 5.0])}
    mixed = ala_mix(g, loc, {"k": torch.tensor([0.0, 0.5])})
    assert mixed["k"].tolist() == [5.0, 4.0]
