"""The nestfed ServerApp: any Flower-capable nestfed method driven through Flower's Message API.

It is a transport of the one round loop (nestfed.federation.loop): sampling, validation,
aggregation, the metrics line, checkpoints, resume and the run directory are the embedded runner's
own. Only the exchange differs: one Flower message per node (:class:`FlowerTransport`).

Run config (``[tool.flwr.app.config]`` of ``flower_app/pyproject.toml``, overridable with
``flwr run --run-config``); types are checked (a boolean must be ``true`` or ``false``, not a string):

- ``experiment``: the experiment TOML on the SuperLink host: absolute, or relative to the
  installed app bundle (where ``flower_app/experiment.toml`` lands) or to the working directory;
- ``overrides``: ``section.key=value`` overrides separated by ``;``;
- ``run-dir``: the run directory ("" = a new ``<output.dir>/<name>-<time>``); it must not exist
  or be empty unless ``resume`` is true, which continues it from its latest checkpoint;
- ``num-supernodes``: nodes to wait for before the QUERY round (0 = data.num_clients);
  ``connect-timeout-s``: how long to wait for them and for their QUERY replies;
- ``round-timeout-s``: how long a round waits for TRAIN replies; a node that has not replied by
  then (or whose SuperLink reports it unavailable) is dropped from the round with a logged reason;
- ``min-clients``: the fewest accepted updates a round needs (0 = federation.min_clients), else
  the round keeps the global state;
- ``poll-interval-s``: how often replies are pulled from the SuperLink;
- ``evaluate``: also send EVALUATE messages (round 0 and after every round), so that
  metrics.jsonl and summary.json carry held-out metrics as in an embedded run;
- ``secure-aggregation``: run every TRAIN round through Flower's SecAgg+ (the server sees only
  sums; nestfed.flower.secure, docs/secure_aggregation.md), with ``secagg-num-shares`` (0 = every
  sampled node), ``secagg-reconstruction-threshold`` (0 = a majority of the shares),
  ``secagg-clipping-range`` (c >= 1) and ``secagg-quantization-range`` (Q); a method whose
  aggregation needs individual updates is refused before anything is written.

Before the rounds: a QUERY message to every node (its partition, rank, n_k, LoRA shapes, base
model and, for a method that needs them, the initial arrays only a model gives, e.g. FedNL's fresh
memory rules). Clients' kept state stays on the nodes, on their disks, keyed by the run directory
and round (nestfed.flower.node_state), so a method whose clients keep state resumes on Flower too:
after a crash of the SuperLink or of the ServerApp, ``resume = true`` with the same ``run-dir``
continues from the latest checkpoint and each node from its state of that round.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from flwr.app import Context, Message, MessageType, RecordDict
from flwr.common.config import get_project_dir
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from nestfed import config as C
from nestfed import methods
from nestfed.config import ExperimentConfig
from nestfed.config.capabilities import Capability
from nestfed.errors import ConfigError, NestfedError, RunFailed
from nestfed.experiments.federated_run import Federation, run_federation
from nestfed.experiments.run import new_run_dir, stored_config
from nestfed.federation import tracking
from nestfed.federation.loop import FitResults
from nestfed.federation.messages import Arrays, ClientInfo, Instruction, Reply
from nestfed.federation.population import Population
from nestfed.federation.run_dir import ON_NODES, ClientState, Exports, RunDir
from nestfed.federation.safeguards import Safeguards
from nestfed.flower.client_app import EXPERIMENT, INITIAL_ARRAYS, TRANSPORT_METRICS
from nestfed.flower.exchange import exchange, wait_for_nodes
from nestfed.flower.exchange import experiment_record as _experiment_record
from nestfed.flower.records import arrays_to_record, config_to_record, content_to_reply, record_to_arrays
from nestfed.flower.refusals import embedded_only
from nestfed.flower.secure import SecAggSettings, secure_fit

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
    "secure-aggregation": False,
    "secagg-num-shares": 0,
    "secagg-reconstruction-threshold": 0,
    "secagg-clipping-range": 1.0,
    "secagg-quantization-range": 2**24,
}


#: EVALUATE messages a round has in flight at once (their adapters are serialised per batch)
EVALUATE_BATCH = 64


def _typed(key: str, value: Any, kind: type) -> Any:
    """A run-config value of the declared kind; raises ConfigError naming the key."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, str)
    if not ok:
        want = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
        raise ConfigError(f"run config: {key} = {value!r}, expected {want}")
    return kind(value)


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
    secure_aggregation: bool = False
    secagg: SecAggSettings = SecAggSettings()

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> RunSettings:
        """Read Flower's run config; unknown keys are ignored, wrong types and ranges raise ConfigError."""
        rc = {**DEFAULTS, **{k: v for k, v in run_config.items() if k in DEFAULTS}}
        kinds = {k: type(v) for k, v in DEFAULTS.items()}
        v = {k: _typed(k, rc[k], kinds[k]) for k in DEFAULTS}
        overrides = tuple(s.strip() for s in v["overrides"].split(";") if s.strip())
        out = cls(
            v["experiment"],
            overrides,
            v["run-dir"],
            v["resume"],
            v["num-supernodes"],
            v["connect-timeout-s"],
            v["round-timeout-s"],
            v["min-clients"],
            v["poll-interval-s"],
            v["evaluate"],
            v["secure-aggregation"],
            SecAggSettings(
                v["secagg-num-shares"],
                v["secagg-reconstruction-threshold"],
                v["secagg-clipping-range"],
                v["secagg-quantization-range"],
            ),
        )
        out.secagg.check()
        if out.poll_interval_s <= 0 or out.round_timeout_s <= 0 or out.connect_timeout_s <= 0:
            raise ConfigError("run config: poll-interval-s, round-timeout-s and connect-timeout-s must be > 0")
        if out.num_supernodes < 0 or out.min_clients < 0:
            raise ConfigError("run config: num-supernodes and min-clients must be >= 0")
        return out


def resolve_experiment(path: str, app_dir: Path | None) -> Path:
    """The experiment file: absolute, else relative to the installed app bundle, else to the cwd."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    for base in ([app_dir] if app_dir is not None else []) + [Path.cwd()]:
        if (base / p).is_file():
            return base / p
    raise ConfigError(
        f"run config: experiment = {path!r} not found in the app bundle "
        f"({app_dir}) or the working directory ({Path.cwd()})"
    )


def app_dir_of(grid: Grid) -> Path | None:
    """Where the SuperLink installed this run's app bundle (None when unknown)."""
    try:
        run = grid.run
        return get_project_dir(run.fab_id, run.fab_version, run.fab_hash)
    except Exception:  # noqa: BLE001 - an in-process grid has no bundle
        return None


def _error_text(msg: Message) -> str:
    return f"node error {msg.error.code}: {msg.error.reason}"


@dataclass
class QueryResult:
    """What the QUERY round found: clients (rank r_k, n_k), {cid: node id}, the LoRA shapes, the base
    model, per-node info for the round-0 line, the initial arrays a node reported."""

    clients: list[ClientInfo]
    node_of: dict[int, int]
    shapes: dict[str, tuple[int, int]]
    base_model: str
    info: dict[str, dict[str, Any]]
    initial_arrays: Arrays
    seconds: float


@dataclass
class FlowerTransport:
    """The round loop's exchange as Flower messages: one TRAIN / EVALUATE message per node.

    grid: the Flower grid; settings: the run settings; node_of: {cid: node id}; cfg_text: the
    resolved experiment (sent with every message, so server and nodes agree on it); query: the
    QUERY round's result (its node info goes into the round-0 line); say: logging; run_dir: the
    run directory's resolved path (the key under which the nodes keep their clients' state).
    """

    grid: Grid
    settings: RunSettings
    node_of: dict[int, int]
    cfg_text: str
    query: QueryResult
    say: Callable[[str], None]
    run_dir: str = ""
    _as_sent_calls: int = 0
    client_state_home: ClassVar[str] = ON_NODES  # the nodes keep their clients' state

    @property
    def asks(self) -> dict[Capability, str]:
        """What running on Flower asks of the method, {capability: the setting}: Flower itself, and
        secure aggregation when the run config turns it on."""
        out = {Capability.FLOWER: "strategy.name"}
        if self.settings.secure_aggregation:
            out[Capability.SECURE_AGGREGATION] = "run config: secure-aggregation"
        return out

    def open(self) -> dict[str, Any]:
        """The QUERY round's node info and duration for the round-0 line."""
        return {"nodes": self.query.info, "query_s": self.query.seconds}

    def _message(self, cid: int, content: RecordDict, kind: str, group: str) -> Message:
        content[EXPERIMENT] = _experiment_record(self.cfg_text, cid, self.run_dir)
        return Message(
            content,
            dst_node_id=self.node_of[cid],
            message_type=kind,
            group_id=group,
            ttl=self.settings.round_timeout_s + 60,
        )

    def fit(
        self, rnd: int, instructions: dict[int, Instruction], on_reply: Callable[[int, Reply], None] | None = None
    ) -> FitResults:
        """TRAIN messages with each node's own ArrayRecord (its rank's shapes) and ConfigRecord; under
        ``secure-aggregation``, Flower's SecAgg+ workflow instead (nestfed.flower.secure)."""
        if self.settings.secure_aggregation:
            return secure_fit(
                self.grid,
                exchange,
                rnd,
                instructions,
                self.node_of,
                self.cfg_text,
                self.settings.secagg,
                max(c.num_examples for c in self.query.clients),
                self.settings.round_timeout_s,
                self.settings.poll_interval_s,
                self.say,
                self.run_dir,
            )
        t0 = time.perf_counter()
        out = FitResults()
        msgs, cid_of = {}, {}
        for cid, ins in instructions.items():
            arr = arrays_to_record(ins.arrays)
            out.info[cid] = {"node_id": self.node_of[cid], "wire_bytes_down": arr.count_bytes()}
            msgs[self.node_of[cid]] = self._message(
                cid, RecordDict({"arrays": arr, "config": config_to_record(ins.config)}), MessageType.TRAIN, str(rnd)
            )
            cid_of[self.node_of[cid]] = cid
        t_enc = time.perf_counter()
        ex = exchange(self.grid, msgs, self.settings.round_timeout_s, self.settings.poll_interval_s)
        t_ex = time.perf_counter()
        for n in ex.missing:
            out.dropped[cid_of[n]] = (
                f"node {n}: the SuperLink did not accept the message"
                if n in ex.unsent
                else f"node {n}: no reply within {self.settings.round_timeout_s:g} s"
            )
        for n, msg in sorted(ex.replies.items()):
            cid = cid_of[n]
            if msg.has_error():
                out.dropped[cid] = f"node {n}: {_error_text(msg)}"
                continue
            try:
                reply = content_to_reply(msg.content)
                out.info[cid]["wire_bytes_up"] = msg.content.array_records["arrays"].count_bytes()
            except (KeyError, TypeError, ValueError) as exc:
                out.dropped[cid] = f"node {n}: malformed reply: {exc!r}"
                continue
            for k in TRANSPORT_METRICS:  # the ClientApp's timings: logged, never shown to the strategy
                if k in reply.metrics:
                    out.info[cid][k] = reply.metrics.pop(k)
            out.info[cid]["reply_latency_s"] = ex.received_at[n] - float(msg.metadata.created_at)
            if on_reply is None:
                out.replies[cid] = reply
            else:
                on_reply(cid, reply)
        out.round_info = {
            "flower": {
                "encode_s": t_enc - t0,
                "push_s": ex.push_s,
                "wait_s": ex.wait_s,
                "pull_s": ex.pull_s,
                "exchange_s": t_ex - t_enc,
                "decode_s": time.perf_counter() - t_ex,
            }
        }
        return out

    def evaluate(
        self, rnd: int, deployments: Mapping[int, tuple[Arrays, float]], as_sent: bool = False
    ) -> dict[str, dict[str, float]] | None:
        """EVALUATE messages (only with the run config's ``evaluate``), :data:`EVALUATE_BATCH` nodes at a
        time, so the server never holds every evaluated client's adapter at once; ``as_sent``: the
        node evaluates the arrays without its client's kept state (config ``as-sent``)."""
        if not self.settings.evaluate:
            return None
        if as_sent:  # one group per call: the mechanism reports send one per truncation rank
            self._as_sent_calls += 1
        out = {}
        cids = list(deployments)
        for i in range(0, len(cids), EVALUATE_BATCH):
            msgs, cid_of = {}, {}
            for cid in cids[i : i + EVALUATE_BATCH]:
                arrays, scale = deployments[cid]
                config = {"scaling": scale, "round": rnd, **({"as-sent": True} if as_sent else {})}
                content = RecordDict({"arrays": arrays_to_record(arrays), "config": config_to_record(config)})
                group = f"eval-{rnd}" + (f"-as-sent-{self._as_sent_calls}" if as_sent else "")
                msgs[self.node_of[cid]] = self._message(cid, content, MessageType.EVALUATE, group)
                cid_of[self.node_of[cid]] = cid
            ex = exchange(self.grid, msgs, self.settings.round_timeout_s, self.settings.poll_interval_s)
            for n, msg in sorted(ex.replies.items()):
                if msg.has_error():
                    self.say(f"evaluation {rnd}: client {cid_of[n]} failed: {_error_text(msg)}")
                    continue
                out[str(cid_of[n])] = {k: float(v) for k, v in msg.content.metric_records["metrics"].items()}
            for n in ex.missing:
                self.say(f"evaluation {rnd}: client {cid_of[n]} did not answer")
        return dict(sorted(out.items(), key=lambda kv: int(kv[0])))

    def client_state(self) -> ClientState | None:
        """None: the nodes keep their clients' state (nestfed.flower.node_state), never the server."""
        return None

    def restore_client_state(self, state: ClientState | None) -> None:
        """Nothing to restore on the server (see :meth:`client_state`)."""
        return None


@dataclass
class FlowerRun:
    """One nestfed experiment on a Flower grid (see the module docstring)."""

    grid: Grid
    settings: RunSettings
    app_dir: Path | None = None
    log: list[str] = field(default_factory=list)
    count_refusal: str = field(default="", init=False)  # a node's line refusing the experiment's client count

    def say(self, text: str) -> None:
        log(logging.INFO, "[nestfed] %s", text)
        self.log.append(text)

    # -- setup ---------------------------------------------------------------------------------
    def load_config(self) -> ExperimentConfig:
        """The experiment, validated, and its method checked for Flower. Raises ConfigError."""
        path = resolve_experiment(self.settings.experiment, self.app_dir)
        cfg = methods.load_config(path, list(self.settings.overrides))
        line = methods.get(cfg.strategy.name).refusal({Capability.FLOWER: "strategy.name"})
        if line is not None:  # e.g. clients that hold compressed models the ServerApp cannot set up
            raise ConfigError(f"{path}: {line}")
        return cfg

    def wait_for_nodes(self, want: int, cfg_text: str = "") -> list[int]:
        """The connected nodes once ``want`` are (nestfed.flower.exchange.wait_for_nodes)."""
        return wait_for_nodes(self.grid, want, cfg_text, self.settings.connect_timeout_s, self.settings.poll_interval_s)

    def query(self, nodes: list[int], cfg: ExperimentConfig, cfg_text: str) -> QueryResult:
        """QUERY every node; nodes that fail, repeat a partition or disagree on shapes are left out."""
        t0 = time.perf_counter()
        msgs = {
            n: Message(
                RecordDict({EXPERIMENT: _experiment_record(cfg_text)}),
                dst_node_id=n,
                message_type=MessageType.QUERY,
                group_id="query",
                ttl=self.settings.connect_timeout_s + 60,
            )
            for n in nodes
        }
        ex = exchange(self.grid, msgs, self.settings.connect_timeout_s, self.settings.poll_interval_s)
        for n in ex.missing:
            self.say(f"query: node {n} did not answer within {self.settings.connect_timeout_s:.0f} s; left out")
        clients: list[ClientInfo] = []
        node_of: dict[int, int] = {}
        shapes: dict[str, tuple[int, int]] | None = None
        initial: Arrays = {}
        base_model = ""
        info: dict[str, dict[str, Any]] = {}
        for n in sorted(ex.replies):
            msg = ex.replies[n]
            if msg.has_error():
                self.say(f"query: node {n} left out: {_error_text(msg)}")
                if "num-partitions" in msg.error.reason:  # the engine's node count is not the experiment's
                    self.count_refusal = msg.error.reason.strip().splitlines()[-1]
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
            if INITIAL_ARRAYS in msg.content.array_records and not initial:
                initial = record_to_arrays(msg.content.array_records[INITIAL_ARRAYS])
            base_model = str(rec.get("base-model", ""))
            node_of[cid] = n
            clients.append(ClientInfo(cid, rank, n_k))
            info[str(cid)] = {
                "node_id": n,
                "rank": rank,
                "num_examples": n_k,
                "prepare_s": float(rec.get("prepare-s", 0.0)),
                "process_age_s": float(rec.get("process-age-s", -1.0)),
                "torch_threads": int(rec.get("torch-threads", 0)),
                "label": str(rec.get("label", "")),
            }
        clients.sort(key=lambda c: c.cid)
        missing = sorted(set(range(cfg.data.num_clients)) - set(node_of))
        if missing:
            self.say(f"query: no node serves partitions {missing}; the federation runs without them")
        return QueryResult(clients, node_of, shapes or {}, base_model, info, initial, time.perf_counter() - t0)

    # -- the run -------------------------------------------------------------------------------
    def gather_clients(self, cfg: ExperimentConfig, cfg_text: str, min_clients: int) -> QueryResult:
        """Wait for the nodes, QUERY them, and check what they report: at least ``min_clients``
        answered (else one line, naming the node count against data.num_clients when a node refused
        it) and no rank above lora.r_max. Raises NestfedError / ConfigError."""
        want = self.settings.num_supernodes or cfg.data.num_clients
        nodes = self.wait_for_nodes(want, cfg_text)
        self.say(f"{len(nodes)} nodes connected (waited for {want})")
        q = self.query(nodes, cfg, cfg_text)
        if len(q.clients) < min_clients:
            why = self.count_refusal
            raise NestfedError(
                f"only {len(q.clients)} nodes answered the query; min-clients is {min_clients}"
                + (f"; {len(nodes)} nodes for data.num_clients = {want}, and a node says: {why}" if why else "")
            )
        for c in q.clients:
            if c.rank > C.r_max(cfg):
                raise ConfigError(f"node of client {c.cid}: rank {c.rank} is above lora.r_max = {C.r_max(cfg)}")
        return q

    def run(self) -> dict[str, Any]:
        """Validate, query the nodes, run the rounds through the loop, finish the run directory."""
        t_start = time.perf_counter()
        s = self.settings
        cfg = self.load_config()
        method = methods.get(cfg.strategy.name)
        cfg_text = C.dumps_toml(cfg)
        run_dir = Path(s.run_dir).expanduser() if s.run_dir else new_run_dir(cfg)
        tracking.check_store(cfg.tracking, cfg.output.dir)
        if s.resume:
            rd = RunDir.open(run_dir, cfg_text)
            rd.check_resume(method.keeps_client_state(cfg), ON_NODES)  # refuses before any message is sent
            for change in rd.accept_config(stored_config(rd), cfg, cfg_text):
                self.say(f"resume: config.toml now has {change}")
        elif run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
            raise NestfedError(
                f"run config: run-dir {run_dir} exists and is not empty; set resume = true to continue it"
            )
        min_clients = s.min_clients or cfg.federation.min_clients
        q = self.gather_clients(cfg, cfg_text, min_clients)
        strategy = method.server(cfg, q.initial_arrays)
        embedded_only(cfg)  # refused before anything is written
        if s.secure_aggregation:  # refused before anything is written
            if Safeguards.from_config(cfg).rule.active:
                raise ConfigError(
                    "run config: secure-aggregation: a robust rule or central DP needs individual "
                    "updates, which secure aggregation hides; docs/secure_aggregation.md"
                )
            s.secagg.check_clients(max(1, round(cfg.federation.fraction * len(q.clients))))
        population = Population.from_config(cfg, q.clients)  # an elastic trace is read before anything is written
        transport = FlowerTransport(self.grid, s, q.node_of, cfg_text, q, self.say, str(run_dir.resolve()))
        labels = {str(c.cid): q.info[str(c.cid)].get("label", "") for c in q.clients}
        roster = {
            str(c.cid): {"rank": c.rank, "label": labels[str(c.cid)], "num_examples": c.num_examples} for c in q.clients
        }

        def summary(state) -> dict[str, Any]:
            if not C.per_client_inline(cfg):
                return {}
            return {
                "clients": [c.cid for c in q.clients],
                "ranks": [c.rank for c in q.clients],
                "client_labels": labels,
            }

        fed = Federation(
            "flower",
            strategy,
            transport,
            q.clients,
            q.shapes,
            method.keeps_client_state(cfg),
            lambda state: Exports(strategy.export(state), q.base_model, strategy.export_files(state)),
            roster,
            population,
            min_clients=min_clients,
            on_event=lambda kind, info: self.say(info["text"]) if kind == "log" else None,
            sinks=tracking.sinks(cfg.tracking, run_dir, cfg.output.dir, cfg.output.name),
            summary=summary,
            log=self.log,
        )

        def open_run_dir() -> RunDir:
            if s.resume:
                self.say(f"resuming {run_dir}")
                return rd
            return RunDir.create(run_dir, cfg_text, C.per_client_inline(cfg))

        try:
            summary_ = run_federation(cfg, fed, open_run_dir, s.resume, t_start)
        except RunFailed as exc:
            self.say(f"failed: {exc}")
            raise
        for rnd in summary_.get("rounds_mostly_dropped", []):
            self.say(f"WARNING: round {rnd} lost most of its sampled clients (see metrics.jsonl's dropped)")
        self.say(f"done: {run_dir}")
        return summary_


def run_on_grid(grid: Grid, run_config: dict[str, Any]) -> dict[str, Any]:
    """Run the experiment named by ``run_config`` on ``grid``; return its summary."""
    settings = RunSettings.from_run_config(run_config)
    return FlowerRun(grid, settings, app_dir_of(grid)).run()


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """The ServerApp entry point: read the run config and run the experiment."""
    run_on_grid(grid, dict(context.run_config))
