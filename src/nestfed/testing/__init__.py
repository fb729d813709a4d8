"""Tooling for tests and benchmarks, not used by any nestfed command.

- `nestfed.testing.local_grid`: ``LocalGrid``, the ServerApp and ClientApps of one experiment
  in one process (flwr's Grid without a SuperLink), for fast tests of the Flower apps' logic.
- `nestfed.testing.flower_deployment`: ``LocalDeployment``, a real SuperLink and SuperNodes
  on 127.0.0.1 driven by the ``flwr`` CLI (tests/flower, bench/perf/flower_*.py), also a quick way to
  try the apps before going to real machines.
"""
