"""FlexLoRA (Bai et al. 2024, arXiv 2402.11505): the server's SVD of the mean product against
numbers computed by hand and by numpy, its invariants, an end-to-end tiny run and an exact resume.

Notation as in test_aggregation_rules: one layer out = in = 2, r_max = 2, lora_alpha = 2 so s = 1
under the default fixed scaling.
"""

import math

import numpy as np
import pytest
import torch
from tiny_federation import crash_and_resume, lines, same_arrays, tiny_config, tiny_prepared

from nestfed.config import ConfigError
from nestfed.experiments.run import run_method
from nestfed.federation.messages import ClientInfo, Reply
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.fedavg.strategy import FedAvg
from nestfed.methods.flexlora.strategy import DISCARDED, SVD_FORM, FlexLoRA, product_svd, split_factors

A_KEY = "base_model.model.m.lora_A.weight"
B_KEY = "base_model.model.m.lora_B.weight"
T = torch.tensor


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def strategy(r_max=2, alpha=2.0, scaling="fixed"):
    return FlexLoRA(LoraSettings(r_max=r_max, lora_alpha=alpha, scaling=scaling))


def product(arrays, scale):
    return scale * arrays[B_KEY].double() @ arrays[A_KEY].double()


def test_hand_computed_diagonal_mean_and_its_truncations():
    # client 1: rank 1, n = 1, B1 A1 = [[6, 0], [0, 0]]; client 2: rank 2, n = 1, B2 A2 = [[0, 0], [0, 2]]
    # W = 0.5 * (B1 A1 + B2 A2) = diag(3, 1): U = V = I, S = (3, 1)
    clients = [ClientInfo(1, 1, 1), ClientInfo(2, 2, 1)]
    st = strategy()
    state = st.initialize({"m": (2, 2)}, clients)
    reps = {
        1: Reply({A_KEY: T([[2.0, 0.0]]), B_KEY: T([[3.0], [0.0]])}, 1),
        2: Reply({A_KEY: T([[0.0, 0.0], [0.0, 1.0]]), B_KEY: T([[0.0, 0.0], [0.0, 2.0]])}, 1),
    }
    new = st.aggregate(1, state, reps)
    r3 = math.sqrt(3.0)
    # symmetric split: B = U sqrt(S), A = sqrt(S) V^T (s = 1); signs: U's largest entry positive
    torch.testing.assert_close(new.arrays[A_KEY], T([[r3, 0.0], [0.0, 1.0]]))
    torch.testing.assert_close(new.arrays[B_KEY], T([[r3, 0.0], [0.0, 1.0]]))
    assert new.meta[SVD_FORM] is True and new.meta[DISCARDED] == 0.0  # rank 2 = r_max: nothing dropped
    ins = st.configure(2, new, clients)
    torch.testing.assert_close(ins[1].arrays[A_KEY], T([[r3, 0.0]]))  # rank-1 truncation diag(3, 0)
    torch.testing.assert_close(ins[1].arrays[B_KEY], T([[r3], [0.0]]))
    arrays, scale = st.deploy(new, 1)
    assert scale == 1.0 and same_arrays(arrays, ins[1].arrays)
    exported, s = st.export(new)
    assert s == 1.0 and same_arrays(exported, new.arrays)
    assert torch.equal(state.arrays[B_KEY], torch.zeros(2, 2)), "aggregate must not mutate its input"


def test_mean_product_and_truncation_against_numpy():
    # the clients of test_aggregation_rules: W = 0.25 B1 A1 + 0.75 B2 A2 = [[10, 12.5], [22.5, 28.5]]
    clients = [ClientInfo(1, 1, 1), ClientInfo(2, 2, 3)]
    st = strategy()
    state = st.initialize({"m": (2, 2)}, clients)
    reps = {
        1: Reply({A_KEY: T([[1.0, 2.0]]), B_KEY: T([[1.0], [3.0]])}, 1),
        2: Reply({A_KEY: T([[3.0, 4.0], [5.0, 6.0]]), B_KEY: T([[1.0, 2.0], [3.0, 4.0]])}, 3),
    }
    new = st.aggregate(1, state, reps)
    W = np.array([[10.0, 12.5], [22.5, 28.5]])
    U, S, Vt = np.linalg.svd(W)
    np.testing.assert_allclose(product(new.arrays, 1.0).numpy(), W, rtol=1e-6)  # rank 2: exact
    one = st.configure(2, new, clients)[1].arrays
    np.testing.assert_allclose(product(one, 1.0).numpy(), S[0] * np.outer(U[:, 0], Vt[0]), rtol=1e-6)
    for j in range(2):  # the symmetric split: ||B[:, j]|| = ||A[j]|| = sqrt(S_j / s)
        assert float(new.arrays[B_KEY][:, j].norm()) == pytest.approx(math.sqrt(S[j]), rel=1e-6)
        assert float(new.arrays[A_KEY][j].norm()) == pytest.approx(math.sqrt(S[j]), rel=1e-6)


def test_rank_scaling_weights_each_product_by_its_scale_and_rescales_the_payload():
    # lora_alpha 2, r_max 2, scaling "rank": s_1 = 2 (rank 1), s_2 = s = 1 (rank 2)
    clients = [ClientInfo(1, 1, 1), ClientInfo(2, 2, 3)]
    st = strategy(scaling="rank")
    state = st.initialize({"m": (2, 2)}, clients)
    first = st.configure(1, state, clients)[1].arrays  # round 1: the plain initial prefix, not rescaled
    assert torch.equal(first[A_KEY], state.arrays[A_KEY][:1]) and torch.equal(first[B_KEY], torch.zeros(2, 1))
    A1, B1 = T([[1.0, 2.0]]), T([[1.0], [3.0]])
    A2, B2 = T([[3.0, 4.0], [5.0, 6.0]]), T([[1.0, 2.0], [3.0, 4.0]])
    new = st.aggregate(1, state, {1: Reply({A_KEY: A1, B_KEY: B1}, 1), 2: Reply({A_KEY: A2, B_KEY: B2}, 3)})
    W = (0.25 * 2.0 * B1 @ A1 + 0.75 * 1.0 * B2 @ A2).double().numpy()
    np.testing.assert_allclose(product(new.arrays, 1.0).numpy(), W, rtol=1e-6)
    U, S, Vt = np.linalg.svd(W)
    arrays, scale = st.deploy(new, 1)
    assert scale == 2.0
    np.testing.assert_allclose(product(arrays, 2.0).numpy(), S[0] * np.outer(U[:, 0], Vt[0]), rtol=1e-6)


def test_one_client_of_full_rank_gets_its_own_product_back():
    torch.manual_seed(1)
    st = strategy(r_max=3, alpha=6.0)  # s = 2
    state = st.initialize({"m": (5, 4)}, [ClientInfo(0, 3, 7)])
    A, B = torch.randn(3, 4), torch.randn(5, 3)
    new = st.aggregate(1, state, {0: Reply({A_KEY: A, B_KEY: B}, 7)})
    torch.testing.assert_close(product(new.arrays, 2.0), product({A_KEY: A, B_KEY: B}, 2.0), rtol=1e-5, atol=1e-5)
    assert new.meta[DISCARDED] == pytest.approx(0.0, abs=1e-12)


def test_beyond_r_max_the_global_state_is_the_best_rank_r_max_approximation():
    torch.manual_seed(2)
    clients = [ClientInfo(0, 2, 1), ClientInfo(1, 2, 2)]
    st = strategy(r_max=2, alpha=2.0)
    state = st.initialize({"m": (5, 6)}, clients)
    reps = {c.cid: Reply({A_KEY: torch.randn(2, 6), B_KEY: torch.randn(5, 2)}, c.num_examples) for c in clients}
    new = st.aggregate(1, state, reps)
    W = sum(p * (reps[c].arrays[B_KEY] @ reps[c].arrays[A_KEY]).double().numpy() for c, p in ((0, 1 / 3), (1, 2 / 3)))
    U, S, Vt = np.linalg.svd(W)
    best2 = (U[:, :2] * S[:2]) @ Vt[:2]
    np.testing.assert_allclose(product(new.arrays, 1.0).numpy(), best2, rtol=1e-5, atol=1e-5)
    assert new.meta[DISCARDED] == pytest.approx(float((S[2:] ** 2).sum() / (S**2).sum()), rel=1e-6)


def test_product_svd_against_the_dense_svd_with_canonical_signs():
    torch.manual_seed(3)
    Bs, As, cs = [torch.randn(6, 2), torch.randn(6, 3)], [torch.randn(2, 4), torch.randn(3, 4)], [0.5, 2.0]
    U, S, Vh = product_svd(Bs, As, cs)
    W = sum(c * (b.double() @ a.double()) for b, a, c in zip(Bs, As, cs)).numpy()
    assert U.shape == (6, 4) and S.shape == (4,) and Vh.shape == (4, 4)  # q = min(out, in, sum r_k)
    np.testing.assert_allclose(S.numpy(), np.linalg.svd(W, compute_uv=False), rtol=1e-10)
    np.testing.assert_allclose(((U * S) @ Vh).numpy(), W, atol=1e-10)
    idx = U.abs().argmax(dim=0)
    assert (U[idx, torch.arange(4)] > 0).all()
    A, B = split_factors(U, S, Vh, 6, 0.5)  # more rows than singular triplets: zero-padded
    assert A.shape == (6, 4) and B.shape == (6, 6) and not A[4:].any() and not B[:, 4:].any()
    np.testing.assert_allclose((0.5 * B @ A).numpy(), W, atol=1e-10)
    with pytest.raises(ValueError, match="do not chain"):
        product_svd([torch.randn(6, 2)], [torch.randn(3, 4)], [1.0])
    with pytest.raises(ValueError, match="rank must be >= 1"):
        split_factors(U, S, Vh, 0, 1.0)


def test_a_zero_product_keeps_the_previous_factors():
    clients = [ClientInfo(1, 1, 1), ClientInfo(2, 2, 1)]
    st = strategy()
    state = st.initialize({"m": (2, 2)}, clients)
    new = st.aggregate(
        1,
        state,
        {
            1: Reply({A_KEY: T([[1.0, 2.0]]), B_KEY: torch.zeros(2, 1)}, 1),
            2: Reply({A_KEY: T([[3.0, 4.0], [5.0, 6.0]]), B_KEY: torch.zeros(2, 2)}, 1),
        },
    )
    assert same_arrays(new.arrays, state.arrays)  # not A = B = 0, which no gradient would leave


def test_equal_ranks_and_identical_clients_give_fedavgs_product():
    torch.manual_seed(4)
    clients = [ClientInfo(i, 3, n) for i, n in enumerate([2, 5, 1])]
    settings = LoraSettings(r_max=3, lora_alpha=3.0)
    A, B = torch.randn(3, 5), torch.randn(4, 3)
    reps = {c.cid: Reply({A_KEY: A.clone(), B_KEY: B.clone()}, c.num_examples) for c in clients}
    state = FedAvg(settings).initialize({"m": (4, 5)}, clients)
    ref = FedAvg(settings).aggregate(1, state, reps)
    got = FlexLoRA(settings).aggregate(1, state, reps)
    torch.testing.assert_close(product(got.arrays, 1.0), product(ref.arrays, 1.0), rtol=1e-5, atol=1e-5)


def test_robust_rules_and_server_optimisers_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="flexlora cannot aggregate robustly.*full products"):
        tiny_config("strategy.name=flexlora", "robust.rule=median")
    with pytest.raises(ConfigError, match="flexlora cannot take a server optimiser.*SVD factorisation"):
        tiny_config("strategy.name=flexlora", "server_optimizer.name=sgdm")


def test_end_to_end_tiny_run_and_export(tmp_path):
    cfg = tiny_config("strategy.name=flexlora")
    summary = run_method(tiny_prepared(cfg), cfg, tmp_path / "run")
    ls = lines(tmp_path / "run")
    assert summary["aggregated_rounds"] == 3
    assert sum(v["loss"] for v in ls[-1]["eval"].values()) < sum(v["loss"] for v in ls[0]["eval"].values())
    assert [ls[1]["clients"][str(c)]["rank_sent"] for c in range(3)] == [2, 4, 8]
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert '"r": 8' in (tmp_path / "run" / "adapter" / "adapter_config.json").read_text()  # rank r_max


def test_a_crashed_run_resumes_to_the_same_state(tmp_path):
    full, resumed = crash_and_resume(tmp_path, tiny_config("strategy.name=flexlora"))
    assert same_arrays(resumed.arrays, full.arrays)
    assert resumed.meta == full.meta and full.meta[SVD_FORM] is True
