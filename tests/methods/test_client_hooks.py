"""The methods' client hooks against hand-derived values: PreLort's nested objective, HetLoRA's
regulariser and pruning, FLoRA's fresh LoRA per round, FFA-LoRA's frozen A."""

import pytest
import torch

from nestfed.config import ModelConfig, TrainConfig
from nestfed.data.clients import ClientData
from nestfed.federation.client import ClientTrainer
from nestfed.federation.hooks import ClientHooks, FitContext
from nestfed.federation.messages import Instruction
from nestfed.federation.training import Batch
from nestfed.methods.ffa_lora.strategy import FFALoRAHooks
from nestfed.methods.flora.strategy import FLoRAHooks
from nestfed.methods.hetlora import HetLoRAOptions
from nestfed.methods.hetlora.strategy import HetLoRAHooks, tail_norm, tail_size
from nestfed.methods.prelort.strategy import nested_loss
from nestfed.nn.backbone import load_backbone
from nestfed.nn.lora import active_rank, get_adapter_state, inject_lora, lora_modules, set_adapter_state

A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture
def model():
    m = load_backbone(ModelConfig(name="tiny-llama")).model
    inject_lora(m, ("q_proj", "v_proj"), rank=4, scaling=0.5)
    set_adapter_state(m, {k: torch.randn_like(v) * 0.1 for k, v in get_adapter_state(m).items()})
    for layer in lora_modules(m).values():
        layer.lora_A.weight.requires_grad_(True)
        layer.lora_B.weight.requires_grad_(True)
    return m


def grads(m):
    out = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    return out


def ctx_for(model, config=None):
    ids = torch.randint(0, 258, (2, 12))
    return FitContext(0, dict(config or {}), {}, model, ClientData(ids, ids.clone(), ids, ids.clone()), TrainConfig())


@pytest.mark.slow
def test_nested_objective_is_the_mean_of_the_subrank_losses_and_gradients(model):
    ids = torch.randint(0, 258, (2, 12))
    batch = Batch(ids.clone(), input_ids=ids)
    per_rank_loss, per_rank_grad = [], []
    for r in (2, 4):
        with active_rank(model, r):
            loss = batch.loss(model)
            loss.backward()
        per_rank_loss.append(loss.item())
        per_rank_grad.append(grads(model))
    value = nested_loss(model, batch, [2, 4])
    got = grads(model)
    assert value == pytest.approx(sum(per_rank_loss) / 2, rel=1e-6)
    for name in got:
        torch.testing.assert_close(got[name], (per_rank_grad[0][name] + per_rank_grad[1][name]) / 2)
    # the rank-2 pass gives the tail rows no gradient; the rank-4 pass does
    a = "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert torch.count_nonzero(per_rank_grad[0][a][2:]) == 0 and torch.count_nonzero(per_rank_grad[1][a][2:]) > 0
    # one sub-rank at the full rank is plain LoRA training (the default hooks' loss)
    plain = ClientHooks().step_loss(ctx_for(model), batch)
    assert nested_loss(model, batch, [4]) == pytest.approx(plain, rel=1e-6)


def test_hetlora_regulariser_adds_lambda_times_tail_norm(model):
    ids = torch.randint(0, 258, (2, 12))
    batch = Batch(ids.clone(), input_ids=ids)
    assert tail_size(4, 0.25) == 1 and tail_size(16, 0.25) == 4 and tail_size(1, 0.25) == 0 and tail_size(2, 0.9) == 1
    expected = sum((0.5 * m.lora_B.weight[:, 3:] @ m.lora_A.weight[3:]).norm() for m in lora_modules(model).values())
    torch.testing.assert_close(tail_norm(model, 0.25), expected)
    ClientHooks().step_loss(ctx_for(model), batch)
    g_plain = grads(model)
    HetLoRAHooks(HetLoRAOptions(reg=10.0, tail=0.25)).step_loss(ctx_for(model), batch)
    g_reg = grads(model)
    a = "model.layers.0.self_attn.q_proj.lora_A.weight"
    torch.testing.assert_close(g_reg[a][:3], g_plain[a][:3])  # the head is not regularised
    # the tail's extra gradient is lambda * d||s B_t A_t|| / dA_t, computed here by autograd alone
    reg = 10.0 * tail_norm(model, 0.25)
    reg.backward()
    g_term = grads(model)
    torch.testing.assert_close(g_reg[a][3:], g_plain[a][3:] + g_term[a][3:], rtol=1e-5, atol=1e-7)


def test_hetlora_client_prunes_only_when_the_tail_norm_fell():
    m = load_backbone(ModelConfig(name="tiny-llama")).model
    inject_lora(m, ("q_proj",), rank=8, scaling=1.0)
    ids = torch.randint(0, 258, (4, 12))
    hooks = HetLoRAHooks(HetLoRAOptions(reg=0.01, tail=0.25, prune_ratio=0.5))
    trainer = ClientTrainer(
        m, {0: ClientData(ids, ids.clone(), ids[:1], ids[:1].clone())}, TrainConfig(local_steps=1, batch_size=2), hooks
    )
    state = {k: torch.randn_like(v) * 0.1 for k, v in get_adapter_state(m).items()}
    base = {"rank": 8, "scaling": 1.0}
    kept = trainer.fit(0, Instruction(state, {**base, "hetlora_prev_tail": -1.0}))
    assert kept.metrics["pruned"] == 0 and kept.arrays[A0].shape[0] == 8
    pruned = trainer.fit(0, Instruction(state, {**base, "hetlora_prev_tail": 1e9}))
    assert pruned.metrics["pruned"] == 4 and pruned.arrays[A0].shape[0] == 4
    assert pruned.arrays["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"].shape[1] == 4
    off = ClientTrainer(m, trainer.data, trainer.train, HetLoRAHooks(HetLoRAOptions(pruning=False)))
    assert off.fit(0, Instruction(state, {**base, "hetlora_prev_tail": 1e9})).metrics["pruned"] == 0


def test_flora_starts_every_client_and_round_from_its_own_fresh_lora(model):
    hooks = FLoRAHooks(init_seed=3)
    draws = {}
    for rnd, cid in ((1, 0), (1, 1), (2, 0)):
        ctx = ctx_for(model, {"rank": 2, "round": rnd})
        ctx.cid = cid
        draws[(rnd, cid)] = hooks.arrays_to_load(ctx, {})[A0]
    assert draws[(1, 0)].shape == (2, 64)
    assert not torch.equal(draws[(1, 0)], draws[(1, 1)]) and not torch.equal(draws[(1, 0)], draws[(2, 0)])
    again = ctx_for(model, {"rank": 2, "round": 1})
    assert torch.equal(hooks.arrays_to_load(again, {})[A0], draws[(1, 0)])  # the seed rule: reproducible
    b0 = A0.replace("lora_A", "lora_B")
    assert torch.count_nonzero(hooks.arrays_to_load(again, {})[b0]) == 0  # B = 0: the fresh LoRA adds nothing


def test_ffa_lora_trains_and_returns_b_only():
    m = load_backbone(ModelConfig(name="tiny-llama")).model
    inject_lora(m, ("q_proj",), rank=2, scaling=1.0)
    ids = torch.randint(0, 258, (4, 12))
    trainer = ClientTrainer(
        m,
        {0: ClientData(ids, ids.clone(), ids[:1], ids[:1].clone())},
        TrainConfig(local_steps=2, batch_size=2, lr=1e-2),
        FFALoRAHooks(),
    )
    state = {k: torch.randn_like(v) * 0.1 for k, v in get_adapter_state(m).items()}
    reply = trainer.fit(0, Instruction(state, {"rank": 2, "scaling": 1.0, "round": 1}))
    assert all(k.endswith("lora_B.weight") for k in reply.arrays) and len(reply.arrays) == 2
    assert all(
        torch.equal(lora_modules(m)[n].lora_A.weight, state[f"base_model.model.{n}.lora_A.weight"])
        for n in lora_modules(m)
    )
