"""Secure aggregation with Flower's own SecAgg+ on a real SuperLink and 4 SuperNodes on 127.0.0.1.

One round of PreLort with ranks 2/4/4/8 (the tiny model, one thread per process, so each node's
training is the same as in this process). The server sees only the SecAgg+ sum; the round's
global state must equal the plain aggregate of the same replies (recomputed here from the round-0
checkpoint with the method's own strategy and trainer) within the stated quantisation bound. A
SuperNode killed after it has shared its keys (on receiving the collect stage's message, its
long-running worker frozen before so that it cannot answer it) is survived: the unmask stage
rebuilds its pairwise masks from the 3 survivors' shares (threshold 3). The two tests share one
deployment (``four_nodes``), the plain run first and the killing one last.
"""

import json
import os
import signal
import subprocess
import time

import pytest

pytest.importorskip("flwr")

from flower_helpers import APP_DIR  # noqa: E402
from test_secure_in_process import SECURE_OVERRIDES, TINY, assert_within_bound, line  # noqa: E402

from nestfed.testing.flower_deployment import LocalDeployment  # noqa: E402

pytestmark = pytest.mark.flower

RUN_TIMEOUT_S = 420


def submit(d, run_dir, **kw):
    rc = {
        "experiment": str(TINY),
        "overrides": ";".join(SECURE_OVERRIDES),
        "run-dir": str(run_dir),
        "connect-timeout-s": 240.0,
        "round-timeout-s": 300.0,
        "poll-interval-s": 0.2,
        "secure-aggregation": True,
    }
    rc.update(kw)
    return d.submit(APP_DIR, rc)


def finish(d, run_id):
    status = d.wait_run(run_id, RUN_TIMEOUT_S)
    if status["status"] != "finished:completed":
        tails = "\n".join(f"--- {p.name} (pid {p.pid})\n{p.tail(15)}" for p in d.procs)
        pytest.fail(f"run {run_id}: {status['status']} ({status.get('status-details')})\n{d.logs(run_id)}\n{tails}")


@pytest.fixture(scope="module")
def four_nodes(tmp_path_factory):
    """A SuperLink and four SuperNodes with Flower's shortest heartbeat (10 s: the SuperLink marks a
    killed node offline within 20 s), node 3's worker alone in its folder (to find it), shared by
    this module's two tests in file order: the plain run first, then the run that kills node 3."""
    d = LocalDeployment(tmp_path_factory.mktemp("four-nodes") / "flower", heartbeat_s=10)
    victim_workers = d.worker_dir / "victim"
    try:
        d.start_superlink()
        nodes = [
            d.start_supernode(
                {"partition-id": i, "num-partitions": 4, **({"worker-dir": str(victim_workers)} if i == 3 else {})}
            )
            for i in range(4)
        ]
        yield d, nodes, victim_workers
    finally:
        d.stop()


def test_secure_aggregation_on_four_supernodes_equals_the_plain_aggregate(four_nodes, tmp_path, keep_threads):
    d, nodes, _ = four_nodes
    t0 = time.monotonic()
    run_dir = tmp_path / "run"
    finish(d, submit(d, run_dir))
    ln = line(run_dir)
    assert ln["aggregated"] and not ln["dropped"]
    assert {c: v["status"] for c, v in ln["clients"].items()} == {str(i): "secure" for i in range(4)}
    sa = ln["secure_aggregation"]
    assert sa["in_sum"] == [0, 1, 2, 3] and (sa["shares"], sa["threshold"]) == (4, 3)
    assert set(sa["stages_s"]) == {"setup", "share_keys", "collect_masked_vectors", "unmask"}
    worst, eps = assert_within_bound(run_dir)
    assert worst > 0  # quantised: the sum went through SecAgg+, not around it
    print(
        f"\nsecure deployment: max |secure - plain| = {worst:.3g}, eps = {eps:.3g}, "
        f"{time.monotonic() - t0:.0f} s, stages {json.dumps({k: round(v, 1) for k, v in sa['stages_s'].items()})}"
    )
    assert all(p.popen.poll() is None for p in nodes)


def test_secure_aggregation_survives_a_supernode_killed_mid_protocol(four_nodes, tmp_path, keep_threads):
    d, nodes, victim_workers = four_nodes
    assert all(p.popen.poll() is None for p in nodes), "the shared nodes must all be up: this test kills one"
    t0 = time.monotonic()
    run_dir = tmp_path / "run"
    victim = nodes[3]  # client 3, rank 8: the only holder of rank rows 4..7
    seen = victim.log.read_text(errors="replace")
    before = {t: seen.count(t) for t in ("Sending: train message", "Receiving: train message")}
    run_id = submit(d, run_dir, **{"min-clients": 2})
    deadline = time.monotonic() + RUN_TIMEOUT_S

    def wait_for(text: str, count: int) -> None:  # count lines of this run only (the node served others)
        while victim.log.read_text(errors="replace").count(text) - before[text] < count:
            assert time.monotonic() < deadline, victim.tail()
            assert not d.run_status(run_id)["status"].startswith("finished"), d.logs(run_id)
            time.sleep(0.1)

    # TRAIN messages: setup, share keys, collect masked vectors. Once the node has sent its
    # encrypted key shares (its second TRAIN reply), freeze its worker, so that the third message
    # (the collect stage) cannot be answered; kill the node when that message arrives, before its
    # masked vector and the unmask stage.
    wait_for("Sending: train message", 2)
    worker = subprocess.run(
        ["pgrep", "-f", f"nestfed.flower.worker --socket {victim_workers}"], capture_output=True, text=True
    ).stdout.split()
    assert len(worker) == 1, worker
    os.kill(int(worker[0]), signal.SIGSTOP)
    wait_for("Receiving: train message", 3)
    d.kill(victim)
    os.kill(int(worker[0]), signal.SIGKILL)
    finish(d, run_id)
    ln = line(run_dir)
    assert ln["aggregated"] and list(ln["dropped"]) == ["3"], ln["dropped"]
    assert "collect_masked_vectors" in ln["dropped"]["3"]
    assert ln["secure_aggregation"]["in_sum"] == [0, 1, 2]
    assert {c: v["status"] for c, v in ln["clients"].items()} == {
        "0": "secure",
        "1": "secure",
        "2": "secure",
        "3": "dropped",
    }
    worst, eps = assert_within_bound(run_dir, {3})
    print(
        f"\nsecure deployment, node killed: max |secure - plain| = {worst:.3g}, eps = {eps:.3g}, "
        f"{time.monotonic() - t0:.0f} s, reason: {ln['dropped']['3']}"
    )
    assert all(p.popen.poll() is None for p in nodes[:3])
