"""The delta-rule operator: chunkwise WY form against the per-token recurrence, by hand, and
its defining property. Small shapes, float64 for tight tolerances; a few seconds in all."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nestfed.ops import delta_rule as dr
from nestfed.ops.delta_rule import delta_rule, delta_rule_chunkwise, delta_rule_recurrent

ALL = [delta_rule_recurrent, delta_rule_chunkwise, delta_rule]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (the shared fixture in conftest.py)."""
    yield


def make_inputs(B, T, H, K, V, *, dtype=torch.float64, seed=0, init=False):
    """Small q, L2-normalised keys (as the FedNL layer makes them), beta = sigmoid in (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    q = 0.5 * torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    beta = torch.randn(B, T, H, generator=g, dtype=dtype).sigmoid()
    h0 = 0.5 * torch.randn(B, H, K, V, generator=g, dtype=dtype) if init else None
    return q, k, v, beta, h0


def run_with_grads(fn, q, k, v, beta, h0, *, scale, chunk_size, seed=1):
    """o, final state and the gradients of a random linear loss on both w.r.t. every input."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, beta)]
    h = None if h0 is None else h0.detach().clone().requires_grad_()
    o, s = fn(*leaves, scale=scale, initial_state=h, chunk_size=chunk_size)
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)
    ds = torch.randn(s.shape, generator=g, dtype=torch.float64).to(s.dtype)
    ((o * do).sum() + (s * ds).sum()).backward()
    grads = [x.grad for x in leaves] + ([] if h is None else [h.grad])
    return o.detach(), s.detach(), grads


def shape_for(T):
    # K != V everywhere, so that a swapped K/V axis cannot pass
    return (1, T, 1, 4, 3) if T >= 1000 else (2, T, 2, 8, 6)


@functools.lru_cache(maxsize=None)
def reference(T, init):
    B, T, H, K, V = shape_for(T)
    ins = make_inputs(B, T, H, K, V, init=init, seed=T)
    return ins, run_with_grads(delta_rule_recurrent, *ins, scale=0.7, chunk_size=64)


@pytest.mark.parametrize("init", [False, True], ids=["zeros", "h0"])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("T", [1, 63, 100, 1000])
def test_chunkwise_matches_recurrent_fp64(T, chunk_size, init):
    ins, (o_ref, s_ref, g_ref) = reference(T, init)
    o, s, grads = run_with_grads(delta_rule_chunkwise, *ins, scale=0.7, chunk_size=chunk_size)
    assert o.dtype == torch.float64 and o.shape == o_ref.shape
    torch.testing.assert_close(o, o_ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(s, s_ref, rtol=1e-9, atol=1e-10)
    names = ["q", "k", "v", "beta", "initial_state"]
    assert len(grads) == len(g_ref) == (5 if init else 4)
    for name, g, gr in zip(names, grads, g_ref):
        assert g is not None, name
        torch.testing.assert_close(g, gr, rtol=1e-8, atol=1e-9, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("use", ["o", "state"])
def test_gradients_when_one_output_is_unused(use):
    ins = make_inputs(1, 50, 2, 4, 3, init=True, seed=4)
    grads = []
    for fn in (delta_rule_recurrent, delta_rule_chunkwise):
        leaves = [x.clone().requires_grad_() for x in ins]
        o, s = fn(*leaves[:4], initial_state=leaves[4], chunk_size=16)
        (o.square().sum() if use == "o" else s.square().sum()).backward()
        # q does not reach the state: autograd through the loop leaves its grad None
        grads.append([torch.zeros_like(x) if x.grad is None else x.grad for x in leaves])
    for g, gr in zip(*grads):
        torch.testing.assert_close(g, gr, rtol=1e-9, atol=1e-10)


def test_chunkwise_matches_recurrent_fp32():
    ins64 = make_inputs(2, 100, 3, 16, 16, init=True, seed=5)
    ins32 = [x.float() for x in ins64]
    o_ref, s_ref, g_ref = run_with_grads(delta_rule_recurrent, *ins64, scale=0.25, chunk_size=64)
    o, s, grads = run_with_grads(delta_rule_chunkwise, *ins32, scale=0.25, chunk_size=32)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s.double(), s_ref, rtol=1e-4, atol=1e-5)
    for g, gr in zip(grads, g_ref):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), gr, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fn", [delta_rule_recurrent, delta_rule_chunkwise])
def test_chaining_equals_one_pass(fn):
    q, k, v, beta, h0 = make_inputs(2, 100, 2, 8, 6, init=True, seed=3)
    o_full, s_full = fn(q, k, v, beta, scale=0.5, initial_state=h0, chunk_size=16)
    cut = 37  # not a multiple of the chunk size
    o1, s1 = fn(q[:, :cut], k[:, :cut], v[:, :cut], beta[:, :cut], scale=0.5, initial_state=h0, chunk_size=16)
    o2, s2 = fn(q[:, cut:], k[:, cut:], v[:, cut:], beta[:, cut:], scale=0.5, initial_state=s1, chunk_size=16)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_full, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s2, s_full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 2, 64])
@pytest.mark.parametrize("fn", ALL)
def test_hand_computed_two_tokens(fn, chunk_size):
    # One head, K = V = 2, S_0 = 0, scale = 0.5.
    # t = 1: k1 = (1, 0), v1 = (1, 2), beta1 = 0.5, q1 = (1, 1)
    #   S_1 = beta1 k1 (v1 - S_0^T k1)^T = 0.5 [[1, 2], [0, 0]] = [[0.5, 1], [0, 0]]
    #   o_1 = 0.5 * S_1^T q1 = 0.5 * (0.5, 1) = (0.25, 0.5)
    # t = 2: k2 = (0.6, 0.8) (unit norm), v2 = (3, -1), beta2 = 0.25, q2 = (2, 0)
    #   S_1^T k2 = (0.6 * 0.5 + 0.8 * 0, 0.6 * 1 + 0.8 * 0) = (0.3, 0.6)
    #   beta2 (v2 - S_1^T k2) = 0.25 * (2.7, -1.6) = (0.675, -0.4)
    #   S_2 = S_1 + k2 (0.675, -0.4) = [[0.5 + 0.405, 1 - 0.24], [0.54, -0.32]]
    #       = [[0.905, 0.76], [0.54, -0.32]]
    #   o_2 = 0.5 * S_2^T q2 = 0.5 * 2 * (0.905, 0.76) = (0.905, 0.76)
    dt = torch.float64
    q = torch.tensor([[1.0, 1.0], [2.0, 0.0]], dtype=dt).view(1, 2, 1, 2)
    k = torch.tensor([[1.0, 0.0], [0.6, 0.8]], dtype=dt).view(1, 2, 1, 2)
    v = torch.tensor([[1.0, 2.0], [3.0, -1.0]], dtype=dt).view(1, 2, 1, 2)
    beta = torch.tensor([0.5, 0.25], dtype=dt).view(1, 2, 1)
    o, s = fn(q, k, v, beta, scale=0.5, chunk_size=chunk_size)
    o_hand = torch.tensor([[0.25, 0.5], [0.905, 0.76]], dtype=dt).view(1, 2, 1, 2)
    s_hand = torch.tensor([[0.905, 0.76], [0.54, -0.32]], dtype=dt).view(1, 1, 2, 2)
    torch.testing.assert_close(o, o_hand, rtol=0, atol=1e-12)
    torch.testing.assert_close(s, s_hand, rtol=0, atol=1e-12)


@pytest.mark.parametrize("fn", ALL)
def test_write_then_read_returns_the_value(fn):
    # beta = 1 and a unit-norm key: S_1^T k = S_0^T k + (k^T k)(v - S_0^T k) = v, whatever S_0
    g = torch.Generator().manual_seed(7)
    K, V = 5, 3
    k = F.normalize(torch.randn(1, 1, 1, K, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(1, 1, 1, V, generator=g, dtype=torch.float64)
    h0 = torch.randn(1, 1, K, V, generator=g, dtype=torch.float64)
    beta = torch.ones(1, 1, 1, dtype=torch.float64)
    o, s = fn(k, k, v, beta, initial_state=h0)
    torch.testing.assert_close(o, v, rtol=0, atol=1e-12)
    # after other writes, writing v' under the same key overwrites what the key reads
    q2, k2, v2, beta2, _ = make_inputs(1, 9, 1, K, V, seed=8)
    v_new = torch.randn(1, 1, 1, V, generator=g, dtype=torch.float64)
    qs = torch.cat([q2, k], dim=1)
    ks = torch.cat([k2, k], dim=1)
    vs = torch.cat([v2, v_new], dim=1)
    bs = torch.cat([beta2, beta], dim=1)
    o, s = fn(qs, ks, vs, bs, initial_state=h0, chunk_size=4)
    torch.testing.assert_close(o[:, -1], v_new[:, 0], rtol=0, atol=1e-12)
    torch.testing.assert_close((k[0, 0, 0] @ s[0, 0]), v_new[0, 0, 0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("fn", ALL)
def test_output_final_state_false_and_dtypes(fn):
    q, k, v, beta, h0 = make_inputs(1, 10, 2, 4, 4, dtype=torch.float32, init=True)
    o, s = fn(q, k, v, beta, initial_state=h0, output_final_state=False)
    assert s is None and o.shape == (1, 10, 2, 4) and o.dtype == torch.float32
    # bf16 on CPU: computed in fp32, o in bf16, the carried state in fp32
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    o_b, s_b = fn(qb, kb, vb, beta.bfloat16(), initial_state=h0)
    o_f, s_f = fn(qb.float(), kb.float(), vb.float(), beta.bfloat16().float(), initial_state=h0)
    assert o_b.dtype == torch.bfloat16 and s_b.dtype == torch.float32
    torch.testing.assert_close(o_b.float(), o_f, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(s_b, s_f, rtol=1e-5, atol=1e-5)


def test_non_contiguous_inputs():
    q, k, v, beta, h0 = make_inputs(2, 40, 3, 4, 5, init=True, seed=11)
    # the same values laid out [B, H, T, D] and viewed back as [B, T, H, D]
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    bt = beta.transpose(1, 2).contiguous().transpose(1, 2)
    assert not qt.is_contiguous()
    o_ref, s_ref = delta_rule_recurrent(q, k, v, beta, initial_state=h0)
    o, s = delta_rule_chunkwise(qt, kt, vt, bt, initial_state=h0, chunk_size=16)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s, s_ref, rtol=1e-10, atol=1e-12)


def _bad(name):
    q, k, v, beta, h0 = make_inputs(2, 5, 3, 4, 6, dtype=torch.float32, init=True)
    args = dict(q=q, k=k, v=v, beta=beta, initial_state=h0, chunk_size=64)
    if name == "q":
        args["q"] = q[0]
    elif name == "k":
        args["k"] = k[..., :3]
    elif name == "v":
        args["v"] = v[:, :4]
    elif name == "beta":
        args["beta"] = beta.unsqueeze(-1)
    elif name == "initial_state":
        args["initial_state"] = h0.transpose(-1, -2)
    elif name == "chunk_size":
        args["chunk_size"] = 0
    elif name == "dtype":
        args["v"] = v.double()
    return args


@pytest.mark.parametrize(
    "name, pattern",
    [
        ("q", r"^q must"),
        ("k", r"^k must"),
        ("v", r"^v must"),
        ("beta", r"^beta must"),
        ("initial_state", r"^initial_state must"),
        ("chunk_size", r"^chunk_size must"),
        ("dtype", r"^q, k and v must share one dtype"),
    ],
)
@pytest.mark.parametrize("fn", ALL)
def test_value_errors_name_the_argument(fn, name, pattern):
    args = _bad(name)
    with pytest.raises(ValueError, match=pattern):
        fn(
            args["q"],
            args["k"],
            args["v"],
            args["beta"],
            initial_state=args["initial_state"],
            chunk_size=args["chunk_size"],
        )


def test_dispatcher_uses_chunkwise_on_cpu():
    q, k, v, beta, h0 = make_inputs(1, 70, 2, 4, 4, dtype=torch.float32, init=True)
    assert not dr._use_fla(q) and not dr._use_fla(q.bfloat16())
    o, s = delta_rule(q, k, v, beta, scale=0.3, initial_state=h0, chunk_size=16)
    o_c, s_c = delta_rule_chunkwise(q, k, v, beta, scale=0.3, initial_state=h0, chunk_size=16)
    torch.testing.assert_close(o, o_c, rtol=0, atol=0)
    torch.testing.assert_close(s, s_c, rtol=0, atol=0)


def test_dispatcher_passes_fla_arguments(monkeypatch):
    # No GPU here: check the wiring to fla's chunk_delta_rule with a stand-in of its signature.
    calls = {}

    def fake_chunk_delta_rule(
        q,
        k,
        v,
        beta,
        scale=None,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        cu_seqlens=None,
        head_first=False,
    ):
        calls.update(
            scale=scale,
            initial_state=initial_state,
            beta_dtype=beta.dtype,
            output_final_state=output_final_state,
            head_first=head_first,
        )
        return "o", "ht"

    monkeypatch.setattr(dr, "_fla_chunk_delta_rule", lambda: fake_chunk_delta_rule)
    monkeypatch.setattr(dr, "_use_fla", lambda q: True)
    q, k, v, beta, h0 = make_inputs(1, 8, 2, 4, 4, dtype=torch.bfloat16, init=True)
    out = delta_rule(q, k, v, beta.float(), scale=0.125, initial_state=h0)
    assert out == ("o", "ht")
    assert calls == dict(
        scale=0.125, initial_state=h0, beta_dtype=torch.bfloat16, output_final_state=True, head_first=False
    )


def test_fla_absent_is_not_an_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_fla(name, *args, **kwargs):
        if name == "fla" or name.startswith("fla."):
            raise ImportError("no fla here")
        return real_import(name, *args, **kwargs)

    dr._fla_chunk_delta_rule.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_fla)
    try:
        assert dr._fla_chunk_delta_rule() is None
    finally:
        dr._fla_chunk_delta_rule.cache_clear()


def test_gpu_bench_script_cpu_dry_run(capsys):
    """bench/perf/gpu_delta_rule.py imports without a GPU and its CPU dry run passes its checks."""
    path = Path(__file__).resolve().parents[2] / "bench" / "perf" / "gpu_delta_rule.py"
    spec = importlib.util.spec_from_file_location("gpu_delta_rule_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # import runs nothing
    n = torch.get_num_threads()
    try:
        assert mod.main(["--cpu-dry-run"]) == 0
    finally:
        torch.set_num_threads(n)
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and len(report["checks"]) == 2 and len(report["timings_fwd_bwd"]) == 2


@pytest.mark.parametrize("fn", [delta_rule_recurrent, delta_rule_chunkwise])
def test_bf16_inputs_under_cpu_autocast_follow_the_dtype_policy(fn):
    """bf16 q, k, v, beta under torch.autocast("cpu", bfloat16) (the bf16 policy): forward and backward
    run (autocast would otherwise turn the fp32 compute's bmm into bf16), computed in fp32, and
    agree with the same bf16 inputs outside autocast."""
    ins = [x.to(torch.bfloat16) for x in make_inputs(2, 40, 2, 8, 6, dtype=torch.float32)[:4]]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, s, grads = run_with_grads(fn, *ins, None, scale=0.7, chunk_size=16)
    o_ref, s_ref, grads_ref = run_with_grads(fn, *ins, None, scale=0.7, chunk_size=16)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    # backward under autocast too (as a training step runs it): the built-in ops' backward may round
    # differently there, the chunkwise form's own backward does not
    for g, r in zip(grads, grads_ref):
        assert g.dtype == torch.bfloat16
        assert (
            torch.equal(g, r)
            if fn is delta_rule_chunkwise
            else torch.allclose(g.float(), r.float(), rtol=2e-2, atol=2e-2)
        )
