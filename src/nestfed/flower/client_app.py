"""The nestfed ClientApp: one partition per SuperNode, the method's client (its ClientTrainer and hooks).

The node config (``flower-supernode --node-config``) names the node's partition:

- ``partition-id`` (required): the nestfed client id this node trains (0-based);
- ``num-partitions`` (optional): checked against the experiment's ``data.num_clients``;
- ``rank`` (optional): the node's LoRA rank r_k; default: the experiment's rank of that client;
- ``threads`` (optional): torch threads, when the experiment's ``train.threads`` is 0;
- ``client-cache`` (optional): where the node keeps its prepared data between ClientApp processes
  (default ``~/.cache/nestfed/clients``; ``off``: rebuild in every process);
- ``client-state`` (optional): where the node keeps its clients' state between rounds (default
  ``~/.cache/nestfed/client-state``; nestfed.flower.node_state);
- ``device`` / ``dtype`` (optional): where this node's client runs (``cpu``, ``cuda``, ``cuda:N``,
  ``auto``) and its frozen weights' dtype, replacing the experiment's ``model.device`` /
  ``model.dtype`` on this node only (nestfed.nn.placement): each SuperNode names its own GPU.

Every message carries the resolved experiment config (TOML text, ``experiment`` record), so
server and nodes always agree on it; each node rebuilds its backbone and its own client data
from it (base weights and data must already be on the node: only adapters travel). One process
builds one `NodeHost` per experiment: the backbone with the method's setup, its trainer and
a pool of the clients' data (nestfed.data.client_pool), shared by every partition the process
serves: a Ray actor of the simulation engine serves many virtual SuperNodes with one backbone, its
memory bounded by ``train.client_memory_mb``, not by the population. A client's data are built at
its first TRAIN or EVALUATE (a QUERY only registers n_k) and kept on the node's disk
(``client-cache``, nestfed.data.client_cache), so a later process loads them instead of
partitioning, tokenising and running the frozen prefix again.

What a client keeps between rounds (``ClientTrainer.client_state``: FedNL's own LoRA when only
the rules travel, FedALA's weights and local model) lives on the node's disk, one file per client
and round under the node config's ``client-state`` folder (default ``~/.cache/nestfed/client-state``;
nestfed.flower.node_state): restored before every TRAIN and EVALUATE, written after every TRAIN,
keyed by the server's run directory. So a fresh process per message trains exactly as the embedded
runner's one process does, and a run resumed after a crash of the SuperLink, the ServerApp or the
SuperNode itself continues from the state of the round it resumes from (tested).

Messages:

- QUERY -> ``node`` ConfigRecord: partition-id, rank, precision (with ``population.precisions``:
  the backbone precision its tier holds, chosen from the client's memory budget by the same
  deterministic draw as the embedded runner; the node trains and evaluates on that backbone),
  num-examples, base-model, shapes (JSON ``{module: [out, in]}``), prepare-s, process-age-s;
  and, for a method whose setup gives them, ``initial-arrays`` (an ArrayRecord the server's
  strategy starts from: FedNL's fresh memory rules).
- TRAIN (``arrays`` + ``config`` = one nestfed Instruction) -> ``arrays`` + ``metrics``
  (the Reply of ``ClientTrainer.fit``; timings added as metrics).
- EVALUATE (``arrays`` + ``config`` with ``scaling``) -> ``metrics`` (``ClientTrainer.evaluate``).
- TRAIN carrying SecAgg+ configs (secure aggregation): Flower's ``secaggplus_mod`` answers the
  protocol's stages; in its collect stage the handler trains, validates and clips its own update and
  replies with the encoded vectors (`handle_secure_train`, nestfed.flower.secure).
"""

from __future__ import annotations

import hashlib
import json
import time
import tomllib
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from nestfed import methods
from nestfed.config import ExperimentConfig, check_rank, r_max
from nestfed.config.schema import check_core
from nestfed.errors import ConfigError
from nestfed.experiments.prepare import install_stream_modules, prepare
from nestfed.federation.client import ClientTrainer
from nestfed.federation.messages import Instruction
from nestfed.federation.prepared import Prepared
from nestfed.federation.secure_sum import encode
from nestfed.flower.framing import process_age_s
from nestfed.flower.node_state import NodeStateStore
from nestfed.flower.records import arrays_to_record, record_to_arrays, record_to_config, reply_to_content
from nestfed.flower.secure import fit_reply, is_secure, read_fit_instruction, secure_mod
from nestfed.nn.backbone import default_cache_dir

EXPERIMENT = "experiment"  # ConfigRecord: "toml" (the resolved experiment), "run-dir" and, for TRAIN, "cid"
INITIAL_ARRAYS = "initial-arrays"  # ArrayRecord in the QUERY reply (e.g. FedNL's fresh memory rules)
# Timings a TRAIN reply carries as metrics (handle_train); the ServerApp moves them to the metrics line.
TRANSPORT_METRICS = (
    "encode_s",
    "decode_s",
    "prepare_s",
    "process_age_s",
    "handler_entered_at",
    "delivery_s",
    "client_state_arrays",
    "client_state_round",
)


@dataclass
class NodeHost:
    """What one process builds for one experiment (config text, device, dtype).

    Shared by every partition the process serves.

    Attributes:
        prep: the prepared backbone and client pool.
        trainer: the method's client trainer (its setup and hooks installed).
        initial_arrays: ``{name: tensor}`` the server's strategy starts from (FedNL's fresh memory
            rules); empty for most methods.
        prepare_s: seconds building it took.
    """

    prep: Prepared
    trainer: ClientTrainer
    initial_arrays: dict[str, torch.Tensor]
    prepare_s: float


@dataclass
class NodeClient:
    """One partition as a node serves it: its host's trainer and what it reports in QUERY.

    Attributes:
        cfg: the experiment config, with this node's placement (`node_placement`).
        cid: the nestfed client id (the node's ``partition-id``).
        rank: the node's LoRA rank r_k (node config ``rank``, else the experiment's).
        trainer: the host's shared client trainer.
        shapes: ``{module: (out, in)}`` of the LoRA-adapted layers.
        base_model: the backbone's source.
        prepare_s: seconds the host took to build.
        initial_arrays: the host's initial arrays (`NodeHost`).
        built_s: seconds the latest `node_client` call spent building (0.0 when it was cached).
        host: the host it belongs to.
    """

    cfg: ExperimentConfig
    cid: int
    rank: int
    trainer: ClientTrainer
    shapes: dict[str, tuple[int, int]]
    base_model: str
    prepare_s: float
    initial_arrays: dict[str, torch.Tensor]
    built_s: float = 0.0  # seconds the latest node_client call spent building (0.0 when it was cached)
    host: NodeHost | None = None

    @property
    def num_examples(self) -> int:
        """n_k, registered without building the client's data (nestfed.data.client_pool)."""
        data = self.trainer.data
        return data.num_examples(self.cid) if hasattr(data, "num_examples") else data[self.cid].num_examples


_HOSTS: OrderedDict[tuple[str, str, str], NodeHost] = OrderedDict()
#: experiments one process keeps built (a long-lived worker or actor serving successive runs)
MAX_HOSTS = 2


def parse_experiment(text: str) -> ExperimentConfig:
    """The experiment config from its resolved TOML text (as the server sends it).

    Args:
        text: the resolved experiment config, as TOML.

    Returns:
        The experiment config.

    Raises:
        ConfigError: when the text is invalid TOML or the config is refused.
    """
    try:
        return methods.config_from_dict(tomllib.loads(text), "<experiment sent by the server>")
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"experiment sent by the server: invalid TOML: {exc}") from None


def node_settings(node_config: dict[str, Any], cfg: ExperimentConfig) -> tuple[int, int | None, int]:
    """The node's partition settings from its node config.

    Args:
        node_config: the node config (``partition-id``, ``num-partitions``, ``rank``, ``threads``).
        cfg: the experiment config they are checked against.

    Returns:
        (partition id, rank override or None, torch threads; 0: unset).

    Raises:
        ConfigError: when ``partition-id`` is missing or out of [0, num_clients), ``num-partitions``
            differs from ``data.num_clients``, or ``rank`` is out of [1, r_max].
    """
    if "partition-id" not in node_config:
        raise ConfigError("node config: 'partition-id' is missing (flower-supernode --node-config 'partition-id=0')")
    pid = node_config["partition-id"]
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < cfg.data.num_clients:
        raise ConfigError(f"node config: partition-id = {pid!r}, expected an integer in [0, {cfg.data.num_clients})")
    n = node_config.get("num-partitions")
    if n is not None and n != cfg.data.num_clients:
        raise ConfigError(
            f"node config: num-partitions = {n!r} but the experiment has data.num_clients = {cfg.data.num_clients}"
        )
    rank = node_config.get("rank")
    if rank is not None:
        check_rank(rank, r_max(cfg), "node config", ConfigError)
    threads = int(node_config.get("threads", 0) or 0)
    return pid, rank, threads


def node_placement(node_config: dict[str, Any], cfg: ExperimentConfig) -> ExperimentConfig:
    """The experiment config with this node's device and dtype.

    Args:
        node_config: the node config; its ``device`` / ``dtype`` keys replace ``model.device`` /
            ``model.dtype``.
        cfg: the experiment config.

    Returns:
        ``cfg`` with the node's placement (``cfg`` itself without those keys).

    Raises:
        ConfigError: naming the node-config key, for a value the experiment's own check refuses.
    """
    changes = {f: str(node_config[k]) for k, f in (("device", "device"), ("dtype", "dtype")) if k in node_config}
    if not changes:
        return cfg
    model = replace(cfg.model, **changes)
    try:
        check_core(replace(cfg, model=model))
    except ValueError as exc:
        raise ConfigError(f"node config: {exc}".replace("model.", "", 1)) from None
    return replace(cfg, model=model)


def client_cache_dir(node_config: dict[str, Any]) -> Path | str:
    """Where this node keeps its prepared client data between ClientApp processes.

    See nestfed.data.client_cache.

    Args:
        node_config: the node config; ``client-cache`` is a directory or ``"off"``.

    Returns:
        The directory (default ``~/.cache/nestfed/clients``, ``$XDG_CACHE_HOME`` respected), or
        ``"off"`` for none.
    """
    value = str(node_config.get("client-cache", "") or "")
    if value == "off":
        return "off"
    return Path(value) if value else default_cache_dir() / "clients"


def node_client(cfg_text: str, node_config: dict[str, Any]) -> NodeClient:
    """The (cached) NodeClient for this experiment and this node's partition.

    A process keeps at most `MAX_HOSTS` experiments built; it sets torch's threads on every call.

    Args:
        cfg_text: the resolved experiment config, as TOML.
        node_config: the node config (the module docstring).

    Returns:
        The prepared partition and the method's client side (its setup, trainer and hooks).

    Raises:
        ConfigError: when the config or node config is refused, or the method runs only embedded.
    """
    cfg = parse_experiment(cfg_text)
    method = methods.get(cfg.strategy.name)
    if not method.on_flower:
        raise ConfigError(f"strategy.name: '{method.name}' runs only embedded")
    pid, rank_override, threads = node_settings(node_config, cfg)
    cfg = node_placement(node_config, cfg)
    key = (hashlib.sha256(cfg_text.encode()).hexdigest(), cfg.model.device, cfg.model.dtype)
    if cfg.train.threads or threads:  # on every message: a process may serve several
        torch.set_num_threads(cfg.train.threads or threads)
    built = 0.0
    if key in _HOSTS:
        _HOSTS.move_to_end(key)
    else:
        t0 = time.perf_counter()
        prep = prepare(cfg, only_clients=[pid], client_cache=client_cache_dir(node_config))  # sets train.threads
        side = method.client(prep, cfg)
        install_stream_modules(prep, cfg)
        _HOSTS[key] = NodeHost(prep, side.trainer, side.initial_arrays, time.perf_counter() - t0)
        while len(_HOSTS) > MAX_HOSTS:
            _HOSTS.popitem(last=False)
        built = _HOSTS[key].prepare_s
    host = _HOSTS[key]
    rank = rank_override if rank_override is not None else host.prep.ranks[pid]
    return NodeClient(
        cfg,
        pid,
        rank,
        host.trainer,
        host.prep.shapes,
        host.prep.backbone.source,
        host.prepare_s,
        host.initial_arrays,
        built,
        host,
    )


def _experiment_text(msg: Message) -> str:
    return str(msg.content.config_records[EXPERIMENT]["toml"])


def handle_query(msg: Message, context: Context) -> Message:
    """QUERY: build (or reuse) this node's client; report its properties.

    Args:
        msg: the QUERY message (its ``experiment`` record).
        context: the ClientApp's Context (its node config).

    Returns:
        The reply: a ``node`` ConfigRecord and, when the method gives them, ``initial-arrays``.
    """
    entered = process_age_s()
    nc = node_client(_experiment_text(msg), dict(context.node_config))
    info = ConfigRecord(
        {
            "partition-id": nc.cid,
            "rank": nc.rank,
            "num-examples": nc.num_examples,
            "base-model": nc.base_model,
            "label": nc.host.prep.label(nc.cid) if nc.host is not None else "",
            "shapes": json.dumps({k: list(v) for k, v in nc.shapes.items()}),
            "prepare-s": nc.prepare_s,
            "process-age-s": entered,
            "torch-threads": torch.get_num_threads(),
        }
    )
    if nc.cfg.population.precisions and nc.host is not None:  # device tiers: the backbone this node holds
        info["precision"] = nc.host.prep.precision(nc.cid)
    content = RecordDict({"node": info})
    if nc.initial_arrays:
        content[INITIAL_ARRAYS] = arrays_to_record(nc.initial_arrays)
    return Message(content, reply_to=msg)


def client_state_store(node_config: dict[str, Any]) -> NodeStateStore:
    """Where this node keeps its clients' state between rounds.

    Args:
        node_config: the node config; ``client-state`` is a directory.

    Returns:
        The store, under ``client-state`` (default ``~/.cache/nestfed/client-state``,
        ``$XDG_CACHE_HOME`` respected).
    """
    value = str(node_config.get("client-state", "") or "")
    return NodeStateStore(Path(value).expanduser() if value else default_cache_dir() / "client-state")


def _run_dir(msg: Message) -> str:
    """The server's run directory, as the message names it (the key of the kept client state)."""
    return str(msg.content.config_records[EXPERIMENT].get("run-dir", ""))


def restore_client_state(context: Context, nc: NodeClient, run_dir: str, up_to: int) -> tuple[int, int]:
    """Put the newest state this node's client kept in a round <= ``up_to`` into its trainer.

    An empty state when there is none (its first round); see nestfed.flower.node_state. The
    returned pair is logged per client and round as ``client_state_round`` and
    ``client_state_arrays``: for FedALA or FedNL rules-only, none after the client's first round
    means the node lost its state.

    Args:
        context: the ClientApp's Context (its node config).
        nc: the node's client.
        run_dir: the server's run directory (the key of the kept state).
        up_to: the last round whose state may be restored.

    Returns:
        (the round it was written in, -1 for none; how many arrays it holds).

    Raises:
        DataError: for an unreadable state file.
    """
    rnd, state = client_state_store(dict(context.node_config)).load(run_dir, nc.cid, up_to)
    nc.trainer.client_state[nc.cid] = state.get(nc.cid, {})
    return (-1 if rnd is None else rnd), sum(len(g) for g in nc.trainer.client_state[nc.cid].values())


def store_client_state(context: Context, nc: NodeClient, run_dir: str, rnd: int) -> None:
    """Write this node's client state after its TRAIN of a round (atomically).

    Nothing is written for a client that keeps none.

    Args:
        context: the ClientApp's Context (its node config).
        nc: the node's client.
        run_dir: the server's run directory (the key of the kept state).
        rnd: the round just trained.
    """
    client_state_store(dict(context.node_config)).save(
        run_dir, nc.cid, rnd, {nc.cid: nc.trainer.client_state.get(nc.cid, {})}
    )


def release_client_state(nc: NodeClient) -> None:
    """Drop the client's state from the shared trainer once the message is answered.

    The node's disk holds it, so a process serving many virtual nodes holds one client's state at a
    time.

    Args:
        nc: the node's client.
    """
    nc.trainer.client_state.pop(nc.cid, None)


def _check_cid(msg: Message, nc: NodeClient) -> None:
    want = msg.content.config_records[EXPERIMENT].get("cid")
    if want is not None and int(want) != nc.cid:
        raise ConfigError(f"this node serves partition {nc.cid}, the message is for client {want}")


def handle_secure_train(msg: Message, context: Context) -> Message:
    """TRAIN inside SecAgg+'s collect stage (nestfed.flower.secure).

    Train as `handle_train` does, then validate and clip the update here (the server will never see
    it) and reply with its encoded vectors (nestfed.federation.secure_sum.encode) for
    ``secaggplus_mod`` to mask. A bad update raises: this node then drops out of the round's sum.

    Args:
        msg: the TRAIN message carrying SecAgg+ configs.
        context: the ClientApp's Context.

    Returns:
        The reply with the encoded vectors and the metrics (timings and the encoding's facts).

    Raises:
        ConfigError: when the message is for another client than this node's partition.
    """
    entered = process_age_s()
    fi = read_fit_instruction(msg.content)
    nc = node_client(fi.cfg_text, dict(context.node_config))
    if fi.cid != nc.cid:
        raise ConfigError(f"this node serves partition {nc.cid}, the message is for client {fi.cid}")
    rnd = int(fi.instruction.config.get("round", 0))
    state_round, restored = restore_client_state(context, nc, fi.run_dir, rnd - 1)
    try:
        reply = nc.trainer.fit(nc.cid, fi.instruction)
        store_client_state(context, nc, fi.run_dir, rnd)
    finally:
        release_client_state(nc)
    vectors, facts = encode(fi.instruction.arrays, reply.arrays, reply.num_examples, fi.layout, fi.scale, fi.clip)
    metrics = {k: float(v) for k, v in reply.metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    metrics.update(facts)
    metrics.update(
        {
            "prepare_s": nc.built_s,
            "process_age_s": entered,
            "client_state_arrays": float(restored),
            "client_state_round": float(state_round),
        }
    )
    return Message(fit_reply(vectors, metrics), reply_to=msg)


def handle_train(msg: Message, context: Context) -> Message:
    """TRAIN: ``ClientTrainer.fit`` on this node's partition; the reply carries timings as metrics.

    SecAgg+'s collect stage goes to `handle_secure_train`.

    Args:
        msg: the TRAIN message (``arrays`` + ``config``: one nestfed Instruction).
        context: the ClientApp's Context.

    Returns:
        The reply: ``arrays`` and ``metrics`` (the fit's, plus `TRANSPORT_METRICS`).

    Raises:
        ConfigError: when the message is for another client than this node's partition.
    """
    if is_secure(msg.content):
        return handle_secure_train(msg, context)
    entered = process_age_s()
    t_in = time.time()
    nc = node_client(_experiment_text(msg), dict(context.node_config))
    _check_cid(msg, nc)
    t0 = time.perf_counter()
    instruction = Instruction(
        record_to_arrays(msg.content.array_records["arrays"]), record_to_config(msg.content.config_records["config"])
    )
    decode_s = time.perf_counter() - t0
    rnd = int(instruction.config.get("round", 0))
    state_round, restored = restore_client_state(context, nc, _run_dir(msg), rnd - 1)
    try:
        reply = nc.trainer.fit(nc.cid, instruction)
        store_client_state(context, nc, _run_dir(msg), rnd)
    finally:
        release_client_state(nc)
    t1 = time.perf_counter()
    content = reply_to_content(reply)
    mr = content.metric_records["metrics"]
    mr["encode_s"] = time.perf_counter() - t1
    mr["decode_s"] = decode_s
    mr["prepare_s"] = nc.built_s  # what this message spent building the client (0 in a worker that has it)
    mr["process_age_s"] = entered
    mr["handler_entered_at"] = t_in
    mr["delivery_s"] = t_in - float(msg.metadata.created_at)
    mr["client_state_arrays"] = restored
    mr["client_state_round"] = state_round
    return Message(content, reply_to=msg)


def handle_evaluate(msg: Message, context: Context) -> Message:
    """EVALUATE: held-out metrics of this node's partition under the sent adapter.

    Measured as its client runs it (kept state restored) or, with config ``as-sent``, exactly as
    sent.

    Args:
        msg: the EVALUATE message (``arrays`` + ``config`` with ``scaling``).
        context: the ClientApp's Context.

    Returns:
        The reply: ``metrics``.

    Raises:
        ConfigError: when the message is for another client than this node's partition.
    """
    nc = node_client(_experiment_text(msg), dict(context.node_config))
    _check_cid(msg, nc)
    cfg = record_to_config(msg.content.config_records["config"])
    arrays = record_to_arrays(msg.content.array_records["arrays"]) if "arrays" in msg.content.array_records else {}
    if cfg.get("as-sent"):  # a global adapter measured as sent (the mechanism reports): no kept state
        metrics = nc.trainer.evaluate_as_sent(nc.cid, arrays, float(cfg["scaling"]))
        return Message(RecordDict({"metrics": MetricRecord({k: float(v) for k, v in metrics.items()})}), reply_to=msg)
    restore_client_state(context, nc, _run_dir(msg), int(cfg.get("round", 0)))
    try:
        metrics = nc.trainer.evaluate(nc.cid, arrays, float(cfg["scaling"]))
    finally:
        release_client_state(nc)
    return Message(RecordDict({"metrics": MetricRecord({k: float(v) for k, v in metrics.items()})}), reply_to=msg)


app = ClientApp()
app.query()(handle_query)
app.train(mods=[secure_mod])(handle_train)  # SecAgg+ only for the messages that carry its configs
app.evaluate()(handle_evaluate)

__all__ = [
    "app",
    "client_state_store",
    "handle_evaluate",
    "handle_query",
    "handle_train",
    "node_client",
    "NodeClient",
    "NodeHost",
    "release_client_state",
    "restore_client_state",
    "store_client_state",
]
