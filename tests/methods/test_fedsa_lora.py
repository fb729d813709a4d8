"""FedSA-LoRA (Guo et al., ICLR 2025): only A travels and is averaged, each client keeps its own B.
Hand-computed aggregation (plain, robust, secure), the client hooks, an end-to-end tiny run with
its export, and an exact resume (global A and the clients' kept B's).

Notation as in test_aggregation_rules: one layer out = in = 2, r_max = 2; client 1 rank 1 (n 1),
client 2 rank 2 (n 3).
"""

import pytest
import torch
from tiny_federation import crash_and_resume, lines, same_arrays, tiny_config, tiny_prepared, tiny_run

from nestfed.config import PrivacyConfig, RobustConfig
from nestfed.experiments.run import run_method
from nestfed.federation.hooks import FitContext
from nestfed.federation.messages import ClientInfo, Reply
from nestfed.federation.robust import BlockRule
from nestfed.federation.run_dir import RunDir
from nestfed.federation.secure_sum import layout, plain_sum
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.fedavg.strategy import FedAvg
from nestfed.methods.fedsa_lora.strategy import OWN_B, FedSAHooks, FedSALoRA, holder_mean, rank_segments
from nestfed.nn.lora import module_shapes

A_KEY = "base_model.model.m.lora_A.weight"
B_KEY = "base_model.model.m.lora_B.weight"
T = torch.tensor
CLIENTS = [ClientInfo(1, 1, 1), ClientInfo(2, 2, 3)]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def start(clients=CLIENTS):
    st = FedSALoRA(LoraSettings(r_max=2, lora_alpha=2.0))
    state = st.initialize({"m": (2, 2)}, clients)
    state.arrays[A_KEY] = T([[1.0, 1.0], [1.0, 1.0]])
    return st, state


def test_only_a_travels_and_is_averaged_over_the_clients_holding_each_row():
    st, state = start()
    ins = st.configure(1, state, CLIENTS)
    assert set(ins[1].arrays) == {A_KEY} and ins[1].arrays[A_KEY].shape == (1, 2)
    assert ins[2].expect == {A_KEY: (2, 2)}  # no B comes back
    new = st.aggregate(
        1, state, {1: Reply({A_KEY: T([[1.0, 2.0]])}, 1), 2: Reply({A_KEY: T([[3.0, 4.0], [5.0, 6.0]])}, 3)}
    )
    # row 0: (1 * [1, 2] + 3 * [3, 4]) / 4; row 1: client 2 alone (no zero-padding dilution)
    torch.testing.assert_close(new.arrays[A_KEY], T([[2.5, 3.5], [5.0, 6.0]]))
    assert torch.equal(new.arrays[B_KEY], torch.zeros(2, 2))  # there is no global B
    assert torch.equal(state.arrays[A_KEY], T([[1.0, 1.0], [1.0, 1.0]])), "aggregate must not mutate its input"


def test_a_row_no_replying_client_holds_keeps_its_value():
    assert rank_segments([4, 2, 4]) == [(0, 2), (2, 4)]
    got = holder_mean(T([[1.0], [7.0]]), [T([[2.0]]), T([[4.0]])], [1.0, 3.0])
    torch.testing.assert_close(got, T([[3.5], [7.0]]))
    with pytest.raises(ValueError, match="exceeds the global rank"):
        holder_mean(T([[1.0]]), [T([[2.0], [3.0]])], [1.0])


def test_equal_ranks_are_fedavg_on_a_bit_for_bit():
    torch.manual_seed(3)
    clients = [ClientInfo(i, 4, n) for i, n in enumerate([5, 1, 7])]
    settings = LoraSettings(r_max=4, lora_alpha=8.0)
    state = FedAvg(settings).initialize({"m": (6, 5)}, clients)
    reps = {c.cid: Reply({A_KEY: torch.randn(4, 5), B_KEY: torch.randn(6, 4)}, c.num_examples) for c in clients}
    ref = FedAvg(settings).aggregate(1, state, reps)
    got = FedSALoRA(settings).aggregate(
        1, state, {c: Reply({A_KEY: r.arrays[A_KEY]}, r.num_examples) for c, r in reps.items()}
    )
    assert torch.equal(got.arrays[A_KEY], ref.arrays[A_KEY])


def test_robust_median_works_per_rank_segment_of_a():
    clients = [ClientInfo(1, 1, 1), ClientInfo(2, 2, 1), ClientInfo(3, 2, 1)]
    st, state = start(clients)
    reps = {
        1: Reply({A_KEY: T([[9.0, 1.0]])}, 1),
        2: Reply({A_KEY: T([[3.0, 4.0], [5.0, 6.0]])}, 1),
        3: Reply({A_KEY: T([[2.0, 8.0], [7.0, 0.0]])}, 1),
    }
    new = st.robust_aggregate(1, state, reps, BlockRule(RobustConfig(rule="median"), PrivacyConfig()))
    # row 0, three members: medians of (9, 3, 2) and (1, 4, 8); row 1, two members: means of the middle two
    torch.testing.assert_close(new.arrays[A_KEY], T([[3.0, 4.0], [6.0, 3.0]]))


def test_a_robust_rule_runs_per_rank_segment_in_a_real_run(tmp_path):
    tiny_run(tmp_path / "run", tiny_config("strategy.name=fedsa_lora", "robust.rule=median", "federation.rounds=1"))
    blocks = lines(tmp_path / "run")[1]["robust"]
    assert {k: v["members"] for k, v in blocks.items()} == {"rank 0:2": [0, 1, 2], "rank 2:4": [1, 2], "rank 4:8": [2]}


def test_secure_sums_rebuild_the_holder_mean():
    st, state = start()
    ins = st.configure(1, state, CLIENTS)
    reps = {1: Reply({A_KEY: T([[1.0, 2.0]])}, 1), 2: Reply({A_KEY: T([[3.0, 4.0], [5.0, 6.0]])}, 3)}
    secure = plain_sum(
        {c: ins[c].arrays for c in reps},
        {c: r.arrays for c, r in reps.items()},
        {1: 1, 2: 3},
        layout(ins[c].expect for c in reps),
    )
    torch.testing.assert_close(st.aggregate_secure(1, state, secure).arrays[A_KEY], T([[2.5, 3.5], [5.0, 6.0]]))


def test_the_hooks_keep_b_on_the_client_and_evaluate_with_it():
    cfg = tiny_config("strategy.name=fedsa_lora")
    prep = tiny_prepared(cfg)
    model = prep.backbone.model
    (m, (out_f, in_f)), *_ = sorted(module_shapes(model).items())
    a, b = f"base_model.model.{m}.lora_A.weight", f"base_model.model.{m}.lora_B.weight"
    hooks = FedSAHooks()
    ctx = FitContext(0, {"rank": 2}, {}, model, prep.data[0], cfg.train)
    loaded = hooks.arrays_to_load(ctx, {a: torch.ones(2, in_f)})
    assert torch.equal(loaded[b], torch.zeros(out_f, 2))  # B = 0 before the client's first round
    sent = hooks.reply_arrays(ctx, {a: torch.ones(2, in_f), b: torch.full((out_f, 2), 3.0)})
    assert set(sent) == {a} and torch.equal(ctx.state[OWN_B][b], torch.full((out_f, 2), 3.0))
    assert torch.equal(hooks.arrays_to_load(ctx, {a: torch.ones(2, in_f)})[b], torch.full((out_f, 2), 3.0))
    ev = hooks.evaluation_arrays(ctx.state, {a: torch.ones(1, in_f), b: torch.zeros(out_f, 1)})
    assert torch.equal(ev[b], torch.full((out_f, 1), 3.0))  # its own B, at the deployed rank
    plain = {a: torch.ones(1, in_f), b: torch.zeros(out_f, 1)}
    assert hooks.evaluation_arrays({}, plain) is plain  # a client that never trained runs B = 0
    # a client that trained only 2 columns (an elastic rank) runs and trains B = 0 on the others
    wide = torch.cat([torch.full((out_f, 2), 3.0), torch.zeros(out_f, 2)], dim=1)
    assert torch.equal(hooks.evaluation_arrays(ctx.state, {a: torch.ones(4, in_f), b: torch.zeros(out_f, 4)})[b], wide)
    ctx.config["rank"] = 4
    assert torch.equal(hooks.arrays_to_load(ctx, {a: torch.ones(4, in_f)})[b], wide)
    # trained at rank 1 this round: its first column is replaced, the second kept
    ctx.config["rank"] = 1
    hooks.reply_arrays(ctx, {a: torch.ones(1, in_f), b: torch.full((out_f, 1), 7.0)})
    assert torch.equal(ctx.state[OWN_B][b], torch.cat([torch.full((out_f, 1), 7.0), torch.full((out_f, 1), 3.0)], 1))


def test_end_to_end_tiny_run_and_export(tmp_path):
    cfg = tiny_config("strategy.name=fedsa_lora")
    summary = run_method(tiny_prepared(cfg), cfg, tmp_path / "run")
    ls = lines(tmp_path / "run")
    assert summary["aggregated_rounds"] == 3 and "B = 0" in summary["adapter_note"]
    loss = [[ln["eval"][str(c)]["loss"] for c in range(3)] for ln in ls]
    assert sum(loss[-1]) < sum(loss[0])
    for c in range(3):  # with the global B = 0 a client evaluated without its own B would run the backbone
        assert loss[-1][c] != loss[0][c]
        assert ls[1]["clients"][str(c)]["params_up"] == 2 * [2, 4, 8][c] * 64  # A of q and v only
    ck = RunDir(tmp_path / "run").latest_checkpoint(True)
    own = ck.client_state[2][OWN_B]
    assert {tuple(v.shape) for v in own.values()} == {(64, 8), (32, 8)} and all(v.any() for v in own.values())
    assert not any(v.any() for k, v in ck.state.arrays.items() if k.endswith("lora_B.weight"))


def test_a_crashed_run_resumes_to_the_same_a_and_the_same_kept_b(tmp_path):
    full, resumed = crash_and_resume(tmp_path, tiny_config("strategy.name=fedsa_lora"))
    assert same_arrays(resumed.arrays, full.arrays)
    kept = [RunDir(tmp_path / d).latest_checkpoint(True).client_state for d in ("full", "part")]
    assert kept[0].keys() == kept[1].keys() == {0, 1, 2}
    for c in kept[0]:
        assert same_arrays(kept[0][c][OWN_B], kept[1][c][OWN_B])
    assert [ln["eval"] for ln in lines(tmp_path / "part")] == [ln["eval"] for ln in lines(tmp_path / "full")]
