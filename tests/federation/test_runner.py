"""The embedded runner on a tiny model with random-token clients: determinism, resume, rejection, bytes."""

import json

import pytest
import torch

from nestfed.adapters.lora import inject_lora, module_shapes
from nestfed.backbone import load_backbone
from nestfed.config import ModelConfig, TrainConfig
from nestfed.federation.client import ClientData, ClientTrainer
from nestfed.federation.messages import ClientInfo, Reply
from nestfed.federation.payload import encode
from nestfed.federation.runner import RoundLoop, load_checkpoint, sample_clients
from nestfed.federation.strategy import LoraSettings
from nestfed.frozen_prefix import first_adapted_layer
from nestfed.strategies import REGISTRY

RANKS = [2, 4, 8]


def setup(name="prelort", layers=(-1,)):
    model = load_backbone(ModelConfig(name="tiny-llama")).model
    inject_lora(model, ("q_proj", "v_proj"), rank=8, scaling=2.0, layers=layers)
    g = torch.Generator().manual_seed(0)
    data = {}
    for cid in range(3):  # learnable streams: arithmetic progressions with a per-client step
        starts = torch.randint(0, 50, (8, 1), generator=g)
        seqs = (starts + (cid + 1) * torch.arange(16)) % 50
        tr, te = seqs[:6], seqs[6:]
        data[cid] = ClientData(tr, tr.clone(), te, te.clone())
        data[cid].cache_prefix(model, first_adapted_layer(model))
    trainer = ClientTrainer(model, data, TrainConfig(local_steps=2, batch_size=2, lr=1e-2))
    strategy = REGISTRY[name](LoraSettings(r_max=8, lora_alpha=16.0, seed=1), {})
    clients = [ClientInfo(c, RANKS[c], 6) for c in range(3)]
    return strategy, trainer, clients, module_shapes(model)


def run(tmp, rounds=3, name="prelort", trainer_wrap=None, resume=False, **kw):
    strategy, trainer, clients, shapes = setup(name)
    if trainer_wrap is not None:
        trainer = trainer_wrap(trainer)
    loop = RoundLoop(strategy, trainer, clients, rounds, tmp, **kw)
    return loop.run(shapes, resume=resume), loop


def test_runs_are_deterministic_and_training_lowers_loss(tmp_path):
    a, _ = run(tmp_path / "a")
    b, _ = run(tmp_path / "b")
    assert a.arrays.keys() == b.arrays.keys()
    assert all(torch.equal(a.arrays[k], b.arrays[k]) for k in a.arrays)
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [ln["round"] for ln in lines] == [0, 1, 2, 3]
    first = sum(v["loss"] for v in lines[0]["eval"].values())
    last = sum(v["loss"] for v in lines[-1]["eval"].values())
    assert last < first


class Interrupt(Exception):
    pass


def test_resume_reaches_the_same_final_adapter_exactly(tmp_path):
    full, _ = run(tmp_path / "full", rounds=3)

    def crash_in_round_2(trainer):
        real = trainer.fit

        def fit(cid, ins):
            if ins.config["round"] == 2 and cid == 1:
                raise Interrupt()
            return real(cid, ins)
        trainer.fit = fit
        return trainer

    with pytest.raises(Interrupt):
        run(tmp_path / "part", rounds=3, trainer_wrap=crash_in_round_2)
    assert load_checkpoint(tmp_path / "part" / "checkpoints" / "round_001.safetensors")[0] == 1
    assert not (tmp_path / "part" / "checkpoints" / "round_002.safetensors").exists()
    resumed, _ = run(tmp_path / "part", rounds=3, resume=True)
    for k in full.arrays:
        assert torch.equal(resumed.arrays[k], full.arrays[k]), k
    rounds = [json.loads(x)["round"] for x in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [0, 1, 2, 3]


@pytest.mark.parametrize("corrupt,reason", [
    (lambda a: {k: v * float("nan") for k, v in a.items()}, "NaN"),
    (lambda a: {k: v for k, v in a.items() if "q_proj" not in k}, "missing keys"),
    (lambda a: {k: (v[:2] if k.endswith("lora_A.weight") else v[:, :2]) for k, v in a.items()}, "rank 2 but the instructed rank is 4"),
])
def test_bad_update_is_rejected_and_never_reaches_the_global_model(tmp_path, corrupt, reason):
    def bad_client_1(trainer):
        real = trainer.fit

        def fit(cid, ins):
            reply = real(cid, ins)
            if cid == 1:
                return Reply(corrupt(reply.arrays), reply.num_examples, reply.metrics)
            return reply
        trainer.fit = fit
        return trainer

    # reference: the same round aggregated from clients 0 and 2 only
    strategy, trainer, clients, shapes = setup()
    state0 = strategy.initialize(shapes, clients)
    ins = strategy.configure(1, state0, clients)
    expected = strategy.aggregate(1, state0, {c: trainer.fit(c, ins[c]) for c in (0, 2)})

    got, loop = run(tmp_path, rounds=1, trainer_wrap=bad_client_1)
    line = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1]
    assert list(line["rejected"]) == ["1"] and reason in line["rejected"]["1"]
    assert line["clients"]["1"]["status"] == "rejected" and line["clients"]["0"]["status"] == "accepted"
    assert any("client 1 update rejected" in m for m in loop.log)
    for k in expected.arrays:
        assert torch.equal(got.arrays[k], expected.arrays[k]), k


def test_round_without_enough_updates_keeps_the_global_state(tmp_path):
    def all_bad(trainer):
        real = trainer.fit

        def fit(cid, ins):
            r = real(cid, ins)
            return Reply({k: v * float("inf") for k, v in r.arrays.items()}, r.num_examples, r.metrics)
        trainer.fit = fit
        return trainer

    strategy, _, clients, shapes = setup()
    init = strategy.initialize(shapes, clients)
    got, _ = run(tmp_path, rounds=1, trainer_wrap=all_bad, min_clients=1)
    assert all(torch.equal(got.arrays[k], init.arrays[k]) for k in init.arrays)
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert line["aggregated"] is False and len(line["rejected"]) == 3


def test_bytes_are_counted_per_client_and_direction(tmp_path):
    _, _ = run(tmp_path, rounds=1)
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    # two adapted layers (q, v of the top layer), in = out = 64 except v (out 32): A [r,64], B [out,r]
    for cid, r in enumerate(RANKS):
        c = line["clients"][str(cid)]
        assert c["params_down"] == r * 64 + 64 * r + r * 64 + 32 * r
        assert c["params_up"] == c["params_down"]
        assert c["dtypes_up"] == ["float32"]
        arrays = {f"k{i}": torch.zeros(n) for i, n in enumerate([r * 64, 64 * r, r * 64, 32 * r])}
        assert abs(c["bytes_down"] - len(encode(arrays))) < 400  # same raw bytes, header differs by key names
        assert c["bytes_down"] >= 4 * c["params_down"]
    assert line["bytes_down"] == sum(c["bytes_down"] for c in line["clients"].values())


def test_client_sampling_is_seeded_and_respects_fraction():
    clients = [ClientInfo(i, 4, 1) for i in range(10)]
    a = sample_clients(clients, 0.3, seed=0, rnd=1)
    assert len(a) == 3 and a == sample_clients(clients, 0.3, seed=0, rnd=1)
    assert [c.cid for c in a] == sorted(c.cid for c in a)
    assert any(sample_clients(clients, 0.3, seed=0, rnd=r) != a for r in range(2, 6))
    assert sample_clients(clients, 1.0, 0, 1) == clients


def test_flora_hetlora_ffa_run_end_to_end(tmp_path):
    for name in ("flora", "hetlora", "ffa_lora", "zeropad"):
        state, loop = run(tmp_path / name, rounds=2, name=name)
        lines = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert not lines[-1]["rejected"], (name, lines[-1]["rejected"])
        assert all(torch.isfinite(v).all() for v in state.arrays.values())


def test_non_lora_parameters_in_a_payload_are_loaded_trained_and_returned():
    _, trainer, _, _ = setup("fedavg")
    model = trainer.model
    norm_key = "base_model.model.model.layers.1.input_layernorm.weight"
    before = model.get_parameter("model.layers.1.input_layernorm.weight").detach().clone()
    from nestfed.federation.messages import Instruction
    ins = Instruction({norm_key: torch.full_like(before, 2.0)}, {"rank": 0, "scaling": 1.0, "round": 1})
    reply = trainer.fit(0, ins)
    assert set(reply.arrays) == {norm_key}
    assert not torch.equal(reply.arrays[norm_key], torch.full_like(before, 2.0))  # it trained from 2.0
    assert (reply.arrays[norm_key] - 2.0).abs().max() < 0.1
    with pytest.raises(KeyError, match="names no LoRA layer or parameter"):
        trainer.fit(0, Instruction({"base_model.model.nope.weight": before}, {"rank": 0, "scaling": 1.0}))
