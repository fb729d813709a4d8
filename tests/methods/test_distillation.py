"""FedMKT's logit knowledge: top-k, per-block CE, DualMinCE selection, the mutual objective."""

import math

import pytest
import torch

from nestfed.federation.training import block_batches
from nestfed.methods.fedmkt.distillation import (
    CE,
    INDICES,
    VALUES,
    dense_target,
    knowledge,
    merge_knowledge,
    mutual_loss,
    select_min_ce,
)
from nestfed.nn.frozen_prefix import causal_lm_loss


def test_knowledge_keeps_topk_log_probs_and_per_block_ce():
    logits = torch.log(torch.tensor([[[0.1, 0.6, 0.3], [0.7, 0.2, 0.1]]]))  # [1, 2, 3]
    labels = torch.tensor([[0, 2]])  # position 0 predicts token 2: CE = -log 0.3
    k = knowledge(logits, labels, 2)
    assert k[VALUES].dtype == torch.float16 and k[INDICES].dtype == torch.int32 and k[CE].shape == (1,)
    assert k[INDICES].tolist() == [[[1, 2], [0, 1]]]
    assert torch.allclose(k[VALUES].float(), torch.log(torch.tensor([[[0.6, 0.3], [0.7, 0.2]]])), atol=1e-3)
    assert float(k[CE][0]) == pytest.approx(-math.log(0.3), rel=1e-5)
    with pytest.raises(ValueError, match="topk"):
        knowledge(logits, labels, 4)


def test_min_ce_selection_per_block_hand_computed():
    def cand(v, ce):
        return {
            VALUES: torch.full((3, 2, 1), float(v)),
            INDICES: torch.full((3, 2, 1), v, dtype=torch.int32),
            CE: torch.tensor(ce),
        }

    own, a, b = cand(0, [1.0, 5.0, 2.0]), cand(1, [2.0, 4.0, 2.0]), cand(2, [3.0, 3.0, 0.5])
    sel, choice = select_min_ce([own, a, b])
    assert choice.tolist() == [0, 2, 2]
    assert sel[INDICES][:, 0, 0].tolist() == [0, 2, 2] and sel[CE].tolist() == [1.0, 3.0, 0.5]
    _, tie = select_min_ce([own, cand(1, [1.0, 5.0, 2.0])])
    assert tie.tolist() == [0, 0, 0]  # ties keep the learner's own knowledge


def test_dense_target_renormalises_the_kept_tokens():
    values = torch.log(torch.tensor([[[0.3, 0.1]]]))
    p = dense_target(values, torch.tensor([[[2, 0]]]), 4)
    assert torch.allclose(p, torch.tensor([[[0.25, 0.0, 0.75, 0.0]]]))


def test_mutual_loss_mixes_lm_and_soft_ce():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    target = knowledge(logits, labels, 7)  # the learner's own full distribution
    lm = float(causal_lm_loss(logits, labels))
    assert float(mutual_loss(logits, labels, target, 1.0)) == pytest.approx(lm, rel=1e-5)
    logq = torch.log_softmax(logits, -1)
    entropy = float(-(logq.exp() * logq).sum(-1).mean())
    assert float(mutual_loss(logits, labels, target, 0.0)) == pytest.approx(entropy, rel=1e-2)  # fp16 values
    with pytest.raises(ValueError, match="lm_weight"):
        mutual_loss(logits, labels, target, 1.2)


def test_merge_and_batches():
    parts = [
        {VALUES: torch.zeros(2, 1, 1), INDICES: torch.zeros(2, 1, 1, dtype=torch.int32), CE: torch.zeros(2)},
        {VALUES: torch.ones(1, 1, 1), INDICES: torch.ones(1, 1, 1, dtype=torch.int32), CE: torch.ones(1)},
    ]
    assert merge_knowledge(parts)[CE].tolist() == [0.0, 0.0, 1.0]
    batches = [b.tolist() for b in block_batches(5, 5, 2, seed=0)]
    assert all(len(b) == 2 for b in batches)
    assert sorted(batches[0] + batches[1] + [batches[2][0]]) == [0, 1, 2, 3, 4]  # one epoch covers every block
