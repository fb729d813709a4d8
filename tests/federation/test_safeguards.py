"""A client cannot game the server: huge updates, inflated n_k, a wrong dtype, updates above the
norm bound, a non-finite aggregate, and client metrics named like server fields (issue 11, part 1).
Faults are injected into real runs of the tiny federation."""

import math

import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm
from tiny_federation import crash_and_resume, lines, same_arrays, tiny_config, tiny_run, with_build

from nestfed.config import PrivacyConfig, ValidationConfig
from nestfed.errors import UpdateRejected
from nestfed.federation.messages import ClientInfo, Instruction, Reply
from nestfed.federation.privacy import epsilon
from nestfed.federation.safeguards import Safeguards
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.hetlora import HetLoRAOptions
from nestfed.methods.hetlora.strategy import HetLoRA


def poison_round_1(value, cid=1):
    """A ``wrap``: client ``cid`` fills its round-1 reply with ``value``."""

    def wrap(trainer):
        real = trainer.fit

        def fit(c, ins):
            r = real(c, ins)
            if c == cid and ins.config["round"] == 1:
                return Reply({k: torch.full_like(v, value) for k, v in r.arrays.items()}, r.num_examples, r.metrics)
            return r

        trainer.fit = fit
        return trainer

    return wrap


def test_hetlora_1e19_is_rejected_and_the_global_stays_finite():
    """The issue's case: HetLoRA, r_max 4, two clients of rank 4 on one 8x8 module, client 1's A and
    B filled with 1e19. Its norm weight overflowed float32 and the global became NaN; the weights are
    now recomputed in float64 when float32 overflows, and the screen rejects the reply anyway."""
    st = HetLoRA(LoraSettings(r_max=4, lora_alpha=8.0), HetLoRAOptions())
    clients = [ClientInfo(0, 4, 10), ClientInfo(1, 4, 10)]
    state = st.initialize({"m": (8, 8)}, clients)
    ins = st.configure(1, state, clients)
    good = Reply({k: v + 0.01 for k, v in ins[0].arrays.items()}, 10)
    bad = Reply({k: torch.full_like(v, 1e19) for k, v in ins[1].arrays.items()}, 10)
    unscreened = st.aggregate(1, state, {0: good, 1: bad})
    assert all(torch.isfinite(v).all() for v in unscreened.arrays.values())  # no overflow in the rule itself
    guard = Safeguards()
    with pytest.raises(UpdateRejected, match="overflows float32"):
        guard.screen(ins[1], bad, 10)
    kept, facts = guard.screen(ins[0], good, 10)
    new = st.aggregate(1, state, {0: kept})
    assert all(torch.isfinite(v).all() for v in new.arrays.values()) and facts["update_norm"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("method", ["hetlora", "fedavg", "zeropad", "prelort"])
def test_a_huge_reply_in_round_1_is_rejected_and_the_run_goes_on(tmp_path, method):
    ranks = "lora.ranks=[4,4,4]" if method in ("fedavg", "hetlora") else "lora.ranks=[2,4,8]"
    value = 1e19 if method == "hetlora" else 1e20
    state, loop, _ = tiny_run(tmp_path, tiny_config(f"strategy.name={method}", ranks), wrap=poison_round_1(value))
    ln = lines(tmp_path)
    assert list(ln[1]["rejected"]) == ["1"] and "overflows float32" in ln[1]["rejected"]["1"]
    assert all(ln[r]["rejected"] == {} and ln[r]["aggregated"] for r in (2, 3))  # no one poisoned afterwards
    assert all(math.isfinite(v["ppl"]) for r in (1, 2, 3) for v in ln[r]["eval"].values())
    assert all(torch.isfinite(v).all() for v in state.arrays.values())


@pytest.mark.slow
def test_with_a_norm_bound_1e6_never_reaches_the_global_model(tmp_path):
    cfg = tiny_config("validation.max_update_norm=1.0", "validation.on_norm=clip")
    state, _, _ = tiny_run(tmp_path, cfg, wrap=poison_round_1(1e6))
    c1 = lines(tmp_path)[1]["clients"]["1"]
    assert c1["status"] == "accepted" and c1["clipped_to"] == 1.0 and c1["update_norm"] > 1e6
    assert max(v.abs().max().item() for v in state.arrays.values()) < 10
    reject = tiny_config("validation.max_update_norm=1.0", "validation.on_norm=reject")
    tiny_run(tmp_path / "r", reject, wrap=poison_round_1(1e6))
    assert "above validation.max_update_norm = 1" in lines(tmp_path / "r")[1]["rejected"]["1"]


def instruction():
    sent = {"m.lora_A.weight": torch.zeros(2, 3), "m.lora_B.weight": torch.zeros(4, 2)}
    return Instruction(sent, {"rank": 2}, {k: tuple(v.shape) for k, v in sent.items()})


def test_norm_clip_by_hand():
    ins = instruction()
    reply = Reply({"m.lora_A.weight": torch.full((2, 3), 1.0), "m.lora_B.weight": torch.zeros(4, 2)}, 3)
    guard = Safeguards(ValidationConfig(max_update_norm=math.sqrt(6) / 2, on_norm="clip"))
    out, facts = guard.screen(ins, reply, 3)
    assert facts["update_norm"] == pytest.approx(math.sqrt(6))
    assert torch.allclose(out.arrays["m.lora_A.weight"], torch.full((2, 3), 0.5))  # halved to the bound


def test_inflated_num_examples_is_refused_or_capped():
    ins = instruction()
    reply = Reply({k: v + 0.1 for k, v in ins.arrays.items()}, 10**9)
    with pytest.raises(UpdateRejected, match="num_examples 1000000000 is above the 16 the client declared"):
        Safeguards().screen(ins, reply, 16)
    out, facts = Safeguards(ValidationConfig(num_examples="cap")).screen(ins, reply, 16)
    assert out.num_examples == 16 and facts["num_examples_capped_from"] == 10**9


@pytest.mark.slow
def test_inflated_num_examples_in_a_run_is_rejected(tmp_path):
    def liar(trainer):
        real = trainer.fit

        def fit(c, ins):
            r = real(c, ins)
            return Reply(r.arrays, 10**9 if c == 2 else r.num_examples, r.metrics)

        trainer.fit = fit
        return trainer

    tiny_run(tmp_path, tiny_config("federation.rounds=1"), wrap=liar)
    assert "declared when it joined" in lines(tmp_path)[1]["rejected"]["2"]


def test_a_wrong_dtype_is_rejected(tmp_path):
    def double(trainer):
        real = trainer.fit

        def fit(c, ins):
            r = real(c, ins)
            return Reply(
                {k: v.double() for k, v in r.arrays.items()} if c == 0 else r.arrays, r.num_examples, r.metrics
            )

        trainer.fit = fit
        return trainer

    tiny_run(tmp_path, tiny_config("federation.rounds=1"), wrap=double)
    assert "dtype float64, but float32 was sent" in lines(tmp_path)[1]["rejected"]["0"]


@pytest.mark.slow
def test_a_non_finite_aggregate_is_never_the_new_global_state(tmp_path):
    cfg = tiny_config("federation.rounds=2")
    from nestfed import methods

    real_build = methods.get("prelort").build

    def build(prep, c):
        mr = real_build(prep, c)
        real_aggregate = mr.strategy.aggregate

        def aggregate(rnd, state, replies):
            new = real_aggregate(rnd, state, replies)
            if rnd == 1:
                k = next(iter(new.arrays))
                new.arrays[k] = new.arrays[k] * float("nan")
            return new

        mr.strategy.aggregate = aggregate
        return mr

    from unittest import mock

    with mock.patch.dict(methods.REGISTRY, {"prelort": with_build("prelort", build)}):
        state, loop, mr = tiny_run(tmp_path, cfg)
    ln = lines(tmp_path)
    assert ln[1]["aggregated"] is False and "non-finite values" in ln[1]["aggregate_rejected"]
    assert ln[2]["aggregated"] is True and ln[2]["rejected"] == {}
    assert all(torch.isfinite(v).all() for v in state.arrays.values())
    assert any("global state kept" in m for m in loop.log)


def analytic_gaussian_epsilon(sigma: float, delta: float) -> float:
    """The exact epsilon of the Gaussian mechanism with sensitivity 1 and noise sigma (Balle and
    Wang 2018, Theorem 8): delta(eps) = Phi(1/(2 sigma) - eps sigma) - e^eps Phi(-1/(2 sigma) - eps sigma)."""

    def gap(eps):
        return norm.cdf(0.5 / sigma - eps * sigma) - math.exp(eps) * norm.cdf(-0.5 / sigma - eps * sigma) - delta

    return brentq(gap, 1e-6, 100)


@pytest.mark.slow
def test_epsilon_comes_from_the_accountant_and_matches_the_analytic_gaussian():
    # 4 rounds of z = 2 without subsampling compose to one Gaussian of sigma 2 / sqrt(4) = 1
    central = PrivacyConfig(mode="central", clip_norm=1.0, noise_multiplier=2.0, delta=1e-5)
    assert epsilon(central, 4, 1.0) == pytest.approx(analytic_gaussian_epsilon(1.0, 1e-5), rel=2e-2)
    # local: sensitivity 2C, so z = 4 is a Gaussian of sigma 2 per round; 4 rounds -> sigma 1
    local = PrivacyConfig(mode="local", clip_norm=1.0, noise_multiplier=4.0, delta=1e-5)
    assert epsilon(local, 4, 1.0) == pytest.approx(analytic_gaussian_epsilon(1.0, 1e-5), rel=2e-2)
    assert epsilon(central, 4, 0.1) < epsilon(central, 4, 1.0)  # subsampling amplifies
    assert epsilon(PrivacyConfig(mode="central", clip_norm=1.0), 3, 1.0) == math.inf
    rdp = PrivacyConfig(mode="central", clip_norm=1.0, noise_multiplier=2.0, accountant="rdp")
    assert epsilon(central, 4, 1.0) <= epsilon(rdp, 4, 1.0) < 1.5 * epsilon(central, 4, 1.0)


@pytest.mark.slow
def test_a_dp_run_writes_epsilon_per_round(tmp_path):
    cfg = tiny_config("privacy.mode=central", "privacy.clip_norm=0.5", "privacy.noise_multiplier=1.0")
    tiny_run(tmp_path, cfg)
    eps = [ln["privacy"]["epsilon"] for ln in lines(tmp_path)[1:]]
    assert eps == sorted(eps) and eps[0] > 0 and len(eps) == 3
    assert eps[-1] == pytest.approx(epsilon(cfg.privacy, 3, 1.0))
    for ln in lines(tmp_path)[1:]:
        assert all(c["clipped_to"] == 0.5 for c in ln["clients"].values() if c["update_norm"] > 0.5)
        assert {b["rule"] for b in ln["robust"].values()} == {"dp_noisy_mean"}


def test_local_dp_clips_and_noises_on_the_client(tmp_path):
    cfg = tiny_config(
        "privacy.mode=local", "privacy.clip_norm=0.01", "privacy.noise_multiplier=0.0", "federation.rounds=1"
    )
    tiny_run(tmp_path, cfg)
    ln = lines(tmp_path)[1]
    for c in ln["clients"].values():
        assert c["metrics"]["update_norm_before_dp"] > 0.01 and c["update_norm"] == pytest.approx(0.01, rel=1e-4)
    assert ln["privacy"]["mode"] == "local" and ln["privacy"]["epsilon"] is None  # no noise: infinite epsilon


@pytest.mark.slow
@pytest.mark.parametrize(
    "trust",
    [
        ("privacy.mode=central", "privacy.clip_norm=0.5", "privacy.noise_multiplier=1.0"),
        ("robust.rule=median", "attack.kind=scale", "attack.clients=[0]", "validation.max_update_norm=2.0"),
    ],
)
def test_robust_and_dp_runs_resume_exactly(tmp_path, trust):
    full, resumed = crash_and_resume(tmp_path, tiny_config(*trust))
    assert same_arrays(resumed.arrays, full.arrays)
    assert [ln.get("privacy") for ln in lines(tmp_path / "part")] == [
        ln.get("privacy") for ln in lines(tmp_path / "full")
    ]


def test_epsilon_at_tiny_noise_stays_small_in_memory_and_below_rdp():
    """PLD's default discretisation needed over 20 GB at z = 0.01 (the server was OOM-killed)."""
    import resource

    tiny = PrivacyConfig(mode="central", clip_norm=1.0, noise_multiplier=0.01)
    eps = epsilon(tiny, 2, 1.0)
    assert (
        1e3
        < eps
        <= epsilon(PrivacyConfig(mode="central", clip_norm=1.0, noise_multiplier=0.01, accountant="rdp"), 2, 1.0)
    )
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 8 * 1024 * 1024  # KiB: under 8 GiB
