"""raFLoRA (Wu et al., arXiv 2602.13486): each rank partition of the clients' products averaged over
the clients that hold it, then FlexLoRA's SVD redistribution. Hand-computed rounds, a per-direction
dense reference, the rank-collapse fixed point against FlexLoRA's geometric shrinkage, the
degenerate cases (FlexLoRA, FedAvg's product, PreLort's segment aggregate), a partition no reply
holds, the options and refusals, and an end-to-end tiny run.

Notation as in test_flexlora: one layer out = in = 2, r_max = 2, lora_alpha = 2 so s = 1 under
the default fixed scaling.
"""

import math

import numpy as np
import pytest
import torch
from tiny_federation import lines, same_arrays, tiny_config, tiny_prepared

from nestfed.config import ConfigError
from nestfed.experiments.run import run_method
from nestfed.federation.messages import ClientInfo, Reply
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.fedavg.strategy import FedAvg
from nestfed.methods.flexlora.strategy import SVD_FORM, FlexLoRA, split_factors
from nestfed.methods.prelort.strategy import PreLort
from nestfed.methods.raflora import RaFLoRAOptions
from nestfed.methods.raflora.strategy import RaFLoRA, partition_terms

A_KEY = "base_model.model.m.lora_A.weight"
B_KEY = "base_model.model.m.lora_B.weight"
T = torch.tensor
R3 = math.sqrt(3.0)
# client 1: rank 1, n = 1, s B1 A1 = diag(6, 0); client 2: rank 2, n = 3, s B2 A2 = diag(2, 4), whose
# partition [0, 1) is diag(2, 0) and [1, 2) is diag(0, 4)
CLIENTS = [ClientInfo(1, 1, 1), ClientInfo(2, 2, 3)]
REPLIES = {
    1: Reply({A_KEY: T([[2.0, 0.0]]), B_KEY: T([[3.0], [0.0]])}, 1),
    2: Reply({A_KEY: T([[1.0, 0.0], [0.0, 1.0]]), B_KEY: T([[2.0, 0.0], [0.0, 4.0]])}, 3),
}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def strategy(r_max=2, alpha=2.0, scaling="fixed", weighting="examples"):
    return RaFLoRA(LoraSettings(r_max=r_max, lora_alpha=alpha, scaling=scaling), RaFLoRAOptions(weighting))


def product(arrays, scale):
    return scale * arrays[B_KEY].double() @ arrays[A_KEY].double()


def test_hand_computed_partition_means_and_the_redistribution():
    st = strategy()
    state = st.initialize({"m": (2, 2)}, CLIENTS)
    new = st.aggregate(1, state, REPLIES)
    # [0, 1): both clients, 1/4 diag(6, 0) + 3/4 diag(2, 0) = diag(3, 0); [1, 2): client 2 alone, diag(0, 4)
    # W = diag(3, 4): S = (4, 3), U = V = [[0, 1], [1, 0]] (signs: each U column's largest entry positive)
    torch.testing.assert_close(new.arrays[A_KEY], T([[0.0, 2.0], [R3, 0.0]]))
    torch.testing.assert_close(new.arrays[B_KEY], T([[0.0, R3], [2.0, 0.0]]))
    assert new.meta[SVD_FORM] is True
    ins = st.configure(2, new, CLIENTS)
    torch.testing.assert_close(ins[1].arrays[A_KEY], T([[0.0, 2.0]]))  # rank-1 truncation: diag(0, 4)
    torch.testing.assert_close(ins[1].arrays[B_KEY], T([[0.0], [2.0]]))
    # FlexLoRA's rank-agnostic weights: 1/4 diag(6, 0) + 3/4 diag(2, 4) = diag(3, 3), the [1, 2) partition
    # shrunk by client 2's share
    flex = FlexLoRA(st.s).aggregate(1, state, REPLIES)
    torch.testing.assert_close(product(flex.arrays, 1.0), torch.diag(T([3.0, 3.0], dtype=torch.float64)))
    assert torch.equal(state.arrays[B_KEY], torch.zeros(2, 2)), "aggregate must not mutate its input"


def test_uniform_weighting_hand_computed():
    st = strategy(weighting="uniform")
    new = st.aggregate(1, st.initialize({"m": (2, 2)}, CLIENTS), REPLIES)
    # [0, 1): 1/2 diag(6, 0) + 1/2 diag(2, 0) = diag(4, 0); [1, 2): diag(0, 4)
    torch.testing.assert_close(product(new.arrays, 1.0), torch.diag(T([4.0, 4.0], dtype=torch.float64)))


def reference(replies, weights, scale_of, global_arrays, s_global, r_max):
    """W by rank direction, independently of the partitions: direction i averages s_k B_k[:, i] A_k[i]
    over the replies of rank > i (weights renormalised over them); no such reply: the global direction."""
    W = 0.0
    for i in range(r_max):
        holders = [c for c, r in replies.items() if r.arrays[A_KEY].shape[0] > i]
        if not holders:
            W = W + s_global * np.outer(global_arrays[B_KEY][:, i].double(), global_arrays[A_KEY][i].double())
            continue
        held = sum(weights[c] for c in holders)
        for c in holders:
            a, b = replies[c].arrays[A_KEY], replies[c].arrays[B_KEY]
            s_k = scale_of(a.shape[0])
            W = W + weights[c] / held * s_k * np.outer(b[:, i].double(), a[i].double())
    return W


@pytest.mark.parametrize("scaling", ["fixed", "rank"])
def test_the_aggregate_is_the_per_direction_mean_truncated_to_r_max(scaling):
    # ranks 1, 2, 2, 4 under r_max = 6: partitions [0, 1), [1, 2), [2, 4) and [4, 6), the last held by no one
    torch.manual_seed(5)
    ranks, n = [1, 2, 2, 4], [3, 1, 2, 5]
    clients = [ClientInfo(i, r, k) for i, (r, k) in enumerate(zip(ranks, n))]
    st = strategy(r_max=6, alpha=12.0, scaling=scaling)
    state = st.initialize({"m": (7, 9)}, clients)
    state.arrays[B_KEY] = torch.randn(7, 6)  # a global state with energy in every direction
    reps = {
        c.cid: Reply({A_KEY: torch.randn(c.rank, 9), B_KEY: torch.randn(7, c.rank)}, c.num_examples) for c in clients
    }
    new = st.aggregate(1, state, reps)
    W = reference(reps, {c.cid: c.num_examples for c in clients}, st.s.scale, state.arrays, st.s.scale(6), 6)
    U, S, Vt = np.linalg.svd(W)
    best = (U[:, :6] * S[:6]) @ Vt[:6]
    np.testing.assert_allclose(product(new.arrays, st.s.scale(6)).numpy(), best, rtol=1e-5, atol=1e-5)
    # every client continues from its rank-r_k truncation of W, at its own scale
    arrays, s_k = st.deploy(new, 1)
    assert s_k == st.s.scale(2)
    np.testing.assert_allclose(product(arrays, s_k).numpy(), (U[:, :2] * S[:2]) @ Vt[:2], rtol=1e-5, atol=1e-5)


def svd_state(st, clients, W):
    """A global state in SVD form holding W (rank <= r_max), as an aggregate leaves it."""
    state = st.initialize({"m": tuple(W.shape)}, clients)
    U, S, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    A, B = split_factors(U, S, Vh, st.s.r_max, st.s.scale(st.s.r_max))
    state.arrays[A_KEY], state.arrays[B_KEY] = A.float(), B.float()
    state.meta[SVD_FORM] = True
    return state


def unchanged(st, state, clients):
    """Every client replies with exactly what it was sent (a round in which no client moves)."""
    ins = st.configure(1, state, clients)
    return {c.cid: Reply({k: v.clone() for k, v in ins[c.cid].arrays.items()}, c.num_examples) for c in clients}


def test_no_client_moving_is_a_fixed_point_where_flexloras_higher_partition_decays_geometrically():
    W0 = torch.diag(T([3.0, 4.0]))
    ra, flex = strategy(), FlexLoRA(LoraSettings(r_max=2, lora_alpha=2.0))
    s_ra, s_flex = svd_state(ra, CLIENTS, W0), svd_state(flex, CLIENTS, W0)
    for _ in range(3):
        s_ra = ra.aggregate(1, s_ra, unchanged(ra, s_ra, CLIENTS))
        s_flex = flex.aggregate(1, s_flex, unchanged(flex, s_flex, CLIENTS))
    # client 1 (n 1) holds the top direction (4) only; the second (3) is client 2's alone (share 3/4)
    torch.testing.assert_close(product(s_ra.arrays, 1.0), W0.double(), rtol=1e-6, atol=1e-6)
    expected = torch.diag(T([3.0 * 0.75**3, 4.0], dtype=torch.float64))
    torch.testing.assert_close(product(s_flex.arrays, 1.0), expected, rtol=1e-6, atol=1e-6)


def test_equal_ranks_at_r_max_are_flexlora_bit_for_bit():
    torch.manual_seed(6)
    clients = [ClientInfo(i, 3, n) for i, n in enumerate([2, 5, 1])]
    settings = LoraSettings(r_max=3, lora_alpha=6.0)
    state = FlexLoRA(settings).initialize({"m": (5, 4)}, clients)
    reps = {c.cid: Reply({A_KEY: torch.randn(3, 4), B_KEY: torch.randn(5, 3)}, c.num_examples) for c in clients}
    ours, theirs = RaFLoRA(settings).aggregate(1, state, reps), FlexLoRA(settings).aggregate(1, state, reps)
    assert same_arrays(ours.arrays, theirs.arrays) and ours.meta == theirs.meta


def test_equal_ranks_and_identical_clients_give_fedavgs_product():
    torch.manual_seed(4)
    clients = [ClientInfo(i, 3, n) for i, n in enumerate([2, 5, 1])]
    settings = LoraSettings(r_max=3, lora_alpha=3.0)
    A, B = torch.randn(3, 5), torch.randn(4, 3)
    reps = {c.cid: Reply({A_KEY: A.clone(), B_KEY: B.clone()}, c.num_examples) for c in clients}
    state = FedAvg(settings).initialize({"m": (4, 5)}, clients)
    ref = FedAvg(settings).aggregate(1, state, reps)
    got = RaFLoRA(settings).aggregate(1, state, reps)
    torch.testing.assert_close(product(got.arrays, 1.0), product(ref.arrays, 1.0), rtol=1e-5, atol=1e-5)


def test_with_the_global_b_returned_unchanged_the_product_is_prelorts_segment_aggregate():
    # only A moves: every holder's B block is the global one, so each partition mean is B[:, P] times
    # the segment mean of A, which is PreLort's (arXiv 2606.15963, section 2.3) in update space
    torch.manual_seed(7)
    clients = [ClientInfo(0, 1, 2), ClientInfo(1, 2, 1), ClientInfo(2, 4, 3), ClientInfo(3, 4, 1)]
    st = strategy(r_max=4, alpha=8.0)
    state = svd_state(st, clients, torch.randn(6, 4) @ torch.randn(4, 5))
    reps = unchanged(st, state, clients)
    for r in reps.values():
        r.arrays[A_KEY] = r.arrays[A_KEY] + torch.randn_like(r.arrays[A_KEY])
    got = st.aggregate(1, state, reps)
    segment = PreLort(st.s).aggregate(1, state, reps)
    assert torch.equal(segment.arrays[B_KEY], state.arrays[B_KEY])  # the segment mean of one B is that B
    torch.testing.assert_close(product(got.arrays, 2.0), product(segment.arrays, 2.0), rtol=1e-5, atol=1e-5)


def test_a_partition_no_reply_holds_keeps_the_global_component():
    # client 1 (rank 4) trains an elastic rank 2 this round: nobody updates [2, 4), which stays
    torch.manual_seed(8)
    clients = [ClientInfo(0, 2, 1), ClientInfo(1, 4, 3)]
    st = strategy(r_max=4, alpha=4.0)  # s = 1
    W0 = torch.randn(5, 4) @ torch.randn(4, 6)
    state = svd_state(st, clients, W0)
    reps = {c: Reply({A_KEY: torch.randn(2, 6), B_KEY: torch.randn(5, 2)}, n) for c, n in ((0, 1), (1, 3))}
    got = st.aggregate(1, state, reps)
    g = state.arrays
    mean = sum(p * product(reps[c].arrays, 1.0) for c, p in ((0, 0.25), (1, 0.75)))
    kept = g[B_KEY][:, 2:].double() @ g[A_KEY][2:].double()
    U, S, Vt = np.linalg.svd((mean + kept).numpy())  # rank 5 > r_max: the state holds its best rank 4
    best = (U[:, :4] * S[:4]) @ Vt[:4]
    np.testing.assert_allclose(product(got.arrays, 1.0).numpy(), best, rtol=1e-5, atol=1e-5)
    flex = FlexLoRA(st.s).aggregate(1, state, reps)  # FlexLoRA drops it
    torch.testing.assert_close(product(flex.arrays, 1.0), mean, rtol=1e-5, atol=1e-5)


def test_one_client_of_full_rank_gets_its_own_product_back():
    torch.manual_seed(1)
    st = strategy(r_max=3, alpha=6.0)  # s = 2
    state = st.initialize({"m": (5, 4)}, [ClientInfo(0, 3, 7)])
    A, B = torch.randn(3, 4), torch.randn(5, 3)
    new = st.aggregate(1, state, {0: Reply({A_KEY: A, B_KEY: B}, 7)})
    torch.testing.assert_close(product(new.arrays, 2.0), product({A_KEY: A, B_KEY: B}, 2.0), rtol=1e-5, atol=1e-5)


def test_partition_terms_hand_computed_and_refusals():
    gB, gA = torch.arange(6.0).reshape(2, 3), torch.arange(6.0).reshape(3, 2)
    Bs = [torch.ones(2, 1), 2 * torch.ones(2, 2)]
    As = [torch.ones(1, 2), 3 * torch.ones(2, 2)]
    out_B, out_A, coeffs = partition_terms(Bs, As, [1.0, 3.0], [0.5, 0.25], gB, gA, 0.125)
    # [0, 1): both, c = 1/4 * 0.5 and 3/4 * 0.25; [1, 2): client 2, c = 0.25; [2, 3): nobody, the global's
    assert coeffs == [0.125, 0.1875, 0.25, 0.125]
    assert [tuple(b.shape) for b in out_B] == [(2, 1)] * 4 and [tuple(a.shape) for a in out_A] == [(1, 2)] * 4
    assert torch.equal(out_B[3], gB[:, 2:]) and torch.equal(out_A[3], gA[2:]) and torch.equal(out_B[2], Bs[1][:, 1:])
    with pytest.raises(ValueError, match="as many"):
        partition_terms(Bs, As[:1], [1.0, 1.0], [1.0, 1.0], gB, gA, 1.0)
    with pytest.raises(ValueError, match="must be > 0"):
        partition_terms(Bs, As, [1.0, 0.0], [1.0, 1.0], gB, gA, 1.0)
    with pytest.raises(ValueError, match="<= r_max = 1"):
        partition_terms(Bs, As, [1.0, 1.0], [1.0, 1.0], gB[:, :1], gA[:1], 1.0)


def test_options_and_refusals_name_the_key_and_the_reason():
    with pytest.raises(ValueError, match="weighting: unknown weighting 'equal'"):
        RaFLoRAOptions(weighting="equal")
    with pytest.raises(ConfigError, match="raflora.weighting"):
        tiny_config("strategy.name=raflora", "raflora.weighting=equal")
    assert tiny_config("strategy.name=raflora", "raflora.weighting=uniform").section("raflora").weighting == "uniform"
    with pytest.raises(ConfigError, match="raflora cannot aggregate robustly.*partition products"):
        tiny_config("strategy.name=raflora", "robust.rule=median")
    with pytest.raises(ConfigError, match="raflora cannot take a server optimiser.*SVD factorisation"):
        tiny_config("strategy.name=raflora", "server_optimizer.name=sgdm")


def test_end_to_end_tiny_run_and_export(tmp_path):
    cfg = tiny_config("strategy.name=raflora")
    summary = run_method(tiny_prepared(cfg), cfg, tmp_path / "run")
    ls = lines(tmp_path / "run")
    assert summary["aggregated_rounds"] == 3
    assert sum(v["loss"] for v in ls[-1]["eval"].values()) < sum(v["loss"] for v in ls[0]["eval"].values())
    assert [ls[1]["clients"][str(c)]["rank_sent"] for c in range(3)] == [2, 4, 8]
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
    assert '"r": 8' in (tmp_path / "run" / "adapter" / "adapter_config.json").read_text()  # rank r_max
