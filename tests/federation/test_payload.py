import pytest
import torch

from nestfed.errors import UpdateRejected
from nestfed.federation.messages import Instruction, Reply
from nestfed.federation.payload import decode, encode, payload_stats, validate_reply

A, B = "base_model.model.m.lora_A.weight", "base_model.model.m.lora_B.weight"


def instruction(may_shrink=False):
    return Instruction({}, {"rank": 4}, {A: (4, 6), B: (5, 4)}, may_shrink)


def good():
    return {A: torch.ones(4, 6), B: torch.ones(5, 4)}


def test_encode_roundtrip_and_byte_count():
    arrays = {A: torch.arange(24.0).reshape(4, 6), B: torch.zeros(5, 4, dtype=torch.float16)}
    back = decode(encode(arrays))
    assert torch.equal(back[A], arrays[A]) and back[B].dtype == torch.float16
    stats = payload_stats(arrays)
    assert stats["params"] == 44 and stats["dtypes"] == ["float16", "float32"]
    # raw tensor bytes (24*4 + 20*2) plus the safetensors header (8-byte length + JSON)
    assert 136 < stats["bytes"] < 136 + 400


@pytest.mark.parametrize(
    "mutate,reason",
    [
        (lambda a: a.__setitem__(A, torch.full((4, 6), float("nan"))), "NaN or Inf"),
        (lambda a: a.__setitem__(B, torch.full((5, 4), float("inf"))), "NaN or Inf"),
        (lambda a: a.pop(B), "missing keys"),
        (lambda a: a.__setitem__("base_model.model.x.lora_A.weight", torch.ones(1)), "unexpected keys"),
        (lambda a: a.__setitem__(A, torch.ones(4, 7)), "shape"),
        (
            lambda a: (a.__setitem__(A, torch.ones(8, 6)), a.__setitem__(B, torch.ones(5, 8))),
            "rank 8 but the instructed rank is 4",
        ),
        (lambda a: (a.__setitem__(A, torch.ones(2, 6)), a.__setitem__(B, torch.ones(5, 2))), "instructed rank is 4"),
    ],
)
def test_bad_updates_are_rejected_with_reason(mutate, reason):
    arrays = good()
    mutate(arrays)
    with pytest.raises(UpdateRejected, match=reason):
        validate_reply(instruction(), Reply(arrays, 10))


def test_rank_may_shrink_only_when_allowed_and_consistently():
    shrunk = {A: torch.ones(2, 6), B: torch.ones(5, 2)}
    validate_reply(instruction(may_shrink=True), Reply(shrunk, 3))
    with pytest.raises(UpdateRejected, match="disagree"):
        validate_reply(instruction(may_shrink=True), Reply({A: torch.ones(2, 6), B: torch.ones(5, 3)}, 3))
    with pytest.raises(UpdateRejected, match="num_examples"):
        validate_reply(instruction(), Reply(good(), 0))


def test_the_counted_bytes_are_the_serialised_bytes_whatever_the_values_and_order():
    import random

    from nestfed.federation.payload import encode, payload_stats

    rng = random.Random(0)
    for trial in range(20):
        keys = [f"base_model.model.l{i}.lora_{'AB'[i % 2]}.weight" for i in range(rng.randint(1, 6))]
        rng.shuffle(keys)
        arrays = {
            k: torch.randn(rng.randint(1, 40), rng.randint(1, 9), dtype=rng.choice([torch.float32, torch.float64]))
            for k in keys
        }
        if trial % 3 == 0:  # a view (a rank prefix), serialised contiguous
            k = keys[0]
            arrays[k] = arrays[k][:, : max(1, arrays[k].shape[1] // 2)]
        assert payload_stats(arrays)["bytes"] == len(encode(arrays))


@pytest.mark.parametrize("flat_numel", [1 << 20, 0])  # one pass over the concatenation / one array at a time
def test_non_finite_and_norm_agree_between_the_flat_and_per_array_paths(monkeypatch, flat_numel):
    import math

    from nestfed.federation import payload, update

    monkeypatch.setattr(payload, "FLAT_NUMEL", flat_numel)
    monkeypatch.setattr(update, "FLAT_NUMEL", flat_numel)
    sent = {A: torch.zeros(4, 6), B: torch.ones(5, 4)}
    reply = {A: torch.full((4, 6), 2.0), B: torch.full((5, 4), 3.0), "idx": torch.tensor([1, 2])}
    assert update.update_norm(sent, reply) == math.sqrt(24 * 4 + 20 * 4)  # idx is no update: not counted
    assert payload.non_finite_keys(reply) == []
    reply[B] = reply[B].clone()
    reply[B][4, 3] = float("-inf")
    assert payload.non_finite_keys(reply) == [B]
    assert payload.non_finite_keys({}) == []
