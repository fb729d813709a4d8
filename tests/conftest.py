"""Shared fixtures: seeds, thread counts, tiny random models (hidden 64, 2 layers).

Builders of a whole tiny federation (any registered method, set up through its home) live in
``tiny_federation.py`` beside this file.
"""

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# One OpenMP thread per process, set before torch loads and inherited by every subprocess a test
# starts (CLI runs, Flower nodes and workers): pytest-xdist already runs two workers on the two
# cores, and two more OpenMP threads each spin against the other worker's (tests/test_cli.py and
# tests/experiments/test_crash_resume.py: 177 s with the default, 89 s with one thread, side by side).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from nestfed.cli import main
from nestfed.config import ModelConfig
from nestfed.nn.backbone import load_backbone

SHARED = Path(__file__).resolve().parents[2] / "shared"
ROOT = Path(__file__).resolve().parents[1]


# the longest tests' measured seconds (call + setup + teardown), written by a run with
# NESTFED_STORE_DURATIONS=1 (a record for measurements)
DURATIONS = Path(__file__).with_name("durations.json")
_measured: dict[str, float] = {}


def pytest_collection_modifyitems(config, items):
    """Mark ``flower`` and ``e2e`` tests ``slow``; the tests run in collection order.

    ``-m "not slow"`` (the quick loop) so leaves them out with the rest of what runs whole
    federations, processes or real models. (Ordering by tests/durations.json was tried: two Flower
    deployments side by side slowed each other 4x, and all of them on one worker made a serial
    critical path; collection order keeps them mostly apart.)
    """
    for item in items:
        if item.get_closest_marker("flower") or item.get_closest_marker("e2e"):
            item.add_marker(pytest.mark.slow)


def pytest_runtest_logreport(report):
    if os.environ.get("NESTFED_STORE_DURATIONS"):
        _measured[report.nodeid] = _measured.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    """With NESTFED_STORE_DURATIONS=1, write the 40 longest tests to tests/durations.json."""
    if os.environ.get("NESTFED_STORE_DURATIONS") and _measured and not hasattr(session.config, "workerinput"):
        top = sorted(_measured.items(), key=lambda kv: -kv[1])[:40]
        DURATIONS.write_text(json.dumps({k: round(v, 1) for k, v in top}, indent=1) + "\n")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny matmuls on one intra-op thread: on a shared 2-core machine two OpenMP threads on small
    ops can run 50x slower when another process holds a core; exact comparisons also want one
    thread count. Restores the count afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def keep_threads():
    """Restore torch's thread count after a test that runs an experiment (which may set it)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=["tiny-llama", "tiny-qwen2"])
def tiny(request):
    """A frozen tiny random backbone of each supported family, with the byte tokenizer."""
    return load_backbone(ModelConfig(name=request.param))


@pytest.fixture
def tiny_llama():
    return load_backbone(ModelConfig(name="tiny-llama"))


@dataclass
class CliResult:
    """What one in-process command returned: exit code, stdout, stderr."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(monkeypatch, capsys, keep_threads):
    """``cli(*args, cwd=...)``: ``nestfed.cli.main`` in this process with these arguments (the same
    entry point the installed command runs); returns a :class:`CliResult`."""

    def call(*args, cwd):
        monkeypatch.chdir(cwd)
        monkeypatch.setattr(sys, "argv", ["nestfed", *map(str, args)])
        monkeypatch.setenv("COLUMNS", "200")
        capsys.readouterr()
        code = 0
        try:
            main()
        except SystemExit as exc:
            code = exc.code or 0
        out = capsys.readouterr()
        return CliResult(code, out.out, out.err)

    return call
