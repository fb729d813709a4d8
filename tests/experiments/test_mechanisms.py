"""The truncation curve and dimension importance of a finished run's global adapter."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_federation import lines, tiny_config, tiny_run

from nestfed.experiments.mechanisms import adapter_rank, dimension_importance, mechanisms
from nestfed.federation.in_process import InProcessTransport
from nestfed.nn.keys import peft_key


def report(cfg, mr, state):
    """The mechanism reports as the embedded runner measures them: the clients evaluate the adapter
    as sent, through the in-process transport."""
    transport = InProcessTransport(mr.trainer)
    return mechanisms(cfg, mr.strategy, mr.clients, state, lambda d: transport.evaluate(0, d, as_sent=True))


def test_dimension_importance_by_hand():
    A1 = torch.tensor([[3.0, 4.0], [0.0, 1.0]])  # row norms 5, 1
    B1 = torch.tensor([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]])  # column norms 1, 2
    A2 = torch.tensor([[0.0, 2.0], [1.0, 0.0]])  # row norms 2, 1
    B2 = torch.tensor([[2.0, 3.0], [0.0, 4.0], [0.0, 0.0]])  # column norms 2, 5
    arrays = {
        peft_key("l1", "lora_A"): A1,
        peft_key("l1", "lora_B"): B1,
        peft_key("l2", "lora_A"): A2,
        peft_key("l2", "lora_B"): B2,
    }
    s = 0.5
    # component 0: layer 1 s*1*5 = 2.5, layer 2 s*2*2 = 2; component 1: s*2*1 = 1, s*5*1 = 2.5
    expected = [math.sqrt(2.5**2 + 2.0**2), math.sqrt(1.0**2 + 2.5**2)]
    assert dimension_importance(arrays, s) == pytest.approx(expected, rel=1e-12)
    # each component's norm is the Frobenius norm of s B[:, i] A[i, :] itself
    direct = math.sqrt(
        sum(float(torch.linalg.matrix_norm(s * torch.outer(B[:, 0], A[0])) ** 2) for A, B in ((A1, B1), (A2, B2)))
    )
    assert dimension_importance(arrays, s)[0] == pytest.approx(direct, rel=1e-12)
    assert adapter_rank({peft_key("l1", "lora_A"): A1, peft_key("l2", "lora_A"): A1[:1]}) is None
    with pytest.raises(ValueError, match="lora_A without lora_B"):
        dimension_importance({peft_key("l1", "lora_A"): A1}, 1.0)


def test_truncation_curve_at_a_clients_rank_is_what_that_client_runs(tmp_path):
    """Under ``fixed`` scaling the global adapter truncated to r_k is exactly client k's
    deployment, so the curve at r = 2, 4, 8 equals the final round's evaluation of clients 0, 1, 2."""
    cfg = tiny_config("strategy.name=prelort", "output.truncations=[1,2,4,8,16]")
    state, _, mr = tiny_run(tmp_path / "run", cfg)
    out = report(cfg, mr, state)
    final = lines(tmp_path / "run")[-1]["eval"]
    assert sorted(out["truncation"], key=int) == ["1", "2", "4", "8"]  # 16 > r_max is left out
    for cid, r in (("0", "2"), ("1", "4"), ("2", "8")):
        assert out["truncation"][r][cid]["loss"] == pytest.approx(final[cid]["loss"], abs=1e-6)
    assert len(out["dimension_importance"]) == 8 and all(v >= 0 for v in out["dimension_importance"])


def test_methods_without_one_nested_adapter_are_skipped(tmp_path):
    cfg = tiny_config("strategy.name=local_only", "federation.rounds=1")
    state, _, mr = tiny_run(tmp_path / "local", cfg)
    assert (
        "local_only cannot export its global adapter at a rank: each client keeps its own adapter"
        in (report(cfg, mr, state)["mechanisms_skipped"])
    )
    cfg = tiny_config("strategy.name=flora", "federation.rounds=1")
    state, _, mr = tiny_run(tmp_path / "flora", cfg)
    assert "a stack of every client's factors" in report(cfg, mr, state)["mechanisms_skipped"]
