"""Messages to nodes and their replies on a Flower Grid: one batch pushed and its replies pulled
(`exchange`), and the wait for the nodes a run needs (`wait_for_nodes`), which asks one
node why when fewer connect than the experiment has clients."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from nestfed.errors import NestfedError
from nestfed.flower.client_app import EXPERIMENT

#: seconds without a new node after which a short-handed wait asks one node why (wait_for_nodes)
SETTLE_S = 10.0


@dataclass
class Exchange:
    """Replies of one batch of messages and their timings.

    Attributes:
        replies: ``{node_id: Message}`` of the replies that arrived (a reply may carry an error).
        missing: the node ids without a reply (unsent ones included), sorted.
        push_s: seconds pushing the messages.
        wait_s: seconds from the push's end to the last pull.
        pull_s: seconds inside the pulls.
        received_at: ``{node_id: wall-clock time}`` each reply was pulled (``time.time()``).
        sent_at: the wall-clock time of the push (``time.time()``).
        unsent: the node ids whose message the push refused (e.g. too large), sorted.
    """

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

    Args:
        grid: the Flower Grid.
        messages: ``{node_id: Message}``, one message per node.
        timeout_s: seconds to wait for the replies, from the push's end.
        poll_s: seconds between pulls.

    Returns:
        The replies, the unanswered and unsent node ids, and the timings.
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
    return Exchange(
        replies, sorted(list(pending.values()) + unsent), push_s, wait_s, pull_s, received_at, sent_at, sorted(unsent)
    )


def experiment_record(cfg_text: str, cid: int | None = None, run_dir: str = "") -> ConfigRecord:
    """The experiment a message carries.

    Args:
        cfg_text: the experiment config's TOML text.
        cid: the client the message is for; None: no ``cid`` key.
        run_dir: the run directory ("" when none).

    Returns:
        A ``ConfigRecord`` with ``toml``, ``run-dir`` and (given a cid) ``cid``.
    """
    rec = ConfigRecord({"toml": cfg_text, "run-dir": run_dir})
    if cid is not None:
        rec["cid"] = cid
    return rec


def wait_for_nodes(grid: Grid, want: int, cfg_text: str, timeout_s: float, poll_s: float) -> list[int]:
    """The connected nodes, once ``want`` of them are (or at ``timeout_s``).

    When fewer have been connected, and none joined, for `SETTLE_S` (at most half the timeout), one
    of them is asked its settings (a QUERY of ``cfg_text``): a node refusing the experiment's client
    count (a simulation engine started with another ``num-supernodes``) stops the run at once with
    its line.

    Args:
        grid: the Flower Grid.
        want: the number of nodes the run needs (the experiment's client count).
        cfg_text: the experiment config's TOML text the probe sends; "" sends no probe.
        timeout_s: seconds to wait at most.
        poll_s: seconds between looks at the connected nodes.

    Returns:
        The connected node ids, sorted (fewer than ``want`` at the timeout).

    Raises:
        NestfedError: when the probed node refuses the experiment's client count.
    """
    start = time.perf_counter()
    deadline = start + timeout_s
    seen, changed, probed = 0, start, cfg_text == ""
    while True:
        nodes = sorted(grid.get_node_ids())
        now = time.perf_counter()
        if len(nodes) >= want or now >= deadline:
            return nodes
        if len(nodes) != seen:
            seen, changed = len(nodes), now
        elif nodes and not probed and now - changed >= min(SETTLE_S, timeout_s / 2):
            probed = True
            _probe(grid, nodes[0], want, len(nodes), cfg_text, timeout_s, poll_s)
        time.sleep(poll_s)


def _probe(grid: Grid, node: int, want: int, have: int, cfg_text: str, timeout_s: float, poll_s: float) -> None:
    """QUERY one node; raise NestfedError when it refuses the experiment's client count."""
    msg = Message(
        RecordDict({EXPERIMENT: experiment_record(cfg_text)}),
        dst_node_id=node,
        message_type=MessageType.QUERY,
        group_id="probe",
        ttl=timeout_s + 60,
    )
    reply = exchange(grid, {node: msg}, timeout_s, poll_s).replies.get(node)
    if reply is not None and reply.has_error() and "num-partitions" in reply.error.reason:
        raise NestfedError(
            f"{have} nodes connected for data.num_clients = {want}, and node {node} says: "
            f"{reply.error.reason.strip().splitlines()[-1]}; start {want} SuperNodes (simulation: "
            f"--federation-config 'num-supernodes={want}') or set data.num_clients to their number"
        )
