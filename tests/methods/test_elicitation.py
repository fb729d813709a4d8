"""Weak-to-strong elicitation: the confidence loss by hand, gradients, and the trainer on a tiny model."""

import math

import pytest
import torch

from nestfed.methods.fedslm.elicitation import confidence_loss, elicit
from nestfed.nn.frozen_prefix import CachedText, lm_logits
from nestfed.nn.lora import get_adapter_state, inject_lora, lora_modules, set_adapter_state
from nestfed.nn.svd import compute_bases, derive_compressed

Q = torch.log(torch.tensor([[[0.25, 0.5, 0.25]]]))  # student: q = (1/4, 1/2, 1/4)
P = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))  # weak: p = (1/2, 1/4, 1/4)
CE_PQ = -(0.5 * math.log(0.25) + 0.25 * math.log(0.5) + 0.25 * math.log(0.25))  # 1.21301
HARD = math.log(2.0)  # -log q(argmax q) = -log 1/2


@pytest.mark.parametrize(
    "alpha, expect", [(0.0, CE_PQ), (1.0, HARD), (0.5, 0.5 * CE_PQ + 0.5 * HARD), (0.25, 0.75 * CE_PQ + 0.25 * HARD)]
)
def test_confidence_loss_hand_computed(alpha, expect):
    assert float(confidence_loss(Q, P, alpha)) == pytest.approx(expect, rel=1e-6)


def test_loss_is_a_mean_over_scored_positions_only():
    s = torch.cat([Q, torch.zeros(1, 1, 3)], dim=1)  # a second position with uniform logits
    w = torch.cat([P, torch.zeros(1, 1, 3)], dim=1)
    mask = torch.tensor([[True, False]])
    assert float(confidence_loss(s, w, 0.0, mask)) == pytest.approx(CE_PQ, rel=1e-6)
    both = (CE_PQ + math.log(3.0)) / 2  # uniform student vs uniform weak: log 3
    assert float(confidence_loss(s, w, 0.0)) == pytest.approx(both, rel=1e-6)


def test_gradients_flow_into_the_student_only_and_the_hard_target_is_stopped():
    s = Q.clone().requires_grad_(True)
    w = P.clone().requires_grad_(True)
    confidence_loss(s, w, 1.0).backward()
    assert w.grad is None or torch.count_nonzero(w.grad) == 0
    # d/ds of -log softmax(s)[1] = softmax(s) - onehot(1): the argmax is treated as a constant label
    assert torch.allclose(s.grad, torch.tensor([[[0.25, -0.5, 0.25]]]), atol=1e-6)


def test_bad_alpha_and_shapes_are_refused():
    with pytest.raises(ValueError, match="alpha must be in"):
        confidence_loss(Q, P, 1.5)
    with pytest.raises(ValueError, match="differ in shape"):
        confidence_loss(Q, P[:, :, :2], 0.5)


def _setup(tiny_llama):
    model = tiny_llama.model
    bases = compute_bases(model, [0.3])
    weak = derive_compressed(model, bases, 0.3)
    g = torch.Generator().manual_seed(5)  # a weak supervisor with peaked predictions, far from the student's
    weak.lm_head = torch.nn.Linear(64, model.config.vocab_size, bias=False)
    with torch.no_grad():
        weak.lm_head.weight.copy_(torch.randn(model.config.vocab_size, 64, generator=g))
    inject_lora(model, ("q_proj", "v_proj", "o_proj"), rank=4, scaling=2.0)
    state = get_adapter_state(model)
    set_adapter_state(model, {k: torch.randn_like(v) * 0.1 if "lora_A" in k else v for k, v in state.items()})
    params = [p for m in lora_modules(model).values() for p in (m.lora_A.weight, m.lora_B.weight)]
    ids = torch.randint(0, model.config.vocab_size, (6, 16), generator=torch.Generator().manual_seed(3))
    return model, weak, params, CachedText(ids)


@pytest.mark.slow
def test_pure_imitation_moves_the_student_towards_the_weak_model(tiny_llama):
    model, weak, params, text = _setup(tiny_llama)
    idx = torch.arange(6)
    with torch.no_grad():
        before = float(confidence_loss(text.logits(model, idx), text.logits(weak, idx), 0.0))
    info = elicit(model, params, weak, text, text, alpha=0.0, steps=8, batch_size=3, lr=1e-2)
    with torch.no_grad():
        after = float(confidence_loss(text.logits(model, idx), text.logits(weak, idx), 0.0))
    assert after < before - 0.05
    assert info["steps"] == 8 and not any(p.requires_grad for p in params)


@pytest.mark.slow
def test_self_anchoring_sharpens_the_students_own_predictions(tiny_llama):
    model, weak, params, text = _setup(tiny_llama)
    idx = torch.arange(6)

    def entropy():
        with torch.no_grad():
            logp = torch.log_softmax(lm_logits(model, text.input_ids[idx]), -1)
        return float(-(logp.exp() * logp).sum(-1).mean())

    h0 = entropy()
    elicit(model, params, weak, text, text, alpha=1.0, steps=8, batch_size=3, lr=1e-2)
    assert entropy() < h0 - 1e-3
