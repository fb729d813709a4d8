"""FedEx-LoRA (Singhal et al., arXiv 2410.09432): FedAvg of A and B plus the exact residual in the
frozen weights. Hand-computed rounds, the exactness invariant (the aggregated model is the mean of
the clients' models; every client starts from the global model) at heterogeneous ranks and both
scalings, the export, an end-to-end tiny run and an exact resume.

Notation as in test_aggregation_rules: one layer out = in = 2, r_max = 2, lora_alpha = 2 so s = 1;
client 1 rank 1 (n 1), client 2 rank 2 (n 3), the global A starts at ones and B at zero.
"""

import json

import pytest
import torch
from tiny_federation import crash_and_resume, lines, same_arrays, tiny_config, tiny_prepared, tiny_run

from nestfed.config import ConfigError
from nestfed.experiments.run import run_method
from nestfed.federation.messages import ClientInfo, Reply
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.fedavg.strategy import FedAvg
from nestfed.methods.fedex_lora import FedExLoRAOptions
from nestfed.methods.fedex_lora.strategy import ClientFactors, FedExLoRA, compact, round_residual
from nestfed.nn.keys import merged_key

A_KEY = "base_model.model.m.lora_A.weight"
B_KEY = "base_model.model.m.lora_B.weight"
MA, MB = merged_key("m", "A"), merged_key("m", "B")
T = torch.tensor
CLIENTS = [ClientInfo(1, 1, 1), ClientInfo(2, 2, 3)]
A1, B1 = T([[1.0, 2.0]]), T([[1.0], [3.0]])
A2, B2 = T([[3.0, 4.0], [5.0, 6.0]]), T([[1.0, 2.0], [3.0, 4.0]])


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def delta(arrays, scale, module="m"):
    """The model change a payload makes on one layer: merged_B merged_A + s B A (float64)."""
    a, b = f"base_model.model.{module}.lora_A.weight", f"base_model.model.{module}.lora_B.weight"
    out = scale * arrays[b].double() @ arrays[a].double()
    ma, mb = merged_key(module, "A"), merged_key(module, "B")
    if ma in arrays:
        out = out + arrays[mb].double() @ arrays[ma].double()
    return out


def test_hand_computed_first_and_second_round():
    st = FedExLoRA(LoraSettings(r_max=2, lora_alpha=2.0))
    state = st.initialize({"m": (2, 2)}, CLIENTS)
    state.arrays[A_KEY] = T([[1.0, 1.0], [1.0, 1.0]])
    ins = st.configure(1, state, CLIENTS)
    # round 1: Bbar = 0, so the rank-1 client's fold (s Bbar[:, 1:] Abar[1:]) is empty
    assert ins[1].arrays[MA].shape == (0, 2) and ins[1].expect == {A_KEY: (1, 2), B_KEY: (2, 1)}
    new = st.aggregate(1, state, {1: Reply({A_KEY: A1, B_KEY: B1}, 1), 2: Reply({A_KEY: A2, B_KEY: B2}, 3)})
    torch.testing.assert_close(new.arrays[A_KEY], T([[2.5, 3.5], [3.75, 4.5]]))  # zero-padded FedAvg
    torch.testing.assert_close(new.arrays[B_KEY], T([[1.0, 1.5], [3.0, 3.0]]))
    # residual 0.25 B1 A1 + 0.75 B2 A2 - Bbar Abar = [[10, 12.5], [22.5, 28.5]] - [[8.125, 10.25], [18.75, 24]];
    # its 5 factor pairs exceed min(out, in) = 2, so it is stored densely as [I, W]
    torch.testing.assert_close(new.arrays[MB], T([[1.875, 2.25], [3.75, 4.5]]))
    torch.testing.assert_close(new.arrays[MA], torch.eye(2))
    glob, s = st.deploy(new)
    torch.testing.assert_close(delta(glob, s), T([[10.0, 12.5], [22.5, 28.5]], dtype=torch.float64))
    # round 2, client 1 (rank 1): prefix Abar[:1], Bbar[:, :1];
    # fold s Bbar[:, 1:] Abar[1:] = [[5.625, 6.75], [11.25, 13.5]]
    one, s1 = st.deploy(new, 1)
    torch.testing.assert_close(one[A_KEY], T([[2.5, 3.5]]))
    residual = one[MB].double() @ one[MA].double()
    torch.testing.assert_close(residual, T([[7.5, 9.0], [15.0, 18.0]], dtype=torch.float64))
    torch.testing.assert_close(delta(one, s1), T([[10.0, 12.5], [22.5, 28.5]], dtype=torch.float64))


def test_uniform_weighting_is_the_papers_one_over_k_hand_computed():
    """``weighting = "uniform"``: p_k = 1/2 for both clients whatever their n_k (1 and 3)."""
    st = FedExLoRA(LoraSettings(r_max=2, lora_alpha=2.0), FedExLoRAOptions(weighting="uniform"))
    state = st.initialize({"m": (2, 2)}, CLIENTS)
    state.arrays[A_KEY] = T([[1.0, 1.0], [1.0, 1.0]])
    new = st.aggregate(1, state, {1: Reply({A_KEY: A1, B_KEY: B1}, 1), 2: Reply({A_KEY: A2, B_KEY: B2}, 3)})
    # Abar = ([[1, 2], [0, 0]] + [[3, 4], [5, 6]]) / 2; Bbar = ([[1, 0], [3, 0]] + [[1, 2], [3, 4]]) / 2
    torch.testing.assert_close(new.arrays[A_KEY], T([[2.0, 3.0], [2.5, 3.0]]))
    torch.testing.assert_close(new.arrays[B_KEY], T([[1.0, 1.0], [3.0, 2.0]]))
    # B1 A1 = [[1, 2], [3, 6]], B2 A2 = [[13, 16], [29, 36]]: their plain mean [[7, 9], [16, 21]]
    # minus Bbar Abar = [[4.5, 6], [11, 15]] is the residual, stored densely (5 pairs > min(out, in))
    torch.testing.assert_close(new.arrays[MB], T([[2.5, 3.0], [5.0, 6.0]]))
    torch.testing.assert_close(new.arrays[MA], torch.eye(2))
    glob, s = st.deploy(new)
    torch.testing.assert_close(delta(glob, s), T([[7.0, 9.0], [16.0, 21.0]], dtype=torch.float64))


def test_the_weighting_option_defaults_to_examples_and_refuses_other_values():
    assert tiny_config("strategy.name=fedex_lora").section("fedex_lora").weighting == "examples"
    assert tiny_config("strategy.name=fedex_lora", "fedex_lora.weighting=uniform").section("fedex_lora").weighting == (
        "uniform"
    )
    with pytest.raises(ConfigError, match="weighting: unknown weighting 'equal'"):
        tiny_config("strategy.name=fedex_lora", "fedex_lora.weighting=equal")


def test_round_residual_factors_hand_computed():
    A_old, B_old = T([[1.0, 1.0], [1.0, 1.0]]), T([[0.0, 2.0], [0.0, 0.0]])
    A_new, B_new = T([[2.5, 3.5], [3.75, 4.5]]), T([[1.0, 1.5], [3.0, 3.0]])
    rows, cols = round_residual(
        A_old, B_old, [ClientFactors(A1, B1, 0.25, 1.0), ClientFactors(A2, B2, 0.75, 1.0)], A_new, B_new, 1.0
    )
    # d_0 = 0 (both clients hold row 0); d_1 = 0.25 (client 1 ran row 1 frozen), column B_old[:, 1] = [2, 0]
    torch.testing.assert_close(
        rows, T([[0.25, 0.25], [0.25, 0.5], [2.25, 3.0], [3.75, 4.5], [-2.5, -3.5], [-3.75, -4.5]])
    )
    torch.testing.assert_close(cols, T([[2.0, 1.0, 1.0, 2.0, 1.0, 1.5], [0.0, 3.0, 3.0, 4.0, 3.0, 3.0]]))


def test_compact_writes_the_dense_residual_exactly():
    rows, cols = torch.arange(6.0).reshape(3, 2), torch.arange(9.0).reshape(3, 3)  # [R 3, in 2], [out 3, R 3]
    kept = compact(rows[:2], cols[:, :2])  # R = 2 <= min(3, 2): unchanged
    assert same_arrays({"r": kept[0], "c": kept[1]}, {"r": rows[:2], "c": cols[:, :2]})
    a, b = compact(rows, cols)  # R = 3 > 2, in = 2 <= out = 3: rows I_2, columns the dense residual
    assert torch.equal(a, torch.eye(2)) and torch.equal(b, T([[10.0, 13.0], [28.0, 40.0], [46.0, 67.0]]))
    a, b = compact(torch.arange(9.0).reshape(3, 3), torch.ones(2, 3))  # out 2 < in 3: rows the dense, columns I_2
    assert torch.equal(b, torch.eye(2)) and torch.equal(a, T([[9.0, 12.0, 15.0], [9.0, 12.0, 15.0]]))


@pytest.mark.parametrize("scaling", ["fixed", "rank"])
def test_the_aggregate_is_exactly_the_mean_of_the_clients_models(scaling):
    torch.manual_seed(5)
    clients = [ClientInfo(0, 1, 2), ClientInfo(1, 2, 3), ClientInfo(2, 3, 5)]
    st = FedExLoRA(LoraSettings(r_max=3, lora_alpha=6.0, scaling=scaling))
    state = st.initialize({"m": (7, 9)}, clients)
    for rnd, taking_part in ((1, [0, 1, 2]), (2, [0, 2]), (3, [0, 1, 2]), (4, [1, 2])):
        glob, s = st.deploy(state)
        ins = st.configure(rnd, state, clients)
        reps, models = {}, {}
        for c in clients:
            scale = st.s.scale(c.rank)
            torch.testing.assert_close(delta(ins[c.cid].arrays, scale), delta(glob, s), rtol=1e-5, atol=1e-5)
            if c.cid not in taking_part:
                continue
            trained = {k: v + torch.randn_like(v) if k in (A_KEY, B_KEY) else v for k, v in ins[c.cid].arrays.items()}
            reps[c.cid] = Reply({k: trained[k] for k in (A_KEY, B_KEY)}, c.num_examples)
            models[c.cid] = delta(trained, scale)
        total = sum(reps[c].num_examples for c in reps)
        state = st.aggregate(rnd, state, reps)
        glob, s = st.deploy(state)
        mean = sum(reps[c].num_examples / total * models[c] for c in reps)
        torch.testing.assert_close(delta(glob, s), mean, rtol=1e-5, atol=1e-5)
    assert state.arrays[MA].shape[0] <= 7  # compacted to at most min(out, in) factor pairs


def test_equal_ranks_and_identical_clients_are_fedavg_with_no_residual():
    torch.manual_seed(4)
    clients = [ClientInfo(i, 2, n) for i, n in enumerate([2, 5, 1])]
    settings = LoraSettings(r_max=2, lora_alpha=4.0)
    A, B = torch.randn(2, 30), torch.randn(20, 2)
    reps = {c.cid: Reply({A_KEY: A.clone(), B_KEY: B.clone()}, c.num_examples) for c in clients}
    state = FedExLoRA(settings).initialize({"m": (20, 30)}, clients)
    got = FedExLoRA(settings).aggregate(1, state, reps)
    ref = FedAvg(settings).aggregate(1, state, reps)
    assert torch.equal(got.arrays[A_KEY], ref.arrays[A_KEY]) and torch.equal(got.arrays[B_KEY], ref.arrays[B_KEY])
    assert got.arrays[MA].shape == (3 * 2 + 2, 30)  # the paper's rows: p_k s A_k and -s Abar, no fold rows
    residual = got.arrays[MB].double() @ got.arrays[MA].double()
    torch.testing.assert_close(residual, torch.zeros(20, 30, dtype=torch.float64), atol=1e-5, rtol=0)


def test_export_is_one_rank_for_every_layer_and_the_global_delta_exactly():
    torch.manual_seed(6)
    clients = [ClientInfo(0, 1, 1), ClientInfo(1, 2, 2)]
    st = FedExLoRA(LoraSettings(r_max=2, lora_alpha=2.0))
    state = st.initialize({"m": (8, 9), "n": (3, 9)}, clients)
    reps = {}
    for c in clients:
        arrays = st.configure(1, state, clients)[c.cid].arrays
        reps[c.cid] = Reply(
            {k: torch.randn_like(v) for k, v in arrays.items() if k.endswith(".weight")}, c.num_examples
        )
    new = st.aggregate(1, state, reps)
    out, scale = st.export(new)
    assert scale == 1.0 and len({v.shape[0] for k, v in out.items() if k.endswith("lora_A.weight")}) == 1
    glob, s = st.deploy(new)
    for m in ("m", "n"):
        torch.testing.assert_close(delta(out, 1.0, m), delta(glob, s, m), rtol=1e-5, atol=1e-5)


def test_robust_rules_and_server_optimisers_are_refused_with_the_reason():
    with pytest.raises(ConfigError, match="fedex_lora cannot aggregate robustly.*residual"):
        tiny_config("strategy.name=fedex_lora", "privacy.mode=central", "privacy.clip_norm=1.0")
    with pytest.raises(ConfigError, match="fedex_lora cannot take a server optimiser.*do not keep their shapes"):
        tiny_config("strategy.name=fedex_lora", "server_optimizer.name=adam", "server_optimizer.lr=0.01")


def test_end_to_end_tiny_run_every_client_runs_the_global_model(tmp_path):
    cfg = tiny_config("strategy.name=fedex_lora")
    prep = tiny_prepared(cfg)
    summary = run_method(prep, cfg, tmp_path / "run")
    ls = lines(tmp_path / "run")
    assert summary["aggregated_rounds"] == 3
    assert sum(v["loss"] for v in ls[-1]["eval"].values()) < sum(v["loss"] for v in ls[0]["eval"].values())
    config = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert config["lora_alpha"] == config["r"]  # scale 1: the residual and s Abar in one adapter
    state, _, mr = tiny_run(tmp_path / "again", cfg, prep)
    glob, s = mr.strategy.deploy(state)
    for m in ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"):
        for c in mr.clients:
            arrays, sc = mr.strategy.deploy(state, c.cid)
            torch.testing.assert_close(delta(arrays, sc, m), delta(glob, s, m), rtol=1e-4, atol=1e-6)
    assert torch.equal(state.arrays[merged_key("model.layers.1.self_attn.q_proj", "A")], torch.eye(64))  # compacted


def test_a_crashed_run_resumes_to_the_same_state(tmp_path):
    full, resumed = crash_and_resume(tmp_path, tiny_config("strategy.name=fedex_lora"))
    assert same_arrays(resumed.arrays, full.arrays)
