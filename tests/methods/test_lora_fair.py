"""LoRA-FAIR (Bian et al., ICCV 2025, arXiv 2411.14961): FedAvg of A and B plus the server's
correction dB to B, here in its closed regularised least-squares form. Hand-computed corrections
(lambda = 0 and lambda > 0), the optimality of the closed form against the dense least-squares
problem, the degenerate cases (identical clients and one client: FedAvg), heterogeneous ranks, the
options and an end-to-end tiny run.

Notation as in test_aggregation_rules: one layer out = in = 2, r_max = 2, lora_alpha = 2 so s = 1;
client 1 rank 1 (n 1), client 2 rank 2 (n 3).
"""

import pytest
import torch
from tiny_federation import crash_and_resume, lines, same_arrays, tiny_config, tiny_prepared

from nestfed.config import ConfigError
from nestfed.experiments.run import run_method
from nestfed.federation.messages import ClientInfo, Reply
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.fedavg.strategy import FedAvg
from nestfed.methods.lora_fair import LoraFairOptions
from nestfed.methods.lora_fair.strategy import LoraFair, correction

A_KEY = "base_model.model.m.lora_A.weight"
B_KEY = "base_model.model.m.lora_B.weight"
T = torch.tensor
CLIENTS = [ClientInfo(1, 1, 1), ClientInfo(2, 2, 3)]
A1, B1 = T([[1.0, 2.0]]), T([[1.0], [3.0]])
A2, B2 = T([[3.0, 4.0], [5.0, 6.0]]), T([[1.0, 2.0], [3.0, 4.0]])


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def test_hand_computed_round_without_regulariser():
    st = LoraFair(LoraSettings(r_max=2, lora_alpha=2.0), LoraFairOptions(lam=0.0))
    state = st.initialize({"m": (2, 2)}, CLIENTS)
    new = st.aggregate(1, state, {1: Reply({A_KEY: A1, B_KEY: B1}, 1), 2: Reply({A_KEY: A2, B_KEY: B2}, 3)})
    # Abar = [[2.5, 3.5], [3.75, 4.5]] (zero-padded FedAvg, invertible), Bbar = [[1, 1.5], [3, 3]];
    # target 0.25 B1 A1 + 0.75 B2 A2 = [[10, 12.5], [22.5, 28.5]]; Bbar + dB = target Abar^-1 = [[1, 2], [3, 4]]
    torch.testing.assert_close(new.arrays[A_KEY], T([[2.5, 3.5], [3.75, 4.5]]))
    torch.testing.assert_close(new.arrays[B_KEY], T([[1.0, 2.0], [3.0, 4.0]]), rtol=1e-5, atol=1e-5)
    product = new.arrays[B_KEY] @ new.arrays[A_KEY]
    torch.testing.assert_close(product, T([[10.0, 12.5], [22.5, 28.5]]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lam,expected", [(0.0, 3.5), (2.0, 3.25)])
def test_hand_computed_correction_with_and_without_regulariser(lam, expected):
    """out 1, in 2, rank 1, p = 1/2 each: A1 = [1, 0], A2 = [1, 2] so Abar = [1, 1]; B1 = 2, B2 = 4 so
    Bbar = 3; the target is [3, 4]. Abar Abar^T = 2, target Abar^T = 7, Bbar Abar Abar^T = 6:
    dB = (7 - 6) / (2 + lam) (lam = 0: the product [3.5, 3.5], the projection of [3, 4] on [1, 1])."""
    st = LoraFair(LoraSettings(r_max=1, lora_alpha=1.0), LoraFairOptions(lam=lam))
    clients = [ClientInfo(0, 1, 5), ClientInfo(1, 1, 5)]
    state = st.initialize({"m": (1, 2)}, clients)
    reps = {
        0: Reply({A_KEY: T([[1.0, 0.0]]), B_KEY: T([[2.0]])}, 5),
        1: Reply({A_KEY: T([[1.0, 2.0]]), B_KEY: T([[4.0]])}, 5),
    }
    new = st.aggregate(1, state, reps)
    torch.testing.assert_close(new.arrays[A_KEY], T([[1.0, 1.0]]))
    torch.testing.assert_close(new.arrays[B_KEY], T([[expected]]))


def test_the_closed_form_minimises_the_regularised_least_squares():
    """Against the dense problem: the gradient 2 ((Bbar + dB) Abar - T) Abar^T + 2 lam dB vanishes."""
    torch.manual_seed(0)
    A_bar, B_bar = torch.randn(3, 9, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    As = [torch.randn(r, 9, dtype=torch.float64) for r in (1, 3)]
    Bs = [torch.randn(6, r, dtype=torch.float64) for r in (1, 3)]
    target = 0.4 * Bs[0] @ As[0] + 0.6 * Bs[1] @ As[1]
    for lam in (0.0, 0.5):
        dB = correction(A_bar, B_bar, As, Bs, [0.4, 0.6], lam)
        grad = ((B_bar + dB) @ A_bar - target) @ A_bar.T + lam * dB
        torch.testing.assert_close(grad, torch.zeros_like(grad), rtol=0, atol=1e-9)
    with pytest.raises(ValueError, match="lam >= 0"):
        correction(A_bar, B_bar, As, Bs, [0.4, 0.6], -1.0)


def test_identical_clients_are_fedavg_and_one_client_gets_its_adapter_back():
    torch.manual_seed(4)
    clients = [ClientInfo(i, 2, n) for i, n in enumerate([2, 5, 1])]
    settings = LoraSettings(r_max=2, lora_alpha=4.0)
    A, B = torch.randn(2, 30), torch.randn(20, 2)
    reps = {c.cid: Reply({A_KEY: A.clone(), B_KEY: B.clone()}, c.num_examples) for c in clients}
    state = LoraFair(settings).initialize({"m": (20, 30)}, clients)
    got = LoraFair(settings).aggregate(1, state, reps)
    ref = FedAvg(settings).aggregate(1, state, reps)
    assert torch.equal(got.arrays[A_KEY], ref.arrays[A_KEY])
    torch.testing.assert_close(got.arrays[B_KEY], ref.arrays[B_KEY], rtol=1e-5, atol=1e-6)
    alone = LoraFair(settings).aggregate(1, state, {0: reps[0]})
    torch.testing.assert_close(alone.arrays[B_KEY], B, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scaling", ["fixed", "rank"])
def test_heterogeneous_ranks_fit_the_exact_mean_product(scaling):
    """Zero-padded means; with lam = 0 and rank(Abar) = r_max the corrected product is the projection
    of the mean of s_k B_k A_k (divided by s) onto Abar's row space."""
    torch.manual_seed(7)
    clients = [ClientInfo(0, 1, 2), ClientInfo(1, 2, 3), ClientInfo(2, 4, 5)]
    st = LoraFair(LoraSettings(r_max=4, lora_alpha=8.0, scaling=scaling), LoraFairOptions(lam=0.0))
    state = st.initialize({"m": (9, 7)}, clients)
    ins = st.configure(1, state, clients)
    reps, target = {}, torch.zeros(9, 7, dtype=torch.float64)
    for c in clients:
        A, B = torch.randn(c.rank, 7), torch.randn(9, c.rank)
        assert ins[c.cid].expect == {A_KEY: (c.rank, 7), B_KEY: (9, c.rank)}
        reps[c.cid] = Reply({A_KEY: A, B_KEY: B}, c.num_examples)
        target += c.num_examples / 10 * st.s.scale(c.rank) / st.s.scale(4) * B.double() @ A.double()
    new = st.aggregate(1, state, reps)
    A_bar = new.arrays[A_KEY].double()
    projection = target @ torch.linalg.pinv(A_bar) @ A_bar
    torch.testing.assert_close(new.arrays[B_KEY].double() @ A_bar, projection, rtol=1e-4, atol=1e-4)


def test_options_and_refusals():
    assert tiny_config("strategy.name=lora_fair").section("lora_fair").lam == 0.01
    assert tiny_config("strategy.name=lora_fair", "lora_fair.lam=0").section("lora_fair").lam == 0
    with pytest.raises(ConfigError, match="lam: -1.0 is not a number >= 0"):
        tiny_config("strategy.name=lora_fair", "lora_fair.lam=-1.0")
    with pytest.raises(ConfigError, match="lora_fair cannot aggregate robustly.*exact product"):
        tiny_config("strategy.name=lora_fair", "robust.rule=median")
    with pytest.raises(ConfigError, match="lora_fair cannot take a server optimiser"):
        tiny_config("strategy.name=lora_fair", "server_optimizer.name=adam", "server_optimizer.lr=0.01")


def test_end_to_end_tiny_run_and_resume(tmp_path):
    cfg = tiny_config("strategy.name=lora_fair")
    summary = run_method(tiny_prepared(cfg), cfg, tmp_path / "run")
    ls = lines(tmp_path / "run")
    assert summary["aggregated_rounds"] == 3
    assert sum(v["loss"] for v in ls[-1]["eval"].values()) < sum(v["loss"] for v in ls[0]["eval"].values())
    full, resumed = crash_and_resume(tmp_path / "resume", cfg)
    assert same_arrays(resumed.arrays, full.arrays)
