"""The clients' learning-rate schedule: each step's rate against the formulas computed by hand (per
round and across rounds, every parameter group alike), and a run whose only local step is warmup
step 0 (rate 0) leaves the global adapter as it was."""

import math

import pytest
import torch

from nestfed.config.schema import TrainConfig
from nestfed.federation.lr_schedule import client_schedule


def rates(train: TrainConfig, rnd: int, rounds: int) -> list[float]:
    """The rate of each parameter group (1e-3 and 1e-2 unscheduled) at each local step of round
    ``rnd``, flattened: step 0's two, step 1's two, ..."""
    w = [torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)]
    opt = torch.optim.AdamW([{"params": [w[0]]}, {"params": [w[1]], "lr": 1e-2}], lr=1e-3)
    sched = client_schedule(opt, train, rnd, rounds)
    out = []
    for _ in range(train.local_steps):
        out.extend(g["lr"] for g in opt.param_groups)
        opt.step()
        if sched is not None:
            sched.step()
    return out


def test_linear_with_warmup_restarts_every_round():
    t = TrainConfig(local_steps=4, lr_schedule="linear", warmup_steps=2)
    want = [0.0, 0.5, 1.0, 0.5]  # warmup s / 2, then (4 - s) / (4 - 2)
    for rnd in (1, 2):
        assert rates(t, rnd, 3) == pytest.approx([r * f for f in want for r in (1e-3, 1e-2)])


def test_cosine_across_the_federation_continues_where_the_round_starts():
    t = TrainConfig(local_steps=2, lr_schedule="cosine", lr_schedule_scope="federation")
    f = [0.5 * (1 + math.cos(math.pi * s / 4)) for s in range(4)]  # 2 rounds x 2 steps
    assert rates(t, 1, 2) == pytest.approx([r * x for x in f[:2] for r in (1e-3, 1e-2)])
    assert rates(t, 2, 2) == pytest.approx([r * x for x in f[2:] for r in (1e-3, 1e-2)])


def test_constant_with_warmup_and_the_default_untouched():
    t = TrainConfig(local_steps=4, lr_schedule="constant", warmup_steps=2)
    assert rates(t, 1, 1) == pytest.approx([0.0, 0.0, 5e-4, 5e-3, 1e-3, 1e-2, 1e-3, 1e-2])
    w = torch.zeros(1, requires_grad=True)
    assert client_schedule(torch.optim.AdamW([w], lr=1e-3), TrainConfig(), 1, 1) is None  # the default: no scheduler


def test_a_round_of_warmup_step_zero_leaves_the_global_adapter_as_it_was(tmp_path):
    from pathlib import Path

    from nestfed import methods
    from nestfed.experiments.prepare import prepare
    from nestfed.experiments.run import run_method
    from nestfed.federation.run_dir import RunDir

    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
    base = ["data.num_clients=2", "lora.ranks=[4,4]", "strategy.name=fedavg", "federation.rounds=1"]
    base += ["train.local_steps=1", "output.plots=false", "train.threads=1"]
    moved = {}
    for warmup in (0, 1):
        cfg = methods.load_config(tiny, [*base, f"train.warmup_steps={warmup}"])
        run_method(prepare(cfg), cfg, tmp_path / str(warmup))
        rd = RunDir(tmp_path / str(warmup))
        a, b = (rd.load_checkpoint(tmp_path / str(warmup) / "checkpoints" / f"round_00{r}.safetensors") for r in (0, 1))
        moved[warmup] = any(not torch.equal(a.state.arrays[k], b.state.arrays[k]) for k in a.state.arrays)
    assert moved == {0: True, 1: False}


def test_bad_schedules_are_one_line_naming_the_key():
    from nestfed import methods
    from nestfed.errors import ConfigError

    with pytest.raises(ConfigError, match="train.lr_schedule: unknown schedule 'step'"):
        methods.load_config(None, ["train.lr_schedule=step"])
    with pytest.raises(ConfigError, match="train.lr_schedule_scope"):
        methods.load_config(None, ["train.lr_schedule_scope=epoch"])


def test_cosine_with_a_warmup_ratio_per_round():
    t = TrainConfig(local_steps=4, lr_schedule="cosine", warmup_ratio=0.25)
    assert t.warmup(5) == 1  # ceil(0.25 x 4)
    want = [0.0, 1.0, 0.75, 0.25]  # warm-up 0 at step 0, then 0.5 (1 + cos(pi (s - 1) / 3))
    for rnd in (1, 2):
        assert rates(t, rnd, 5) == pytest.approx([r * f for f in want for r in (1e-3, 1e-2)])


def test_a_warmup_ratio_across_the_federation_counts_every_round():
    t = TrainConfig(local_steps=4, lr_schedule="linear", warmup_ratio=0.3, lr_schedule_scope="federation")
    assert t.schedule_steps(3) == 12 and t.warmup(3) == 4  # ceil(0.3 x 12)
    want = [1.0, 7 / 8, 6 / 8, 5 / 8]  # round 2 holds steps 4..7: (12 - s) / (12 - 4)
    assert rates(t, 2, 3) == pytest.approx([r * f for f in want for r in (1e-3, 1e-2)])


@pytest.mark.parametrize(
    "sets, message",
    [
        (["train.warmup_ratio=1.0"], r"train.warmup_ratio must be in \[0, 1\), got 1.0"),
        (["train.warmup_steps=1", "train.warmup_ratio=0.1"], "give one of the two warm-ups, not both"),
        (["train.local_steps=4", "train.warmup_steps=5"], "a warm-up of 5 steps is longer than each round's 4 steps"),
        (
            [
                "train.local_steps=4",
                "federation.rounds=2",
                "train.warmup_steps=9",
                "train.lr_schedule_scope=federation",
            ],
            "a warm-up of 9 steps is longer than the federation's 8 steps",
        ),
    ],
)
def test_bad_warmups_are_one_line_naming_the_key(sets, message):
    from nestfed import methods
    from nestfed.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        methods.load_config(None, sets)
    methods.load_config(None, ["train.local_steps=4", "federation.rounds=2", "train.warmup_steps=4"])  # 4 of 4: fine
