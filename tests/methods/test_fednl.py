"""FedNL through its home on the tiny federation: what travels in each mode (and its bytes),
FedAvg of theta by n_k, the kept LoRA and an exact resume, the constant gate's schedule."""

import pytest
import torch
from tiny_federation import Interrupt, crash_at, lines, tiny_config, tiny_prepared, tiny_run

from nestfed import methods
from nestfed.config import ConfigError
from nestfed.federation.messages import ClientInfo
from nestfed.federation.run_dir import RunDir
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.fednl import FedNLOptions
from nestfed.methods.fednl.strategy import FedNL
from nestfed.nn.memory import memory_rules

RULE = "base_model.model.model.layers.1.self_attn.memory."


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def cfg_of(travel="all", gate="learned", *extra):
    return tiny_config(
        "strategy.name=fednl",
        f"fednl.travel={travel}",
        "lora.ranks=[4]",
        "lora.lora_alpha=8.0",
        'lora.target_modules=["q_proj","k_proj","v_proj"]',
        "fednl.layers=[1]",
        f"fednl.gate={gate}",
        "fednl.alpha_init=0.2",
        "fednl.chunk_size=4",
        "fednl.alpha_start=0.0",
        "fednl.alpha_end=0.6",
        "fednl.alpha_warmup_steps=6",
        "train.local_steps=3",
        "federation.rounds=2",
        *extra,
    )


def setup(travel="all", gate="learned", n_examples=(6, 6, 6)):
    cfg = cfg_of(travel, gate)
    return methods.get("fednl").build(tiny_prepared(cfg, n_examples), cfg)


def run(tmp, rounds=2, travel="all", resume=False, wrap=None, gate="learned"):
    state, loop, mr = tiny_run(tmp, cfg_of(travel, gate, f"federation.rounds={rounds}"), resume=resume, wrap=wrap)
    return state, mr.trainer, mr.strategy


@pytest.mark.slow
def test_what_travels_in_each_mode_and_its_bytes(tmp_path):
    s_all, _, _ = run(tmp_path / "all", travel="all")
    s_rules, trainer, _ = run(tmp_path / "rules", travel="rules")
    names = ("beta_bias", "beta_weight", "gate_logit", "conv_q", "conv_k", "conv_v", "norm_weight")
    rules = {RULE + n for n in names}
    lora = {k for k in s_all.arrays if "lora_" in k}
    assert len(lora) == 6 and set(s_all.arrays) == lora | rules  # LoRA on q, k, v of layer 1 + the rules
    assert set(s_rules.arrays) == rules
    la, lr = lines(tmp_path / "all")[-1], lines(tmp_path / "rules")[-1]
    hidden, H, Hkv, D, taps = 64, 4, 2, 16, 4
    # beta from the input [H, hidden] + [H], a gate per head, the short convolutions on q, k, v and
    # the read's norm weight [H, D]
    n_rules = H * hidden + H + H + (H * D + 2 * Hkv * D) * taps + H * D
    assert lr["clients"]["0"]["params_down"] == lr["clients"]["0"]["params_up"] == n_rules
    lora_params = 4 * (64 + 64) + 2 * 4 * (64 + 32)  # q: 64 -> 64, k and v: 64 -> 32
    assert la["clients"]["0"]["params_down"] == lora_params + n_rules
    assert la["clients"]["0"]["bytes_up"] > lr["clients"]["0"]["bytes_up"] + 4 * lora_params  # float32 LoRA on top
    assert lr["bytes_down"] == sum(c["bytes_down"] for c in lr["clients"].values())
    # the rules trained (beta's projection moved off its zero start) and every update was accepted
    assert s_rules.arrays[RULE + "beta_weight"].abs().max() > 0
    assert not la["rejected"] and not lr["rejected"]
    # rules mode: each client keeps its own LoRA, and they differ between clients
    kept = [trainer.client_state[c]["kept"] for c in range(3)]
    key = next(k for k in kept[0] if k.endswith("q_proj.lora_B.weight"))
    assert not torch.equal(kept[0][key], kept[1][key]) and kept[0][key].abs().max() > 0


def test_aggregation_is_fedavg_of_theta_by_examples():
    mr = setup("all", n_examples=(2, 4, 6))
    state = mr.strategy.initialize(mr.shapes, mr.clients)
    ins = mr.strategy.configure(1, state, mr.clients)
    replies = {c: mr.trainer.fit(c, ins[c]) for c in range(3)}
    new = mr.strategy.aggregate(1, state, replies)
    for k in state.arrays:
        expect = (2 * replies[0].arrays[k] + 4 * replies[1].arrays[k] + 6 * replies[2].arrays[k]) / 12
        assert torch.allclose(new.arrays[k], expect, atol=1e-6), k
    assert set(replies[0].arrays) == set(ins[0].arrays)  # everything sent trains and comes back


@pytest.mark.slow
def test_kept_lora_makes_a_resumed_run_exact(tmp_path):
    full, t_full, _ = run(tmp_path / "full", rounds=3, travel="rules")

    with pytest.raises(Interrupt):
        run(tmp_path / "part", rounds=3, travel="rules", wrap=crash_at(3, 2))
    kept = RunDir(tmp_path / "part").load_checkpoint(tmp_path / "part" / "checkpoints" / "round_002.safetensors")
    assert sorted(kept.client_state) == [0, 1, 2] and all("kept" in kept.client_state[c] for c in range(3))
    resumed, t_res, _ = run(tmp_path / "part", rounds=3, travel="rules", resume=True)
    for k in full.arrays:
        assert torch.equal(resumed.arrays[k], full.arrays[k]), k
    for c in range(3):
        for k, v in t_full.client_state[c]["kept"].items():
            assert torch.equal(t_res.client_state[c]["kept"][k], v), (c, k)
    assert [ln["eval"] for ln in lines(tmp_path / "part")] == [ln["eval"] for ln in lines(tmp_path / "full")]


def test_constant_gate_follows_its_schedule(tmp_path):
    seen = []

    def spy(trainer):
        real = trainer.fit

        def fit(cid, ins):
            rule = memory_rules(trainer.model)[1]
            orig = rule.gate

            def gate(x, tail=None):
                seen.append((ins.config["round"], round(float(rule.alpha.detach()), 6)))
                return orig(x, tail)

            rule.gate = gate
            try:
                return real(cid, ins)
            finally:
                del rule.gate

        trainer.fit = fit
        return trainer

    state, _, strategy = run(tmp_path, rounds=2, gate="constant", wrap=spy)
    # alpha = 0.6 * step / 6 over the run's local steps (3 per round), the same for every client
    train_alphas = sorted({a for r, a in seen})
    assert train_alphas == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    assert float(state.arrays[RULE + "alpha"]) == pytest.approx(0.6)  # after 6 steps: the schedule's end
    assert strategy.alpha_at(3) == pytest.approx(0.3)
    # evaluation after round 1 ran with alpha 0.3 (the value the global state carried)
    ck = RunDir(tmp_path).load_checkpoint(tmp_path / "checkpoints" / "round_001.safetensors")
    assert float(ck.state.arrays[RULE + "alpha"]) == pytest.approx(0.3)


def test_lora_only_payload_switches_the_memory_off():
    mr = setup("all")
    trainer = mr.trainer
    state = mr.strategy.initialize(mr.shapes, mr.clients)
    ev_mem = trainer.evaluate(0, *mr.strategy.deploy(state, 0))
    rule = memory_rules(trainer.model)[1]
    assert rule.enabled
    lora_only = {k: v for k, v in state.arrays.items() if "lora_" in k}
    ev_plain = trainer.evaluate(0, lora_only, 2.0)
    assert not rule.enabled
    assert ev_mem["loss"] != ev_plain["loss"]


def test_fednl_refuses_a_model_without_memory_and_bad_options():
    strategy = FedNL(LoraSettings(r_max=4, lora_alpha=8.0), FedNLOptions("all"), {})
    with pytest.raises(ValueError, match="no memory rules"):
        strategy.initialize({"m": (4, 4)}, [ClientInfo(0, 4, 1)])
    with pytest.raises(ValueError, match="travel: unknown value 'some' \\(known: all, rules, none\\)"):
        FedNLOptions("some")
    with pytest.raises(ConfigError, match="fednl.travel: unknown value"):
        cfg_of("some")
    with pytest.raises(ConfigError, match="FedNL keeps o_proj frozen"):
        tiny_config("strategy.name=fednl", "lora.ranks=[4]", 'lora.target_modules=["q_proj","o_proj"]')
    cfg = cfg_of("all", "learned", "fednl.layers=[5]")
    with pytest.raises(ConfigError, match="fednl.layers: index 5 out of range for 2 layers"):
        methods.get("fednl").check_model(tiny_prepared(cfg), cfg)


@pytest.mark.slow
def test_travel_none_is_local_only_training_with_no_aggregation_drop(tmp_path):
    """``travel = "none"``: the server's rules never move, each client trains and keeps its own
    rules and LoRA, and evaluating the federated model is evaluating the client's own model (the
    aggregation drop is zero by construction, which is what the rules-only table sets beside it)."""
    cfg = cfg_of("none", "learned", "train.eval_local=true")
    state, _, mr = tiny_run(tmp_path / "none", cfg)
    initial = mr.strategy.initialize(mr.shapes, mr.clients)
    assert set(state.arrays) == set(initial.arrays) and all(
        torch.equal(state.arrays[k], initial.arrays[k]) for k in state.arrays
    )
    kept = [mr.trainer.client_state[c]["kept_rules"] for c in range(3)]
    key = RULE + "beta_weight"
    assert kept[0][key].abs().max() > 0 and not torch.equal(kept[0][key], kept[1][key])
    last = lines(tmp_path / "none")[-1]
    for c in ("0", "1", "2"):
        assert last["eval"][c]["loss"] == pytest.approx(last["clients"][c]["metrics"]["local_loss"], abs=1e-6)
    # the clients' own rules survive a crash: the resumed run ends where the uninterrupted one does
    with pytest.raises(Interrupt):
        tiny_run(tmp_path / "part", cfg, wrap=crash_at(2, 1))
    tiny_run(tmp_path / "part", cfg, resume=True)
    assert lines(tmp_path / "part")[-1]["eval"] == last["eval"]
    with pytest.raises(ConfigError, match="fednl.travel: 'none'"):
        cfg_of("none", "learned", "robust.rule=median")


def test_fednl_trains_under_the_bf16_policy(tmp_path):
    """model.dtype = bfloat16 on the CPU (autocast): the delta rule's forward and backward follow the
    dtype policy, so a round trains, aggregates and evaluates to finite perplexities."""
    cfg = tiny_config("strategy.name=fednl", "lora.ranks=[4]", "model.dtype=bfloat16", "federation.rounds=1")
    tiny_run(tmp_path, cfg)
    last = lines(tmp_path)[-1]
    assert last["aggregated"] and all(c["status"] == "accepted" for c in last["clients"].values())
    assert all(torch.isfinite(torch.tensor(v["ppl"])) for v in last["eval"].values())


class _PullGate:
    """A step loss that wants every gate at alpha = 0.9 (and nothing else), so that where the
    loss wants the gate is known."""

    def __init__(self, hooks):
        self.hooks = hooks

    def __call__(self, ctx, batch):
        loss = sum(((torch.sigmoid(r.gate_logit) - 0.9) ** 2).sum() for r in memory_rules(ctx.model).values())
        loss.backward()
        return float(loss.detach())


@pytest.mark.parametrize("rule_lr,moves", [(0.3, True), (1e-3, False)], ids=["own-group", "lora-rate"])
def test_the_gate_reaches_where_the_loss_wants_it_in_its_own_group(rule_lr, moves):
    """8 local steps: with the rules' own learning rate the gate goes from 0.5 to the loss's 0.9;
    at the LoRA's rate (the old recipe) Adam moves its logit by at most 8 x 1e-3, so it stays at
    0.5. The memory parameters sit in their own group, with no weight decay."""
    cfg = cfg_of(
        "all",
        "learned",
        f"fednl.rule_lr={rule_lr}",
        "fednl.alpha_init=0.5",
        "train.local_steps=8",
        "train.weight_decay=0.1",
    )
    mr = methods.get("fednl").build(tiny_prepared(cfg), cfg)
    hooks = mr.trainer.hooks
    hooks.step_loss = _PullGate(hooks)
    groups = []
    real = torch.optim.AdamW

    def spy(groups_, **kw):
        groups.extend(groups_)
        return real(groups_, **kw)

    state = mr.strategy.initialize(mr.shapes, mr.clients)
    ins = mr.strategy.configure(1, state, mr.clients)
    torch.optim.AdamW = spy
    try:
        reply = mr.trainer.fit(0, ins[0])
    finally:
        torch.optim.AdamW = real
    alpha = torch.sigmoid(reply.arrays[RULE + "gate_logit"])
    if moves:
        assert torch.allclose(alpha, torch.full_like(alpha, 0.9), atol=0.03)
    else:
        assert (alpha - 0.5).abs().max() < 8 * 1e-3 / 4 + 1e-6  # sigmoid'(0) = 1/4
    rules, lora = groups[1], groups[0]
    assert rules["lr"] == rule_lr and rules["weight_decay"] == 0.0
    assert lora["lr"] == cfg.train.lr and lora["weight_decay"] == 0.1  # LoRA keeps train's settings
    assert len(rules["params"]) == 7 and len(lora["params"]) == 6  # the rules of layer 1; LoRA on q, k, v


def test_window_dropout_draws_per_step_and_never_reaches_evaluation():
    """``window_dropout``: each local step draws its suppressed heads from the seed rule (the same
    draw on a rerun), ``steps`` suppresses every head of a step at once, ``heads`` each head on
    its own, at about the configured rate; after the steps no head is suppressed."""
    from nestfed.methods.fednl.hooks import dropped_heads

    cfg = cfg_of("all", "learned", "fednl.window_dropout=0.5", "train.local_steps=6")
    mr = methods.get("fednl").build(tiny_prepared(cfg), cfg)
    model = mr.trainer.model
    seen = []
    rule = memory_rules(model)[1]
    real = rule.mix

    def mix(*a, **kw):
        seen.append(None if rule.drop is None else rule.drop.clone())
        return real(*a, **kw)

    rule.mix = mix
    state = mr.strategy.initialize(mr.shapes, mr.clients)
    ins = mr.strategy.configure(1, state, mr.clients)
    mr.trainer.fit(0, ins[0])
    first = seen[:]
    assert rule.drop is None  # cleared after the steps
    seen.clear()
    mr.trainer.evaluate(0, state.arrays, 1.0)
    assert seen and all(d is None for d in seen)  # evaluation suppresses nothing
    seen.clear()
    mr.trainer.fit(0, ins[0])
    assert all(torch.equal(a, b) for a, b in zip(first[:6], seen[:6]))  # seeded: the same draws again
    assert all(bool(d.all()) or not bool(d.any()) for d in first[:6])  # "steps": all heads or none
    assert any(bool(d.all()) for d in first[:6]) and any(not bool(d.any()) for d in first[:6])
    g = torch.Generator().manual_seed(0)
    per_head = torch.stack([dropped_heads(model, 0.25, "heads", g)[1] for _ in range(400)]).float()
    assert 0.2 < float(per_head.mean()) < 0.3 and float(per_head.std(0).min()) > 0  # heads drawn apart


@pytest.mark.slow
def test_fednl_runs_federated_mqar_through_the_recipe(tmp_path):
    """configs/fednl/mqar.toml's source and FedNL on a tiny model: each client is scored on its own
    and on the held-out vocabulary, per queried value, and the gates moved off their start."""
    from nestfed.experiments.prepare import prepare
    from nestfed.experiments.run import run_method
    from nestfed.methods import load_config

    cfg = load_config(
        "configs/fednl/mqar.toml",
        [
            "model.name=tiny-llama",
            "data.max_train=32",
            "data.max_test=8",
            "train.local_steps=4",
            "federation.rounds=1",
            "evaluation.every=1",
            f"output.dir={tmp_path}",
            "output.plots=false",
        ],
    )
    s = run_method(prepare(cfg), cfg, tmp_path / "run")
    for c in ("0", "1", "2", "3"):
        m = s["final"][c]
        assert set(k for k in m if k.startswith("accuracy@")) == {"accuracy@own", "accuracy@held_out"}
        assert m["tokens"] == 2 * 8 * 4  # own + held-out rows, 4 queried values each
    rules = RunDir(tmp_path / "run").latest_checkpoint().state.arrays
    alpha = torch.sigmoid(rules[next(k for k in rules if k.endswith("layers.0.self_attn.memory.gate_logit"))])
    assert (alpha - 0.5).abs().max() > 0.05  # 4 steps at rule_lr 0.1 move the gate
