"""The memory's capability tests must fail when the memory is cut out: each of three faults is
injected (the read disconnected from the output, the read's queries replaced by random ones, the
gate held at issue 24's 0.05) and both training tests of tests/nn/test_memory_capability.py are
run under it, by pytest (this script imports nothing from tests/: a pytest plugin installs the
fault around each test's call); every one must fail, at the assertion named. Prints a JSON line
per (fault, test) beside pytest's report; ``--json`` writes them all in one object.

    .venv/bin/python bench/studies/fednl_capability_faults.py --json bench/results/fednl_capability_faults.json
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.nn.functional import normalize

from nestfed.nn import memory

ROOT = Path(__file__).resolve().parents[2]
TEST_FILE = ROOT / "tests" / "nn" / "test_memory_capability.py"
TESTS = (
    "test_a_memory_trained_from_scratch_recalls_past_the_window",
    "test_lora_and_memory_on_a_frozen_backbone_reach_full_attention",
)
Install = Callable[[ModuleType], Callable[[], None]]


def patch(owner, name: str, value) -> Callable[[], None]:
    """Set ``owner.name`` to ``value``; returns the undo."""
    old = getattr(owner, name)
    setattr(owner, name, value)
    return lambda: setattr(owner, name, old)


def faults() -> dict[str, Install]:
    """{name: install}: ``install(test_module)`` injects the fault (into MemoryRule's methods, or the
    settings the test module builds its memory with) and returns its undo."""
    rule, inputs = memory.MemoryRule, memory.MemoryRule.inputs

    def random_queries(self, q, k, v, valid=None, state=None):
        q_lin, k_lin, v_lin = inputs(self, q, k, v, valid, state)
        return normalize(torch.randn_like(q_lin), dim=-1), k_lin, v_lin

    def gate_held(**kw):
        return memory.MemorySettings(**{**kw, "gate": "constant", "alpha_init": 0.05})

    return {
        "the read disconnected from the output": lambda T: patch(rule, "mix", lambda self, *a: a[4]),
        "the read's queries random": lambda T: patch(rule, "inputs", random_queries),
        "the gate held at 0.05": lambda T: patch(T, "MemorySettings", gate_held),
    }


class FaultPlugin:
    """A pytest plugin: the fault installed around each test's call (undone after), and each test's
    outcome: ``passed: the fault went unnoticed``, ``failed at: <the failing assert's line>``, or
    ``error: <exception>`` for anything but an AssertionError."""

    def __init__(self, install: Install):
        self.install, self.outcomes = install, {}

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        undo = self.install(item.module)
        try:
            return (yield)
        finally:
            undo()

    def pytest_runtest_makereport(self, item, call) -> None:
        if call.when != "call":
            return
        if call.excinfo is None:
            self.outcomes[item.name] = "passed: the fault went unnoticed"
        elif call.excinfo.errisinstance(AssertionError):
            lines = "".join(traceback.format_exception(call.excinfo.value)).splitlines()
            line = [ln.strip() for ln in lines if ln.strip().startswith("assert")]
            self.outcomes[item.name] = f"failed at: {line[-1] if line else '?'}"
        else:
            self.outcomes[item.name] = f"error: {call.excinfo.exconly()}"


def run_fault(install: Install, tests=TESTS) -> dict[str, str]:
    """{test name: outcome} of ``tests`` run by pytest (one process, one thread) under the fault."""
    plugin = FaultPlugin(install)
    args = [f"{TEST_FILE}::{t}" for t in tests] + ["-q", "-n", "0", "-p", "no:cacheprovider", "--no-header"]
    pytest.main(args, plugins=[plugin])
    return {t: plugin.outcomes.get(t, "not run") for t in tests}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    res = {"bench": "fednl_capability_faults", "results": []}
    for name, install in faults().items():
        for test, outcome in run_fault(install).items():
            res["results"].append({"fault": name, "test": test, "outcome": outcome})
            print(json.dumps(res["results"][-1]), flush=True)
    res["all_caught"] = all(r["outcome"].startswith("failed") for r in res["results"])
    print(json.dumps({"all_caught": res["all_caught"]}))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
