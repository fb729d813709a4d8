"""The ServerApp and ClientApp objects in one process (LocalGrid: no SuperLink, no polling).

Fast checks of the apps' logic: the same final adapter and evaluation as the embedded runner,
dropped and rejected updates, the minimum of clients, the QUERY round's checks.
"""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")

from flower_helpers import OVERRIDES, TINY, assert_same_adapter, embedded_run, expected_round_without  # noqa: E402
from flwr.app import Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from nestfed import methods  # noqa: E402
from nestfed.errors import ConfigError, NestfedError  # noqa: E402
from nestfed.federation.messages import ClientInfo  # noqa: E402
from nestfed.federation.run_dir import RunDir  # noqa: E402
from nestfed.flower import client_app as CA  # noqa: E402
from nestfed.flower.records import content_to_reply, reply_to_content  # noqa: E402
from nestfed.flower.server_app import RunSettings, resolve_experiment, run_on_grid  # noqa: E402
from nestfed.testing.local_grid import LocalGrid  # noqa: E402

NODES = {101: {"partition-id": 0, "num-partitions": 3}, 102: {"partition-id": 1}, 103: {"partition-id": 2}}


def run_config(run_dir, **kw):
    rc = {
        "experiment": str(TINY),
        "overrides": ";".join(OVERRIDES),
        "run-dir": str(run_dir),
        "round-timeout-s": 5.0,
        "poll-interval-s": 0.01,
    }
    rc.update(kw)
    return rc


def lines(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def state_of(run_dir, rnd):
    return RunDir(run_dir).load_checkpoint(run_dir / "checkpoints" / f"round_{rnd:03d}.safetensors").state


@pytest.mark.slow
def test_same_final_adapter_and_evaluation_as_the_embedded_runner(tmp_path, keep_threads):
    emb = embedded_run(tmp_path / "embedded")
    grid = LocalGrid(CA.app, NODES)
    summary = run_on_grid(grid, run_config(tmp_path / "flower", evaluate=True))
    assert_same_adapter(emb, tmp_path / "flower")
    fl, em = lines(tmp_path / "flower"), lines(emb)
    assert [ln["round"] for ln in fl] == [0, 1, 2]
    for a, b in zip(fl, em):
        assert a["eval"] == b["eval"]  # the same held-out metrics, bit for bit
        if a["round"]:
            assert a["bytes_down"] == b["bytes_down"] and a["bytes_up"] == b["bytes_up"]
            assert {c: v["rank_sent"] for c, v in a["clients"].items()} == {"0": 2, "1": 4, "2": 8}
    assert fl[0]["nodes"]["2"]["rank"] == 8 and fl[0]["nodes"]["0"]["node_id"] == 101
    assert (
        summary["engine"] == "flower"
        and summary["mean_ppl"] == json.loads((emb / "summary.json").read_text())["mean_ppl"]
    )
    # one run path: the same summary fields, the mechanism reports measured by the nodes
    es = json.loads((emb / "summary.json").read_text())
    assert summary["truncation"] == es["truncation"] and summary["dimension_importance"] == es["dimension_importance"]
    assert summary["client_labels"] == es["client_labels"]  # each node reports its partition's label
    embedded_only = {"prepare_time_s", "frozen_prefix_layers", "client_pool"}
    flower_only = {"events", "clients", "ranks"}
    assert set(es) - set(summary) <= embedded_only and set(summary) - set(es) <= flower_only, set(es) ^ set(summary)
    # one QUERY per node, then one TRAIN per node per round, EVALUATE at rounds 0, 1, 2, and one
    # EVALUATE per node at each truncation rank r = 1, 2, 4, 8 (the mechanism reports)
    kinds = [m.metadata.message_type for m in grid.pushed]
    assert kinds.count("query") == 3 and kinds.count("train") == 6 and kinds.count("evaluate") == 9 + 3 * 4


def test_silent_and_failing_nodes_are_dropped_and_rounds_aggregate_the_others(tmp_path, keep_threads):
    def fail(node, msg):  # node 102 never answers in round 1; node 103 answers round 2 with an error
        return {(102, "1"): "silent", (103, "2"): "error"}.get((node, msg.metadata.group_id))

    run_on_grid(LocalGrid(CA.app, NODES, fail), run_config(tmp_path, **{"min-clients": 2, "round-timeout-s": 0.3}))
    r1, r2 = lines(tmp_path)[1:]
    assert r1["aggregated"] and list(r1["dropped"]) == ["1"] and "no reply within 0.3 s" in r1["dropped"]["1"]
    assert r2["aggregated"] and list(r2["dropped"]) == ["2"] and "simulated failure" in r2["dropped"]["2"]
    assert r2["clients"]["2"]["status"] == "dropped" and r2["clients"]["1"]["status"] == "accepted"
    expected = expected_round_without(tmp_path, 2, {2})
    got = state_of(tmp_path, 2)
    assert all(torch.equal(got.arrays[k], expected.arrays[k]) for k in expected.arrays)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dropped_updates"] == 2 and any(
        "client 1 dropped: node 102: no reply" in m for m in summary["rejections"]
    )


def test_below_min_clients_the_round_keeps_the_global_state(tmp_path, keep_threads):
    def fail(node, msg):
        return "error" if node == 103 and msg.metadata.message_type == "train" else None

    run_on_grid(LocalGrid(CA.app, NODES, fail), run_config(tmp_path, **{"min-clients": 3}))
    ln = lines(tmp_path)
    assert not ln[1]["aggregated"] and not ln[2]["aggregated"]
    s2 = state_of(tmp_path, 2)
    node = next(iter(CA._HOSTS.values())).prep
    clients = [ClientInfo(int(c), v["rank"], v["num_examples"]) for c, v in ln[0]["nodes"].items()]
    cfg = methods.load_config(TINY, list(OVERRIDES))
    init = methods.get("prelort").server(cfg, {}).initialize(node.shapes, clients)
    assert all(torch.equal(s2.arrays[k], init.arrays[k]) for k in init.arrays)
    assert all(torch.equal(s2.arrays[k], v) for k, v in state_of(tmp_path, 0).arrays.items())


def test_a_bad_update_is_rejected_with_its_reason(tmp_path, keep_threads):
    bad = ClientApp()
    bad.query()(CA.handle_query)

    @bad.train()
    def train(msg, context):
        reply = CA.handle_train(msg, context)
        if context.node_config["partition-id"] == 2:
            r = content_to_reply(reply.content)
            r.arrays = {k: v * float("nan") for k, v in r.arrays.items()}
            return Message(reply_to_content(r), reply_to=msg)
        return reply

    run_on_grid(LocalGrid(bad, NODES), run_config(tmp_path, **{"min-clients": 2}))
    ln = lines(tmp_path)[1]
    assert list(ln["rejected"]) == ["2"] and "NaN" in ln["rejected"]["2"] and ln["aggregated"]
    expected = expected_round_without(tmp_path, 1, {2})  # the round as if client 2 had not replied
    assert all(torch.equal(state_of(tmp_path, 1).arrays[k], v) for k, v in expected.arrays.items())


def test_query_leaves_out_duplicate_partitions_and_broken_nodes(tmp_path, keep_threads):
    nodes = {**NODES, 104: {"partition-id": 1}, 105: {}}  # a second node for partition 1; one without id
    grid = LocalGrid(CA.app, nodes)
    summary = run_on_grid(grid, run_config(tmp_path, overrides=";".join(OVERRIDES + ("federation.rounds=1",))))
    events = "\n".join(summary["events"])
    assert "node 104 left out: partition 1 is already served by node 102" in events
    assert "node 105 left out" in events and "partition-id" in events
    assert summary["clients"] == [0, 1, 2]


def test_node_config_and_run_config_are_checked():
    cfg = methods.load_config(TINY, list(OVERRIDES))
    assert CA.node_settings({"partition-id": 2, "rank": 4, "threads": 2}, cfg) == (2, 4, 2)
    for bad in (
        {},
        {"partition-id": 3},
        {"partition-id": "0"},
        {"partition-id": 0, "num-partitions": 5},
        {"partition-id": 0, "rank": 9},
    ):
        with pytest.raises(ConfigError):
            CA.node_settings(bad, cfg)
    for rank in (0, 9, 4.0, True):
        with pytest.raises(ConfigError, match=rf"^node config: rank {rank!r} is not an integer in \[1, r_max = 8\]$"):
            CA.node_settings({"partition-id": 0, "rank": rank}, cfg)
    assert CA.node_placement({"partition-id": 0}, cfg) is cfg
    placed = CA.node_placement({"partition-id": 0, "device": "cuda:1", "dtype": "bfloat16"}, cfg)
    assert (placed.model.device, placed.model.dtype) == ("cuda:1", "bfloat16") and placed.lora == cfg.lora
    with pytest.raises(ConfigError, match="node config: device: 'gpu' is not auto, cpu, cuda or cuda:N"):
        CA.node_placement({"partition-id": 0, "device": "gpu"}, cfg)
    s = RunSettings.from_run_config({"overrides": "a.b=1; c.d=[1,2] ;", "evaluate": True, "unknown": 1})
    assert s.overrides == ("a.b=1", "c.d=[1,2]") and s.evaluate
    with pytest.raises(ConfigError):
        RunSettings.from_run_config({"poll-interval-s": 0})
    for key, bad in (("resume", "false"), ("evaluate", 1), ("min-clients", 1.5), ("round-timeout-s", "9")):
        with pytest.raises(ConfigError, match=f"run config: {key} = "):
            RunSettings.from_run_config({key: bad})
    assert resolve_experiment(str(TINY), None) == TINY
    with pytest.raises(ConfigError):
        resolve_experiment("no/such.toml", TINY.parent)


def test_a_rank_from_the_node_config_reaches_the_strategy(tmp_path, keep_threads):
    nodes = {101: {"partition-id": 0, "rank": 1}, 102: {"partition-id": 1}, 103: {"partition-id": 2}}
    run_on_grid(LocalGrid(CA.app, nodes), run_config(tmp_path))
    ln = lines(tmp_path)
    assert ln[0]["nodes"]["0"]["rank"] == 1 and ln[1]["clients"]["0"]["rank_sent"] == 1
    sd = json.loads((tmp_path / "summary.json").read_text())
    assert sd["ranks"] == [1, 4, 8]


@pytest.mark.parametrize(
    "name,ranks",
    [
        ("zeropad", "[2,4,8]"),
        ("hetlora", "[2,4,8]"),
        ("flora", "[2,4,8]"),
        ("ffa_lora", "[2,4,8]"),
        ("fedavg", "[4]"),
        ("fed_plora", "[2,4,8]"),
    ],
)
def test_every_strategy_runs_unchanged_and_matches_the_embedded_runner(tmp_path, keep_threads, name, ranks):
    over = OVERRIDES + (f"strategy.name={name}", f"lora.ranks={ranks}")
    emb = embedded_run(tmp_path / "embedded", over)
    run_on_grid(LocalGrid(CA.app, NODES), run_config(tmp_path / "flower", overrides=";".join(over)))
    assert_same_adapter(emb, tmp_path / "flower")


def test_resume_continues_from_the_latest_checkpoint_to_the_same_adapter(tmp_path, keep_threads):
    full = tmp_path / "full"
    run_on_grid(LocalGrid(CA.app, NODES), run_config(full))
    part = tmp_path / "part"
    run_on_grid(LocalGrid(CA.app, NODES), run_config(part, overrides=";".join(OVERRIDES + ("federation.rounds=1",))))
    assert [ln["round"] for ln in lines(part)] == [0, 1]
    summary = run_on_grid(LocalGrid(CA.app, NODES), run_config(part, resume=True))
    assert [ln["round"] for ln in lines(part)] == [0, 1, 2]
    assert any("resuming" in m for m in summary["events"])
    assert_same_adapter(full, part)


def fresh_process(node, msg):
    """What flwr 1.42's process isolation does: every message meets a fresh ClientApp process, so
    nothing a node built in memory survives from one message to the next (only its disk)."""
    CA._HOSTS.clear()
    return None


def nodes_with_state(root):
    """NODES, each keeping its clients' state in its own folder under ``root``."""
    return {n: {**cfg, "client-state": str(root / f"node-{n}")} for n, cfg in NODES.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name,extra", [("fednl", ("fednl.travel=rules",)), ("fednl", ()), ("fedala", ())])
def test_client_state_survives_fresh_processes_on_the_nodes_disk(tmp_path, keep_threads, name, extra):
    """FedNL rules-only (each client's own LoRA) and FedALA (its weights and local model) keep
    per-client state between rounds; FedNL with everything travelling keeps none. On each node's
    disk (nestfed.flower.node_state), a fresh process per message ends with the embedded runner's
    client state and gives its evaluations and exports bit for bit; with the state wiped before
    every message the rules-only evaluations differ (so the comparison can fail)."""
    import shutil

    from safetensors.torch import load_file

    from nestfed.federation.run_files import flatten_client_state
    from nestfed.flower.node_state import NodeStateStore

    over = OVERRIDES + (f"strategy.name={name}", "lora.ranks=[4]", 'lora.target_modules=["q_proj","v_proj"]') + extra
    emb = embedded_run(tmp_path / "embedded", over)
    nodes = nodes_with_state(tmp_path / "state")
    grid = LocalGrid(CA.app, nodes, fail=fresh_process)
    run_on_grid(grid, run_config(tmp_path / "flower", overrides=";".join(over), evaluate=True))
    fl, em = lines(tmp_path / "flower"), lines(emb)
    assert [a["eval"] for a in fl] == [b["eval"] for b in em]
    kept = RunDir(emb).load_checkpoint(emb / "checkpoints" / "round_002.safetensors").client_state
    want = flatten_client_state(kept)
    restored = [{c: v["client_state_arrays"] for c, v in ln["clients"].items()} for ln in fl[1:]]
    assert restored[0] == {"0": 0, "1": 0, "2": 0} and (min(restored[1].values()) > 0) == bool(want)
    rounds = [{c: v["client_state_round"] for c, v in ln["clients"].items()} for ln in fl[1:]]
    assert rounds == [{"0": -1, "1": -1, "2": -1}, {c: (1 if want else -1) for c in ("0", "1", "2")}]
    assert bool(want) == (name == "fedala" or bool(extra))
    got = {}
    run_dir = str((tmp_path / "flower").resolve())
    for cfg in nodes.values():
        store, pid = NodeStateStore(Path(cfg["client-state"])), cfg["partition-id"]
        assert [r for r, _ in store.rounds(run_dir, pid)] == ([1, 2] if want else [])  # the newest two
        assert not any(store.rounds(run_dir, c) for c in range(3) if c != pid)  # each node holds its own client only
        got.update(flatten_client_state(store.load(run_dir, pid, 2)[1]))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    if name == "fednl":
        ra, rb = (load_file(str(d / "memory_rules.safetensors")) for d in (emb, tmp_path / "flower"))
        assert sorted(ra) == sorted(rb) and all(torch.equal(ra[k], rb[k]) for k in ra)
    rules_only = "fednl.travel=rules" in extra
    assert (tmp_path / "flower" / "adapter").exists() == (not rules_only)
    if not rules_only:
        assert_same_adapter(emb, tmp_path / "flower")
        return

    def amnesia(node, msg):
        fresh_process(node, msg)
        shutil.rmtree(nodes[node]["client-state"], ignore_errors=True)

    run_on_grid(
        LocalGrid(CA.app, nodes, fail=amnesia),
        run_config(tmp_path / "amnesia", overrides=";".join(over), evaluate=True),
    )
    lost = lines(tmp_path / "amnesia")
    assert all(v["client_state_arrays"] == 0 for ln in lost[1:] for v in ln["clients"].values())
    assert lost[0]["eval"] == em[0]["eval"]  # before any training nothing was kept
    assert lost[2]["eval"] != em[2]["eval"]


@pytest.mark.slow
def test_a_stateful_method_resumes_on_flower_from_the_nodes_state(tmp_path, keep_threads):
    """FedALA crashed after round 1 (the ServerApp gone, the nodes' processes too) resumes from its
    checkpoint and each node's state of round 1, to the embedded runner's adapter bit for bit;
    a checkpoint that holds its clients' state itself (an embedded run) is refused on Flower."""
    over = OVERRIDES + ("strategy.name=fedala", "lora.ranks=[4]")
    emb = embedded_run(tmp_path / "embedded", over)
    nodes = nodes_with_state(tmp_path / "state")
    part = tmp_path / "part"
    run_on_grid(
        LocalGrid(CA.app, nodes, fail=fresh_process),
        run_config(part, overrides=";".join(over + ("federation.rounds=1",))),
    )
    summary = run_on_grid(
        LocalGrid(CA.app, nodes, fail=fresh_process), run_config(part, overrides=";".join(over), resume=True)
    )
    assert any("resuming" in m for m in summary["events"])
    fl = lines(part)
    assert [ln["round"] for ln in fl] == [0, 1, 2]
    assert {c: v["client_state_round"] for c, v in fl[2]["clients"].items()} == {"0": 1, "1": 1, "2": 1}
    assert_same_adapter(emb, part)
    with pytest.raises(NestfedError, match="holds itself"):
        run_on_grid(
            LocalGrid(CA.app, nodes), run_config(emb, overrides=";".join(over + ("federation.rounds=3",)), resume=True)
        )


def test_a_run_is_never_overwritten_and_embedded_only_methods_are_refused(tmp_path, keep_threads):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(NestfedError, match="exists and is not empty; set resume = true"):
        run_on_grid(LocalGrid(CA.app, NODES), run_config(tmp_path / "used"))
    assert (tmp_path / "used" / "metrics.jsonl").read_text() == "{}\n"
    fedslm = ";".join(OVERRIDES + ("strategy.name=fedslm",))
    with pytest.raises(ConfigError, match="fedslm cannot run on Flower: it runs only embedded"):
        run_on_grid(LocalGrid(CA.app, NODES), run_config(tmp_path / "slm", overrides=fedslm))
    assert not (tmp_path / "slm").exists()
    with pytest.raises(ConfigError, match="run config: resume = 'false', expected true or false"):
        run_on_grid(LocalGrid(CA.app, NODES), run_config(tmp_path / "x", resume="false"))


def test_a_flower_checkpoint_of_a_stateful_method_is_refused_by_the_embedded_resume(tmp_path, keep_threads):
    """Its clients' state is on the nodes: the embedded runner cannot continue it exactly."""
    over = OVERRIDES + ("strategy.name=fedala", "lora.ranks=[4]", "federation.rounds=1")
    nodes = nodes_with_state(tmp_path / "state")
    run_on_grid(LocalGrid(CA.app, nodes), run_config(tmp_path / "run", overrides=";".join(over)))
    with pytest.raises(NestfedError, match="keeps per-client state, which this checkpoint does not hold"):
        RunDir(tmp_path / "run").check_resume(True)
    RunDir(tmp_path / "run").check_resume(False)  # a method that keeps nothing could
    other = ";".join(OVERRIDES + ("strategy.name=prelort", "federation.rounds=1"))
    run_on_grid(LocalGrid(CA.app, NODES), run_config(tmp_path / "p", overrides=other))
    (tmp_path / "p" / "summary.json").unlink()
    with pytest.raises(NestfedError, match="a resumed run keeps its config; these differ: lora.lora_alpha"):
        run_on_grid(
            LocalGrid(CA.app, NODES), run_config(tmp_path / "p", overrides=other + ";lora.lora_alpha=4.0", resume=True)
        )


def test_too_few_nodes_for_the_clients_are_refused_at_once_naming_both_numbers(tmp_path, keep_threads, monkeypatch):
    """A simulation engine started with 2 SuperNodes (num-partitions 2) for 3 clients: the
    ServerApp asks one node once none joined for a while, and stops with its line instead of
    waiting out connect-timeout-s."""
    import time

    from nestfed.flower import exchange

    monkeypatch.setattr(exchange, "SETTLE_S", 0.2)
    two = {101: {"partition-id": 0, "num-partitions": 2}, 102: {"partition-id": 1, "num-partitions": 2}}
    grid = LocalGrid(CA.app, two)
    t0 = time.perf_counter()
    with pytest.raises(NestfedError) as err:
        run_on_grid(grid, run_config(tmp_path, **{"connect-timeout-s": 60.0}))
    assert time.perf_counter() - t0 < 30
    text = str(err.value)
    assert "2 nodes connected for data.num_clients = 3" in text
    assert "num-partitions = 2 but the experiment has data.num_clients = 3" in text
    assert "--federation-config 'num-supernodes=3'" in text


def test_more_nodes_than_clients_are_refused_naming_both_numbers(tmp_path, keep_threads):
    """An engine started with 4 SuperNodes (num-partitions 4) for 3 clients: every node refuses the
    experiment, and the one line says why, not only that no node answered."""
    four = {100 + i: {"partition-id": i, "num-partitions": 4} for i in range(4)}
    with pytest.raises(NestfedError) as err:
        run_on_grid(LocalGrid(CA.app, four), run_config(tmp_path))
    text = str(err.value)
    assert "only 0 nodes answered the query" in text and "4 nodes for data.num_clients = 3" in text
    assert "num-partitions = 4 but the experiment has data.num_clients = 3" in text
