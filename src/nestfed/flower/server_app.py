"""The nestfed ServerApp: any nestfed strategy driven through Flower's Message API.

It replaces the embedded runner's round loop (``federation/runner.py``) and nothing else: the
strategy (``make_strategy``), client sampling (``sample_clients``), reply validation
(``validate_reply``), payload byte counts (``payload_stats``), atomic checkpoints
(``save_checkpoint``), the metrics line format, the PEFT export and the run directory are the
embedded runner's own. Only the transport differs: one Flower message per node.

Run config (``[tool.flwr.app.config]`` of ``flower_app/pyproject.toml``, overridable with
``flwr run --run-config``):

- ``experiment``: the experiment TOML on the SuperLink host: absolute, or relative to the
  installed app bundle (where ``flower_app/experiment.toml`` lands) or to the working directory;
- ``overrides``: ``section.key=value`` overrides separated by ``;``;
- ``run-dir``: the run directory ("" = a new ``<output.dir>/<name>-<time>``); ``resume``: continue
  from its latest checkpoint;
- ``num-supernodes``: nodes to wait for before the QUERY round (0 = data.num_clients);
  ``connect-timeout-s``: how long to wait for them and for their QUERY replies;
- ``round-timeout-s``: how long a round waits for TRAIN replies; a node that has not replied by
  then (or whose SuperLink reports it unavailable) is dropped from the round with a logged reason;
- ``min-clients``: the fewest accepted updates a round needs (0 = federation.min_clients), else
  the round keeps the global state;
- ``poll-interval-s``: how often replies are pulled from the SuperLink;
- ``evaluate``: also send EVALUATE messages (round 0 and after every round), so that
  metrics.jsonl and summary.json carry held-out metrics as in an embedded run.

Round: sample -> ``strategy.configure`` -> one TRAIN message per sampled node with its own
ArrayRecord (its rank's shapes) and ConfigRecord -> pull replies until all arrived or the
timeout -> ``validate_reply`` each -> ``strategy.aggregate`` (if at least min-clients were
accepted) -> atomic checkpoint -> [evaluate] -> one metrics line. Finally the PEFT adapter (none
for FedNL when only the rules travel) and, for FedNL, ``memory_rules.safetensors``; the strategy
starts FedNL from the fresh memory rules a node reported in its QUERY reply.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from nestfed import config as C
from nestfed.adapters.peft_export import export_peft_adapter
from nestfed.errors import ConfigError, UpdateRejected
from nestfed.experiment import new_run_dir, write_text_atomic
from nestfed.federation.messages import ClientInfo, GlobalState, Instruction, Reply
from nestfed.federation.payload import payload_stats, validate_reply
from nestfed.federation.runner import (latest_checkpoint, load_checkpoint, sample_clients, save_checkpoint,
                                      save_tensors_atomic)
from nestfed.flower.client_app import EXPERIMENT, MEMORY_INIT
from nestfed.flower.records import arrays_to_record, config_to_record, content_to_reply, record_to_arrays
from nestfed.strategies import make_strategy

# Timings the ClientApp adds to a TRAIN reply's metrics (see client_app.handle_train).
TRANSPORT_METRICS = ("encode_s", "decode_s", "prepare_s", "process_age_s", "handler_entered_at", "delivery_s",
                     "client_state_arrays")

DEFAULTS: dict[str, Any] = {
    "experiment": "experiment.toml",
    "overrides": "",
    "run-dir": "",
    "resume": False,
    "num-supernodes": 0,
    "connect-timeout-s": 300.0,
    "round-timeout-s": 600.0,
    "min-clients": 0,
    "poll-interval-s": 0.5,
    "evaluate": False,
}


@dataclass(frozen=True)
class RunSettings:
    """The ServerApp's run config, typed (see the module docstring)."""

    experiment: str = DEFAULTS["experiment"]
    overrides: tuple[str, ...] = ()
    run_dir: str = ""
    resume: bool = False
    num_supernodes: int = 0
    connect_timeout_s: float = 300.0
    round_timeout_s: float = 600.0
    min_clients: int = 0
    poll_interval_s: float = 0.5
    evaluate: bool = False

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> RunSettings:
        """Read Flower's run config; unknown keys are ignored, wrong types raise ConfigError."""
        rc = {**DEFAULTS, **{k: v for k, v in run_config.items() if k in DEFAULTS}}
        try:
            overrides = tuple(s.strip() for s in str(rc["overrides"]).split(";") if s.strip())
            out = cls(str(rc["experiment"]), overrides, str(rc["run-dir"]), bool(rc["resume"]),
                      int(rc["num-supernodes"]), float(rc["connect-timeout-s"]), float(rc["round-timeout-s"]),
                      int(rc["min-clients"]), float(rc["poll-interval-s"]), bool(rc["evaluate"]))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"run config: {exc}") from None
        if out.poll_interval_s <= 0 or out.round_timeout_s <= 0 or out.connect_timeout_s <= 0:
            raise ConfigError("run config: poll-interval-s, round-timeout-s and connect-timeout-s must be > 0")
        return out


def resolve_experiment(path: str, app_dir: Path | None) -> Path:
    """The experiment file: absolute, else relative to the installed app bundle, else to the cwd."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    for base in ([app_dir] if app_dir is not None else []) + [Path.cwd()]:
        if (base / p).is_file():
            return base / p
    raise ConfigError(f"run config: experiment = {path!r} not found in the app bundle "
                      f"({app_dir}) or the working directory ({Path.cwd()})")


def app_dir_of(grid: Grid) -> Path | None:
    """Where the SuperLink installed this run's app bundle (None when unknown)."""
    try:
        from flwr.common.config import get_project_dir

        run = grid.run
        return get_project_dir(run.fab_id, run.fab_version, run.fab_hash)
    except Exception:  # noqa: BLE001 - an in-process grid has no bundle
        return None


@dataclass
class Exchange:
    """Replies of one batch of messages: {node_id: Message}, the unanswered node ids, timings."""

    replies: dict[int, Message]
    missing: list[int]
    push_s: float
    wait_s: float
    pull_s: float
    received_at: dict[int, float]
    sent_at: float
    unsent: list[int] = field(default_factory=list)


def exchange(grid: Grid, messages: dict[int, Message], timeout_s: float, poll_s: float) -> Exchange:
    """Push one message per node, then pull replies every ``poll_s`` until all arrived or ``timeout_s``.

    Like ``Grid.send_and_receive`` but with a chosen poll interval (Flower's sleeps 3 s) and
    per-reply arrival times. A reply may carry an error (e.g. the node became unavailable).
    """
    nodes = list(messages)
    t0 = time.perf_counter()
    sent_at = time.time()
    ids = list(grid.push_messages([messages[n] for n in nodes]))
    ids += [None] * (len(nodes) - len(ids))  # flwr returns [] when the push failed (e.g. too large)
    push_s = time.perf_counter() - t0
    pending = {mid: n for mid, n in zip(ids, nodes) if mid}
    unsent = [n for mid, n in zip(ids, nodes) if not mid]  # reported as missing: dropped with a reason
    replies: dict[int, Message] = {}
    received_at: dict[int, float] = {}
    pull_s = 0.0
    deadline = time.perf_counter() + timeout_s
    while pending:
        t = time.perf_counter()
        got = list(grid.pull_messages(list(pending)))
        pull_s += time.perf_counter() - t
        now = time.time()
        for msg in got:
            n = pending.pop(msg.metadata.reply_to_message_id, None)
            if n is not None:
                replies[n] = msg
                received_at[n] = now
        if not pending or time.perf_counter() >= deadline:
            break
        time.sleep(min(poll_s, max(0.0, deadline - time.perf_counter())))
    wait_s = time.perf_counter() - t0 - push_s
    return Exchange(replies, sorted(list(pending.values()) + unsent), push_s, wait_s, pull_s, received_at, sent_at,
                    sorted(unsent))


def _experiment_record(cfg_text: str, cid: int | None = None) -> ConfigRecord:
    rec = ConfigRecord({"toml": cfg_text})
    if cid is not None:
        rec["cid"] = cid
    return rec


def _error_text(msg: Message) -> str:
    return f"node error {msg.error.code}: {msg.error.reason}"


@dataclass
class FlowerRun:
    """One nestfed experiment on a Flower grid (see the module docstring)."""

    grid: Grid
    settings: RunSettings
    app_dir: Path | None = None
    log: list[str] = field(default_factory=list)
    memory_init: dict[str, Any] = field(default_factory=dict)  # FedNL: the fresh rules a node reported

    def say(self, text: str) -> None:
        from logging import INFO

        from flwr.common.logger import log

        log(INFO, "[nestfed] %s", text)
        self.log.append(text)

    # -- setup ---------------------------------------------------------------------------------
    def load_config(self) -> C.ExperimentConfig:
        path = resolve_experiment(self.settings.experiment, self.app_dir)
        return C.load(path, list(self.settings.overrides))

    def wait_for_nodes(self, want: int) -> list[int]:
        deadline = time.perf_counter() + self.settings.connect_timeout_s
        while True:
            nodes = sorted(self.grid.get_node_ids())
            if len(nodes) >= want or time.perf_counter() >= deadline:
                return nodes
            time.sleep(self.settings.poll_interval_s)

    def query(self, nodes: list[int], cfg: C.ExperimentConfig, cfg_text: str):
        """QUERY every node; return (clients, {cid: node_id}, shapes, base model, per-node info)."""
        msgs = {n: Message(RecordDict({EXPERIMENT: _experiment_record(cfg_text)}), dst_node_id=n,
                           message_type=MessageType.QUERY, group_id="query",
                           ttl=self.settings.connect_timeout_s + 60) for n in nodes}
        ex = exchange(self.grid, msgs, self.settings.connect_timeout_s, self.settings.poll_interval_s)
        for n in ex.missing:
            self.say(f"query: node {n} did not answer within {self.settings.connect_timeout_s:.0f} s; left out")
        clients: list[ClientInfo] = []
        node_of: dict[int, int] = {}
        shapes: dict[str, tuple[int, int]] | None = None
        memory_init: dict[str, Any] = {}
        base_model = ""
        info: dict[str, dict[str, Any]] = {}
        for n in sorted(ex.replies):
            msg = ex.replies[n]
            if msg.has_error():
                self.say(f"query: node {n} left out: {_error_text(msg)}")
                continue
            try:
                rec = dict(msg.content.config_records["node"])
                cid, rank, n_k = int(rec["partition-id"]), int(rec["rank"]), int(rec["num-examples"])
                node_shapes = {k: (int(v[0]), int(v[1])) for k, v in json.loads(str(rec["shapes"])).items()}
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                self.say(f"query: node {n} left out: malformed reply ({exc!r})")
                continue
            if cid in node_of:
                self.say(f"query: node {n} left out: partition {cid} is already served by node {node_of[cid]}")
                continue
            if shapes is not None and node_shapes != shapes:
                self.say(f"query: node {n} left out: its LoRA layer shapes differ from the other nodes'")
                continue
            shapes = node_shapes
            if MEMORY_INIT in msg.content.array_records and not memory_init:
                memory_init = record_to_arrays(msg.content.array_records[MEMORY_INIT])
            base_model = str(rec.get("base-model", ""))
            node_of[cid] = n
            clients.append(ClientInfo(cid, rank, n_k))
            info[str(cid)] = {"node_id": n, "rank": rank, "num_examples": n_k,
                              "prepare_s": float(rec.get("prepare-s", 0.0)),
                              "process_age_s": float(rec.get("process-age-s", -1.0)),
                              "torch_threads": int(rec.get("torch-threads", 0))}
        clients.sort(key=lambda c: c.cid)
        missing = sorted(set(range(cfg.data.num_clients)) - set(node_of))
        if missing:
            self.say(f"query: no node serves partitions {missing}; the federation runs without them")
        self.memory_init = memory_init
        return clients, node_of, shapes or {}, base_model, info, ex

    # -- one round -----------------------------------------------------------------------------
    def train_round(self, rnd: int, state: GlobalState, strategy, clients: list[ClientInfo], node_of: dict[int, int],
                    cfg: C.ExperimentConfig, cfg_text: str, min_clients: int) -> tuple[GlobalState, dict[str, Any]]:
        t0 = time.perf_counter()
        fed = cfg.federation
        sampled = sample_clients(clients, fed.fraction, fed.seed, rnd)
        instructions: dict[int, Instruction] = strategy.configure(rnd, state, sampled)
        t_conf = time.perf_counter()
        msgs: dict[int, Message] = {}
        cid_of: dict[int, int] = {}
        wire_down: dict[int, int] = {}
        for cid, ins in instructions.items():
            arr = arrays_to_record(ins.arrays)
            wire_down[cid] = arr.count_bytes()
            content = RecordDict({"arrays": arr, "config": config_to_record(ins.config),
                                  EXPERIMENT: _experiment_record(cfg_text, cid)})
            n = node_of[cid]
            cid_of[n] = cid
            msgs[n] = Message(content, dst_node_id=n, message_type=MessageType.TRAIN, group_id=str(rnd),
                              ttl=self.settings.round_timeout_s + 60)
        t_enc = time.perf_counter()
        ex = exchange(self.grid, msgs, self.settings.round_timeout_s, self.settings.poll_interval_s)
        t_ex = time.perf_counter()
        accepted: dict[int, Reply] = {}
        per_client: dict[str, dict[str, Any]] = {}
        rejected: dict[str, str] = {}
        dropped: dict[str, str] = {}
        for n in ex.missing:
            cid = cid_of[n]
            dropped[str(cid)] = ("the SuperLink did not accept the message" if n in ex.unsent
                                 else f"no reply within {self.settings.round_timeout_s:g} s")
        decode_s = 0.0
        for n, msg in sorted(ex.replies.items()):
            cid = cid_of[n]
            ins = instructions[cid]
            down = payload_stats(ins.arrays)
            info: dict[str, Any] = {"bytes_down": down["bytes"], "params_down": down["params"],
                                    "dtypes_down": down["dtypes"], "wire_bytes_down": wire_down[cid],
                                    "rank_sent": ins.config.get("rank"), "node_id": n}
            if msg.has_error():
                dropped[str(cid)] = _error_text(msg)
                info["status"] = "dropped"
                per_client[str(cid)] = info
                continue
            t = time.perf_counter()
            try:
                reply = content_to_reply(msg.content)
                info["wire_bytes_up"] = msg.content.array_records["arrays"].count_bytes()
            except (KeyError, TypeError, ValueError) as exc:
                dropped[str(cid)] = f"malformed reply: {exc!r}"
                info["status"] = "dropped"
                per_client[str(cid)] = info
                continue
            decode_s += time.perf_counter() - t
            for k in TRANSPORT_METRICS:  # the ClientApp's timings: logged, never shown to the strategy
                if k in reply.metrics:
                    info[k] = reply.metrics.pop(k)
            up = payload_stats(reply.arrays)
            info.update({"bytes_up": up["bytes"], "params_up": up["params"], "dtypes_up": up["dtypes"],
                         "num_examples": reply.num_examples,
                         "reply_latency_s": ex.received_at[n] - float(msg.metadata.created_at)})
            try:
                validate_reply(ins, reply)
                accepted[cid] = reply
                info["status"] = "accepted"
            except UpdateRejected as exc:
                rejected[str(cid)] = str(exc)
                info["status"] = "rejected"
            info.update({k: v for k, v in reply.metrics.items() if isinstance(v, (int, float))})
            per_client[str(cid)] = info
        for cid, reason in sorted(dropped.items()):
            self.say(f"round {rnd}: client {cid} (node {node_of[int(cid)]}) dropped: {reason}")
            per_client.setdefault(cid, {"status": "dropped", "node_id": node_of[int(cid)], "bytes_down": 0,
                                        "bytes_up": 0})
        for cid, reason in sorted(rejected.items()):
            self.say(f"round {rnd}: client {cid} update rejected: {reason}")
        for c in per_client.values():
            c.setdefault("bytes_up", 0)
        aggregated = len(accepted) >= min_clients
        t_agg0 = time.perf_counter()
        if aggregated:
            state = strategy.aggregate(rnd, state, accepted)
        else:
            self.say(f"round {rnd}: {len(accepted)} accepted updates < min_clients {min_clients}; global state kept")
        t_agg = time.perf_counter() - t_agg0
        return state, {"round": rnd, "sampled": [c.cid for c in sampled], "aggregated": aggregated,
                       "clients": per_client, "rejected": rejected, "dropped": dropped,
                       "bytes_down": sum(c.get("bytes_down", 0) for c in per_client.values()),
                       "bytes_up": sum(c.get("bytes_up", 0) for c in per_client.values()),
                       "flower": {"configure_s": t_conf - t0, "encode_s": t_enc - t_conf, "push_s": ex.push_s,
                                  "wait_s": ex.wait_s, "pull_s": ex.pull_s, "decode_s": decode_s,
                                  "exchange_s": t_ex - t_enc, "aggregate_s": t_agg}}

    def evaluate(self, state: GlobalState | None, strategy, clients: list[ClientInfo], node_of: dict[int, int],
                 cfg_text: str, rnd: int) -> dict[str, dict[str, float]]:
        msgs: dict[int, Message] = {}
        cid_of: dict[int, int] = {}
        for c in clients:
            arrays, scale = ({}, 1.0) if state is None else strategy.deploy(state, c.cid)
            n = node_of[c.cid]
            cid_of[n] = c.cid
            msgs[n] = Message(RecordDict({"arrays": arrays_to_record(arrays), "config": config_to_record({"scaling": scale}),
                                          EXPERIMENT: _experiment_record(cfg_text, c.cid)}),
                              dst_node_id=n, message_type=MessageType.EVALUATE, group_id=f"eval-{rnd}",
                              ttl=self.settings.round_timeout_s + 60)
        ex = exchange(self.grid, msgs, self.settings.round_timeout_s, self.settings.poll_interval_s)
        out = {}
        for n, msg in sorted(ex.replies.items()):
            if msg.has_error():
                self.say(f"evaluation {rnd}: client {cid_of[n]} failed: {_error_text(msg)}")
                continue
            out[str(cid_of[n])] = {k: float(v) for k, v in msg.content.metric_records["metrics"].items()}
        for n in ex.missing:
            self.say(f"evaluation {rnd}: client {cid_of[n]} did not answer")
        return dict(sorted(out.items(), key=lambda kv: int(kv[0])))

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        t_start = time.perf_counter()
        cfg = self.load_config()
        cfg_text = C.dumps_toml(cfg)
        s = self.settings
        run_dir = Path(s.run_dir).expanduser() if s.run_dir else new_run_dir(cfg)
        min_clients = s.min_clients or cfg.federation.min_clients
        want = s.num_supernodes or cfg.data.num_clients
        nodes = self.wait_for_nodes(want)
        self.say(f"{len(nodes)} nodes connected (waited for {want})")
        t_q = time.perf_counter()
        clients, node_of, shapes, base_model, node_info, qex = self.query(nodes, cfg, cfg_text)
        query_s = time.perf_counter() - t_q
        if len(clients) < min_clients:
            raise RuntimeError(f"only {len(clients)} nodes answered the query; min-clients is {min_clients}")
        for c in clients:
            if c.rank > C.r_max(cfg):
                raise ConfigError(f"node of client {c.cid}: rank {c.rank} is above lora.r_max = {C.r_max(cfg)}")
        strategy = make_strategy(cfg)
        if cfg.strategy.name == "fednl":
            if not self.memory_init:
                raise RuntimeError("fednl: no node reported its memory rules ('memory-init' in the QUERY reply); "
                                   "are the SuperNodes running this nestfed version?")
            strategy.options["memory_init"] = self.memory_init
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics_path = run_dir / "metrics.jsonl"
        start = 1
        if s.resume and latest_checkpoint(run_dir) is not None:
            done, state = load_checkpoint(latest_checkpoint(run_dir))
            start = done + 1
            if metrics_path.exists():
                keep = [ln for ln in metrics_path.read_text().splitlines()
                        if ln.strip() and json.loads(ln)["round"] <= done]
                metrics_path.write_text("".join(ln + "\n" for ln in keep))
            self.say(f"resuming {run_dir} after round {done}")
        else:
            write_text_atomic(run_dir / "config.toml", cfg_text)
            state = strategy.initialize(shapes, clients)
            metrics_path.unlink(missing_ok=True)
            line0: dict[str, Any] = {"round": 0, "nodes": node_info, "query_s": query_s}
            if s.evaluate:
                line0["eval"] = self.evaluate(None, strategy, clients, node_of, cfg_text, 0)
            self._append(metrics_path, line0)
        for rnd in range(start, cfg.federation.rounds + 1):
            t0 = time.perf_counter()
            state, line = self.train_round(rnd, state, strategy, clients, node_of, cfg, cfg_text, min_clients)
            t = time.perf_counter()
            save_checkpoint(run_dir / "checkpoints" / f"round_{rnd:03d}.safetensors", rnd, state)
            line["flower"]["checkpoint_s"] = time.perf_counter() - t
            if s.evaluate:
                t = time.perf_counter()
                line["eval"] = self.evaluate(state, strategy, clients, node_of, cfg_text, rnd)
                line["flower"]["evaluate_s"] = time.perf_counter() - t
            line["time_s"] = time.perf_counter() - t0
            self._append(metrics_path, line)
            self.say(f"round {rnd}: {sum(c['status'] == 'accepted' for c in line['clients'].values())} accepted, "
                     f"{len(line['rejected'])} rejected, {len(line['dropped'])} dropped, {line['time_s']:.1f} s")
        arrays, scale = strategy.export(state)
        if arrays:  # FedNL with fednl_travel = "rules" has no global LoRA: each client keeps its own
            export_peft_adapter(arrays, scale, run_dir / "adapter", base_model)
        if hasattr(strategy, "export_rules"):
            save_tensors_atomic(strategy.export_rules(state), run_dir / "memory_rules.safetensors")
        summary = self._summary(run_dir, cfg, clients, time.perf_counter() - t_start)
        write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
        self.say(f"done: {run_dir}")
        return summary

    @staticmethod
    def _append(path: Path, line: dict[str, Any]) -> None:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def _summary(self, run_dir: Path, cfg: C.ExperimentConfig, clients: list[ClientInfo], wall: float) -> dict[str, Any]:
        from nestfed import report

        lines = report.read_metrics(run_dir)
        rounds = [ln for ln in lines if ln["round"] > 0]
        if self.settings.evaluate and all(ln.get("eval") for ln in lines):
            summary = report.summarise(lines, cfg)
            if cfg.output.plots:
                report.plot_run(run_dir)
        else:
            summary = {"method": cfg.strategy.name, "rounds": len(rounds), "ranks": [c.rank for c in clients],
                       "bytes_down_total": sum(ln["bytes_down"] for ln in rounds),
                       "bytes_up_total": sum(ln["bytes_up"] for ln in rounds),
                       "rejected_updates": sum(len(ln["rejected"]) for ln in rounds)}
        summary.update({"engine": "flower", "run_dir": str(run_dir), "wall_time_s": wall,
                        "clients": [c.cid for c in clients],
                        "dropped_updates": sum(len(ln.get("dropped", {})) for ln in rounds),
                        "rejections": [m for m in self.log if any(w in m for w in ("rejected", "dropped", "min_clients"))],
                        "events": self.log})
        return summary


def run_on_grid(grid: Grid, run_config: dict[str, Any]) -> dict[str, Any]:
    """Run the experiment named by ``run_config`` on ``grid``; return its summary."""
    settings = RunSettings.from_run_config(run_config)
    return FlowerRun(grid, settings, app_dir_of(grid)).run()


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """The ServerApp entry point: read the run config and run the experiment."""
    run_on_grid(grid, dict(context.run_config))
