"""FedSVD (Lee et al., NeurIPS 2025, arXiv 2505.12805): clients train only B, the server
re-factorises mean(B) A by SVD. Hand-computed rounds (SVDs small enough to do by hand), the
exactness of the re-factorisation (the product is FFA-LoRA's; A orthonormal), the degenerate cases
(one client; a period that never re-factorises is FFA-LoRA bit for bit), heterogeneous ranks under
both scalings, the options and an end-to-end tiny run."""

import pytest
import torch
from tiny_federation import lines, tiny_config, tiny_prepared, tiny_run

from nestfed.config import ConfigError
from nestfed.experiments.run import run_method
from nestfed.federation.messages import ClientInfo, Reply
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.fedsvd import FedSVDOptions
from nestfed.methods.fedsvd.strategy import FedSVD, product_svd, refactorise
from nestfed.methods.ffa_lora.strategy import FFALoRA

A_KEY = "base_model.model.m.lora_A.weight"
B_KEY = "base_model.model.m.lora_B.weight"
T = torch.tensor


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def rank_one_round(weighting="examples"):
    """r_max = 1, s = 1; global A = [[0, 2]]; client 1 (n 1) B = [[0], [4]], client 2 (n 3) B = [[4], [4]]."""
    clients = [ClientInfo(1, 1, 1), ClientInfo(2, 1, 3)]
    st = FedSVD(LoraSettings(r_max=1, lora_alpha=1.0), FedSVDOptions(weighting=weighting))
    state = st.initialize({"m": (2, 2)}, clients)
    state.arrays[A_KEY] = T([[0.0, 2.0]])
    replies = {1: Reply({B_KEY: T([[0.0], [4.0]])}, 1), 2: Reply({B_KEY: T([[4.0], [4.0]])}, 3)}
    return st, state, clients, replies


def test_hand_computed_rank_one_round():
    st, state, clients, replies = rank_one_round()
    ins = st.configure(1, state, clients)
    assert ins[1].expect == {B_KEY: (2, 1)}  # only B comes back
    new = st.aggregate(1, state, replies)
    # Bbar = (1 [0, 4] + 3 [4, 4]) / 4 = [3, 4]; Bbar A = [[0, 6], [0, 8]] = 10 [0.6, 0.8]^T [0, 1]
    torch.testing.assert_close(new.arrays[A_KEY], T([[0.0, 1.0]]))
    torch.testing.assert_close(new.arrays[B_KEY], T([[6.0], [8.0]]))
    assert torch.equal(state.arrays[A_KEY], T([[0.0, 2.0]])), "aggregate must not mutate its input"


def test_uniform_weighting_hand_computed():
    st, state, _, replies = rank_one_round("uniform")
    new = st.aggregate(1, state, replies)
    # Bbar = ([0, 4] + [4, 4]) / 2 = [2, 4]; Bbar A = [[0, 4], [0, 8]] = 4 sqrt(5) [1, 2]^T / sqrt(5) [0, 1]
    torch.testing.assert_close(new.arrays[A_KEY], T([[0.0, 1.0]]))
    torch.testing.assert_close(new.arrays[B_KEY], T([[4.0], [8.0]]))


def test_hand_computed_heterogeneous_ranks_under_rank_scaling():
    """r_max 2, lora_alpha 2, ``rank`` scaling: s = 1 globally, s_1 = 2 for the rank-1 client."""
    clients = [ClientInfo(1, 1, 1), ClientInfo(2, 2, 1)]
    st = FedSVD(LoraSettings(r_max=2, lora_alpha=2.0, scaling="rank"))
    state = st.initialize({"m": (2, 3)}, clients)
    state.arrays[A_KEY] = T([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    replies = {1: Reply({B_KEY: T([[1.0], [0.0]])}, 1), 2: Reply({B_KEY: T([[0.0, 0.0], [0.0, 3.0]])}, 1)}
    new = st.aggregate(1, state, replies)
    # Bbar = ((2/1) pad([1, 0]) + [[0, 0], [0, 3]]) / 2 = [[1, 0], [0, 1.5]];
    # Bbar A = [[1, 0, 0], [0, 1.5, 0]]: singular values 1.5 (e_2, e_2) then 1 (e_1, e_1)
    torch.testing.assert_close(new.arrays[A_KEY], T([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    torch.testing.assert_close(new.arrays[B_KEY], T([[0.0, 1.0], [1.5, 0.0]]))
    # the rank-1 client gets the top pair, B times s / s_1 = 1/2, and runs 2 [[0], [0.75]] [[0, 1, 0]]
    one, s1 = st.deploy(new, 1)
    assert s1 == 2.0
    torch.testing.assert_close(one[A_KEY], T([[0.0, 1.0, 0.0]]))
    torch.testing.assert_close(one[B_KEY], T([[0.0], [0.75]]))


def test_product_svd_and_refactorise_against_the_dense_svd():
    torch.manual_seed(0)
    B, A = torch.randn(7, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    U, S, Vh = product_svd(B, A)
    dense = torch.linalg.svdvals(B @ A)
    torch.testing.assert_close(S, dense[:3])
    torch.testing.assert_close(U @ torch.diag(S) @ Vh, B @ A)
    A2, B2 = refactorise(B, A)
    torch.testing.assert_close(B2 @ A2, B @ A)
    torch.testing.assert_close(A2 @ A2.T, torch.eye(3, dtype=torch.float64))
    assert refactorise(torch.zeros(7, 3), A.float()) is None  # a zero product: the caller keeps its factors
    with pytest.raises(ValueError, match="do not chain"):
        product_svd(B, A.T)


def test_equals_the_authors_rule_on_the_same_inputs_up_to_signs():
    """The authors' code (seanie12/fed-svd, ``reinit_lora``) takes the dense SVD of B A and sets
    A = Vh[:r], B = U[:, :r] diag(S[:r]); written here independently on the same inputs. Singular
    vectors are defined up to sign: each row of A agrees up to its sign, with B's column flipped alike."""
    torch.manual_seed(1)
    A, B = torch.randn(4, 12, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)
    U, S, Vh = torch.linalg.svd(B @ A, full_matrices=False)
    ref_A, ref_B = Vh[:4], U[:, :4] @ torch.diag(S[:4])
    A2, B2 = refactorise(B, A)
    signs = torch.sign((A2 * ref_A).sum(dim=1))
    assert torch.equal(signs.abs(), torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(A2, signs[:, None] * ref_A, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(B2, ref_B * signs, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("scaling", ["fixed", "rank"])
def test_the_global_model_is_exactly_the_mean_of_the_clients_models(scaling):
    """Heterogeneous ranks: s B' A' = sum_k p_k s_k B_k A[:r_k] (the mean product has rank <= r_max),
    A' has orthonormal rows, and each client starts from its rank-r_k truncation of it."""
    torch.manual_seed(5)
    clients = [ClientInfo(0, 1, 2), ClientInfo(1, 2, 3), ClientInfo(2, 4, 5)]
    st = FedSVD(LoraSettings(r_max=4, lora_alpha=8.0, scaling=scaling))
    state = st.initialize({"m": (9, 7)}, clients)
    for rnd in (1, 2):
        ins = st.configure(rnd, state, clients)
        reps, mean = {}, torch.zeros(9, 7, dtype=torch.float64)
        for c in clients:
            sent = ins[c.cid].arrays
            B = sent[B_KEY] + torch.randn_like(sent[B_KEY])
            reps[c.cid] = Reply({B_KEY: B}, c.num_examples)
            mean += c.num_examples / 10 * st.s.scale(c.rank) * B.double() @ sent[A_KEY].double()
        state = st.aggregate(rnd, state, reps)
        A, B = state.arrays[A_KEY].double(), state.arrays[B_KEY].double()
        torch.testing.assert_close(st.s.scale(4) * B @ A, mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(A @ A.T, torch.eye(4, dtype=torch.float64), rtol=1e-5, atol=1e-5)
        U, S, Vh = torch.linalg.svd(mean)
        for c in clients:
            arrays, sc = st.deploy(state, c.cid)
            truncated = U[:, : c.rank] @ torch.diag(S[: c.rank]) @ Vh[: c.rank]
            got = sc * arrays[B_KEY].double() @ arrays[A_KEY].double()
            torch.testing.assert_close(got, truncated, rtol=1e-5, atol=1e-5)


def test_one_client_gets_its_own_model_back_and_equal_ranks_give_ffa_loras_product():
    torch.manual_seed(2)
    settings = LoraSettings(r_max=3, lora_alpha=6.0)
    clients = [ClientInfo(i, 3, n) for i, n in enumerate([4, 1, 2])]
    st, ffa = FedSVD(settings), FFALoRA(settings)
    state = st.initialize({"m": (8, 6)}, clients)
    reps = {c.cid: Reply({B_KEY: torch.randn(8, 3)}, c.num_examples) for c in clients}
    alone = st.aggregate(1, state, {0: reps[0]})
    torch.testing.assert_close(
        alone.arrays[B_KEY].double() @ alone.arrays[A_KEY].double(),
        reps[0].arrays[B_KEY].double() @ state.arrays[A_KEY].double(),
        rtol=1e-5,
        atol=1e-5,
    )
    got, ref = st.aggregate(1, state, reps), ffa.aggregate(1, state, reps)
    torch.testing.assert_close(
        got.arrays[B_KEY].double() @ got.arrays[A_KEY].double(),
        ref.arrays[B_KEY].double() @ ref.arrays[A_KEY].double(),
        rtol=1e-5,
        atol=1e-5,
    )
    never = FedSVD(settings, FedSVDOptions(period=1000)).aggregate(1, state, reps)  # no SVD round: FFA-LoRA
    assert all(torch.equal(never.arrays[k], ref.arrays[k]) for k in ref.arrays)


def test_a_zero_mean_product_keeps_the_factors():
    st, state, _, _ = rank_one_round()
    new = st.aggregate(1, state, {1: Reply({B_KEY: torch.zeros(2, 1)}, 1)})
    assert torch.equal(new.arrays[A_KEY], state.arrays[A_KEY]) and torch.equal(new.arrays[B_KEY], torch.zeros(2, 1))


def test_options_and_refusals():
    assert tiny_config("strategy.name=fedsvd").section("fedsvd") == FedSVDOptions()
    with pytest.raises(ConfigError, match="period: 0 is not a count of rounds"):
        tiny_config("strategy.name=fedsvd", "fedsvd.period=0")
    with pytest.raises(ConfigError, match="weighting: unknown weighting 'n'"):
        tiny_config("strategy.name=fedsvd", "fedsvd.weighting=n")
    with pytest.raises(ConfigError, match="fedsvd cannot aggregate robustly.*re-factorises"):
        tiny_config("strategy.name=fedsvd", "robust.rule=median")
    with pytest.raises(ConfigError, match="fedsvd cannot take a server optimiser"):
        tiny_config("strategy.name=fedsvd", "server_optimizer.name=adam", "server_optimizer.lr=0.01")


def test_end_to_end_tiny_run(tmp_path):
    cfg = tiny_config("strategy.name=fedsvd")
    prep = tiny_prepared(cfg)
    summary = run_method(prep, cfg, tmp_path / "run")
    ls = lines(tmp_path / "run")
    assert summary["aggregated_rounds"] == 3
    assert sum(v["loss"] for v in ls[-1]["eval"].values()) < sum(v["loss"] for v in ls[0]["eval"].values())
    state, _, _ = tiny_run(tmp_path / "again", cfg, prep)
    for k, A in state.arrays.items():
        if k.endswith("lora_A.weight"):
            torch.testing.assert_close(A @ A.T, torch.eye(A.shape[0]), rtol=1e-4, atol=1e-4)
