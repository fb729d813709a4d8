"""PreLort's transfer to low-rank clients where only it can help (bench/studies/rank_transfer.py):
a skill only the clients of rank 8 and 16 see reaches the rank-2 clients' prefix under PreLort's
nested objective, given local steps, and not under ZeroPad; with 10 local steps under neither."""

import importlib.util
from functools import partial
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location(
        "bench_rank_transfer", ROOT / "bench" / "studies" / "rank_transfer.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_rank_2_client_alone_never_learns_the_skill(study):
    """The construction: its data never reach the skill's inputs, so training fits its own map
    (error near 0) and leaves the skill's error at 1 or above."""
    T = sum(study.shifts(0))
    state = study.shared_shift.initial(1)
    payload = {study.KEY_A: state.arrays[study.KEY_A][:2], study.KEY_B: state.arrays[study.KEY_B][:, :2]}
    reply = study.shared_shift.train(payload, [2], T, 100, 5e-3, seed=0, sample=partial(study.inputs, 64, False))
    E = reply.arrays[study.KEY_B] @ reply.arrays[study.KEY_A] - T
    own, skill = (float(E[:, c].norm() / T[:, c].norm()) for c in (slice(0, 16), slice(16, 32)))
    assert own < 0.05
    assert skill >= 1.0


def test_inputs_of_a_client_without_the_skill_are_zero_on_its_half(study):
    g = torch.Generator().manual_seed(0)
    assert study.inputs(8, False, g)[:, 16:].abs().sum() == 0
    x = study.inputs(8, True, g)
    assert x[:4, 16:].abs().sum() == 0 and x[4:, :16].abs().sum() == 0 and x[4:, 16:].abs().sum() > 0


@pytest.mark.slow
def test_prelort_carries_the_skill_to_rank_2_given_local_steps_and_zeropad_does_not(study):
    prelort = study.federate("prelort", 0, 10, 50, 5e-3, 8)[-1]
    zeropad = study.federate("zeropad", 0, 10, 50, 5e-3, 8)[-1]
    assert prelort["skill"] < 0.3 < 0.5 < zeropad["skill"]
    assert prelort["own"] < 0.05 and zeropad["own"] < 0.05


@pytest.mark.slow
def test_with_10_local_steps_neither_carries_the_skill_though_prelort_s_full_adapter_holds_it(study):
    prelort = study.federate("prelort", 0, 10, 10, 5e-3, 8)[-1]
    zeropad = study.federate("zeropad", 0, 10, 10, 5e-3, 8)[-1]
    assert prelort["skill"] > 0.9 and zeropad["skill"] > 0.9
    assert prelort["skill_full"] < 0.3 < 0.9 < zeropad["skill_full"]
