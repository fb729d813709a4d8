"""FedSLM's two-stage aggregation against hand-computed matrices and dense reference computations."""

import pytest
import torch

from nestfed.federation.messages import ClientInfo, Reply
from nestfed.methods.fedslm.strategy import FedSLM, SLMGroups, fuse_cores, intra_group_mean
from nestfed.nn.svd import core_key, project, reconstruct

L = "model.layers.0.mlp.up_proj"
K = core_key(L)


def test_core_key_names_the_parameter_apply_arrays_loads():
    assert K == "base_model.model.model.layers.0.mlp.up_proj.sigma"


def test_intra_group_fedavg_hand_computed():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    b = torch.tensor([[5.0, 6.0], [7.0, 8.0]])
    # n = 1 and 3: (a + 3 b) / 4
    assert torch.allclose(intra_group_mean([a, b], [1, 3]), torch.tensor([[4.0, 5.0], [6.0, 7.0]]))


def test_fusion_hand_computed_both_rules():
    prev = torch.diag(torch.tensor([9.0, 9.0, 9.0]))
    s1 = torch.tensor([[2.0]])  # group of rank 1, N = 1
    s2 = torch.tensor([[6.0, 4.0], [-4.0, 8.0]])  # group of rank 2, N = 3
    avg = fuse_cores(prev, [s1, s2], [1, 3], "average")
    # (1 * pad(s1) + 3 * pad(s2)) / 4; the third coordinate nobody holds becomes 0
    assert torch.allclose(avg, torch.tensor([[5.0, 3.0, 0.0], [-3.0, 6.0, 0.0], [0.0, 0.0, 0.0]]))
    cov = fuse_cores(prev, [s1, s2], [1, 3], "coverage")
    # (0, 0): (2 + 18) / 4; entries only group 2 holds: its values; (2, 2): kept from prev
    assert torch.allclose(cov, torch.tensor([[5.0, 4.0, 0.0], [-4.0, 8.0, 0.0], [0.0, 0.0, 9.0]]))
    with pytest.raises(ValueError, match="unknown fusion"):
        fuse_cores(prev, [s1], [1], "median")
    with pytest.raises(ValueError, match="positive"):
        fuse_cores(prev, [s1], [0], "average")


def _bases(out=5, inp=4, R=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(out, R, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(inp, R, generator=g, dtype=torch.float64))
    return U, V


def test_core_space_fusion_equals_the_dense_weighted_average_of_reconstructions():
    """W_g = sum_g N_g U_g Sigma_g V_g^T / N (dense), and the projection U_g^T W_g V_g equals the
    leading block of the fused core."""
    U, V = _bases()
    g = torch.Generator().manual_seed(1)
    ranks, sizes = [1, 2, 3], [2.0, 5.0, 3.0]
    cores = [torch.randn(r, r, generator=g, dtype=torch.float64) for r in ranks]
    dense = sum(n * reconstruct(U[:, :r], s, V[:, :r]) for n, r, s in zip(sizes, ranks, cores)) / sum(sizes)
    M = fuse_cores(torch.zeros(3, 3, dtype=torch.float64), cores, sizes, "average")
    assert torch.allclose(reconstruct(U, M, V), dense, atol=1e-12)
    for r in ranks:
        assert torch.allclose(project(dense, U[:, :r], V[:, :r]), M[:r, :r], atol=1e-12)


def test_core_space_fusion_is_exact_for_whitened_bases():
    """Whitened bases (V not orthonormal, dual D with D^T V = I; nn/whitening.py): the fused
    core still represents the dense weighted average of reconstructions, and projecting it onto
    every group's prefixes with the dual basis returns the strategy's leading block M[:r, :r]."""
    from nestfed.nn.whitening import whitened_svd

    g = torch.Generator().manual_seed(4)
    X = torch.randn(50, 4, generator=g, dtype=torch.float64) @ torch.randn(4, 4, generator=g, dtype=torch.float64)
    U, _, V, D = whitened_svd(torch.randn(5, 4, generator=g, dtype=torch.float64), X.T @ X, damping=0.0)
    U, V, D = U[:, :3], V[:, :3], D[:, :3]
    assert not torch.allclose(V.T @ V, torch.eye(3, dtype=torch.float64), atol=1e-3)
    ranks, sizes = [1, 2, 3], [2.0, 5.0, 3.0]
    cores = [torch.randn(r, r, generator=g, dtype=torch.float64) for r in ranks]
    dense = sum(n * reconstruct(U[:, :r], s, V[:, :r]) for n, r, s in zip(sizes, ranks, cores)) / sum(sizes)
    for rule in ("average", "coverage"):
        M = fuse_cores(torch.zeros(3, 3, dtype=torch.float64), cores, sizes, rule)
        if rule == "average":
            assert torch.allclose(reconstruct(U, M, V), dense, atol=1e-12)
        W = reconstruct(U, M, V)
        for r in ranks:
            assert torch.allclose(project(W, U[:, :r], V[:, :r], D[:, :r]), M[:r, :r], atol=1e-10)


def test_equal_ranks_reduce_both_rules_to_fedavg():
    g = torch.Generator().manual_seed(2)
    cores = [torch.randn(3, 3, generator=g) for _ in range(3)]
    fedavg = intra_group_mean(cores, [1, 2, 3])
    for rule in ("average", "coverage"):
        assert torch.allclose(fuse_cores(torch.zeros(3, 3), cores, [1, 2, 3], rule), fedavg, atol=1e-6)


def _federation(fusion, ratios=(0.3, 0.5, 0.7)):
    ranks = [{L: 1}, {L: 2}, {L: 3}][: len(ratios)]
    groups = SLMGroups(list(ratios), ranks, {0: 0, 1: 0, 2: 1, 3: 2}, {L: torch.tensor([4.0, 2.0, 1.0])})
    clients = [ClientInfo(c, 0, n) for c, n in enumerate([1, 3, 4, 2])]
    return FedSLM(groups, fusion), clients


def test_three_groups_in_one_federation_hand_computed():
    """ratios 0.3 / 0.5 / 0.7 with ranks 1 / 2 / 3: clients 0, 1 (n = 1, 3) in group 0, client 2
    (n = 4) in group 1, client 3 (n = 2) in group 2."""
    st, clients = _federation("average")
    state = st.initialize(None, clients)
    assert torch.equal(state.arrays[K], torch.diag(torch.tensor([4.0, 2.0, 1.0])))
    ins = st.configure(1, state, clients)
    assert {c: tuple(i.arrays[K].shape) for c, i in ins.items()} == {0: (1, 1), 1: (1, 1), 2: (2, 2), 3: (3, 3)}
    assert torch.equal(ins[2].arrays[K], torch.diag(torch.tensor([4.0, 2.0])))
    assert ins[3].expect == {K: (3, 3)} and ins[0].config["ratio"] == 0.3
    replies = {
        0: Reply({K: torch.tensor([[2.0]])}, 1),
        1: Reply({K: torch.tensor([[6.0]])}, 3),  # group 0 mean: (2 + 18) / 4 = 5, N_0 = 4
        2: Reply({K: torch.tensor([[1.0, 2.0], [3.0, 4.0]])}, 4),  # N_1 = 4
        3: Reply({K: torch.tensor([[7.0, 1.0, 1.0], [1.0, 6.0, 1.0], [1.0, 1.0, 5.0]])}, 2),  # N_2 = 2
    }
    new = st.aggregate(1, state, replies)
    # average: (4 * pad([5]) + 4 * pad(S1) + 2 * S2) / 10
    expect = torch.tensor(
        [[(20 + 4 + 14) / 10, (8 + 2) / 10, 2 / 10], [(12 + 2) / 10, (16 + 12) / 10, 2 / 10], [2 / 10, 2 / 10, 10 / 10]]
    )
    assert torch.allclose(new.arrays[K], expect)
    assert new.meta["group_examples"] == {"0": 4.0, "1": 4.0, "2": 2.0}
    assert torch.equal(state.arrays[K], torch.diag(torch.tensor([4.0, 2.0, 1.0])))  # input untouched
    # next round: group 1 starts from the projection U_1^T W_g V_1 = the leading 2 x 2 block
    assert torch.allclose(st.configure(2, new, clients)[2].arrays[K], expect[:2, :2])

    st_c, _ = _federation("coverage")
    cov = st_c.aggregate(1, state, replies)
    expect_c = torch.tensor([[38 / 10, 10 / 6, 1.0], [14 / 6, 28 / 6, 1.0], [1.0, 1.0, 5.0]])
    assert torch.allclose(cov.arrays[K], expect_c)


def test_average_fusion_shrinks_the_largest_groups_extra_directions_and_coverage_does_not():
    """Untrained clients (each returns what it got): 'average' multiplies the coordinates only the
    rank-3 group holds by its share 2/10 every round; 'coverage' keeps diag(S) fixed."""
    for fusion, third in (("average", [0.2, 0.04, 0.008]), ("coverage", [1.0, 1.0, 1.0])):
        st, clients = _federation(fusion)
        state = st.initialize(None, clients)
        for rnd, value in zip((1, 2, 3), third):
            ins = st.configure(rnd, state, clients)
            replies = {c: Reply(dict(i.arrays), clients[c].num_examples) for c, i in ins.items()}
            state = st.aggregate(rnd, state, replies)
            assert float(state.arrays[K][2, 2]) == pytest.approx(value)


def test_a_group_without_replies_keeps_its_coordinates_under_coverage():
    st, clients = _federation("coverage")
    state = st.initialize(None, clients)
    replies = {0: Reply({K: torch.tensor([[3.0]])}, 1)}
    new = st.aggregate(1, state, replies)
    assert torch.allclose(new.arrays[K], torch.diag(torch.tensor([3.0, 2.0, 1.0])))


def test_unknown_client_and_fusion_are_named():
    st, clients = _federation("coverage")
    with pytest.raises(ValueError, match="client 9"):
        st.initialize(None, clients + [ClientInfo(9, 0, 1)])
    with pytest.raises(ValueError, match="compression.fusion"):
        FedSLM(st.groups, "sum")
