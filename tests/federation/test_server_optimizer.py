"""Server optimisers (Reddi et al., ICLR 2021, "Adaptive Federated Optimization", Algorithm 2; FedAvgM):
each optimiser over two rounds against the paper's formulas in plain numpy and literal values, the
identity bit for bit on a tiny run, the frozen-entries rule on a heterogeneous-rank PreLort
aggregate (plain, robust and secure), FedSLM's cores, an exact resume, what clients and exports
never see, and bad values refused with one line naming the key."""

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from tiny_federation import crash_and_resume, lines, same_arrays, tiny_config, tiny_run, with_build

from nestfed import config, methods
from nestfed.config import PrivacyConfig, RobustConfig, ServerOptimizerConfig
from nestfed.errors import ConfigError
from nestfed.federation.messages import ClientInfo, GlobalState, Reply
from nestfed.federation.robust import BlockRule
from nestfed.federation.run_dir import RunDir
from nestfed.federation.safeguards import Safeguards
from nestfed.federation.secure_sum import layout, plain_sum
from nestfed.federation.server_optimizer import server_step
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.fedslm.strategy import FedSLM, SLMGroups
from nestfed.methods.prelort.strategy import PreLort
from nestfed.nn.svd import core_key

ROOT = Path(__file__).resolve().parents[2]
X0 = np.array([[0.5, -1.0, 2.0]])
DELTAS = [np.array([[0.1, -0.2, 0.3]]), np.array([[0.05, 0.4, -0.01]])]
TAU, B1, B2 = 1e-3, 0.9, 0.99


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def paper(name, lr, mu=0.9):
    """x_1, x_2 and the moments after round 2 from the formulas (numpy, float64): FedAvgM
    m_t = mu m_{t-1} + D_t, x += lr m_t; Algorithm 2 lines 11-15 with m_{-1} = 0, v_{-1} = tau^2."""
    x, m, v, xs = X0.copy(), np.zeros_like(X0), np.full_like(X0, TAU**2), []
    for d in DELTAS:
        if name == "sgd":
            x = x + lr * d
        elif name == "sgdm":
            m = mu * m + d
            x = x + lr * m
        else:
            m = B1 * m + (1 - B1) * d
            if name == "adagrad":
                v = v + d**2
            elif name == "yogi":
                v = v - (1 - B2) * d**2 * np.sign(v - d**2)
            else:
                v = B2 * v + (1 - B2) * d**2
            x = x + lr * m / (np.sqrt(v) + TAU)
        xs.append(x)
    return xs, m, v


@pytest.mark.parametrize("name", ["sgd", "sgdm", "adagrad", "adam", "yogi"])
def test_two_rounds_follow_the_papers_formulas(name):
    o = ServerOptimizerConfig(name=name, lr=0.5, momentum=0.9, beta1=B1, beta2=B2, tau=TAU)
    state = GlobalState({"w": torch.tensor(X0)}, {"round": 0})
    want, m, v = paper(name, 0.5)
    for t, d in enumerate(DELTAS):
        state, facts = server_step(o, state, GlobalState({"w": state.arrays["w"] + torch.tensor(d)}, {"round": t + 1}))
        np.testing.assert_allclose(state.arrays["w"].numpy(), want[t], rtol=1e-13, atol=1e-15)
        assert state.meta == {"round": t + 1}  # the aggregate's meta is kept
        assert facts["server_optimizer"]["name"] == name and facts["server_optimizer"]["frozen_entries"] == 0
    step2 = want[1] - want[0]
    assert facts["server_optimizer"]["step_norm"] == pytest.approx(np.linalg.norm(step2), rel=1e-9)
    assert facts["server_optimizer"]["pseudo_gradient_norm"] == pytest.approx(np.linalg.norm(DELTAS[1]), rel=1e-9)
    kept = {"sgd": set(), "sgdm": {"m/w"}}.get(name, {"m/w", "v/w"})
    assert set(state.optimizer) == kept
    if "m/w" in kept:
        np.testing.assert_allclose(state.optimizer["m/w"].numpy(), m, rtol=1e-13)
    if "v/w" in kept:
        np.testing.assert_allclose(state.optimizer["v/w"].numpy(), v, rtol=1e-13)


def test_literal_values_by_hand():
    """A few entries worked by hand. FedAvgM (lr 0.5, mu 0.9), entry 1: m_1 = -0.2, m_2 = 0.9 * -0.2 + 0.4
    = 0.22, x_2 = -1 + 0.5 (-0.2) + 0.5 * 0.22 = -0.99. FedYogi, entry 2: v_0 = tau^2 = 1e-6 < D_1^2 = 0.09
    so v_1 = 1e-6 + 0.01 * 0.09 = 9.01e-4; D_2^2 = 1e-4 < v_1 so v_2 = 9.01e-4 - 0.01 * 1e-4 = 9.00e-4
    (Yogi's additive decrease). FedAdagrad, entry 0 after round 1: m_1 = 0.1 * 0.1 = 0.01, v_1 = 1e-6
    + 0.01 = 0.010001, x_1 = 0.5 + 0.5 * 0.01 / (0.1000049999875 + 0.001) = 0.5 + 0.0495025 = 0.5495025."""
    xs, _, _ = paper("sgdm", 0.5)
    assert xs[1][0, 1] == pytest.approx(-0.99, abs=1e-15)
    _, _, v = paper("yogi", 0.5)
    assert v[0, 2] == pytest.approx(9.0e-4, abs=1e-15)
    xs, _, _ = paper("adagrad", 0.5)
    assert xs[0][0, 0] == pytest.approx(0.5 + 0.005 / (np.sqrt(0.010001) + 0.001), abs=1e-15)
    assert xs[0][0, 0] == pytest.approx(0.5495025, abs=1e-7)
    o = ServerOptimizerConfig(name="yogi", lr=0.5, beta1=B1, beta2=B2, tau=TAU)
    s = GlobalState({"w": torch.tensor(X0)})
    for d in DELTAS:
        s, _ = server_step(o, s, GlobalState({"w": s.arrays["w"] + torch.tensor(d)}))
    assert float(s.optimizer["v/w"][0, 2]) == pytest.approx(9.0e-4, abs=1e-15)


def test_the_identity_is_the_aggregate_itself_and_integer_arrays_pass_through():
    new = GlobalState({"w": torch.tensor([1.0, -0.0]), "i": torch.tensor([3])}, {})
    out, facts = server_step(ServerOptimizerConfig(), GlobalState({"w": torch.zeros(2)}), new)
    assert out is new and facts == {}
    old = GlobalState({"w": torch.zeros(2), "i": torch.tensor([1])})
    out, facts = server_step(ServerOptimizerConfig(name="adam", lr=0.1), old, new)
    assert torch.equal(out.arrays["i"], torch.tensor([3])) and set(out.optimizer) == {"m/w", "v/w"}
    # entry 1 moved by -0.0, which is no update: frozen, its bits (-0.0) kept; entry 0 moved by 1
    assert facts["server_optimizer"]["frozen_entries"] == 1 and str(out.arrays["w"][1].item()) == "-0.0"
    assert out.arrays["w"][0].item() == pytest.approx(0.1 * 0.1 / (np.sqrt(1e-6 * 0.99 + 0.01) + 1e-3), rel=1e-6)
    with pytest.raises(ValueError, match="no pseudo-gradient"):
        server_step(ServerOptimizerConfig(name="adam"), GlobalState({"w": torch.zeros(3)}), new)


def test_sgdm_with_momentum_0_and_lr_1_equals_no_optimiser_bit_for_bit(tmp_path):
    plain, _, _ = tiny_run(tmp_path / "plain", tiny_config())
    avgm, _, _ = tiny_run(tmp_path / "avgm", tiny_config("server_optimizer.name=sgdm", "server_optimizer.momentum=0.0"))
    assert same_arrays(plain.arrays, avgm.arrays)
    assert plain.optimizer == {} and set(avgm.optimizer) == {f"m/{k}" for k in avgm.arrays}
    a, b = lines(tmp_path / "plain"), lines(tmp_path / "avgm")
    assert [ln["eval"] for ln in a] == [ln["eval"] for ln in b]
    assert all("server_optimizer" not in ln for ln in a)  # the default's metrics line is today's
    assert [ln["server_optimizer"]["name"] for ln in b[1:]] == ["sgdm"] * 3
    # the default writes today's checkpoint: the arrays only
    with safe_open(str(RunDir(tmp_path / "plain").checkpoint_path(3)), "pt") as f:
        assert all(k.startswith("global/") for k in f.keys())


def _prelort_round(o, state, replies, rule=None):
    guard = Safeguards(optimizer=o) if rule is None else Safeguards(rule=rule, optimizer=o)
    return guard.aggregate(PreLort(LoraSettings(r_max=4, lora_alpha=8.0)), 1, state, replies)


A, B = "base_model.model.m.lora_A.weight", "base_model.model.m.lora_B.weight"


def _hetero_state():
    g = torch.Generator().manual_seed(3)
    arrays = {
        A: torch.randn(4, 3, generator=g, dtype=torch.float64),
        B: torch.randn(2, 4, generator=g, dtype=torch.float64),
    }
    return GlobalState(arrays, {"ranks": {"0": 2, "1": 4}})


def _reply(state, rank, shift, n=10):
    return Reply({A: state.arrays[A][:rank] + shift, B: state.arrays[B][:, :rank] - shift}, n)


@pytest.mark.parametrize("rule", [None, BlockRule(RobustConfig(rule="median"), PrivacyConfig())])
def test_rank_rows_no_accepted_client_holds_are_frozen_in_value_and_moments(rule):
    """PreLort, ranks 2 and 4 (segments [0, 2) and [2, 4)). Round 1: both reply, every row moves.
    Round 2: only the rank-2 client: rows 2-3 of A and columns 2-3 of B are left unchanged by the
    segment-wise rule (and by its robust block form), so under FedAdam they keep their values, m
    and v exactly (no stale momentum), while rows 0-1 take the paper's step."""
    o = ServerOptimizerConfig(name="adam", lr=0.05, beta1=B1, beta2=B2, tau=TAU)
    s0 = _hetero_state()
    s1, f1 = _prelort_round(o, s0, {0: _reply(s0, 2, 0.1), 1: _reply(s0, 4, 0.3)}, rule)
    assert f1["server_optimizer"]["frozen_entries"] == 0
    s2, f2 = _prelort_round(o, s1, {0: _reply(s1, 2, -0.2)}, rule)
    assert f2["server_optimizer"]["frozen_entries"] == 2 * 3 + 2 * 2
    for key, tail in ((A, (slice(2, 4), slice(None))), (B, (slice(None), slice(2, 4)))):
        assert torch.equal(s2.arrays[key][tail], s1.arrays[key][tail])
        for mom in ("m/", "v/"):
            assert torch.equal(s2.optimizer[mom + key][tail], s1.optimizer[mom + key][tail])
    # the held rows, by the formulas: round 1 D = mean(0.1, 0.3) on rows 0-1 of A (-mean on B's columns)
    # and 0.3 on rows 2-3; round 2 D = -0.2 on rows 0-1
    m, v, x = 0.0, TAU**2, s0.arrays[A][0, 0].item()
    for d in (0.2, -0.2):
        m = B1 * m + (1 - B1) * d
        v = B2 * v + (1 - B2) * d * d
        x = x + 0.05 * m / (np.sqrt(v) + TAU)
    assert s2.arrays[A][0, 0].item() == pytest.approx(x, abs=1e-14)
    m_tail = (1 - B1) * 0.3
    v_tail = B2 * TAU**2 + (1 - B2) * 0.09
    x_tail = s0.arrays[A][3, 2].item() + 0.05 * m_tail / (np.sqrt(v_tail) + TAU)
    assert s2.arrays[A][3, 2].item() == pytest.approx(x_tail, abs=1e-14)


def test_secure_aggregation_composes_and_keeps_the_rule():
    """From secure sums the rebuild is the same segment mean (up to float64 rounding), and the step
    on it is the same: the optimiser needs only the aggregate, never a single update."""
    o = ServerOptimizerConfig(name="yogi", lr=0.05)
    st = PreLort(LoraSettings(r_max=4, lora_alpha=8.0))
    s0 = _hetero_state()
    replies = {0: _reply(s0, 2, 0.1), 1: _reply(s0, 4, 0.3, n=30)}
    sent = {c: {A: s0.arrays[A][:r], B: s0.arrays[B][:, :r]} for c, r in ((0, 2), (1, 4))}
    lay = layout([{k: tuple(v.shape) for k, v in sent[c].items()} for c in (0, 1)])
    secure = plain_sum(sent, {c: r.arrays for c, r in replies.items()}, {0: 10, 1: 30}, lay)
    guard = Safeguards(optimizer=o)
    plain, _ = guard.aggregate(st, 1, s0, replies)
    sec, facts = guard.aggregate_secure(st, 1, s0, secure)
    for k in (A, B):
        assert torch.allclose(sec.arrays[k], plain.arrays[k], atol=1e-12)
    assert facts["server_optimizer"]["name"] == "yogi" and "robust" not in facts


def test_fedslm_cores_an_uncovered_entry_is_frozen():
    """FedSLM's coverage fusion keeps an entry no replying group covers: under FedAvgM it does not
    move, whatever momentum it carries; covered entries take m_t = mu m_{t-1} + D_t."""
    L = "model.layers.0.mlp.up_proj"
    groups = SLMGroups([0.5, 1.0], [{L: 1}, {L: 2}], {0: 0, 1: 1}, {L: torch.tensor([3.0, 2.0])})
    st = FedSLM(groups, "coverage")
    o = ServerOptimizerConfig(name="sgdm", lr=1.0, momentum=0.5)
    guard = Safeguards(optimizer=o)
    s0 = st.initialize(None, [ClientInfo(0, 1, 4), ClientInfo(1, 2, 4)])
    K = core_key(L)
    s1, _ = guard.aggregate(st, 1, s0, {1: Reply({K: s0.arrays[K] + 1.0}, 4)})  # D = 1 everywhere
    assert torch.equal(s1.arrays[K], torch.tensor([[4.0, 1.0], [1.0, 3.0]]))
    s2, f2 = guard.aggregate(st, 2, s1, {0: Reply({K: s1.arrays[K][:1, :1] + 2.0}, 4)})  # only (0, 0) covered
    # (0, 0): m = 0.5 * 1 + 2 = 2.5 -> 6.5; the three others are frozen (no stale momentum 0.5 * 1)
    assert torch.equal(s2.arrays[K], torch.tensor([[6.5, 1.0], [1.0, 3.0]]))
    assert f2["server_optimizer"]["frozen_entries"] == 3


def test_crash_and_resume_with_fedadam_is_exact(tmp_path):
    cfg = tiny_config("server_optimizer.name=adam", "server_optimizer.lr=0.01")
    full, resumed = crash_and_resume(tmp_path, cfg)
    assert same_arrays(resumed.arrays, full.arrays)
    assert set(full.optimizer) == {p + k for k in full.arrays for p in ("m/", "v/")}
    assert same_arrays(resumed.optimizer, full.optimizer)
    assert [ln["eval"] for ln in lines(tmp_path / "part")] == [ln["eval"] for ln in lines(tmp_path / "full")]
    with safe_open(str(RunDir(tmp_path / "full").checkpoint_path(2)), "pt") as f:
        assert {k.split("/")[0] for k in f.keys()} == {"global", "optimizer"}


@pytest.mark.parametrize(
    "name,extra", [("zeropad", ()), ("hetlora", ()), ("ffa_lora", ()), ("fednl", ("lora.ranks=[4]",))]
)
def test_other_lora_strategies_compose(tmp_path, name, extra):
    """Zero-padding, norm weights with pruning, B-only updates (A never moves: every A entry is frozen)
    and FedNL's memory rules beside its LoRA: every floating array gets its moments."""
    cfg = tiny_config(
        f"strategy.name={name}", "server_optimizer.name=adam", "server_optimizer.lr=0.01", "federation.rounds=2", *extra
    )
    state, _, _ = tiny_run(tmp_path / name, cfg)
    assert set(state.optimizer) == {p + k for k in state.arrays for p in ("m/", "v/")}
    assert all(torch.isfinite(v).all() for v in list(state.arrays.values()) + list(state.optimizer.values()))
    facts = lines(tmp_path / name)[2]["server_optimizer"]
    a_entries = sum(v.numel() for k, v in state.arrays.items() if k.endswith("lora_A.weight"))
    assert facts["step_norm"] > 0 and (facts["frozen_entries"] == a_entries if name == "ffa_lora" else True)


def test_a_non_finite_round_keeps_the_old_moments_too(tmp_path, monkeypatch):
    """Round 2's aggregate carries a NaN: the round loop keeps the global arrays of round 1 and, with
    them, round 1's m and v (the NaN never reaches the moments of a later round)."""
    home = methods.get("zeropad")

    def build(prep, cfg):
        mr = home.build(prep, cfg)
        real = mr.strategy.aggregate

        def aggregate(rnd, state, replies):
            new = real(rnd, state, replies)
            if rnd == 2:
                k = sorted(new.arrays)[0]
                new.arrays[k] = new.arrays[k] * float("nan")
            return new

        mr.strategy.aggregate = aggregate
        return mr

    monkeypatch.setitem(methods.REGISTRY, "zeropad", with_build("zeropad", build))
    cfg = tiny_config(
        "strategy.name=zeropad", "server_optimizer.name=adam", "server_optimizer.lr=0.01", "federation.rounds=2"
    )
    tiny_run(tmp_path / "r", cfg)
    rd = RunDir(tmp_path / "r")
    one, two = (rd.load_checkpoint(rd.checkpoint_path(r)).state for r in (1, 2))
    assert lines(tmp_path / "r")[2]["aggregated"] is False
    assert same_arrays(two.arrays, one.arrays) and same_arrays(two.optimizer, one.optimizer) and one.optimizer


def test_clients_deployments_and_the_export_never_see_the_optimiser_state(tmp_path):
    cfg = tiny_config("server_optimizer.name=yogi", "server_optimizer.lr=0.01", "federation.rounds=1")
    state, loop, mr = tiny_run(tmp_path / "r", cfg)
    assert state.optimizer
    st = mr.strategy
    payloads = [ins.arrays for ins in st.configure(2, state, mr.clients).values()]
    payloads += [st.deploy(state, c.cid)[0] for c in mr.clients] + [st.deploy(state)[0], st.export(state)[0]]
    for arrays in payloads:
        assert set(arrays) <= set(state.arrays) and not any(k.startswith(("m/", "v/")) for k in arrays)


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["server_optimizer.name=fedadam"],
            "server_optimizer.name: unknown server optimiser 'fedadam' (known: sgd, "
            "sgdm, adagrad, adam, yogi); did you mean 'adam'?",
        ),
        (["server_optimizer.lr=0"], "server_optimizer.lr: the server learning rate eta must be > 0, got 0"),
        (["server_optimizer.momentum=1.0"], "server_optimizer.momentum: mu must be in [0, 1), got 1.0"),
        (["server_optimizer.beta2=-0.1"], "server_optimizer.beta2: the decay parameters must be in [0, 1)"),
        (["server_optimizer.tau=0.0"], "server_optimizer.tau: the adaptivity tau must be > 0"),
        (['server_optimizer.tau="x"'], "server_optimizer.tau: expected a number"),
        (
            ["strategy.name=flora", "server_optimizer.name=adam"],
            "server_optimizer.name: flora cannot take a server optimiser: its global state is a stack",
        ),
        (
            ["strategy.name=flora", "server_optimizer.lr=0.5"],
            "server_optimizer.name: flora cannot take a server optimiser",
        ),
        (
            [
                "strategy.name=fednl",
                "lora.ranks=[4]",
                'lora.target_modules=["q_proj"]',
                "fednl.gate=constant",
                "server_optimizer.name=sgdm",
            ],
            "fednl cannot take a server optimiser ('sgdm') with fednl.gate = 'constant'",
        ),
    ],
)
def test_bad_values_exit_2_with_one_line_and_no_run_dir(tmp_path, cli, args, needle):
    sets = [a for s in args for a in ("--set", s)]
    r = cli("run", ROOT / "configs" / "tiny.toml", "--set", f"output.dir={tmp_path / 'runs'}", *sets, cwd=tmp_path)
    code, err = r.returncode, r.stderr
    assert code == 2 and needle in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_the_section_round_trips_and_the_refusals_follow_the_registry():
    cfg = methods.load_config(None, ["server_optimizer.name=yogi", "server_optimizer.lr=0.03"])
    assert cfg.server_optimizer == ServerOptimizerConfig(name="yogi", lr=0.03)
    assert '[server_optimizer]\nname = "yogi"\nlr = 0.03\n' in config.dumps_toml(cfg)
    assert methods.config_from_dict(config.to_dict(cfg)) == cfg
    assert config.differences(methods.load_config(None), cfg) == [
        "server_optimizer.lr: 1.0 -> 0.03",
        "server_optimizer.name: 'sgd' -> 'yogi'",
    ]
    refused = sorted(set(methods.REGISTRY) - set(methods.declaring(methods.Capability.SERVER_OPTIMIZER)))
    assert {"flora", "fedmkt"} <= set(refused) and not {"prelort", "zeropad", "hetlora", "fedslm"} & set(refused)
    with pytest.raises(ConfigError, match="fedmkt cannot take a server optimiser"):
        methods.load_config(None, ["strategy.name=fedmkt", "server_optimizer.name=adam"])
