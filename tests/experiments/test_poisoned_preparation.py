"""Data poisoning happens where a client's data is prepared (embedded runs and Flower nodes
alike): the attacker's training text changes, nobody else's, and no test split."""

from pathlib import Path

import pytest
import torch

from nestfed import methods
from nestfed.experiments.prepare import prepare

TINY = Path(__file__).parents[2] / "configs" / "tiny.toml"


@pytest.mark.slow
def test_only_the_attackers_training_text_is_poisoned():
    clean = prepare(methods.load_config(TINY))
    poisoned = prepare(methods.load_config(TINY, ["attack.kind=shuffle", "attack.clients=[1]"]))
    for cid, d in clean.data.items():
        p = poisoned.data[cid]
        assert torch.equal(p.test_ids, d.test_ids)
        if cid != 1:
            assert torch.equal(p.train_ids, d.train_ids)
    d, p = clean.data[1], poisoned.data[1]
    assert not torch.equal(p.train_ids, d.train_ids)
    assert all(sorted(p.train_ids[i].tolist()) == sorted(d.train_ids[i].tolist()) for i in range(len(d.train_ids)))
    # the cached frozen prefix is computed from the poisoned text
    if d.train_hidden is not None:
        assert not torch.equal(p.train_hidden, d.train_hidden)
