import pytest
import torch

from nestfed.adapters.lora import active_rank, get_adapter_state, inject_lora, lora_modules, set_adapter_state
from nestfed.backbone import load_backbone
from nestfed.config import ModelConfig
from nestfed.federation.objectives import Batch, hetlora, nested, plain, tail_norm, tail_size


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
    value = nested(model, batch, {"subranks": [2, 4]})
    got = grads(model)
    assert value == pytest.approx(sum(per_rank_loss) / 2, rel=1e-6)
    for name in got:
        torch.testing.assert_close(got[name], (per_rank_grad[0][name] + per_rank_grad[1][name]) / 2)
    # the rank-2 pass gives the tail rows no gradient; the rank-4 pass does
    a = "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert torch.count_nonzero(per_rank_grad[0][a][2:]) == 0 and torch.count_nonzero(per_rank_grad[1][a][2:]) > 0
    # one sub-rank at the full rank is plain LoRA training
    assert nested(model, batch, {"subranks": [4]}) == pytest.approx(plain(model, batch, {}), rel=1e-6)


def test_hetlora_regulariser_adds_lambda_times_tail_norm(model):
    ids = torch.randint(0, 258, (2, 12))
    batch = Batch(ids.clone(), input_ids=ids)
    assert tail_size(4, 0.25) == 1 and tail_size(16, 0.25) == 4 and tail_size(1, 0.25) == 0 and tail_size(2, 0.9) == 1
    expected = sum((0.5 * l.lora_B.weight[:, 3:] @ l.lora_A.weight[3:]).norm() for l in lora_modules(model).values())
    torch.testing.assert_close(tail_norm(model, 0.25), expected)
    plain(model, batch, {})
    g_plain = grads(model)
    hetlora(model, batch, {"hetlora_reg": 10.0, "hetlora_tail": 0.25})
    g_reg = grads(model)
    a = "model.layers.0.self_attn.q_proj.lora_A.weight"
    torch.testing.assert_close(g_reg[a][:3], g_plain[a][:3])  # the head is not regularised
    assert not torch.allclose(g_reg[a][3:], g_plain[a][3:])


def test_hetlora_client_prunes_only_when_the_tail_norm_fell():
    from nestfed.config import TrainConfig
    from nestfed.federation.client import ClientData, ClientTrainer
    from nestfed.federation.messages import Instruction

    m = load_backbone(ModelConfig(name="tiny-llama")).model
    inject_lora(m, ("q_proj",), rank=8, scaling=1.0)
    ids = torch.randint(0, 258, (4, 12))
    trainer = ClientTrainer(m, {0: ClientData(ids, ids.clone(), ids[:1], ids[:1].clone())}, TrainConfig(local_steps=1, batch_size=2))
    state = {k: torch.randn_like(v) * 0.1 for k, v in get_adapter_state(m).items()}
    base = {"rank": 8, "scaling": 1.0, "objective": "hetlora", "hetlora_reg": 0.01, "hetlora_tail": 0.25,
            "hetlora_prune_ratio": 0.5, "hetlora_pruning": True}
    kept = trainer.fit(0, Instruction(state, {**base, "hetlora_prev_tail": -1.0}))
    assert kept.metrics["pruned"] == 0 and kept.arrays["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape[0] == 8
    pruned = trainer.fit(0, Instruction(state, {**base, "hetlora_prev_tail": 1e9}))
    assert pruned.metrics["pruned"] == 4
    assert pruned.arrays["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape[0] == 4
    assert pruned.arrays["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"].shape[1] == 4
