"""The FAB's ClientApp forwards every message to a long-running worker per node
(nestfed.flower.node_forwarder, nestfed.flower.worker): the same adapter, evaluations and
client state as the embedded runner, one worker process per node across messages, a light
ClientApp process, errors that name the fault, and workers that leave when told."""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from flower_helpers import OVERRIDES, assert_same_adapter, embedded_run  # noqa: E402
from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402
from test_apps_in_process import NODES, lines, run_config  # noqa: E402

from nestfed.flower import node_forwarder as NF  # noqa: E402
from nestfed.flower.server_app import run_on_grid  # noqa: E402
from nestfed.testing.local_grid import LocalGrid  # noqa: E402


@pytest.fixture
def worker_dir(monkeypatch):
    """A short private worker folder; its workers are told to leave (sockets removed) afterwards."""
    d = Path(tempfile.mkdtemp(prefix="nfw-test-"))
    monkeypatch.setenv("NESTFED_WORKER_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _worker_pids(folder: Path) -> set[int]:
    out = subprocess.run(["pgrep", "-f", f"nestfed.flower.worker --socket {folder}"], capture_output=True, text=True)
    return {int(x) for x in out.stdout.split()}


@pytest.mark.slow
def test_forwarded_messages_give_the_embedded_runners_adapter_and_state(tmp_path, worker_dir, keep_threads):
    over = OVERRIDES + ("strategy.name=fedala", "lora.ranks=[4]", 'lora.target_modules=["q_proj","v_proj"]')
    emb = embedded_run(tmp_path / "embedded", over)
    grid = LocalGrid(NF.app, NODES)
    run_on_grid(grid, run_config(tmp_path / "flower", overrides=";".join(over), evaluate=True))
    fl, em = lines(tmp_path / "flower"), lines(emb)
    assert [a["eval"] for a in fl] == [b["eval"] for b in em]  # bit for bit, rounds 0-2
    assert_same_adapter(emb, tmp_path / "flower")
    # FedALA's kept state went to each worker and came back through the Context every round
    assert all(v["client_state_arrays"] > 0 for v in fl[2]["clients"].values())
    sockets = sorted(p.name for p in worker_dir.glob("*.sock"))
    assert sockets == ["n101.sock", "n102.sock", "n103.sock"]
    pids = _worker_pids(worker_dir)
    assert len(pids) == 3  # one worker per node served all of that node's messages
    for sock in worker_dir.glob("*.sock"):
        sock.unlink()
    deadline = time.monotonic() + 10
    while _worker_pids(worker_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _worker_pids(worker_dir)  # a worker whose socket is gone leaves


def _bad_query(node_id: int) -> tuple[Message, Context]:
    """A query of the tiny experiment to a node whose partition-id (7) has no client."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    toml = (Path(__file__).parents[2] / "configs" / "tiny.toml").read_text()
    msg = Message(RecordDict({"experiment": ConfigRecord({"toml": toml})}), dst_node_id=node_id, message_type="query")
    ctx = Context(run_id=1, node_id=node_id, node_config={"partition-id": 7}, state=RecordDict(), run_config={})
    return msg, ctx


@pytest.mark.slow
def test_a_failing_client_is_reported_with_its_error(worker_dir):
    with pytest.raises(RuntimeError, match="ConfigError: node config: partition-id = 7"):
        NF.forward(*_bad_query(201))


@pytest.mark.slow
def test_the_forwarder_process_stays_light():
    code = (
        "import sys, nestfed.flower.node_forwarder; "
        "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_foreign_or_open_worker_dir_and_a_too_long_socket_path_are_refused(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(PermissionError, match="mode 0700"):
        NF.worker_dir({"worker-dir": str(open_dir)})
    long_dir = tmp_path / ("x" * 100)
    with pytest.raises(RuntimeError, match="longer than a Unix socket"):
        NF.connect_worker(1234567890123, {"worker-dir": str(long_dir)})


def test_a_worker_that_cannot_start_is_reported_with_its_log(tmp_path, monkeypatch):
    d = Path(tempfile.mkdtemp(prefix="nfw-bad-"))
    try:
        monkeypatch.setattr(NF.sys, "executable", "/bin/false")
        with pytest.raises(RuntimeError, match="exited with code 1"):
            NF.connect_worker(5, {"worker-dir": str(d)})
        assert not list(d.glob("*.sock"))
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slow
def test_a_worker_that_leaves_as_the_forwarder_connects_is_replaced_once(worker_dir, monkeypatch):
    """The first connection is closed by its peer before any answer (a worker leaving on its idle
    time); the forwarder connects again, to a fresh worker, which answers (here with the client's
    own error)."""
    import socket

    real, calls = NF.connect_worker, []

    def connect(node_id, node_config):
        calls.append(node_id)
        if len(calls) == 1:
            mine, theirs = socket.socketpair()
            theirs.close()
            return mine
        return real(node_id, node_config)

    monkeypatch.setattr(NF, "connect_worker", connect)
    with pytest.raises(RuntimeError, match="ConfigError: node config: partition-id = 7"):
        NF.forward(*_bad_query(202))
    assert calls == [202, 202]


def test_an_idle_worker_leaves_and_removes_its_socket_and_a_replaced_one_leaves_it(tmp_path):
    """nestfed.flower.worker.serve in this process: with no message for idle_s it returns and removes
    its socket; when another worker has replaced the socket file it returns and leaves that one."""
    import socket
    import threading

    from nestfed.flower.worker import serve

    path = tmp_path / "w" / "node.sock"
    t0 = time.monotonic()
    serve(path, idle_s=0.2)
    assert not path.exists() and time.monotonic() - t0 < 5.0
    t = threading.Thread(target=serve, args=(path, 30.0))
    t.start()
    while not path.exists():
        time.sleep(0.01)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(path.with_name("other.sock")))
    os.replace(path.with_name("other.sock"), path)  # another worker took the path over
    t.join(timeout=5.0)
    assert not t.is_alive() and path.exists()  # it left within its 1 s poll, and left the other's socket
    other.close()
