"""PreLort's objective and aggregation options (the sampled objective and the paper's two
ablations), and the local-only baseline."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tiny_federation import crash_and_resume, lines, same_arrays, tiny_config, tiny_prepared, tiny_run

from nestfed import methods
from nestfed.config import ConfigError
from nestfed.federation.aggregation import truncate_rank
from nestfed.federation.messages import ClientInfo, Reply
from nestfed.federation.run_dir import RunDir
from nestfed.federation.strategy import LoraSettings
from nestfed.methods.prelort import PreLortOptions
from nestfed.methods.prelort.strategy import PreLort, PreLortHooks, sampled_subrank
from nestfed.methods.zeropad.strategy import ZeroPad
from nestfed.nn.lora import active_rank


def test_sampled_subrank_is_uniform_and_follows_the_seed_rule():
    draws = [sampled_subrank([2, 4, 8], 1, 3, 2, step) for step in range(3000)]
    counts = Counter(draws)
    assert set(counts) == {2, 4, 8}
    assert all(abs(c / 3000 - 1 / 3) < 0.04 for c in counts.values())  # 3 sigma of a binomial is 0.026
    assert draws == [sampled_subrank([2, 4, 8], 1, 3, 2, step) for step in range(3000)]  # a resume draws the same
    assert draws != [sampled_subrank([2, 4, 8], 1, 4, 2, step) for step in range(3000)]  # another round differs
    with pytest.raises(ValueError, match="subranks is empty"):
        sampled_subrank([], 0, 1, 0, 0)


def test_each_objective_runs_the_sub_ranks_it_names(monkeypatch):
    seen = []

    class Batch:
        def loss(self, model):
            seen.append(model.current)
            return torch.tensor(1.0, requires_grad=True)

    class Model:
        current = None

    def fake_active_rank(model, r):
        class Ctx:
            def __enter__(self):
                model.current = r

            def __exit__(self, *a):
                model.current = None

        return Ctx()

    monkeypatch.setattr("nestfed.methods.prelort.strategy.active_rank", fake_active_rank)

    class Ctx:
        model = Model()
        config = {"subranks": [2, 4, 8], "round": 2, "seed": 5}
        cid, seed, round = 1, 5, 2
        scratch = {}

    for objective, expected in (
        ("nested", [2, 4, 8]),
        ("full_rank", [8]),
        ("sampled", [sampled_subrank([2, 4, 8], 5, 2, 1, 7)]),
    ):
        seen.clear()
        hooks = PreLortHooks(objective)
        hooks.before_step(Ctx, 7)
        loss = hooks.step_loss(Ctx, Batch())
        assert seen == expected and loss == pytest.approx(1.0)


def test_nested_loss_with_one_sub_rank_is_the_plain_loss_at_that_rank():
    """The sampled objective's one pass computes exactly the plain LoRA loss at the drawn rank."""
    cfg = tiny_config("strategy.name=prelort")
    prep = tiny_prepared(cfg)
    model = prep.backbone.model
    from nestfed.federation.training import client_batches
    from nestfed.methods.prelort.strategy import nested_loss

    torch.manual_seed(0)
    for m in model.modules():
        if hasattr(m, "lora_B"):
            m.lora_B.weight.data.normal_(0, 0.1)
    batch = next(iter(client_batches(prep.data[0], 1, 2, 0)))
    with active_rank(model, 4):
        plain = batch.loss(model).item()
    assert nested_loss(model, batch, [4]) == pytest.approx(plain, abs=1e-6)


def test_zeropad_aggregation_ablation_equals_zeropad():
    settings = LoraSettings(r_max=4, lora_alpha=4.0)
    shapes = {"m": (3, 2)}
    clients = [ClientInfo(0, 2, 1), ClientInfo(1, 4, 3)]
    ablation, zp = PreLort(settings, PreLortOptions(aggregation="zeropad")), ZeroPad(settings)
    state = ablation.initialize(shapes, clients)
    g = torch.Generator().manual_seed(0)
    replies = {}
    for c in clients:
        arrays = {
            k: torch.randn(v.narrow(0 if k.endswith("lora_A.weight") else 1, 0, c.rank).shape, generator=g)
            for k, v in state.arrays.items()
        }
        replies[c.cid] = Reply(arrays, c.num_examples)
    assert same_arrays(ablation.aggregate(1, state, replies).arrays, zp.aggregate(1, state, replies).arrays)
    assert not same_arrays(
        PreLort(settings).aggregate(1, state, replies).arrays, zp.aggregate(1, state, replies).arrays
    )


def test_unknown_options_name_the_field():
    with pytest.raises(ConfigError, match="prelort.objective.*unknown objective 'half'"):
        tiny_config("strategy.name=prelort", "prelort.objective=half")
    with pytest.raises(ConfigError, match="prelort.aggregation"):
        tiny_config("strategy.name=prelort", "prelort.aggregation=median")


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["sampled", "full_rank"])
def test_variants_resume_exactly(tmp_path, objective):
    full, resumed = crash_and_resume(tmp_path, tiny_config("strategy.name=prelort", f"prelort.objective={objective}"))
    assert same_arrays(full.arrays, resumed.arrays)


@pytest.mark.slow
def test_sampled_objective_trains_one_pass_per_step(tmp_path):
    """Under the sampled objective a rank-8 client's step is one forward at the drawn sub-rank; the
    run differs from the nested one (different gradients) and lowers the training loss."""
    cfg = tiny_config("strategy.name=prelort", "prelort.objective=sampled", "federation.rounds=2")
    _, _, _ = tiny_run(tmp_path / "s", cfg)
    nested_cfg = tiny_config("strategy.name=prelort", "federation.rounds=2")
    tiny_run(tmp_path / "n", nested_cfg)
    s, n = lines(tmp_path / "s"), lines(tmp_path / "n")
    assert s[-1]["eval"] != n[-1]["eval"]
    assert s[-1]["eval"]["2"]["loss"] < s[0]["eval"]["2"]["loss"]


@pytest.mark.slow
def test_local_only_clients_keep_their_own_adapters(tmp_path):
    cfg = tiny_config("strategy.name=local_only")
    state, loop, mr = tiny_run(tmp_path / "run", cfg)
    initial = mr.strategy.initialize(mr.shapes, mr.clients)
    assert same_arrays(state.arrays, initial.arrays)  # the server never moves
    kept = mr.trainer.client_state
    for c in mr.clients:
        own = kept[c.cid]["adapter"]
        assert all(v.shape[0 if k.endswith("lora_A.weight") else 1] == c.rank for k, v in own.items())
        # evaluated under its own adapter: equal to evaluating that adapter directly
        ev = lines(tmp_path / "run")[-1]["eval"][str(c.cid)]
        direct = mr.trainer.evaluate(c.cid, own, mr.strategy.s.scale(c.rank))
        assert ev["loss"] == pytest.approx(direct["loss"], abs=1e-6)
    # no cross-talk: client 0 (rank 2) trained beside others equals client 0 trained in a
    # federation of one (same data, same seeds, same initial prefix of the r_max = 8 adapter)
    solo_cfg = tiny_config("strategy.name=local_only", "data.num_clients=1", "lora.ranks=[2]", "lora.r_max=8")
    _, _, solo = tiny_run(tmp_path / "solo", solo_cfg, tiny_prepared(solo_cfg, n_examples=(6,)))
    assert same_arrays(solo.trainer.client_state[0]["adapter"], kept[0]["adapter"])
    first_loss = [ln["eval"]["0"]["loss"] for ln in lines(tmp_path / "run")]
    assert first_loss[-1] < first_loss[0]


@pytest.mark.slow
def test_local_only_resumes_exactly_and_refuses_robust_rules(tmp_path):
    crash_and_resume(tmp_path, tiny_config("strategy.name=local_only"))
    # the server state never moves: what must survive the crash is each client's own adapter,
    # which the final evaluation runs
    assert lines(tmp_path / "part")[-1]["eval"] == lines(tmp_path / "full")[-1]["eval"]
    assert [ln["round"] for ln in lines(tmp_path / "part")] == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="local-only training aggregates nothing"):
        tiny_config("strategy.name=local_only", "robust.rule=median")
    assert not methods.get("local_only").can(methods.Capability.GLOBAL_MODEL)


def dilute(dilution):
    return PreLort(LoraSettings(r_max=2, lora_alpha=2.0), PreLortOptions(dilution=dilution))


A_KEY, B_KEY = "base_model.model.m.lora_A.weight", "base_model.model.m.lora_B.weight"
HET = [ClientInfo(1, 1, 1), ClientInfo(2, 2, 3)]  # rank 1 (n 1) and rank 2 (n 3)


def het_round(st):
    state = st.initialize({"m": (2, 2)}, HET)
    state.arrays[A_KEY] = torch.ones(2, 2)
    reps = {
        1: Reply({A_KEY: torch.tensor([[1.0, 2.0]]), B_KEY: torch.tensor([[1.0], [3.0]])}, 1),
        2: Reply({A_KEY: torch.tensor([[3.0, 4.0], [5.0, 6.0]]), B_KEY: torch.tensor([[1.0, 2.0], [3.0, 4.0]])}, 3),
    }
    return state, reps


@pytest.mark.parametrize("dilution", [0.0, 0.5, 1.0])
def test_dilution_scales_the_segments_few_clients_hold_hand_computed(dilution):
    st = dilute(dilution)
    state, reps = het_round(st)
    new = st.aggregate(1, state, reps)
    # segment [0,1) is held by both clients (N_0 = N = 4): (1*[0,1] + 3*[2,3]) / 4 = [1.5, 2.5], weight 1
    # segment [1,2) by the rank-2 client only (N_1 = 3): its update [4, 5] scaled by (3/4)^dilution
    w = (3 / 4) ** dilution
    torch.testing.assert_close(new.arrays[A_KEY], torch.tensor([[2.5, 3.5], [1 + 4 * w, 1 + 5 * w]]))
    # B: column 0 by both (start 0): (1*[1,3] + 3*[1,3]) / 4; column 1 by client 2 only: [2, 4] scaled
    torch.testing.assert_close(new.arrays[B_KEY], torch.tensor([[1.0, 2 * w], [3.0, 4 * w]]))
    if dilution == 1.0:  # the update-space form of ZeroPad's dilution: sum over holders of n_k delta_k / N
        torch.testing.assert_close(new.arrays[A_KEY][1], torch.tensor([1 + 3 * 4 / 4, 1 + 3 * 5 / 4]))


@pytest.mark.parametrize("dilution", [0.5, 1.0])
def test_with_equal_ranks_any_dilution_is_fedavg(dilution):
    from nestfed.methods.fedavg.strategy import FedAvg

    torch.manual_seed(3)
    clients = [ClientInfo(i, 4, n) for i, n in enumerate([5, 1, 7])]
    settings = LoraSettings(r_max=4, lora_alpha=8.0)
    ref, st = FedAvg(settings), PreLort(settings, PreLortOptions(dilution=dilution))
    state = ref.initialize({"a": (6, 5), "b": (3, 6)}, clients)
    state.arrays = {k: torch.randn_like(v) for k, v in state.arrays.items()}
    reps = {
        c.cid: Reply({k: v + torch.randn_like(v) for k, v in state.arrays.items()}, c.num_examples) for c in clients
    }
    want, got = ref.aggregate(1, state, reps), st.aggregate(1, state, reps)
    for k in want.arrays:
        torch.testing.assert_close(got.arrays[k], want.arrays[k], rtol=1e-5, atol=1e-6)


def test_dilution_is_the_same_under_the_mean_block_rule_and_from_secure_sums():
    from nestfed.config import PrivacyConfig, RobustConfig
    from nestfed.federation.robust import BlockRule
    from nestfed.federation.secure_sum import decode, encode, layout

    st = dilute(0.5)
    state, reps = het_round(st)
    want = st.aggregate(1, state, reps)
    rule = BlockRule(RobustConfig(), PrivacyConfig())
    rule.start_round(1)
    robust = st.robust_aggregate(1, state, reps, rule)
    ins = st.configure(1, state, HET)
    lay = layout(ins[c].expect for c in ins)
    vectors = [encode(ins[c].arrays, reps[c].arrays, reps[c].num_examples, lay, 1 / 3, 1e9)[0] for c in ins]
    total = [sum(v[i] for v in vectors) for i in range(len(vectors[0]))]
    secure = st.aggregate_secure(1, state, decode(total, lay, 1 / 3, sorted(ins)))
    for k in want.arrays:
        torch.testing.assert_close(robust.arrays[k], want.arrays[k])
        torch.testing.assert_close(secure.arrays[k], want.arrays[k], rtol=1e-6, atol=1e-6)


def test_dilution_outside_zero_to_one_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="prelort.dilution"):
        methods.load_config(None, ["strategy.name=prelort", "prelort.dilution=1.5"])
    assert (
        methods.load_config(None, ["strategy.name=prelort", "prelort.dilution=0.25"]).section("prelort").dilution
        == 0.25
    )


def test_deploy_cap_by_hand():
    from nestfed.methods.prelort.strategy import deploy_cap

    main_job = {"0": 2, "1": 4, "2": 4, "3": 8, "4": 16}  # holders: [0,2) 5, [2,4) 4, [4,8) 2, [8,16) 1
    assert [deploy_cap(main_job, m) for m in (0, 1, 2, 3, 4, 5, 6)] == [16, 16, 8, 4, 4, 2, 2]
    assert deploy_cap({"0": 4, "1": 4}, 3) == 4  # one rank: the lowest segment is always kept


@pytest.mark.parametrize("scaling", ["fixed", "rank"])
def test_min_holders_caps_what_clients_deploy_and_what_is_exported(scaling):
    """Ranks 2/4/4/8/16 with min_holders = 2: the segment [8, 16) (one holder) is left out. Every
    client deploys min(r_k, 8); the export has that segment zeroed, and its function is the global
    adapter deployed at the cap; the aggregate itself is the paper's."""
    settings = LoraSettings(r_max=16, lora_alpha=16.0, scaling=scaling)
    clients = [ClientInfo(c, r, 1) for c, r in enumerate([2, 4, 4, 8, 16])]
    plain, capped = PreLort(settings), PreLort(settings, PreLortOptions(min_holders=2))
    state = plain.initialize({"m": (6, 5)}, clients)
    g = torch.Generator().manual_seed(0)
    state.arrays = {k: torch.randn(v.shape, generator=g) for k, v in state.arrays.items()}
    ins = plain.configure(1, state, clients)
    reps = {
        c: Reply({k: v + torch.randn(v.shape, generator=g) for k, v in i.arrays.items()}, 1) for c, i in ins.items()
    }
    new = plain.aggregate(1, state, reps)
    assert same_arrays(capped.aggregate(1, state, reps).arrays, new.arrays)  # training and aggregation unchanged
    for c, r in enumerate([2, 4, 4, 8, 16]):
        arrays, s = capped.deploy(new, c)
        want, s_want = (
            plain.deploy(new, c)
            if r <= 8
            else (
                {k: v.narrow(0 if "lora_A" in k else 1, 0, 8) for k, v in new.arrays.items()},
                settings.scale(8),
            )
        )
        assert same_arrays(arrays, want) and s == s_want, c
    exported, s = capped.export(new)
    a, b = exported["base_model.model.m.lora_A.weight"], exported["base_model.model.m.lora_B.weight"]
    assert not a[8:].any() and not b[:, 8:].any() and a.shape == (16, 5)
    top, s_top = capped.deploy(new, None)
    torch.testing.assert_close(
        s * b @ a, s_top * top["base_model.model.m.lora_B.weight"] @ top["base_model.model.m.lora_A.weight"]
    )


@pytest.mark.slow
def test_min_holders_run_ends_where_the_stored_curve_says(tmp_path):
    """A real run with min_holders = 2 on the tiny federation (ranks 2/4/8: [4, 8) has one holder)
    ends at the same global adapter as the plain run, and each client's final perplexity is the
    plain run's truncation curve at min(r_k, 4): what bench/studies/prelort_min_holders.py reads."""
    from nestfed.experiments.run import run_method

    base = ("strategy.name=prelort", "output.truncations=[1,2,4,8]")
    cfg, capped_cfg = tiny_config(*base), tiny_config(*base, "prelort.min_holders=2")
    prep = tiny_prepared(cfg)
    plain = run_method(prep, cfg, tmp_path / "plain")
    capped = run_method(prep, capped_cfg, tmp_path / "capped")
    a = RunDir(tmp_path / "plain").latest_checkpoint(False).state.arrays
    b = RunDir(tmp_path / "capped").latest_checkpoint(False).state.arrays
    assert same_arrays(a, b)
    final = lines(tmp_path / "capped")[-1]["eval"]
    for cid, r in (("0", 2), ("1", 4), ("2", 8)):
        assert final[cid]["loss"] == pytest.approx(plain["truncation"][str(min(r, 4))][cid]["loss"], abs=1e-6)
    assert capped["truncation"]["8"] == capped["truncation"]["4"]  # the export leaves [4, 8) out
    from nestfed.errors import NestfedError
    from nestfed.experiments.export import export_adapter

    out, desc = export_adapter(tmp_path / "capped", client=2)  # client 2 (rank 8) deploys the cap, 4
    assert desc["rank"] == 4 and '"r": 4' in (out / "adapter_config.json").read_text()
    with pytest.raises(NestfedError, match="--rank 8: client 2 runs rank 4"):
        export_adapter(tmp_path / "capped", rank=8, client=2)
    with pytest.raises(ConfigError, match="min_holders: -1 is not a count"):
        tiny_config(*base, "prelort.min_holders=-1")


def test_validated_deploy_rank_holds_rows_out_and_picks_the_best_prefix(tmp_path):
    """The hook holds validation_rows rows out of training (the same rows every round), measures
    the received adapter at every sub-rank on them by hand's arithmetic, keeps the argmin (ties:
    the larger rank) on the client, and evaluation and export --client run that prefix."""
    from nestfed.federation.hooks import FitContext
    from nestfed.federation.training import Batch

    cfg = tiny_config("strategy.name=prelort", "prelort.deploy_rank=validated", "prelort.validation_rows=2")
    prep = tiny_prepared(cfg)
    model, data = prep.backbone.model, prep.data[2]
    g = torch.Generator().manual_seed(1)
    from nestfed.nn.lora import lora_modules

    for m in lora_modules(model).values():  # a non-zero adapter, so the sub-ranks differ
        m.lora_B.weight.data = 0.3 * torch.randn(m.lora_B.weight.shape, generator=g)
    hooks = methods.get("prelort").client_hooks(cfg)
    assert (
        hooks.keeps_state and not methods.get("prelort").client_hooks(tiny_config("strategy.name=prelort")).keeps_state
    )
    seen = []
    for rnd in (1, 2):
        ctx = FitContext(2, {"subranks": [2, 4, 8], "round": rnd, "seed": 0}, {}, model, data, cfg.train)
        metrics = hooks.after_load(ctx, {})
        assert ctx.data.num_examples == data.num_examples - 2
        kept = {tuple(r.tolist()) for r in ctx.data.train_ids}
        held = [i for i, r in enumerate(data.train_ids) if tuple(r.tolist()) not in kept]
        seen.append(held)
        losses = {}
        for r in (2, 4, 8):
            with active_rank(model, r), torch.no_grad():
                b = Batch(data.train_labels[held], hidden=data.train_hidden[held], start=data.start)
                losses[r] = float(b.loss(model))
        assert {r: metrics[f"validation_loss@{r}"] for r in (2, 4, 8)} == pytest.approx(losses)
        best = min(losses, key=lambda r: (losses[r], -r))
        assert metrics["deploy_rank"] == best and int(ctx.state["deploy"]["rank"][0]) == best
    assert seen[0] == seen[1] and len(seen[0]) == 2
    arrays = {"x.lora_A.weight": torch.ones(8, 3), "x.lora_B.weight": torch.ones(5, 8)}
    cut = hooks.evaluation_arrays({"deploy": {"rank": torch.tensor([4])}}, arrays)
    assert cut["x.lora_A.weight"].shape == (4, 3) and cut["x.lora_B.weight"].shape == (5, 4)
    assert hooks.evaluation_arrays({}, arrays) is arrays


def test_equal_validation_losses_keep_the_clients_own_rank():
    from nestfed.federation.hooks import FitContext

    cfg = tiny_config("strategy.name=prelort", "prelort.deploy_rank=validated")
    prep = tiny_prepared(cfg)  # LoRA B = 0: every prefix computes the backbone
    hooks = methods.get("prelort").client_hooks(cfg)
    ctx = FitContext(1, {"subranks": [2, 4], "round": 1, "seed": 0}, {}, prep.backbone.model, prep.data[1], cfg.train)
    assert hooks.after_load(ctx, {})["deploy_rank"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("scaling", ["fixed", "rank"])
def test_a_validated_run_deploys_and_exports_each_clients_chosen_prefix(tmp_path, scaling, monkeypatch):
    """A real run: each client's final evaluation is the global adapter cut to the rank it chose
    (its last reply's deploy_rank), export --client writes that rank, --rank must match it. On the
    tiny federation every client's own rank validates best, so the choice is made the smallest
    rank here (the choice itself is tested by hand above)."""
    from nestfed.errors import NestfedError
    from nestfed.experiments.export import export_adapter
    from nestfed.experiments.run import run_method

    monkeypatch.setattr(PreLortHooks, "choose", staticmethod(lambda losses: min(losses)))

    cfg = tiny_config(
        "strategy.name=prelort",
        "prelort.deploy_rank=validated",
        "prelort.validation_rows=2",
        f"lora.scaling={scaling}",
        "train.lr=0.05",
    )
    prep = tiny_prepared(cfg)
    run_method(prep, cfg, tmp_path / "run")
    last = lines(tmp_path / "run")[-1]
    chosen = {c: int(m["metrics"]["deploy_rank"]) for c, m in last["clients"].items()}
    assert chosen == {"0": 2, "1": 2, "2": 2}
    ck = RunDir(tmp_path / "run").latest_checkpoint(True)
    assert {c: int(s["deploy"]["rank"][0]) for c, s in ck.client_state.items()} == {
        int(c): r for c, r in chosen.items()
    }
    st = methods.get("prelort").server(cfg, {})
    s = st.s
    for c, r in chosen.items():
        cut = truncate_rank(ck.state.arrays, r)
        want = prep_eval(prep, int(c), cut, s.scale(r))
        assert last["eval"][c]["loss"] == pytest.approx(want, abs=1e-6)
        out, desc = export_adapter(tmp_path / "run", client=int(c))
        assert desc["rank"] == r and f'"r": {r}' in (out / "adapter_config.json").read_text()
    c, r = next((c, r) for c, r in chosen.items())
    with pytest.raises(NestfedError, match=f"client {c} runs rank {r}"):
        export_adapter(tmp_path / "run", rank=r + 1 if r < 8 else 1, client=int(c))


def prep_eval(prep, cid, arrays, scale):
    from nestfed.evaluation.client import evaluate_client
    from nestfed.nn.arrays import apply_arrays

    apply_arrays(prep.backbone.model, arrays, scale)
    return evaluate_client(prep.backbone.model, prep.data[cid], prep.cfg.train)["loss"]


def test_bad_deploy_rank_options_name_the_key():
    with pytest.raises(ConfigError, match="deploy_rank: unknown choice 'best'"):
        tiny_config("strategy.name=prelort", "prelort.deploy_rank=best")
    with pytest.raises(ConfigError, match="validation_rows: 0 is not a count"):
        tiny_config("strategy.name=prelort", "prelort.validation_rows=0")


@pytest.mark.slow
def test_a_validated_run_resumes_exactly_with_each_clients_choice(tmp_path):
    """A crash mid-run resumes to the uninterrupted run's adapter, and each client's kept choice
    (its checkpointed state) is the uninterrupted run's."""
    cfg = tiny_config("strategy.name=prelort", "prelort.deploy_rank=validated", "prelort.validation_rows=2")
    full, resumed = crash_and_resume(tmp_path, cfg)
    assert same_arrays(full.arrays, resumed.arrays)
    kept = [RunDir(tmp_path / d).latest_checkpoint(True).client_state for d in ("full", "part")]
    choices = [{c: int(s["deploy"]["rank"][0]) for c, s in k.items()} for k in kept]
    assert choices[0] == choices[1] and set(choices[0]) == {0, 1, 2}
