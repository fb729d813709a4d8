"""A node's kept client state on disk (nestfed.flower.node_state): which round a message restores,
what is pruned, and what a broken file gives."""

import pytest
import torch

from nestfed.errors import DataError
from nestfed.flower.node_state import NodeStateStore, run_key


def state(cid, value):
    return {cid: {"fedala": {"w": torch.full((2, 3), float(value)), "local": torch.arange(4.0) + value}}}


def test_a_train_restores_the_newest_state_before_its_round_and_pruning_keeps_what_a_redo_needs(tmp_path):
    store, run = NodeStateStore(tmp_path), "/runs/a"
    assert store.load(run, 3, 10) == (None, {})  # a client's first round
    for rnd in (1, 3, 4):
        store.save(run, 3, rnd, state(3, rnd))
    # after writing round 4: round 3 (what a redo of round 4 starts from) and round 4 are kept
    assert [r for r, _ in store.rounds(run, 3)] == [3, 4]
    rnd, got = store.load(run, 3, 3)  # a redo of round 4 (TRAIN restores <= round - 1)
    assert rnd == 3 and torch.equal(got[3]["fedala"]["w"], torch.full((2, 3), 3.0))
    rnd, got = store.load(run, 3, 4)  # EVALUATE after round 4
    assert rnd == 4 and torch.equal(got[3]["fedala"]["local"], torch.arange(4.0) + 4)
    store.save(run, 3, 4, state(3, 4))  # the redo overwrites round 4, keeps round 3
    assert [r for r, _ in store.rounds(run, 3)] == [3, 4]
    store.save(run, 3, 7, state(3, 7))
    assert [r for r, _ in store.rounds(run, 3)] == [4, 7]
    assert store.load(run, 3, 2) == (None, {})  # pruned: nothing that old is ever asked for again


def test_runs_and_clients_are_kept_apart_and_a_client_that_keeps_nothing_writes_nothing(tmp_path):
    store = NodeStateStore(tmp_path)
    store.save("/runs/a", 0, 1, state(0, 1))
    store.save("/runs/b", 0, 1, state(0, 5))
    assert store.save("/runs/a", 1, 1, {1: {}}) is None and store.rounds("/runs/a", 1) == []
    assert torch.equal(store.load("/runs/a", 0, 1)[1][0]["fedala"]["w"], torch.ones(2, 3))
    assert torch.equal(store.load("/runs/b", 0, 1)[1][0]["fedala"]["w"], torch.full((2, 3), 5.0))
    assert run_key("/runs/a") != run_key("/runs/b") and len(run_key("/runs/a")) == 16
    assert (tmp_path / run_key("/runs/a") / "run.txt").read_text() == "/runs/a\n"
    assert not list(tmp_path.rglob(".*"))  # no temporary file left


def test_a_broken_or_foreign_state_file_is_one_line_naming_it(tmp_path):
    store = NodeStateStore(tmp_path)
    path = store.save("/runs/a", 2, 1, state(2, 1))
    path.write_bytes(b"not safetensors")
    with pytest.raises(DataError, match=r"round-000001\.safetensors: not a readable client-state file"):
        store.load("/runs/a", 2, 1)
    from safetensors.torch import save_file

    from nestfed.federation.run_files import flatten_client_state

    save_file(flatten_client_state(state(5, 1) | state(2, 2)), str(path.with_name("round-000002.safetensors")))
    with pytest.raises(DataError, match="holds the state of clients"):
        store.load("/runs/a", 2, 2)
