"""Attacks on the real client path: the client trainer itself produces the byzantine update
(issue 11, part 3); data poisoning changes the text a client trains on."""

import pytest
import torch
from tiny_federation import tiny_config, tiny_prepared

from nestfed import methods
from nestfed.data.poisoning import poison_tokens
from nestfed.federation.update import update_norm


def fit(*overrides, cid=1):
    """Client ``cid``'s round-1 reply and what it was sent, under PreLort on the tiny federation."""
    cfg = tiny_config(*overrides)
    mr = methods.get("prelort").build(tiny_prepared(cfg), cfg)
    state = mr.strategy.initialize(mr.shapes, mr.clients)
    ins = mr.strategy.configure(1, state, mr.clients)[cid]
    return mr.trainer.fit(cid, ins), ins.arrays


@pytest.fixture(scope="module")
def honest():
    return fit()


def test_sign_flip_and_scale_act_on_the_trained_update(honest):
    reply, sent = honest
    flipped, _ = fit("attack.kind=sign_flip", "attack.clients=[1]")
    scaled, _ = fit("attack.kind=scale", "attack.clients=[1]", "attack.scale=100")
    for k, v in reply.arrays.items():
        torch.testing.assert_close(flipped.arrays[k], 2 * sent[k] - v)
        torch.testing.assert_close(scaled.arrays[k], sent[k] + 100 * (v - sent[k]), rtol=1e-5, atol=1e-6)
    assert update_norm(sent, scaled.arrays) == pytest.approx(100 * update_norm(sent, reply.arrays), rel=1e-4)


def test_an_attack_touches_only_the_named_clients(honest):
    reply, _ = honest
    other, _ = fit("attack.kind=sign_flip", "attack.clients=[0]")
    assert all(torch.equal(other.arrays[k], v) for k, v in reply.arrays.items())


def test_free_rider_returns_what_it_received_without_training():
    reply, sent = fit("attack.kind=free_rider", "attack.clients=[1]")
    assert all(torch.equal(reply.arrays[k], sent[k]) for k in reply.arrays)
    assert reply.metrics["train_tokens"] == 0


def test_noise_replaces_the_update_by_gaussian_noise():
    reply, sent = fit("attack.kind=noise", "attack.clients=[1]", "attack.noise_std=0.5")
    d = torch.cat([(reply.arrays[k] - sent[k]).flatten() for k in reply.arrays])
    assert d.std().item() == pytest.approx(0.5, rel=0.1) and abs(d.mean().item()) < 0.05


def test_poisoned_text_keeps_unlabelled_positions():
    g = torch.Generator().manual_seed(0)
    ids = torch.arange(24).reshape(2, 12)
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt
    shuffled, sl = poison_tokens(ids, labels, "shuffle", 50, g)
    assert torch.equal(shuffled[:, :4], ids[:, :4]) and not torch.equal(shuffled, ids)
    assert all(sorted(shuffled[i, 4:].tolist()) == ids[i, 4:].tolist() for i in range(2))
    assert torch.equal(sl[:, 4:], shuffled[:, 4:]) and (sl[:, :4] == -100).all()
    rand, rl = poison_tokens(ids, labels, "random_text", 50, g)
    assert torch.equal(rand[:, :4], ids[:, :4]) and rand.max() < 50 and torch.equal(rl[:, 4:], rand[:, 4:])
    with pytest.raises(ValueError, match="does not poison data"):
        poison_tokens(ids, labels, "scale", 50, g)


def test_the_fault_kinds_by_hand():
    from nestfed.config import AttackConfig
    from nestfed.federation.attacks import attacked_reply

    sent = {"m.lora_A.weight": torch.zeros(2, 3), "idx": torch.tensor([1, 2])}
    reply = {"m.lora_A.weight": torch.ones(2, 3), "idx": torch.tensor([1, 2])}
    g = torch.Generator().manual_seed(0)
    const = attacked_reply("constant", sent, reply, AttackConfig("constant", (0,), value=1e9), g)
    assert torch.equal(const["m.lora_A.weight"], torch.full((2, 3), 1e9)) and torch.equal(const["idx"], reply["idx"])
    assert torch.isnan(attacked_reply("nans", sent, reply, AttackConfig("nans", (0,)), g)["m.lora_A.weight"]).all()
    f64 = attacked_reply("float64", sent, reply, AttackConfig("float64", (0,)), g)
    assert f64["m.lora_A.weight"].dtype == torch.float64 and f64["idx"].dtype == torch.int64
