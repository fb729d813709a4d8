"""Wall time per round on Flower's deployment engine against the embedded runner, same work.

The work: the Flower tests' experiment (tiny random Llama, BBC News, 3 clients with ranks
2/4/8, PreLort, 2 rounds, 1 torch thread), per round configure -> 3 local fits -> validate ->
aggregate -> commit; no per-round evaluation on either side (the embedded runner's is
switched off for the comparison by a no-op ``evaluate``).

Three runs, in one invocation:

- ``embedded``: ``RoundLoop`` in this process (clients one after another on one model);
- ``in_process_apps``: the same ServerApp and ClientApp code on ``LocalGrid`` (records,
  handlers, validation; no SuperLink, no processes, no polling): what the apps themselves cost;
- ``deployment``: a SuperLink and 3 SuperNodes on 127.0.0.1, ``flwr run flower_app``.

Where the deployment's round time goes, from timestamps taken on both sides (one host, one clock):
``process_start_s`` (ClientApp process start to its handler: interpreter, flwr and torch
imports, bundle install, fetching the message), ``rebuild_s`` (the fresh process rebuilds the
backbone and its client data), ``fit_s``, ``to_node_s`` (message created on the server to the
ClientApp process start: SuperLink -> SuperNode transfer plus the SuperNode's 3 s idle poll and
SuperExec's 1 s task poll), ``to_server_s`` (reply created to reply pulled: SuperNode -> SuperLink
transfer plus the ServerApp's poll), ``push_s`` / ``pull_s`` (the ServerApp's calls to the
SuperLink). Prints one JSON object.

The FAB's ClientApp is a light forwarder (nestfed.flower.node_forwarder: flwr and the standard
library) that hands each message to a long-running worker per node (nestfed.flower.worker), which
keeps the backbone, the client's data and its trainer between messages: ``process_start_s`` is
then the forwarder process's start, and ``rebuild_s`` is 0 for every message after a node's first
(the QUERY, which builds the worker's client, inside ``query_round_incl_node_builds``).

``--client-cache on`` (the default of a SuperNode) lets each node keep its prepared data between
ClientApp processes (nestfed.data.client_cache: the first message builds it, the others load it);
``off`` rebuilds it in every process, as before the cache existed. Run both to see what it removes.

Usage: ``.venv/bin/python bench/perf/flower_vs_embedded.py [--keep DIR] [--client-cache on|off]``; the main
job's protocol (SmolLM2-135M, real BBC News, 3 clients of ranks 2/4/8, 4 local steps, 2 rounds):
``--config configs/bbc_news.toml --set data.num_clients=3 --set lora.ranks=[2,4,8] --set
federation.rounds=2 --set train.threads=0 --embedded-threads 2 --node-threads 1`` (the embedded
runner on both cores; three SuperNodes of one thread each share them).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from nestfed.io.markdown import markdown_table

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
APP_DIR = ROOT / "flower_app"
OVERRIDES = [
    "data.num_clients=3",
    "lora.ranks=[2,4,8]",
    "strategy.name=prelort",
    "federation.rounds=2",
    "train.threads=1",
    "output.plots=false",
]
CONFIG = TINY


def no_eval_transport(trainer):
    """The in-process transport without per-round evaluation (the deployment run does none either)."""
    from nestfed.federation.in_process import InProcessTransport

    class NoEval(InProcessTransport):
        def evaluate(self, rnd, deployments, as_sent=False):
            return None

    return NoEval(trainer)


def flat(client: dict) -> dict:
    """A client's entry of a metrics line with its own metrics (train_time_s) beside the server's fields."""
    return {**client.get("metrics", {}), **client}


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def mean(xs):
    xs = list(xs)
    return round(statistics.fmean(xs), 3) if xs else None


def embedded(out: Path) -> dict:
    from nestfed import config, methods
    from nestfed.experiments.prepare import prepare
    from nestfed.federation.loop import RoundLoop
    from nestfed.federation.run_dir import RunDir

    cfg = methods.load_config(CONFIG, OVERRIDES)
    t0 = time.perf_counter()
    prep = prepare(cfg)
    prep_s = time.perf_counter() - t0
    method = methods.get(cfg.strategy.name)
    mr = method.build(prep, cfg)
    loop = RoundLoop(
        mr.strategy,
        no_eval_transport(mr.trainer),
        mr.clients,
        cfg.federation.rounds,
        RunDir.create(out, config.dumps_toml(cfg)),
        seed=cfg.federation.seed,
        capabilities=method.capabilities,
        method=method.name,
    )
    t0 = time.perf_counter()
    loop.run(prep.shapes)
    total = time.perf_counter() - t0
    rounds = [ln for ln in lines(out) if ln["round"] > 0]
    return {
        "prepare_s": round(prep_s, 3),
        "rounds_s": [round(ln["time_s"], 3) for ln in rounds],
        "mean_round_s": mean(ln["time_s"] for ln in rounds),
        "fit_s_per_client": mean(c["metrics"]["train_time_s"] for ln in rounds for c in ln["clients"].values()),
        "run_s": round(total, 3),
    }


def in_process(out: Path, node_config: dict) -> dict:
    from nestfed.flower import client_app
    from nestfed.flower.server_app import run_on_grid
    from nestfed.testing.local_grid import LocalGrid

    client_app._CACHE.clear()
    grid = LocalGrid(client_app.app, {101 + i: {"partition-id": i, **node_config} for i in range(3)})
    t0 = time.perf_counter()
    run_on_grid(
        grid,
        {"experiment": str(CONFIG), "overrides": ";".join(OVERRIDES), "run-dir": str(out), "poll-interval-s": 0.01},
    )
    total = time.perf_counter() - t0
    ls = lines(out)
    rounds = [ln for ln in ls if ln["round"] > 0]
    return {
        "query_s_incl_prepare": round(ls[0]["query_s"], 3),
        "rounds_s": [round(ln["time_s"], 3) for ln in rounds],
        "mean_round_s": mean(ln["time_s"] for ln in rounds),
        "run_s": round(total, 3),
    }


def deployment(work: Path, node_config: dict) -> tuple[dict, Path]:
    from nestfed.testing.flower_deployment import LocalDeployment

    run_dir = work / "deployment_run"
    d = LocalDeployment(work / "flower")
    try:
        t0 = time.perf_counter()
        d.start_superlink()
        superlink_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(3):
            d.start_supernode({"partition-id": i, **node_config})
        deadline = time.monotonic() + 120
        while len([n for n in d.nodes() if n.get("status") == "online"]) < 3:
            if time.monotonic() > deadline:
                raise TimeoutError("SuperNodes did not come online")
            time.sleep(0.2)
        supernodes_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        run_id = d.submit(
            APP_DIR,
            {
                "experiment": str(CONFIG),
                "overrides": ";".join(OVERRIDES),
                "run-dir": str(run_dir),
                "connect-timeout-s": 900.0,
                "round-timeout-s": 1800.0,
            },
        )
        submit_s = time.perf_counter() - t0
        status = d.wait_run(run_id, 900, poll_s=1.0)
        total = time.perf_counter() - t0
        if status["status"] != "finished:completed":
            raise RuntimeError(f"run {status['status']}:\n{d.logs(run_id)}")
    finally:
        d.stop()
    ls = lines(run_dir)
    rounds = [ln for ln in ls if ln["round"] > 0]
    fits = [flat(c) for ln in rounds for c in ln["clients"].values()]

    def per_client(key):
        return mean(c[key] for c in fits)

    to_node = mean(c["delivery_s"] - c["process_age_s"] for c in fits)
    server_compute = mean(
        ln["flower"]["encode_s"]
        + ln["flower"]["decode_s"]
        + ln["timing"]["configure_s"]
        + ln["timing"]["validate_s"]
        + ln["timing"]["aggregate_s"]
        for ln in rounds
    )
    slowest = []
    for ln in rounds:  # the critical path: the client whose reply came last
        c = max(
            map(flat, ln["clients"].values()),
            key=lambda c: c["delivery_s"] + c.get("prepare_s", 0) + c["train_time_s"] + c["reply_latency_s"],
        )
        slowest.append(
            {
                "to_node_s": c["delivery_s"] - c["process_age_s"],
                "process_start_s": c["process_age_s"],
                "rebuild_s": c["prepare_s"],
                "fit_s": c["train_time_s"],
                "to_server_s": c["reply_latency_s"],
            }
        )
    out = {
        "startup_s": {
            "superlink": round(superlink_s, 3),
            "three_supernodes_online": round(supernodes_s, 3),
            "flwr_run_submit": round(submit_s, 3),
            "query_round_incl_node_builds": round(ls[0]["query_s"], 3),
            "run_total_after_submit": round(total, 3),
        },
        "rounds_s": [round(ln["time_s"], 3) for ln in rounds],
        "mean_round_s": mean(ln["time_s"] for ln in rounds),
        "per_client_mean_s": {
            "to_node_s": to_node,
            "process_start_s": per_client("process_age_s"),
            "rebuild_s": per_client("prepare_s"),
            "fit_s": per_client("train_time_s"),
            "to_server_s": per_client("reply_latency_s"),
            "decode_encode_on_node_s": mean(c["decode_s"] + c["encode_s"] for c in fits),
        },
        "critical_path_mean_s": {k: mean(s[k] for s in slowest) for k in slowest[0]},
        "server_per_round_s": {
            "push_s": mean(ln["flower"]["push_s"] for ln in rounds),
            "pull_s_total_over_polls": mean(ln["flower"]["pull_s"] for ln in rounds),
            "compute_s": server_compute,
        },
        "wire_bytes_per_round": {
            "down": mean(sum(c["wire_bytes_down"] for c in ln["clients"].values()) for ln in rounds),
            "up": mean(sum(c["wire_bytes_up"] for c in ln["clients"].values()) for ln in rounds),
        },
        "flwr_ls": {k: status.get(k) for k in ("elapsed", "network-traffic", "compute-time")},
    }
    return out, run_dir


def setting(result: dict) -> str:
    """A result's column of docs/flower.md: how the ClientApp ran."""
    exp = result["experiment"]
    if "worker" in exp.get("client_app", ""):
        n = exp.get("node_threads", 1)
        return f"long-running worker, {n} thread{'s' if n != 1 else ''} per node"
    return "client cache" if exp.get("client_cache") == "on" else "rebuild per message"


def table(result: dict) -> str:
    """docs/flower.md's row for one result (tables.py stacks the files' rows): seconds per round
    and per client (the mean over clients and rounds)."""
    e, d = result["embedded"], result["deployment"]
    pc = d["per_client_mean_s"]
    head = [
        "ClientApp",
        "embedded round",
        "Flower round",
        "per client: process start (interpreter, imports, bundle, message)",
        "rebuild",
        "fit (embedded)",
        "to the node + back to the server",
    ]
    row = [
        setting(result),
        f"{e['mean_round_s']:.1f} s",
        f"{d['mean_round_s']:.1f} s ({result['deployment_over_embedded_round_time']:g}x)",
        f"{pc['process_start_s']:.1f} s",
        f"{pc['rebuild_s']:.1f} s",
        f"{pc['fit_s']:.1f} s ({e['fit_s_per_client']:.1f} s)",
        f"{pc['to_node_s'] + pc['to_server_s']:.1f} s",
    ]
    return "\n".join(markdown_table(head, [row])) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    ap.add_argument("--config", type=Path, default=TINY, help="the experiment (default configs/tiny.toml)")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=None,
        help="section.key=value (replaces the default overrides when given)",
    )
    ap.add_argument(
        "--client-cache",
        choices=("on", "off"),
        default="on",
        help="SuperNodes keep their prepared data between ClientApp processes (default on)",
    )
    ap.add_argument("--embedded-threads", type=int, default=0, help="torch threads of the embedded run (0 = config)")
    ap.add_argument("--node-threads", type=int, default=0, help="torch threads per SuperNode (node config 'threads')")
    ap.add_argument("--skip-in-process", action="store_true", help="leave out the in-process apps run")
    args = ap.parse_args()
    global CONFIG, OVERRIDES
    CONFIG = args.config.resolve()
    if args.overrides:
        OVERRIDES = list(args.overrides) + ["output.plots=false"]
    work = Path(tempfile.mkdtemp(prefix="nestfed-flower-bench-")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    node_config: dict = {"client-cache": str(work / "client_cache") if args.client_cache == "on" else "off"}
    if args.node_threads:
        node_config["threads"] = args.node_threads
    threads = torch.get_num_threads()
    try:
        import os

        result = {
            "bench": "flower_vs_embedded",
            "experiment": {
                "config": str(args.config),
                "overrides": OVERRIDES,
                "client_cache": args.client_cache,
                "embedded_threads": args.embedded_threads or "config",
                "node_threads": args.node_threads or "config",
                "per_round_work": "configure, 3 fits, validate, aggregate, checkpoint (no evaluation)",
                "client_app": "nestfed.flower.node_forwarder -> a long-running worker per node",
            },
            "machine": {"cpus": os.cpu_count(), "loadavg_at_start": list(os.getloadavg())},
        }
        if args.embedded_threads:
            torch.set_num_threads(args.embedded_threads)
        result["embedded"] = embedded(work / "embedded_run")
        torch.set_num_threads(threads)
        if not args.skip_in_process:
            result["in_process_apps"] = in_process(work / "in_process_run", node_config)
            torch.set_num_threads(threads)
        result["deployment"], dep_dir = deployment(work, node_config)
        from safetensors.torch import load_file

        if not args.skip_in_process:
            a = load_file(str(work / "in_process_run" / "adapter" / "adapter_model.safetensors"))
            b = load_file(str(dep_dir / "adapter" / "adapter_model.safetensors"))
            result["deployment_adapter_equals_in_process"] = sorted(a) == sorted(b) and all(
                torch.equal(a[k], b[k]) for k in a
            )
        e, dep = result["embedded"]["mean_round_s"], result["deployment"]["mean_round_s"]
        result["deployment_over_embedded_round_time"] = round(dep / e, 2) if e else None
        result["machine"]["loadavg_at_end"] = list(os.getloadavg())
        print(json.dumps(result, indent=2))
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
