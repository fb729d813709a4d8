"""A client's held-out metrics over row groups: token-weighted loss, row-weighted accuracy, and the
same numbers a separate evaluation of each group gives."""

import math

import pytest
import torch

from nestfed.config import TrainConfig
from nestfed.data.clients import ClientData
from nestfed.evaluation.client import evaluate_client, pool_groups
from nestfed.evaluation.lm import evaluate_lm


def test_pooling_is_token_weighted_for_loss_and_row_weighted_for_accuracy():
    got = pool_groups(
        [
            ("a", {"loss": 1.0, "tokens": 30.0, "accuracy": 0.5}, 4),
            ("b", {"loss": 2.0, "tokens": 10.0, "accuracy": 1.0}, 12),
        ],
        per_group=True,
    )
    assert got["loss"] == pytest.approx((1.0 * 30 + 2.0 * 10) / 40) and got["tokens"] == 40.0
    assert got["accuracy"] == pytest.approx((0.5 * 4 + 1.0 * 12) / 16)
    assert got["ppl"] == pytest.approx(math.exp(1.25))
    assert got["loss@a"] == 1.0 and got["accuracy@b"] == 1.0
    plain = pool_groups([("all", {"loss": 3.0, "tokens": 5.0}, 2)], per_group=False)
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
