"""A client's held-out metrics over row groups: token-weighted loss, row-weighted accuracy, and the
same numbers a separate evaluation of each group gives."""

import math

import pytest
import torch

from nestfed.config import TrainConfig
from nestfed.data.clients import ClientData
from nestfed.evaluation.client import evaluate_client, pool_groups
from nestfed.evaluation.lm import evaluate_lm


def test_pooling_weights_loss_and_accuracy_by_labelled_tokens():
    """Each labelled token is one answer (one per row for multiple choice, so row-weighted there;
    one per query for multi-query recall)."""
    got = pool_groups(
        [
            ("a", {"loss": 1.0, "tokens": 30.0, "accuracy": 0.5}),
            ("b", {"loss": 2.0, "tokens": 10.0, "accuracy": 1.0}),
        ],
        per_group=True,
    )
    assert got["loss"] == pytest.approx((1.0 * 30 + 2.0 * 10) / 40) and got["tokens"] == 40.0
    assert got["accuracy"] == pytest.approx((0.5 * 30 + 1.0 * 10) / 40)
    assert got["ppl"] == pytest.approx(math.exp(1.25))
    assert got["loss@a"] == 1.0 and got["accuracy@b"] == 1.0
    plain = pool_groups([("all", {"loss": 3.0, "tokens": 5.0})], per_group=False)
    assert set(plain) == {"loss", "ppl", "tokens"}


def test_grouped_evaluation_equals_each_group_alone(tiny_llama, one_thread):
    model = tiny_llama.model
    ids = torch.randint(0, 200, (6, 10), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[3:, 6:] = -100  # the second group's rows end early: it is cut to its last labelled token
    groups = {"short": torch.tensor([3, 4, 5]), "long": torch.tensor([0, 1, 2])}
    d = ClientData(ids[:1], labels[:1], ids, labels, test_groups=groups)
    got = evaluate_client(model, d, TrainConfig(eval_batch_size=2))
    for name, idx in groups.items():
        alone = evaluate_lm(model, labels[idx], ids[idx], batch_size=2)
        assert got[f"loss@{name}"] == pytest.approx(alone["loss"], rel=1e-5)
    whole = evaluate_lm(model, labels, ids, batch_size=6)
    assert got["loss"] == pytest.approx(whole["loss"], rel=1e-5) and got["tokens"] == whole["tokens"]


@torch.no_grad()
def test_accuracy_counts_every_labelled_token(tiny_llama, one_thread):
    """A row with several labelled tokens (multi-query recall) scores each against the argmax over
    the candidates at its position; rows with one label (multiple choice) are the special case."""
    model = tiny_llama.model
    ids = torch.randint(0, 200, (3, 12), generator=torch.Generator().manual_seed(2))
    candidates = list(range(40, 60))
    logits = model(ids).logits
    labels = torch.full_like(ids, -100)
    right = [(0, 5), (1, 11), (2, 4)]  # labelled with the candidate the model ranks first: right
    wrong = [(0, 9), (2, 3), (2, 7)]  # labelled with the one it ranks last: wrong
    for r, t in right + wrong:
        order = logits[r, t - 1, candidates].argsort(descending=True)
        labels[r, t] = candidates[int(order[0 if (r, t) in right else -1])]
    got = evaluate_lm(model, labels, ids, batch_size=2, letter_ids=candidates)
    assert got["tokens"] == 6.0 and got["accuracy"] == pytest.approx(3 / 6)
    one = labels.clone()
    one[0, 9] = one[2, 3] = one[2, 7] = one[2, 4] = -100  # one label per row: the row-wise accuracy
    assert evaluate_lm(model, one, ids, batch_size=2, letter_ids=candidates)["accuracy"] == 1.0
