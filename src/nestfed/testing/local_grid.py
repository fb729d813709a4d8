"""An in-process Flower grid: the ServerApp and ClientApps of one experiment in one process.

``LocalGrid`` implements flwr's ``Grid`` by calling ClientApp objects directly (one ``Context``
per simulated node, its own ``node_config``), in the order messages were pushed. It runs the
exact code paths of the deployed apps (records, handlers, validation, aggregation) without a
SuperLink, SuperNodes, process starts or polling: the fast test of the apps' logic, and the
"no transport" baseline of ``bench/perf/flower_vs_embedded.py``. ``fail`` lets a test make a node
answer with an error or not at all.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid


def _delivered(msg: Message) -> Message:
    """The message as a node receives it: its own metadata and config records (a mod such as
    Flower's ``secaggplus_mod`` edits them in place; the sender's copy must not change)."""
    content = RecordDict(
        {name: ConfigRecord(dict(rec)) if isinstance(rec, ConfigRecord) else rec for name, rec in msg.content.items()}
    )
    return Message(metadata=copy.copy(msg.metadata), content=content)


class LocalGrid(Grid):
    """A Grid whose nodes are ClientApp calls in this process.

    Args:
        client_app: the ClientApp every node runs.
        nodes: {node_id: node_config}.
        fail: fail(node_id, message) gives None (answer normally), ``"error"`` (answer with an error
            reply) or ``"silent"`` (never answer); None: every node answers normally.
        run_config: the run config every node's Context holds (default: empty).
    """

    def __init__(
        self,
        client_app: ClientApp,
        nodes: dict[int, dict[str, Any]],
        fail: Callable[[int, Message], str | None] | None = None,
        run_config: dict[str, Any] | None = None,
    ):
        self.client_app = client_app
        self.nodes = dict(nodes)
        self.fail = fail
        self._run = None
        self._replies: dict[str, Message] = {}
        self._contexts = {
            n: Context(
                run_id=1, node_id=n, node_config=dict(cfg), state=RecordDict(), run_config=dict(run_config or {})
            )
            for n, cfg in self.nodes.items()
        }
        self.pushed: list[Message] = []
        # Messages take their run, source node and task ids from the process's task identity,
        # which Flower's runtime sets in a deployed ServerApp process; set it here when unset.
        from flwr.supercore.task_identity import TaskIdentity

        for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
            if getattr(TaskIdentity, attr) is None:
                setattr(TaskIdentity, attr, value)

    def set_run(self, run) -> None:  # noqa: ANN001 - flwr's Run
        """Record the run the ServerApp drives.

        Args:
            run: flwr's Run.
        """
        self._run = run

    @property
    def run(self):  # noqa: ANN201
        return self._run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        """Build a message for one node.

        Args:
            content: the message's records.
            message_type: e.g. ``train`` or ``evaluate``.
            dst_node_id: the receiving node.
            group_id: the message's group (the round).
            ttl: its time to live in seconds; None for flwr's default.

        Returns:
            The message.
        """
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        """List the nodes.

        Returns:
            The node ids.
        """
        return list(self.nodes)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Deliver each message to its node's ClientApp at once and keep the reply for a pull.

        A node's exception becomes an error reply (``CLIENT_APP_RAISED_EXCEPTION``), as in a
        deployed runtime; ``fail`` may turn a reply into an error or drop it.

        Args:
            messages: the messages, in the order they are delivered.

        Returns:
            The messages' ids.
        """
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = msg.object_id
            mid = msg.metadata.message_id
            ids.append(mid)
            self.pushed.append(msg)
            node = msg.metadata.dst_node_id
            mode = self.fail(node, msg) if self.fail is not None else None
            if mode == "silent":
                continue
            if mode == "error":
                reply = Message(Error(code=0, reason="simulated failure"), reply_to=msg)
            else:
                try:  # a copy, as a wire would deliver: a node's mods may change what they receive
                    reply = self.client_app(message=_delivered(msg), context=self._contexts[node])
                except Exception as exc:  # noqa: BLE001 - what the deployed runtime does too
                    reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=repr(exc)), reply_to=msg)
            self._replies[mid] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Take the replies that have arrived (each is given once).

        Args:
            message_ids: the ids of pushed messages.

        Returns:
            The replies to those of them that were answered.
        """
        return [self._replies.pop(mid) for mid in list(message_ids) if mid in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push the messages and pull their replies (a silent node's is missing).

        Args:
            messages: the messages.
            timeout: unused: every reply arrives during the push.

        Returns:
            The replies.
        """
        return self.pull_messages(list(self.push_messages(messages)))
