"""docs/flower.md's simulation commands, run as the page writes them: its ``config.toml`` block and
its bash block, taken from the page (so they cannot drift), in a folder laid out like the
repository (``.venv`` is this interpreter's environment, which is not on ``PATH``). The only change
is the SuperLink's port, a free one instead of 9093, so that parallel runs do not collide.

The run finishes with the embedded runner's run directory, and the SuperLink is gone afterwards
(stopped by the PID the commands recorded). And without ``--federation-config``: flwr's 2 virtual
SuperNodes against the bundle's 3 clients stop the run early, with one line naming both numbers."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")

from nestfed.testing.doc_pages import section_blocks  # noqa: E402
from nestfed.testing.flower_deployment import LocalDeployment, free_port  # noqa: E402

pytestmark = pytest.mark.flower

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## On one machine: Flower's simulation engine"


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_simulation_commands_of_docs_flower_run_as_written(tmp_path):
    blocks = section_blocks(ROOT / "docs" / "flower.md", SECTION)
    assert len(blocks["toml"]) == 1 and len(blocks["bash"]) == 1, blocks
    port = str(free_port())
    cli_config, commands = (b.replace("9093", port) for b in (blocks["toml"][0], blocks["bash"][0]))
    assert port in cli_config and port in commands

    work = tmp_path / "repo"
    work.mkdir()
    (work / ".venv").symlink_to(Path(sys.executable).parents[1])
    (work / "flower_app").symlink_to(ROOT / "flower_app")
    (work / "configs").symlink_to(ROOT / "configs")
    d = LocalDeployment(tmp_path / "flower")  # its FLWR_HOME, and stop() for whatever is left on failure
    (d.home / "config.toml").write_text(cli_config)
    env = {
        "PATH": "/usr/bin:/bin",  # not the venv's bin: the commands put it there themselves
        "HOME": str(tmp_path / "home"),
        "FLWR_HOME": str(d.home),
        "COLUMNS": "200",
        **{k: os.environ[k] for k in ("PYTHONPATH", "TMPDIR", "LANG") if k in os.environ},
    }
    try:
        r = subprocess.run(
            ["bash", "-e", "-c", commands],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=540,
            start_new_session=True,
        )
        log = work / "superlink.log"
        superlink_log = log.read_text(errors="replace") if log.exists() else ""
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + superlink_log[-3000:]
        assert "finished:completed" in r.stdout, r.stdout[-3000:]
        pid = int((work / "superlink.pid").read_text())
        deadline = time.monotonic() + 30.0
        while alive(pid) and time.monotonic() < deadline:  # SIGTERM: it shuts down gracefully
            time.sleep(0.2)
        assert not alive(pid)  # `kill "$(cat superlink.pid)"` stopped it
    finally:
        d.stop()
    run_dir = work / "runs" / "sim-1"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [ln["round"] for ln in lines] == [0, 1, 2]  # the bundle's experiment: 2 rounds
    assert all(c["status"] == "accepted" for ln in lines[1:] for c in ln["clients"].values())
    assert sorted(int(c) for c in lines[1]["clients"]) == [0, 1, 2]  # 3 clients, one per virtual SuperNode
    assert json.loads((run_dir / "summary.json").read_text())["engine"] == "flower"
    adapter = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 8  # r_max of ranks 2/4/8


def test_flwr_default_node_count_against_the_bundles_three_clients_stops_early(tmp_path):
    """No --federation-config: flwr 1.42 starts 2 virtual SuperNodes for the bundle's 3 clients. The
    run fails long before connect-timeout-s (300 s), its log holding the one line that names both
    numbers; no run directory is written."""
    run_dir = tmp_path / "run"
    with LocalDeployment(tmp_path / "flower", simulation=True) as d:
        d.start_superlink()
        t0 = time.monotonic()
        run_id = d.submit(ROOT / "flower_app", {"run-dir": str(run_dir)})
        status = d.wait_run(run_id, 240)
        elapsed = time.monotonic() - t0
        logs = " ".join(d.logs(run_id).split())  # flwr log wraps long lines
    assert status["status"] == "finished:failed", (status, logs[-3000:])
    assert elapsed < 150, elapsed
    assert "2 nodes connected for data.num_clients = 3" in logs, logs[-3000:]
    assert "num-partitions = 2 but the experiment has data.num_clients = 3" in logs, logs[-3000:]
    assert not run_dir.exists()
