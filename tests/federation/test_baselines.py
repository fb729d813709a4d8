"""FedProx, FedALA and FedSSI on the real runner and trainer (tiny model): each reduces to FedAvg
exactly when its extra term is off, and its term does what its paper says when on."""

import json

import pytest
import torch

from nestfed.adapters.lora import inject_lora, module_shapes
from nestfed.backbone import load_backbone
from nestfed.config import ModelConfig, TrainConfig
from nestfed.federation import client_state
from nestfed.federation.client import ClientData, ClientTrainer
from nestfed.federation.messages import ClientInfo, Instruction
from nestfed.federation.objectives import Batch, prox, ssi
from nestfed.federation.runner import RoundLoop
from nestfed.federation.strategy import LoraSettings
from nestfed.frozen_prefix import first_adapted_layer
from nestfed.strategies import REGISTRY


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def setup(name, options=None, layers=(-2, -1)):
    model = load_backbone(ModelConfig(name="tiny-llama")).model
    inject_lora(model, ("q_proj", "k_proj", "v_proj"), rank=4, scaling=2.0, layers=layers)
    g = torch.Generator().manual_seed(0)
    data = {}
    for cid in range(3):
        starts = torch.randint(0, 50, (8, 1), generator=g)
        seqs = (starts + (cid + 1) * torch.arange(16)) % 50
        data[cid] = ClientData(seqs[:6], seqs[:6].clone(), seqs[6:], seqs[6:].clone())
        data[cid].cache_prefix(model, first_adapted_layer(model))
    trainer = ClientTrainer(model, data, TrainConfig(local_steps=3, batch_size=2, lr=1e-2))
    strategy = REGISTRY[name](LoraSettings(r_max=4, lora_alpha=8.0, seed=1), options or {})
    return strategy, trainer, [ClientInfo(c, 4, 6) for c in range(3)], module_shapes(model)


def run(tmp, name, options=None, rounds=2):
    strategy, trainer, clients, shapes = setup(name, options)
    loop = RoundLoop(strategy, trainer, clients, rounds, tmp)
    return loop.run(shapes), trainer


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_off_switches_reduce_to_fedavg_exactly(tmp_path):
    ref, _ = run(tmp_path / "avg", "fedavg")
    prox_state, _ = run(tmp_path / "prox", "fedprox", {"mu": 0.0})
    ssi_state, _ = run(tmp_path / "ssi", "fedssi", {"c": 0.0, "psm_steps": 2})  # PSM runs, leaves no trace
    ala_state, trainer = run(tmp_path / "ala", "fedala", {"layers": 1, "steps": 0})  # W stays 1
    assert same(prox_state.arrays, ref.arrays)
    assert same(ssi_state.arrays, ref.arrays)
    assert same(ala_state.arrays, ref.arrays)
    line = json.loads((tmp_path / "ssi" / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["clients"]["0"]["psm_loss"] > 0


def update_norm(name, options):
    strategy, trainer, clients, shapes = setup(name, options)
    state = strategy.initialize(shapes, clients)
    ins = strategy.configure(1, state, clients)[0]
    reply = trainer.fit(0, ins)
    return sum(float((reply.arrays[k] - ins.arrays[k]).norm() ** 2) for k in reply.arrays) ** 0.5


def test_proximal_and_importance_terms_pull_towards_the_global_model():
    free = update_norm("fedavg", {})
    assert update_norm("fedprox", {"mu": 1e4}) < 0.5 * free
    assert update_norm("fedssi", {"c": 1e4, "psm_steps": 2}) < 0.5 * free


def test_prox_and_ssi_objectives_add_their_terms():
    _, trainer, _, _ = setup("fedavg")
    model = trainer.model
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    a = torch.tensor([0.0, 0.0])
    batch = Batch(trainer.data[0].train_labels[:2], input_ids=trainer.data[0].train_ids[:2])
    ce = prox(model, batch, {"fedprox_mu": 0.0, "_anchor": [(p, a)]})
    p.grad = None
    assert prox(model, batch, {"fedprox_mu": 2.0, "_anchor": [(p, a)]}) == pytest.approx(ce)
    assert torch.allclose(p.grad, torch.tensor([2.0, 4.0]))  # d/dp mu/2 ||p - a||^2 = mu (p - a)
    p.grad = None
    ssi(model, batch, {"fedssi_c": 0.5, "_anchor": [(p, a)], "_importance": [torch.tensor([1.0, 3.0])]})
    assert torch.allclose(p.grad, torch.tensor([1.0, 6.0]))  # d/dp c sum w (p - a)^2 = 2 c w (p - a)


def test_surrogate_importance_is_nonnegative_mean_one_and_restores_theta():
    strategy, trainer, clients, shapes = setup("fedssi", {"c": 0.1, "psm_steps": 3})
    state = strategy.initialize(shapes, clients)
    ins = strategy.configure(1, state, clients)[0]
    from nestfed.federation.client import apply_arrays
    from nestfed.adapters.lora import lora_modules

    apply_arrays(trainer.model, ins.arrays, 2.0)
    params = [w for m in lora_modules(trainer.model).values() for w in (m.lora_A.weight, m.lora_B.weight)]
    before = [p.detach().clone() for p in params]
    cfg = dict(ins.config)
    client_state.regulariser_inputs(trainer, 0, cfg, params)
    omega = cfg["_importance"]
    assert all((o >= 0).all() for o in omega)
    total = sum(float(o.sum()) for o in omega) / sum(o.numel() for o in omega)
    assert total == pytest.approx(1.0, rel=1e-5)
    assert max(float(o.max()) for o in omega) > 2.0  # importance is not uniform
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))


def test_fedala_mixes_top_layers_with_learned_weights(tmp_path):
    state, trainer = run(tmp_path, "fedala", {"layers": 1, "steps": 3, "eta": 1.0}, rounds=3)
    st = trainer.client_state[0]
    w = st["ala_weights"]
    assert w and all(k.split(".layers.")[1].startswith("1.") for k in w)  # only the top LoRA layer
    allw = torch.cat([v.flatten() for v in w.values()])
    assert allw.min() >= 0 and allw.max() <= 1 and allw.min() < 1  # learned, clipped to [0, 1]
    # the client evaluates the mix of the new global and its local model
    arrays = client_state.evaluation_arrays(trainer, 0, state.arrays)
    k = next(iter(w))
    assert torch.allclose(arrays[k], st["ala_local"][k] + (state.arrays[k] - st["ala_local"][k]) * w[k], atol=1e-7)
    low = next(x for x in state.arrays if ".layers.0." in x)
    assert torch.equal(arrays[low], state.arrays[low])  # lower layers: the global model


def test_ala_keys_and_mix_arithmetic():
    arrays = {f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_{m}.weight": torch.ones(2)
              for i in range(3) for m in "AB"}
    assert [k.split(".layers.")[1][0] for k in client_state.ala_keys(arrays, 2)] == ["1", "1", "2", "2"]
    g, loc = {"k": torch.tensor([1.0, 3.0])}, {"k": torch.tensor([5.0, 5.0])}
    mixed = client_state.ala_mix(g, loc, {"k": torch.tensor([0.0, 0.5])})
    assert mixed["k"].tolist() == [5.0, 4.0]


def test_client_state_round_trips_through_flat_keys():
    st = {0: {"kept": {"a.lora_A.weight": torch.ones(2)}}, 3: {"ala_weights": {"b": torch.zeros(1)}}}
    back = client_state.unflatten_state(client_state.flatten_state(st))
    assert back.keys() == st.keys() and torch.equal(back[0]["kept"]["a.lora_A.weight"], torch.ones(2))
    with pytest.raises(ValueError, match="not <cid>/<group>"):
        client_state.unflatten_state({"x/kept/a": torch.ones(1)})


def test_unknown_keep_local_is_an_error():
    _, trainer, _, _ = setup("fedavg")
    with pytest.raises(KeyError, match="client 0: unknown keep_local"):
        trainer.fit(0, Instruction({}, {"rank": 4, "scaling": 2.0, "keep_local": "everything"}))
