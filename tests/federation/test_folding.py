"""Replies held up to federation.hold_replies, then folded into running sums: the folded aggregate of
every rule that folds equals its held aggregate to float32 rounding, within the bound bit for bit;
a rule that needs every update holds them all; a whole run with hold_replies = 1 ends where the held
run ends."""

import json

import pytest
import torch
from tiny_federation import tiny_config, tiny_prepared, tiny_run

from nestfed import methods
from nestfed.config import RobustConfig
from nestfed.federation.folding import ReplyFolder
from nestfed.federation.robust import BlockRule
from nestfed.federation.safeguards import Safeguards

FOLDING = methods.declaring(methods.Capability.SECURE_AGGREGATION)  # rebuilt from sums: what folds
SIX = ("data.num_clients=6", "lora.ranks=[2,2,4,4,8,8]")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def round_of(name, ranks=SIX):
    """One round of ``name`` on the tiny federation: the strategy, the initial state, the instructions
    and the trained replies of all six clients."""
    if not methods.get(name).can(methods.Capability.HETEROGENEOUS_RANKS):
        ranks = ("data.num_clients=6", "lora.ranks=[4]")
    cfg = tiny_config(f"strategy.name={name}", *ranks)
    mr = methods.get(name).build(tiny_prepared(cfg, (6,) * 6), cfg)
    state = mr.strategy.initialize(mr.shapes, mr.clients)
    ins = mr.strategy.configure(1, state, mr.clients)
    replies = {c: mr.trainer.fit(c, ins[c]) for c in ins}
    return cfg, mr.strategy, state, ins, replies


def fold(strategy, state, ins, replies, hold, safeguards=None):
    """The folder of the loop for ``strategy``'s method (it folds when the method declares secure
    aggregation)."""
    secure = methods.get(strategy.name).can(methods.Capability.SECURE_AGGREGATION)
    f = ReplyFolder(
        strategy,
        safeguards or Safeguards(),
        1,
        state,
        ins,
        hold,
        max(r.num_examples for r in replies.values()),
        secure=secure,
    )
    for c in sorted(replies):
        f.add(c, replies[c])
    return f


@pytest.mark.parametrize("name", FOLDING)
def test_folded_sums_give_the_held_aggregate(name):
    _, st, state, ins, replies = round_of(name)
    held = fold(st, state, ins, replies, hold=6)
    assert not held.folded and held.facts()["held_replies"] == 6
    exact, _ = held.aggregate()
    reference = st.aggregate(1, state, replies)
    assert all(torch.equal(exact.arrays[k], reference.arrays[k]) for k in reference.arrays)  # bit for bit
    folded = fold(st, state, ins, replies, hold=1)
    assert folded.folded and folded.facts() == {"held_replies": 0, "held_bytes": 0, "folded_replies": 6}
    got, _ = folded.aggregate()
    for k in reference.arrays:
        torch.testing.assert_close(got.arrays[k], reference.arrays[k], rtol=1e-5, atol=1e-6)
    moved = [k for k in reference.arrays if not torch.equal(reference.arrays[k], state.arrays[k])]
    assert moved or name == "local_only"  # the round changed something (local-only keeps its state)


@pytest.mark.parametrize("name", [m for m in methods.REGISTRY if m not in FOLDING and m not in ("fedslm", "fedmkt")])
def test_rules_that_need_every_update_hold_them_all(name):
    _, st, state, ins, replies = round_of(name)
    f = fold(st, state, ins, replies, hold=1)
    assert not f.folded and f.facts()["held_replies"] == 6 and f.facts()["held_bytes"] > 0


def test_a_robust_rule_holds_every_update():
    _, st, state, ins, replies = round_of("zeropad")
    rule = Safeguards(rule=BlockRule(RobustConfig(rule="median"), Safeguards().privacy))
    f = fold(st, state, ins, replies, hold=1, safeguards=rule)
    assert not f.folded and len(f.held) == 6


def test_a_run_that_folds_every_round_ends_at_the_held_runs_adapter(tmp_path):
    cfg = tiny_config("strategy.name=prelort", *SIX, "federation.rounds=2")
    folded_cfg = tiny_config("strategy.name=prelort", *SIX, "federation.rounds=2", "federation.hold_replies=1")
    held, _, _ = tiny_run(tmp_path / "held", cfg, tiny_prepared(cfg, (6,) * 6))
    folded, loop, _ = tiny_run(tmp_path / "folded", folded_cfg, tiny_prepared(folded_cfg, (6,) * 6))
    for k in held.arrays:  # round 1 agrees to float32 rounding; round 2's training amplifies it (up to 2.6e-6
        # on an AVX-512/AMX CPU), far below a round's update (about 1e-3)
        torch.testing.assert_close(folded.arrays[k], held.arrays[k], rtol=1e-4, atol=1e-5)
    ln = [json.loads(x) for x in (tmp_path / "folded" / "metrics.jsonl").read_text().splitlines()]
    assert ln[1]["replies"] == {"held_replies": 0, "held_bytes": 0, "folded_replies": 6}
    assert "replies" not in json.loads((tmp_path / "held" / "metrics.jsonl").read_text().splitlines()[1])
