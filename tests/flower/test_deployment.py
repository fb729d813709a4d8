"""nestfed on Flower's deployment engine for real: a SuperLink and SuperNodes on 127.0.0.1.

Each test that kills a process starts its own SuperLink (free port, private FLWR_HOME, telemetry
and update checks off, runtime dependency installation disabled) and SuperNodes; the two that kill
nothing share one SuperLink and three SuperNodes (``three_nodes``), each submitting its own run.
A test submits the ``flower_app`` bundle with ``flwr run`` and reads the outcome from the
SuperLink (``flwr run`` exits 0 even when the run fails). Every process is stopped by its PID in
the fixture's teardown, on failure too. Flower starts a fresh ClientApp process per message (a
thin forwarder to the node's long-running worker, which builds torch and the model once), so one
exchange costs seconds here.
"""

import json
import os
import signal
import subprocess
import time

import pytest
import torch

pytest.importorskip("flwr")

from flower_helpers import APP_DIR, OVERRIDES, TINY, assert_same_adapter, expected_round_without  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from nestfed.federation.run_dir import RunDir  # noqa: E402
from nestfed.testing.flower_deployment import LocalDeployment  # noqa: E402

pytestmark = pytest.mark.flower

RUN_TIMEOUT_S = 420


def run_config(run_dir, **kw):
    rc = {
        "experiment": str(TINY),
        "overrides": ";".join(OVERRIDES),
        "run-dir": str(run_dir),
        "connect-timeout-s": 240.0,
        "round-timeout-s": 300.0,
    }
    rc.update(kw)
    return rc


def finish(d: LocalDeployment, run_id: int) -> dict:
    """Wait for the run; fail with the run's and the processes' logs unless it completed."""
    status = d.wait_run(run_id, RUN_TIMEOUT_S)
    if status["status"] != "finished:completed":
        tails = "\n".join(f"--- {p.name} (pid {p.pid})\n{p.tail(15)}" for p in d.procs)
        pytest.fail(f"run {run_id}: {status['status']} ({status.get('status-details')})\n{d.logs(run_id)}\n{tails}")
    return status


def metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    """A SuperLink and three SuperNodes (partitions 0-2, each with its own client-state folder), shared
    by the tests that kill nothing: each submits its own run to the same nodes, whose workers stay
    warm between runs (a node serving one experiment after another, as a deployment does)."""
    root = tmp_path_factory.mktemp("three-nodes")
    d = LocalDeployment(root / "flower")
    try:
        d.start_superlink()
        nodes = [
            d.start_supernode({"partition-id": i, "num-partitions": 3, "client-state": str(root / f"state-{i}")})
            for i in range(3)
        ]
        yield d, nodes
    finally:
        d.stop()


def test_two_rounds_of_prelort_on_three_supernodes_match_the_embedded_runner(three_nodes, tmp_path, embedded_reference):
    d, nodes = three_nodes
    run_dir = tmp_path / "run"
    status = finish(d, d.submit(APP_DIR, run_config(run_dir)))
    assert status["status"] == "finished:completed"
    # the final PEFT adapter is bit-identical to the embedded runner's (same seed, config, 1 thread)
    assert_same_adapter(embedded_reference, run_dir)
    lines = metrics(run_dir)
    assert [ln["round"] for ln in lines] == [0, 1, 2]
    assert {c: v["rank"] for c, v in lines[0]["nodes"].items()} == {"0": 2, "1": 4, "2": 8}
    for ln in lines[1:]:
        assert ln["aggregated"] and not ln["rejected"] and not ln["dropped"]
        assert {c: v["status"] for c, v in ln["clients"].items()} == {"0": "accepted", "1": "accepted", "2": "accepted"}
        assert {c: v["rank_sent"] for c, v in ln["clients"].items()} == {"0": 2, "1": 4, "2": 8}
        assert all(v["torch_threads"] == 1 for v in lines[0]["nodes"].values())
    emb = metrics(embedded_reference)
    assert [ln["bytes_up"] for ln in lines[1:]] == [ln["bytes_up"] for ln in emb[1:]]
    assert all(p.popen.poll() is None for p in nodes)  # every SuperNode still up
    assert json.loads((run_dir / "summary.json").read_text())["engine"] == "flower"


def test_fednl_rules_only_keeps_each_clients_lora_across_fresh_processes(three_nodes, tmp_path):
    """FedNL with only the memory rules travelling: each client's own LoRA lives on its SuperNode's
    disk between messages (every message meets a fresh ClientApp process), so two rounds evaluate
    and export exactly as the embedded runner does."""
    from flower_helpers import embedded_run

    over = OVERRIDES + (
        "strategy.name=fednl",
        "fednl.travel=rules",
        "lora.ranks=[4]",
        'lora.target_modules=["q_proj","v_proj"]',
    )
    emb = embedded_run(tmp_path / "embedded", over)
    d, _ = three_nodes
    run_dir = tmp_path / "run"
    finish(d, d.submit(APP_DIR, run_config(run_dir, overrides=";".join(over), evaluate=True)))
    assert [ln["eval"] for ln in metrics(run_dir)] == [ln["eval"] for ln in metrics(emb)]
    ra, rb = (load_file(str(p / "memory_rules.safetensors")) for p in (emb, run_dir))
    assert sorted(ra) == sorted(rb) and all(torch.equal(ra[k], rb[k]) for k in ra)
    assert not (run_dir / "adapter").exists()  # rules only: no global LoRA


def test_a_supernode_killed_mid_run_is_dropped_and_nothing_is_corrupted(deployment, tmp_path):
    d = deployment
    d.heartbeat_s = 10  # Flower's shortest: the SuperLink marks the killed node offline within 20 s
    d.start_superlink()
    victim_workers = d.worker_dir / "victim"  # node 2's worker alone in its folder, to find it
    nodes = [
        d.start_supernode({"partition-id": i, **({"worker-dir": str(victim_workers)} if i == 2 else {})})
        for i in range(3)
    ]
    victim = nodes[2]
    run_dir = tmp_path / "run"
    run_id = d.submit(APP_DIR, run_config(run_dir, **{"min-clients": 2}))
    deadline = time.monotonic() + RUN_TIMEOUT_S

    def wait_for(text: str) -> None:
        while text not in victim.log.read_text(errors="replace"):
            assert time.monotonic() < deadline, victim.tail()
            assert not d.run_status(run_id)["status"].startswith("finished"), d.logs(run_id)
            time.sleep(0.1)

    # once node 2 has answered the QUERY, freeze its worker, so that it cannot answer round 1 however
    # fast it trains; kill the node (SIGKILL, no goodbye) when round 1's message reaches it: the
    # SuperLink notices by the missing heartbeats (<= 2 x 10 s)
    wait_for("Sending: query message")
    worker = subprocess.run(
        ["pgrep", "-f", f"nestfed.flower.worker --socket {victim_workers}"], capture_output=True, text=True
    ).stdout.split()
    assert len(worker) == 1, worker
    os.kill(int(worker[0]), signal.SIGSTOP)
    wait_for("Receiving: train message")
    d.kill(victim)
    os.kill(int(worker[0]), signal.SIGKILL)
    finish(d, run_id)
    lines = metrics(run_dir)
    assert lines[0]["nodes"]["2"]["rank"] == 8  # node 2 answered the QUERY before it died
    for ln in lines[1:]:  # round 1: killed while its message was in flight; round 2: known offline
        assert ln["aggregated"] and list(ln["dropped"]) == ["2"], ln["dropped"]
        assert "Node Unavailable" in ln["dropped"]["2"]
        assert {c: v["status"] for c, v in ln["clients"].items()} == {"0": "accepted", "1": "accepted", "2": "dropped"}
    # nothing corrupted: checkpoints and the adapter load and are finite, no temporary files are
    # left, and each round is exactly the aggregation of the two surviving clients' updates
    for rnd in (1, 2):
        ck = RunDir(run_dir).load_checkpoint(run_dir / "checkpoints" / f"round_{rnd:03d}.safetensors")
        done, state = ck.round, ck.state
        assert done == rnd and ck.client_state is None and all(torch.isfinite(v).all() for v in state.arrays.values())
        expected = expected_round_without(run_dir, rnd, {2})
        assert all(torch.equal(state.arrays[k], expected.arrays[k]) for k in expected.arrays), rnd
    adapter = load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))
    assert adapter and all(torch.isfinite(v).all() for v in adapter.values())
    assert not list((run_dir / "checkpoints").glob(".*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dropped_updates"] == 2 and nodes[0].popen.poll() is None


def test_the_serverapp_and_the_superlink_killed_mid_round_resume_to_the_uninterrupted_adapter(tmp_path):
    """FedALA (its clients keep state) on a SuperLink with a database: the ServerApp process is
    SIGKILLed while round 2 is in flight, its run stopped (``flwr stop``) and the run resubmitted
    with resume = true; then the
    SuperLink itself is SIGKILLed while round 3 is in flight, restarted on its port and database
    (the SuperNodes reconnect), and the run resumed again. The final adapter is the embedded
    runner's uninterrupted one bit for bit, every round has one metrics line, and each client
    started round 3 from its own state of round 2, read from its node's disk."""
    from flower_helpers import embedded_run

    over = OVERRIDES + ("strategy.name=fedala", "lora.ranks=[4]", "federation.rounds=3")
    emb = embedded_run(tmp_path / "embedded", over)
    d = LocalDeployment(tmp_path / "flower", database=str(tmp_path / "superlink.db"), heartbeat_s=10)
    try:
        d.start_superlink()
        for i in range(3):
            d.start_supernode({"partition-id": i, "client-state": str(tmp_path / f"state-{i}")})
        run_dir = tmp_path / "run"
        rc = run_config(run_dir, overrides=";".join(over))

        def wait_for_round(rnd, run_id):
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while not (run_dir / "metrics.jsonl").exists() or rnd not in [ln["round"] for ln in metrics(run_dir)]:
                assert time.monotonic() < deadline, f"round {rnd} never committed"
                assert not d.run_status(run_id)["status"].startswith("finished"), d.logs(run_id)
                time.sleep(0.1)

        first = d.submit(APP_DIR, rc)
        wait_for_round(1, first)  # round 2's TRAIN messages go out now
        apps = d.processes("flwr-serverapp")
        assert len(apps) == 1
        os.kill(apps[0], signal.SIGKILL)
        # as docs/flower.md says: stop the dead run (else the nodes keep serving its messages until the
        # SuperLink notices the ServerApp's missing heartbeats, up to a minute), then resume
        d.flwr("stop", str(first), d.name)
        second = d.submit(APP_DIR, {**rc, "resume": True})
        wait_for_round(2, second)  # round 3 in flight
        d.kill(next(p for p in d.procs if p.name == "superlink"))
        d.start_superlink(same_port=True)
        finish(d, d.submit(APP_DIR, {**rc, "resume": True}))
        assert d.run_status(first)["status"] == "finished:stopped"  # the killed ServerApp's run never completes
        lines = metrics(run_dir)
        assert [ln["round"] for ln in lines] == [0, 1, 2, 3]
        assert {c: v["client_state_round"] for c, v in lines[3]["clients"].items()} == {"0": 2, "1": 2, "2": 2}
        assert_same_adapter(emb, run_dir)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["outcome"] == "completed" and sum("resuming" in e for e in summary["events"]) == 1
    finally:
        d.stop()
    assert not d.processes()  # nothing of the deployment is left running
