"""FedNL through the real runner on a tiny model: what travels in each mode (and its bytes),
FedAvg of theta by n_k, the kept LoRA and an exact resume, the constant gate's schedule."""

import json

import pytest
import torch

from nestfed.adapters.lora import inject_lora, module_shapes
from nestfed.adapters.memory import MemorySettings, fresh_rule_arrays, install_memory, memory_rules
from nestfed.backbone import load_backbone
from nestfed.config import ModelConfig, TrainConfig
from nestfed.federation import client_state
from nestfed.federation.client import ClientData, ClientTrainer
from nestfed.federation.messages import ClientInfo, GlobalState, Reply
from nestfed.federation.runner import RoundLoop, load_checkpoint
from nestfed.federation.strategy import LoraSettings
from nestfed.frozen_prefix import first_adapted_layer
from nestfed.strategies import REGISTRY

RULE = "base_model.model.model.layers.1.self_attn.memory."


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def setup(travel="all", gate="learned", n_examples=(6, 6, 6), **train):
    model = load_backbone(ModelConfig(name="tiny-llama")).model
    inject_lora(model, ("q_proj", "k_proj", "v_proj"), rank=4, scaling=2.0, layers=(-1,))
    install_memory(model, MemorySettings(gate=gate, alpha_init=0.2, chunk_size=4), layers=(1,))
    g = torch.Generator().manual_seed(0)
    data = {}
    for cid, n in enumerate(n_examples):
        starts = torch.randint(0, 50, (n + 2, 1), generator=g)
        seqs = (starts + (cid + 1) * torch.arange(16)) % 50
        tr, te = seqs[:n], seqs[n:]
        data[cid] = ClientData(tr, tr.clone(), te, te.clone())
        data[cid].cache_prefix(model, first_adapted_layer(model))
    kw = dict(local_steps=3, batch_size=2, lr=1e-2)
    kw.update(train)
    trainer = ClientTrainer(model, data, TrainConfig(**kw))
    options = {"travel": travel, "memory_init": fresh_rule_arrays(model, [1]), "gate": gate,
               "alpha_start": 0.0, "alpha_end": 0.6, "alpha_warmup_steps": 6, "local_steps": kw["local_steps"]}
    strategy = REGISTRY["fednl"](LoraSettings(r_max=4, lora_alpha=8.0, seed=1), options)
    clients = [ClientInfo(c, 4, n) for c, n in enumerate(n_examples)]
    return strategy, trainer, clients, module_shapes(model)


def run(tmp, rounds=2, travel="all", resume=False, wrap=None, **kw):
    strategy, trainer, clients, shapes = setup(travel, **kw)
    if wrap is not None:
        trainer = wrap(trainer)
    loop = RoundLoop(strategy, trainer, clients, rounds, tmp)
    return loop.run(shapes, resume=resume), trainer, strategy


def lines(tmp):
    return [json.loads(x) for x in (tmp / "metrics.jsonl").read_text().splitlines()]


def test_what_travels_in_each_mode_and_its_bytes(tmp_path):
    s_all, _, _ = run(tmp_path / "all", travel="all")
    s_rules, trainer, _ = run(tmp_path / "rules", travel="rules")
    rules = {RULE + n for n in ("beta_bias", "beta_weight", "gate_logit")}
    lora = {k for k in s_all.arrays if "lora_" in k}
    assert len(lora) == 6 and set(s_all.arrays) == lora | rules  # LoRA on q, k, v of layer 1 + the rules
    assert set(s_rules.arrays) == rules
    la, lr = lines(tmp_path / "all")[-1], lines(tmp_path / "rules")[-1]
    H, D = 4, 16
    assert lr["clients"]["0"]["params_down"] == lr["clients"]["0"]["params_up"] == H * D + H + 1
    lora_params = 4 * (64 + 64) + 2 * 4 * (64 + 32)  # q: 64 -> 64, k and v: 64 -> 32
    assert la["clients"]["0"]["params_down"] == lora_params + H * D + H + 1
    assert la["clients"]["0"]["bytes_up"] > 5 * lr["clients"]["0"]["bytes_up"]
    assert lr["bytes_down"] == sum(c["bytes_down"] for c in lr["clients"].values())
    # the rules trained (beta's projection moved off its zero start) and every update was accepted
    assert s_rules.arrays[RULE + "beta_weight"].abs().max() > 0
    assert not la["rejected"] and not lr["rejected"]
    # rules mode: each client keeps its own LoRA, and they differ between clients
    kept = [trainer.client_state[c]["kept"] for c in range(3)]
    key = next(k for k in kept[0] if k.endswith("q_proj.lora_B.weight"))
    assert not torch.equal(kept[0][key], kept[1][key]) and kept[0][key].abs().max() > 0


def test_aggregation_is_fedavg_of_theta_by_examples():
    strategy, trainer, clients, shapes = setup("all", n_examples=(2, 4, 6))
    state = strategy.initialize(shapes, clients)
    ins = strategy.configure(1, state, clients)
    replies = {c: trainer.fit(c, ins[c]) for c in range(3)}
    new = strategy.aggregate(1, state, replies)
    for k in state.arrays:
        expect = (2 * replies[0].arrays[k] + 4 * replies[1].arrays[k] + 6 * replies[2].arrays[k]) / 12
        assert torch.allclose(new.arrays[k], expect, atol=1e-6), k
    assert set(replies[0].arrays) == set(ins[0].arrays)  # everything sent trains and comes back


def test_kept_lora_makes_a_resumed_run_exact(tmp_path):
    full, t_full, _ = run(tmp_path / "full", rounds=3, travel="rules")

    class Crash(Exception):
        pass

    def crash(trainer):
        real = trainer.fit

        def fit(cid, ins):
            if ins.config["round"] == 3 and cid == 2:
                raise Crash()
            return real(cid, ins)
        trainer.fit = fit
        return trainer

    with pytest.raises(Crash):
        run(tmp_path / "part", rounds=3, travel="rules", wrap=crash)
    assert (tmp_path / "part" / "checkpoints" / "clients_002.safetensors").is_file()
    resumed, t_res, _ = run(tmp_path / "part", rounds=3, travel="rules", resume=True)
    for k in full.arrays:
        assert torch.equal(resumed.arrays[k], full.arrays[k]), k
    for c in range(3):
        for k, v in t_full.client_state[c]["kept"].items():
            assert torch.equal(t_res.client_state[c]["kept"][k], v), (c, k)
    assert [ln["eval"] for ln in lines(tmp_path / "part")] == [ln["eval"] for ln in lines(tmp_path / "full")]


def test_constant_gate_follows_its_schedule(tmp_path):
    seen = []

    def spy(trainer):
        real = trainer.fit

        def fit(cid, ins):
            rule = memory_rules(trainer.model)[1]
            orig = rule.gate

            def gate(x, tail=None):
                seen.append((ins.config["round"], round(float(rule.alpha.detach()), 6)))
                return orig(x, tail)
            rule.gate = gate
            try:
                return real(cid, ins)
            finally:
                del rule.gate
        trainer.fit = fit
        return trainer

    state, _, strategy = run(tmp_path, rounds=2, gate="constant", wrap=spy)
    # alpha = 0.6 * step / 6 over the run's local steps (3 per round), the same for every client
    train_alphas = sorted({a for r, a in seen})
    assert train_alphas == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    assert float(state.arrays[RULE + "alpha"]) == pytest.approx(0.6)  # after 6 steps: the schedule's end
    assert strategy.alpha_at(3) == pytest.approx(0.3)
    # evaluation after round 1 ran with alpha 0.3 (the value the global state carried)
    assert float(load_checkpoint(tmp_path / "checkpoints" / "round_001.safetensors")[1]
                 .arrays[RULE + "alpha"]) == pytest.approx(0.3)


def test_lora_only_payload_switches_the_memory_off():
    strategy, trainer, clients, shapes = setup("all")
    state = strategy.initialize(shapes, clients)
    ev_mem = trainer.evaluate(0, *strategy.deploy(state, 0))
    rule = memory_rules(trainer.model)[1]
    assert rule.enabled
    lora_only = {k: v for k, v in state.arrays.items() if "lora_" in k}
    ev_plain = trainer.evaluate(0, lora_only, 2.0)
    assert not rule.enabled
    assert ev_mem["loss"] != ev_plain["loss"]


def test_fednl_refuses_a_model_without_memory():
    strategy = REGISTRY["fednl"](LoraSettings(r_max=4, lora_alpha=8.0), {"travel": "all"})
    with pytest.raises(ValueError, match="no memory rules"):
        strategy.initialize({"m": (4, 4)}, [ClientInfo(0, 4, 1)])
    with pytest.raises(ValueError, match="unknown travel"):
        REGISTRY["fednl"](LoraSettings(r_max=4, lora_alpha=8.0), {"travel": "some"}).initialize({}, [])
