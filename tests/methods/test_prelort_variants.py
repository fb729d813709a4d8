"""PreLort's objective and aggregation options (the sampled objective and the paper's two
ablations), and the local-only baseline."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tiny_federation import crash_and_resume, lines, same_arrays, tiny_config, tiny_prepared, tiny_run

from nestfed import methods
from nestfed.config import ConfigError
from nestfed.federation.messages import ClientInfo, Reply
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


@pytest.mark.parametrize("objective", ["sampled", "full_rank"])
def test_variants_resume_exactly(tmp_path, objective):
    full, resumed = crash_and_resume(tmp_path, tiny_config("strategy.name=prelort", f"prelort.objective={objective}"))
    assert same_arrays(full.arrays, resumed.arrays)


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


def test_local_only_resumes_exactly_and_refuses_robust_rules(tmp_path):
    crash_and_resume(tmp_path, tiny_config("strategy.name=local_only"))
    # the server state never moves: what must survive the crash is each client's own adapter,
    # which the final evaluation runs
    assert lines(tmp_path / "part")[-1]["eval"] == lines(tmp_path / "full")[-1]["eval"]
    assert [ln["round"] for ln in lines(tmp_path / "part")] == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="local-only training aggregates nothing"):
        tiny_config("strategy.name=local_only", "robust.rule=median")
    assert methods.get("local_only").global_adapter is False
