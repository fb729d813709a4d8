"""A finished run's client models rebuilt from its directory: the same held-out numbers the run's
last evaluation wrote, and with the memory knocked out exactly the model without its memory."""

import pytest
from tiny_federation import lines, tiny_config, tiny_prepared, tiny_run

from nestfed.errors import NestfedError
from nestfed.experiments.run_models import client_evaluations
from nestfed.nn.memory import is_memory_key


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def cfg_of(*extra):
    return tiny_config(
        "strategy.name=fednl",
        "lora.ranks=[4]",
        'lora.target_modules=["q_proj","k_proj","v_proj"]',
        "fednl.travel=rules",
        "federation.rounds=2",
        *extra,
    )


def test_client_models_are_rebuilt_with_their_kept_state_and_knocked_out(tmp_path):
    cfg = cfg_of()
    _, _, mr = tiny_run(tmp_path / "run", cfg)
    last = lines(tmp_path / "run")[-1]["eval"]
    got = client_evaluations(tmp_path / "run", prep=tiny_prepared(cfg))
    assert set(got) == set(last) == {"0", "1", "2"}
    for c in got:  # each client's own LoRA (rules mode) and the global rules, as the run evaluated them
        assert got[c]["loss"] == pytest.approx(last[c]["loss"], abs=1e-6)
    off = client_evaluations(tmp_path / "run", knocked_out=True, prep=tiny_prepared(cfg))
    prep = tiny_prepared(cfg)
    from nestfed import methods
    from nestfed.federation.run_dir import RunDir

    run = methods.get("fednl").build(prep, cfg)
    ck = RunDir(tmp_path / "run").latest_checkpoint(True)
    run.trainer.client_state = ck.client_state
    for c in got:
        arrays, scale = run.strategy.deploy(ck.state, int(c))
        runs = run.trainer.hooks.evaluation_arrays(ck.client_state[int(c)], arrays)  # + the client's own LoRA
        no_memory = {k: v for k, v in runs.items() if not is_memory_key(k)}  # no rules: the memory stays off
        want = run.trainer.evaluate_as_sent(int(c), no_memory, scale)
        assert off[c]["loss"] == pytest.approx(want["loss"], abs=1e-6)
        assert abs(off[c]["loss"] - got[c]["loss"]) > 1e-4


def test_knocking_out_a_run_without_memory_is_refused(tmp_path):
    cfg = tiny_config("strategy.name=fedavg", "lora.ranks=[4]", "federation.rounds=1")
    tiny_run(tmp_path / "run", cfg)
    with pytest.raises(NestfedError, match="fedavg has no memory to knock out"):
        client_evaluations(tmp_path / "run", knocked_out=True, prep=tiny_prepared(cfg))
