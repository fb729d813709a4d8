"""Fixtures of the Flower tests."""

import pytest
import torch
from flower_helpers import embedded_run

from nestfed.testing.flower_deployment import LocalDeployment


@pytest.fixture
def keep_threads():
    """Restore torch's thread count after a test that runs an experiment in this process."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def embedded_reference(tmp_path_factory):
    """The embedded run of the Flower tests' experiment (a run directory), computed once per session."""
    return embedded_run(tmp_path_factory.mktemp("embedded") / "run")


@pytest.fixture
def deployment(tmp_path):
    """A LocalDeployment (SuperLink and SuperNodes on 127.0.0.1) under tmp_path, stopped after the test."""
    d = LocalDeployment(tmp_path / "flower")
    try:
        yield d
    finally:
        d.stop()
