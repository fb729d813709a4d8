"""Safe when nothing is set: the default screen (nestfed.federation.relative_screen) rejects a
client whose update is far larger than its peers', per rank block; aggregation cannot overflow; a
destroyed or stalled run stops loudly; a resume refuses a config.toml edited since its checkpoint."""

import math

import pytest
import torch
from tiny_federation import lines, tiny_config, tiny_prepared, tiny_run

from nestfed import methods
from nestfed.config import dumps_toml
from nestfed.errors import NestfedError, RunFailed
from nestfed.experiments.run import stored_config
from nestfed.federation.folding import ReplyFolder
from nestfed.federation.messages import GlobalState, Instruction, Reply
from nestfed.federation.relative_screen import RelativeScreen, round_blocks
from nestfed.federation.run_dir import RunDir
from nestfed.federation.safeguards import Safeguards
from nestfed.federation.update import block_norms, origin

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def test_block_norms_by_hand():
    sent = {A: torch.zeros(4, 3), B: torch.zeros(5, 4)}
    x = torch.cat([torch.ones(2, 3), torch.full((2, 3), 2.0)])
    y = torch.cat([torch.full((5, 2), 3.0), torch.zeros(5, 2)], 1)
    got = block_norms(sent, {A: x, B: y, "rule.beta": torch.full((2,), 4.0)}, (2, 4))
    assert got == pytest.approx({"0:2": math.sqrt(6 + 90), "2:4": math.sqrt(24), "other": math.sqrt(32)})
    # a rank-2 reply reaches only the first block; the update is taken against the sent prefix
    assert block_norms(sent, {A: x[:2] + 0, B: y[:, :2]}, (2, 4)) == pytest.approx({"0:2": math.sqrt(96)})


def test_the_lower_median_makes_one_honest_peer_the_reference():
    s = RelativeScreen(10.0, (2, 4))
    among = {"0:2": [1.0, 1e6]}
    assert s.reason({"0:2": 1.0}, among) is None
    why = s.reason({"0:2": 1e6}, among)
    assert "rank block 0:2" in why and "1e+06 x its peers' median 1" in why
    assert s.reason({"2:4": 1e6}, {"2:4": [1e6]}) is None  # alone in its block: compared with nothing
    assert s.reason({"0:2": 5.0}, {"0:2": [0.0, 0.0, 5.0]}) is None  # peers that did not move: no reference
    assert RelativeScreen(0.0, (2,)).reason({"0:2": 1e9}, among) is None  # 0 = off


def _instruction(r):
    return Instruction({A: torch.zeros(r, 3), B: torch.zeros(5, r)}, {"rank": r}, {A: (r, 3), B: (5, r)})


def _reply(r, v):
    return Reply({A: torch.full((r, 3), v), B: torch.full((5, r), v)}, 1)


@pytest.mark.parametrize("hold", [8, 2])  # held and settled together / folded on arrival after the first ones
def test_the_folder_drops_the_outlier_and_aggregates_the_others(hold):
    from nestfed.methods.zeropad.strategy import ZeroPad

    cfg = tiny_config("strategy.name=zeropad")
    strategy = methods.get("zeropad").server(cfg, {A: torch.zeros(8, 3), B: torch.zeros(5, 8)})
    assert isinstance(strategy, ZeroPad)
    state = GlobalState({A: torch.zeros(8, 3), B: torch.zeros(5, 8)}, {})
    ranks = {0: 2, 1: 2, 2: 4, 3: 4, 4: 8}
    ins = {c: _instruction(r) for c, r in ranks.items()}
    assert round_blocks(ins) == (2, 4, 8)
    folder = ReplyFolder(strategy, Safeguards(), 1, state, ins, hold, 1, screen=RelativeScreen(10.0, (2, 4, 8)))
    values = {0: 1.0, 1: 1.5, 2: 1e6, 3: 2.0, 4: 1.0}  # client 2 sends a huge update
    for c in sorted(ranks):
        folder.add(c, _reply(ranks[c], values[c]))
    rejected = folder.settle()
    assert list(rejected) == [2] and "rank block 0:2" in rejected[2]
    assert folder.count == 4
    new, _ = folder.aggregate()
    assert float(new.arrays[A].abs().max()) < 10  # the outlier never reached the aggregate


LORA = [m for m in methods.REGISTRY if m not in ("fedslm", "fedmkt", "local_only")]


def _hostile(kind):
    """A ``wrap`` for tiny_run: client 0's reply is its update x 1e6, or constant entries of 1e9."""

    def wrap(trainer):
        real = trainer.fit

        def fit(c, ins):
            reply = real(c, ins)
            if c != 0:
                return reply
            out = {}
            for k, v in reply.arrays.items():
                if not v.is_floating_point():
                    out[k] = v
                elif kind == "scale":
                    o = origin(ins.arrays, k, v)
                    out[k] = o + 1e6 * (v - o)
                else:
                    out[k] = torch.full_like(v, 1e9)
            return Reply(out, reply.num_examples, reply.metrics)

        trainer.fit = fit
        return trainer

    return wrap


def _config(name, *extra):
    equal = not methods.get(name).can(methods.Capability.HETEROGENEOUS_RANKS)
    return tiny_config(f"strategy.name={name}", "federation.rounds=2", *(["lora.ranks=[4]"] if equal else []), *extra)


def _final_ppl(tmp_path):
    ev = lines(tmp_path)[-1]["eval"]
    return sum(v["ppl"] for v in ev.values()) / len(ev)


@pytest.mark.parametrize("kind", ["scale", "constant"])
@pytest.mark.parametrize("name", LORA)
def test_one_hostile_client_of_three_leaves_every_lora_method_within_five_percent(tmp_path, name, kind):
    cfg = _config(name)
    prep = tiny_prepared(cfg)
    tiny_run(tmp_path / "clean", cfg, prep)
    clean = _final_ppl(tmp_path / "clean")
    tiny_run(tmp_path / "hostile", cfg, prep, wrap=_hostile(kind))
    for ln in lines(tmp_path / "hostile")[1:]:
        assert ln["clients"]["0"]["status"] == "rejected", ln["rejected"]
        assert ln["aggregated"] and all(ln["clients"][c]["status"] == "accepted" for c in ("1", "2"))
    assert math.isfinite(_final_ppl(tmp_path / "hostile"))
    assert abs(_final_ppl(tmp_path / "hostile") / clean - 1) < 0.05


@pytest.mark.slow
def test_no_honest_reply_of_the_tiny_federation_is_screened_out(tmp_path):
    for name in LORA:
        tiny_run(tmp_path / name, _config(name, "federation.rounds=3"))
        for ln in lines(tmp_path / name)[1:]:
            assert ln["rejected"] == {}, (name, ln["rejected"])


def test_the_screen_turned_off_lets_the_hostile_client_in(tmp_path):
    tiny_run(tmp_path, _config("zeropad", "validation.norm_ratio=0"), wrap=_hostile("scale"))
    assert lines(tmp_path)[1]["clients"]["0"]["status"] == "accepted"


@pytest.mark.parametrize("exponent", [3, 8, 13, 18, 23, 28, 33, 38])
@pytest.mark.parametrize("name", [m for m in LORA if m != "fednl"])
def test_aggregation_never_overflows_for_any_finite_float32_reply(name, exponent):
    """The strategy's own rule (no screen), one reply of three with entries of 10^e: every
    aggregated array is finite."""
    cfg = _config(name)
    prep = tiny_prepared(cfg)
    mr = methods.get(name).build(prep, cfg)
    st = mr.strategy
    state = st.initialize(mr.shapes, mr.clients)
    ins = st.configure(1, state, mr.clients)
    big = min(10.0**exponent, float(torch.finfo(torch.float32).max))
    replies = {}
    for c, i in ins.items():
        g = torch.Generator().manual_seed(c)
        arrays = {k: torch.randn(shape, generator=g) * 0.01 for k, shape in i.expect.items()}
        if c == 0:
            arrays = {k: torch.full(shape, big) for k, shape in i.expect.items()}
        replies[c] = Reply(arrays, 6)
    new = st.aggregate(1, state, replies)
    bad = [k for k, v in new.arrays.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    assert bad == [], bad[:3]


def test_a_destroyed_model_stops_the_run_with_one_line(tmp_path):
    def wrap(trainer):
        real = trainer.evaluate

        def evaluate(cid, arrays, scaling):
            return {**real(cid, arrays, scaling), "ppl": float("nan")}

        trainer.evaluate = evaluate
        return trainer

    with pytest.raises(RunFailed, match="round 0: the global model's held-out perplexity is nan for 3 of 3"):
        tiny_run(tmp_path, _config("zeropad"), wrap=wrap)
    assert [ln["round"] for ln in lines(tmp_path)] == [0]  # committed first: the evidence is on disk


def test_a_stalled_federation_stops_after_stall_rounds(tmp_path):
    cfg = _config("zeropad", "federation.rounds=5", "validation.stall_rounds=2")

    def wrap(trainer):
        real = trainer.fit

        def fit(c, ins):
            reply = real(c, ins)
            return Reply({k: torch.full_like(v, float("nan")) for k, v in reply.arrays.items()}, reply.num_examples)

        trainer.fit = fit
        return trainer

    with pytest.raises(RunFailed, match="round 2: no update aggregated for 2 rounds in a row") as exc:
        tiny_run(tmp_path, cfg, wrap=wrap)
    assert exc.value.round == 2 and [ln["round"] for ln in lines(tmp_path)] == [0, 1, 2]


def test_a_failed_run_records_its_outcome_and_exports_nothing(tmp_path):
    """Every client sends noise of std 1e30 and the screen is off: no aggregate is finite, so no
    round aggregates; after validation.stall_rounds the run stops, summary.json says why."""
    import json

    from nestfed.experiments.run import run_method

    cfg = _config(
        "zeropad",
        "validation.norm_ratio=0",
        "validation.stall_rounds=1",
        "attack.kind=noise",
        "attack.noise_std=1e30",
        "attack.clients=[0,1,2]",
    )
    with pytest.raises(RunFailed, match=r"run: round 1: no update aggregated for 1 rounds in a row"):
        run_method(tiny_prepared(cfg), cfg, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["outcome"] == "failed" and summary["failed_round"] == 1 and summary["adapter"] is None
    assert "no update aggregated" in summary["failure"] and not (tmp_path / "run" / "adapter").exists()


def test_resume_refuses_a_config_edited_since_the_checkpoint(tmp_path):
    cfg = _config("zeropad")
    tiny_run(tmp_path, cfg)
    rd = RunDir.open(tmp_path)
    assert stored_config(rd) == cfg  # the checkpoint recorded the resolved config
    edited = tiny_config("strategy.name=zeropad", "federation.rounds=2", "lora.lora_alpha=32.0")
    (tmp_path / "config.toml").write_text(dumps_toml(edited))
    with pytest.raises(NestfedError, match=r"lora.lora_alpha: 16.0 -> 32.0"):
        rd.accept_config(stored_config(rd), methods.load_config(tmp_path / "config.toml"), dumps_toml(edited))
    longer = tiny_config("strategy.name=zeropad", "federation.rounds=4")  # the allowed change stays allowed
    (tmp_path / "config.toml").write_text(dumps_toml(longer))
    assert rd.accept_config(stored_config(rd), longer, dumps_toml(longer)) == ["federation.rounds: 2 -> 4"]


def test_malformed_inputs_give_one_line_and_write_nothing(tmp_path):
    from nestfed.data.corpora import bbc_news
    from nestfed.errors import ConfigError, DataError
    from nestfed.experiments.run import run_method

    (tmp_path / "bbc" / "tech").mkdir(parents=True)
    (tmp_path / "bbc" / "tech" / "001.txt").write_text("Headline\n\nText.")
    (tmp_path / "bbc" / "tech" / "002.txt").write_text("  \n")
    with pytest.raises(DataError, match=r"002.txt: empty article"):
        bbc_news(tmp_path / "bbc")
    (tmp_path / "a_file").write_text("")
    cfg = _config("zeropad", "tracking.mlflow=true", f"tracking.mlflow_uri=sqlite:///{tmp_path}/a_file/store/mlflow.db")
    with pytest.raises(ConfigError, match=r"tracking.mlflow_uri: .* is not a writable folder"):
        run_method(tiny_prepared(cfg), cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match=r"privacy.noise_multiplier must be >= 0"):
        tiny_config("privacy.noise_multiplier=-1")  # refused with privacy off too


@pytest.mark.parametrize("flat_numel", [1 << 20, 0])  # gathered per rank / one array at a time
def test_block_norms_agree_between_the_gathered_and_per_array_paths(monkeypatch, flat_numel):
    from nestfed.federation import update

    monkeypatch.setattr(update, "FLAT_NUMEL", flat_numel)
    g = torch.Generator().manual_seed(0)
    sent = {A: torch.randn(8, 3, generator=g), B: torch.randn(5, 8, generator=g)}
    reply = {A: torch.randn(4, 3, generator=g), B: torch.randn(5, 4, generator=g), "rule": torch.ones(3)}
    got = block_norms(sent, reply, (2, 4, 8))  # a reply of rank 4 against a sent rank 8 (HetLoRA's pruning)
    dA, dB = reply[A] - sent[A][:4], reply[B] - sent[B][:, :4]
    want = {
        "0:2": math.sqrt(float(dA[:2].pow(2).sum() + dB[:, :2].pow(2).sum())),
        "2:4": math.sqrt(float(dA[2:].pow(2).sum() + dB[:, 2:].pow(2).sum())),
        "other": math.sqrt(3.0),
    }
    assert got == pytest.approx(want, rel=1e-6)


def test_the_gathered_path_gives_the_per_array_norms_and_the_updates(monkeypatch):
    from nestfed.federation import update

    A2, B2 = A.replace("q_proj", "v_proj"), B.replace("q_proj", "v_proj")
    g = torch.Generator().manual_seed(1)
    sent = {k: torch.randn(*s, generator=g) for k, s in ((A, (4, 3)), (B, (5, 4)), (A2, (4, 6)), (B2, (2, 4)))}
    reply = {k: v + torch.randn(v.shape, generator=g) for k, v in sent.items()}
    order = (A, A2, B, B2)
    norms, gathered = update.measure(sent, reply, (2, 4), order)
    assert gathered is not None and gathered.keys_a == (A, A2) and gathered.keys_b == (B, B2)
    d = {k: (reply[k].double() - sent[k].double()) for k in sent}
    assert torch.equal(gathered.a, torch.cat([d[A], d[A2]], 1)) and torch.equal(gathered.b, torch.cat([d[B], d[B2]], 0))
    by_hand = {
        f"{lo}:{hi}": math.sqrt(
            sum(float(d[k][lo:hi].pow(2).sum()) for k in (A, A2))
            + sum(float(d[k][:, lo:hi].pow(2).sum()) for k in (B, B2))
        )
        for lo, hi in ((0, 2), (2, 4))
    }
    assert norms == pytest.approx(by_hand, rel=1e-12)
    monkeypatch.setattr(update, "FLAT_NUMEL", 0)  # one array at a time: no gathered form
    per_array, none = update.measure(sent, reply, (2, 4), order)
    assert none is None and per_array == pytest.approx(norms, rel=1e-12)


def test_folding_a_gathered_update_equals_folding_it_array_by_array():
    from nestfed.federation.update import gather

    strategy = methods.get("zeropad").server(
        tiny_config("strategy.name=zeropad"), {A: torch.zeros(4, 3), B: torch.zeros(5, 4)}
    )
    g = torch.Generator().manual_seed(2)
    ins = {c: _instruction(r) for c, r in enumerate((2, 4, 4))}
    replies = {c: Reply({k: torch.randn(v.shape, generator=g) for k, v in ins[c].arrays.items()}, 3 + c) for c in ins}
    state = GlobalState({A: torch.zeros(4, 3), B: torch.zeros(5, 4)})

    def folded(use_gathered):
        f = ReplyFolder(strategy, Safeguards(), 1, state, ins, hold=1, n_max=5, secure=True)
        assert f.can_fold
        f._scale = 1 / 5
        for c, rep in replies.items():
            gathered = gather(ins[c].arrays, rep.arrays, tuple(f._layout)) if use_gathered else None
            assert gathered is not None or not use_gathered
            f._fold(c, rep, gathered)
        assert f._keys == ((A,), (B,))  # the gathered keys match: the two-kernel path ran
        return f._key_sums()

    assert all(torch.equal(x, y) for x, y in zip(folded(True), folded(False), strict=True))
