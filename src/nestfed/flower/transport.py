"""The ServerApp's side of the wire: the QUERY round that learns the federation (``query``) and
the round loop's exchange as Flower messages (``FlowerTransport``, a Transport of
nestfed.federation.transport): one TRAIN / EVALUATE message per node, or Flower's SecAgg+ for a
TRAIN round under ``secure-aggregation`` (nestfed.flower.secure).

QUERY asks every node for its partition, rank, n_k, LoRA shapes and base model and, for a method
that needs them, the initial arrays only a model gives (e.g. FedNL's fresh memory rules). Clients'
kept state stays on the nodes (nestfed.flower.node_state), so the transport keeps none.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid

from nestfed.config import ExperimentConfig
from nestfed.config.capabilities import Capability
from nestfed.federation.messages import Arrays, ClientInfo, Instruction, Reply
from nestfed.federation.run_dir import ON_NODES, ClientState
from nestfed.federation.transport import FitResults
from nestfed.flower.client_app import EXPERIMENT, INITIAL_ARRAYS, TRANSPORT_METRICS
from nestfed.flower.exchange import exchange
from nestfed.flower.exchange import experiment_record as _experiment_record
from nestfed.flower.records import arrays_to_record, config_to_record, content_to_reply, record_to_arrays
from nestfed.flower.run_settings import RunSettings
from nestfed.flower.secure import secure_fit

#: EVALUATE messages a round has in flight at once (their adapters are serialised per batch)
EVALUATE_BATCH = 64


def _error_text(msg: Message) -> str:
    return f"node error {msg.error.code}: {msg.error.reason}"


@dataclass
class QueryResult:
    """What the QUERY round found.

    Attributes:
        clients: the clients that answered (rank r_k, n_k), by id.
        node_of: {cid: node id}.
        shapes: the LoRA layers' weight shapes, {module: (out, in)}.
        base_model: the nodes' base model.
        info: {cid: the node's fields for the round-0 line}.
        initial_arrays: the initial arrays a node reported (those only a model gives); {} for none.
        seconds: the round's duration, in seconds.
        refusal: a node's line refusing the experiment's client count; "" when none did.
    """

    clients: list[ClientInfo]
    node_of: dict[int, int]
    shapes: dict[str, tuple[int, int]]
    base_model: str
    info: dict[str, dict[str, Any]]
    initial_arrays: Arrays
    seconds: float
    refusal: str = ""


@dataclass
class FlowerTransport:
    """The round loop's exchange as Flower messages: one TRAIN / EVALUATE message per node.

    Attributes:
        grid: the Flower grid.
        settings: the run settings.
        node_of: {cid: node id}.
        cfg_text: the resolved experiment, sent with every message so server and nodes agree on it.
        query: the QUERY round's result (its node info goes into the round-0 line).
        say: called with each line to log.
        run_dir: the run directory's resolved path (the key under which the nodes keep their
            clients' state); default "".
        client_state_home: run_dir.ON_NODES: the nodes keep their clients' state.
    """

    grid: Grid
    settings: RunSettings
    node_of: dict[int, int]
    cfg_text: str
    query: QueryResult
    say: Callable[[str], None]
    run_dir: str = ""
    _as_sent_calls: int = 0
    client_state_home: ClassVar[str] = ON_NODES

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
        """Send TRAIN messages, each node's own ArrayRecord (its rank's shapes) and ConfigRecord.

        Under ``secure-aggregation``, Flower's SecAgg+ workflow instead (nestfed.flower.secure).
        """
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
        """Send EVALUATE messages, ``EVALUATE_BATCH`` nodes at a time (only with the run config's ``evaluate``).

        The server never holds every evaluated client's adapter at once; ``as_sent`` has the node
        evaluate the arrays without its client's kept state (config ``as-sent``).
        """
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
        """Nothing to restore on the server (see ``client_state``)."""
        return None


def query(
    grid: Grid,
    nodes: list[int],
    cfg: ExperimentConfig,
    cfg_text: str,
    settings: RunSettings,
    say: Callable[[str], None],
) -> QueryResult:
    """QUERY every node for its partition, rank, n_k, LoRA shapes and base model.

    Nodes that fail, repeat a partition or disagree on shapes are left out, each with a line.

    Args:
        grid: the Flower grid.
        nodes: the node ids to ask.
        cfg: the experiment's config (its client count).
        cfg_text: the resolved experiment, sent to every node.
        settings: the run settings (``connect_timeout_s``: how long to wait for the replies).
        say: called with each line to log.

    Returns:
        What the round found.
    """
    t0 = time.perf_counter()
    msgs = {n: _query_message(n, cfg_text, settings) for n in nodes}
    ex = exchange(grid, msgs, settings.connect_timeout_s, settings.poll_interval_s)
    for n in ex.missing:
        say(f"query: node {n} did not answer within {settings.connect_timeout_s:.0f} s; left out")
    clients: list[ClientInfo] = []
    node_of: dict[int, int] = {}
    shapes: dict[str, tuple[int, int]] | None = None
    initial: Arrays = {}
    base_model, refusal = "", ""
    info: dict[str, dict[str, Any]] = {}
    for n in sorted(ex.replies):
        msg = ex.replies[n]
        if msg.has_error():
            say(f"query: node {n} left out: {_error_text(msg)}")
            if "num-partitions" in msg.error.reason:  # the engine's node count is not the experiment's
                refusal = msg.error.reason.strip().splitlines()[-1]
            continue
        try:
            reply = _read_query_reply(msg)
            _check_joins(reply, node_of, shapes)
        except ValueError as exc:
            say(f"query: node {n} left out: {exc}")
            continue
        shapes = reply.shapes
        if INITIAL_ARRAYS in msg.content.array_records and not initial:
            initial = record_to_arrays(msg.content.array_records[INITIAL_ARRAYS])
        base_model = str(reply.record.get("base-model", ""))
        node_of[reply.client.cid] = n
        clients.append(reply.client)
        info[str(reply.client.cid)] = _node_info(n, reply)
    clients.sort(key=lambda c: c.cid)
    missing = sorted(set(range(cfg.data.num_clients)) - set(node_of))
    if missing:
        say(f"query: no node serves partitions {missing}; the federation runs without them")
    return QueryResult(clients, node_of, shapes or {}, base_model, info, initial, time.perf_counter() - t0, refusal)


@dataclass(frozen=True)
class _QueryReply:
    client: ClientInfo
    shapes: dict[str, tuple[int, int]]
    record: dict[str, Any]


def _query_message(node: int, cfg_text: str, settings: RunSettings) -> Message:
    return Message(
        RecordDict({EXPERIMENT: _experiment_record(cfg_text)}),
        dst_node_id=node,
        message_type=MessageType.QUERY,
        group_id="query",
        ttl=settings.connect_timeout_s + 60,
    )


def _read_query_reply(msg: Message) -> _QueryReply:
    """A node's QUERY reply; ValueError with the reason when it cannot be read."""
    try:
        rec = dict(msg.content.config_records["node"])
        client = ClientInfo(int(rec["partition-id"]), int(rec["rank"]), int(rec["num-examples"]))
        node_shapes = {k: (int(v[0]), int(v[1])) for k, v in json.loads(str(rec["shapes"])).items()}
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"malformed reply ({exc!r})") from None
    return _QueryReply(client, node_shapes, rec)


def _check_joins(reply: _QueryReply, node_of: dict[int, int], shapes: dict[str, tuple[int, int]] | None) -> None:
    """ValueError with the reason when a readable reply cannot join the nodes already accepted."""
    if reply.client.cid in node_of:
        raise ValueError(f"partition {reply.client.cid} is already served by node {node_of[reply.client.cid]}")
    if shapes is not None and reply.shapes != shapes:
        raise ValueError("its LoRA layer shapes differ from the other nodes'")


def _node_info(node: int, reply: _QueryReply) -> dict[str, Any]:
    rec = reply.record
    return {
        "node_id": node,
        "rank": reply.client.rank,
        "num_examples": reply.client.num_examples,
        "prepare_s": float(rec.get("prepare-s", 0.0)),
        "process_age_s": float(rec.get("process-age-s", -1.0)),
        "torch_threads": int(rec.get("torch-threads", 0)),
        "label": str(rec.get("label", "")),
        **({"precision": str(rec["precision"])} if "precision" in rec else {}),
    }
