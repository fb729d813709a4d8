"""Secure aggregation's arithmetic (nestfed.federation.secure_sum): decoding the sums gives each
method's own aggregate, by hand and on heterogeneous ranks; the client's self-validation; the
quantisation bound; which strategies may aggregate securely."""

import math

import pytest
import torch
from secagg_quantisation import quantised_sum

from nestfed.federation.messages import ClientInfo, GlobalState, Reply
from nestfed.federation.secure_sum import (
    encode,
    layout,
    padded_mean,
    plain_sum,
    segment_mean,
    sum_error,
)
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.fedavg.strategy import FedAvg
from nestfed.methods.prelort.strategy import PreLort
from nestfed.methods.zeropad.strategy import ZeroPad

A, B = "m.lora_A.weight", "m.lora_B.weight"


def test_decoding_by_hand():
    # one lora_A matrix, r_max = 3, in = 1: G = [[1], [2], [3]]
    g = torch.tensor([[1.0], [2.0], [3.0]])
    # client 0: rank 1, n = 2, update [[0.5]]; client 1: rank 2, n = 1, update [[1.0], [-3.0]]
    sent = {0: {A: g[:1].clone()}, 1: {A: g[:2].clone()}}
    replies = {0: {A: g[:1] + torch.tensor([[0.5]])}, 1: {A: g[:2] + torch.tensor([[1.0], [-3.0]])}}
    lay = layout([{A: (1, 1)}, {A: (2, 1)}])
    assert lay == {A: (2, 1)}
    s = plain_sum(sent, replies, {0: 2, 1: 1}, lay)
    assert s.clients == [0, 1]
    # S = 2 * [0.5, 0] + 1 * [1, -3] = [2, -3]; C = [2 + 1, 1] = [3, 1]
    assert torch.allclose(s.sums[A], torch.tensor([[2.0], [-3.0]], dtype=torch.float64))
    assert torch.allclose(s.counts, torch.tensor([3.0, 1.0], dtype=torch.float64))
    # segment mean: row 0: 1 + 2/3; row 1: 2 - 3/1 = -1; row 2 held by nobody: unchanged 3
    assert torch.allclose(segment_mean(g, s.sums[A], s.counts, 0), torch.tensor([[1 + 2 / 3], [-1.0], [3.0]]))
    # padded parameter mean over N = 3: row 0: (2 * 1.5 + 1 * 2) / 3; row 1: (0 + 1 * -1) / 3; row 2: 0
    assert torch.allclose(padded_mean(g, s.sums[A], s.counts, 0), torch.tensor([[5 / 3], [-1 / 3], [0.0]]))


def _round(strategy, ranks, n, seed=0, drop=()):
    """A random global state, the strategy's instructions and random replies (sent + noise)."""
    gen = torch.Generator().manual_seed(seed)
    r_max = strategy.s.r_max
    arrays = {}
    for m, (out, inp) in {"q": (5, 6), "v": (7, 3)}.items():
        arrays[f"{m}.lora_A.weight"] = torch.randn(r_max, inp, generator=gen)
        arrays[f"{m}.lora_B.weight"] = torch.randn(out, r_max, generator=gen)
    clients = [ClientInfo(c, r, n[c]) for c, r in enumerate(ranks)]
    state = GlobalState(arrays, {"ranks": {str(c.cid): c.rank for c in clients}})
    ins = strategy.configure(1, state, clients)
    replies = {
        c: Reply({k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in ins[c].arrays.items()}, n[c])
        for c in ins
        if c not in drop
    }
    lay = layout(ins[c].expect for c in replies)
    secure = plain_sum({c: ins[c].arrays for c in replies}, {c: r.arrays for c, r in replies.items()}, n, lay)
    return state, replies, secure


@pytest.mark.parametrize("cls", [PreLort, ZeroPad])
@pytest.mark.parametrize(
    "ranks,drop", [([2, 4, 4], ()), ([2, 4, 4, 8], ()), ([2, 4, 4, 8], (3,)), ([8, 2, 4, 2], (0,))]
)
def test_secure_aggregate_equals_the_methods_own_aggregate(cls, ranks, drop):
    strategy = cls(LoraSettings(r_max=8, lora_alpha=16.0))
    n = {c: k for c, k in enumerate([3, 5, 7, 2][: len(ranks)])}
    state, replies, secure = _round(strategy, ranks, n, drop=drop)
    plain = strategy.aggregate(1, state, replies)
    sec = strategy.aggregate_secure(1, state, secure)
    assert sorted(sec.arrays) == sorted(plain.arrays)
    for k in plain.arrays:
        assert sec.arrays[k].dtype == plain.arrays[k].dtype
        assert torch.allclose(sec.arrays[k], plain.arrays[k], atol=1e-6, rtol=0), (
            k,
            (sec.arrays[k] - plain.arrays[k]).abs().max(),
        )
    assert sec.meta == plain.meta


def test_fedavg_secure_aggregate_at_one_rank():
    strategy = FedAvg(LoraSettings(r_max=4, lora_alpha=16.0))
    state, replies, secure = _round(strategy, [4, 4, 4], {0: 1, 1: 9, 2: 4})
    plain, sec = strategy.aggregate(1, state, replies), strategy.aggregate_secure(1, state, secure)
    assert all(torch.allclose(sec.arrays[k], plain.arrays[k], atol=1e-6, rtol=0) for k in plain.arrays)


def test_the_quantised_sum_stays_within_the_stated_bound():
    """Flower's SecAgg+ quantisation (clip c, Q levels, stochastic rounding) simulated on the encoded
    vectors: the decoded segment means stay within eps (1 + |m|) / (C - eps)."""
    strategy = PreLort(LoraSettings(r_max=8, lora_alpha=16.0))
    n = {0: 3, 1: 5, 2: 7, 3: 2}
    state, replies, exact = _round(strategy, [2, 4, 4, 8], n)
    ins = strategy.configure(1, state, [ClientInfo(c, r, n[c]) for c, r in enumerate([2, 4, 4, 8])])
    lay = layout(ins[c].expect for c in ins)
    clip, q = 1.0, 2**16  # coarse on purpose, so the error is visible
    secure = quantised_sum(ins, replies, n, lay, clip, q)
    k = len(replies)
    eps = sum_error(k, clip, q, max(n.values()))
    assert (secure.counts - exact.counts).abs().max() <= eps
    for key in exact.sums:
        assert (secure.sums[key] - exact.sums[key]).abs().max() <= eps
    plain = strategy.aggregate(1, state, replies)
    sec = strategy.aggregate_secure(1, state, secure)
    for key, s in exact.sums.items():
        d = 0 if key.endswith("lora_A.weight") else 1
        c = exact.counts.clone()
        m = (s / c.reshape([-1, 1] if d == 0 else [1, -1])).abs().max()
        bound = eps * (1 + float(m)) / (float(c.min()) - eps) + 1e-6  # + float32 rounding
        err = float((sec.arrays[key] - plain.arrays[key]).abs().max())
        assert 0 < err <= bound, (key, err, bound)


def test_the_client_validates_its_own_update():
    sent = {A: torch.zeros(2, 3), B: torch.zeros(4, 2)}
    lay = {A: (4, 3), B: (4, 4)}
    good = {A: torch.full((2, 3), 0.5), B: torch.full((4, 2), 3.0)}
    vec, info = encode(sent, good, 4, lay, 1 / 8, 1.0)
    assert info == {"secure_clipped": 8.0, "secure_weight": 0.5}
    assert [tuple(v.shape) for v in vec] == [(4, 3), (4, 4), (4,)]
    assert torch.equal(vec[1][:, :2], torch.full((4, 2), 0.5, dtype=torch.float64))  # clipped to 1, times 4/8
    assert vec[1][:, 2:].abs().sum() == 0 and vec[2].tolist() == [0.5, 0.5, 0.0, 0.0]
    bad = dict(good, **{A: torch.full((2, 3), math.nan)})
    with pytest.raises(ValueError, match="NaN"):
        encode(sent, bad, 4, lay, 1 / 8, 1.0)
    with pytest.raises(ValueError, match="shape"):
        encode(sent, dict(good, **{A: torch.zeros(3, 3)}), 4, lay, 1 / 8, 1.0)
    with pytest.raises(ValueError, match="missing"):
        encode(sent, {A: good[A]}, 4, lay, 1 / 8, 1.0)
    with pytest.raises(ValueError, match="n_max"):
        encode(sent, good, 9, lay, 1 / 8, 1.0)
    with pytest.raises(ValueError, match="LoRA matrices only"):
        layout([{"m.beta.weight": (3, 3)}])
