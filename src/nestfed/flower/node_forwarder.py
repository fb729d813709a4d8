"""The FAB's ClientApp: a thin forwarder to a long-running worker beside the SuperNode.

flwr 1.42 runs every message in a fresh ClientApp process. This module imports only the
standard library and flwr (under a second, against about six for torch, transformers and the
nestfed client), and hands each message with its Context to the node's worker
(nestfed.flower.worker), which keeps the backbone, the prepared data and the trainer between
messages; the worker is started on the first message and leaves after ``worker-idle-s``
seconds without one. The reply comes back as the real ClientApp (nestfed.flower.client_app.app)
made it; the Context's state (what a client keeps between rounds) is put back into this
process's Context for the SuperNode to store, exactly as when the ClientApp ran here.

Node config (``flower-supernode --node-config``), besides the client's own keys
(nestfed.flower.client_app):

- ``worker-dir``: where the node's worker socket and log live (default: the environment's
  ``NESTFED_WORKER_DIR``, else ``$TMPDIR/nestfed-workers-<uid>``; created 0700, refused when
  another user owns it or others can enter it; a socket path holds at most 107 bytes);
- ``worker-idle-s``: seconds a worker waits for the next message before it exits (default 900);
- ``worker-start-s``: seconds to wait for a new worker to listen (default 300).

A TRAIN reply's ``process_age_s`` metric is replaced by this process's age, so that it keeps
meaning the start-up cost of the process that received the message.

On Flower's simulation engine the ClientApp runs inside Ray's actors, which already live across
messages and serve many virtual SuperNodes each: there the message goes to the real ClientApp in
the actor's own process (one backbone and one bounded pool of clients per actor,
nestfed.flower.client_app.NodeHost), since a worker per virtual node would hold a backbone per
node and multiply the memory by the population.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.common import serde
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

from nestfed.flower.framing import process_age_s, receive, send


def worker_dir(node_config: dict[str, Any]) -> Path:
    """The node's worker directory, created 0700.

    Args:
        node_config: the node config; ``worker-dir`` (default: ``NESTFED_WORKER_DIR``, else
            ``$TMPDIR/nestfed-workers-<uid>``).

    Returns:
        The directory's path.

    Raises:
        PermissionError: when it belongs to another user or others may enter it.
    """
    value = str(node_config.get("worker-dir", "") or os.environ.get("NESTFED_WORKER_DIR", ""))
    path = Path(value) if value else Path(tempfile.gettempdir()) / f"nestfed-workers-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"node config worker-dir: {path} must belong to this user with mode 0700 "
            f"(owner uid {st.st_uid}, mode {oct(st.st_mode & 0o777)})"
        )
    return path


def _connect(path: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
        return conn
    except OSError:
        conn.close()
        return None


def connect_worker(node_id: int, node_config: dict[str, Any]) -> socket.socket:
    """A connection to this node's worker, starting one when none listens.

    Args:
        node_id: the SuperNode's id (the socket is ``<worker-dir>/n<node_id>.sock``).
        node_config: the node config (``worker-dir``, ``worker-idle-s``, ``worker-start-s``).

    Returns:
        The connected Unix socket.

    Raises:
        RuntimeError: when the socket path exceeds 107 bytes, or a new worker exits (with the end of
            its log) or does not listen within ``worker-start-s`` seconds.
        PermissionError: when the worker directory is refused (`worker_dir`).
    """
    folder = worker_dir(node_config)
    path = folder / f"n{node_id}.sock"
    if len(os.fsencode(path)) > 107:
        raise RuntimeError(
            f"node config worker-dir: the socket path {path} is longer than a Unix socket's 107 bytes; "
            "give a shorter worker-dir"
        )
    conn = _connect(path)
    if conn is not None:
        return conn
    log = folder / f"n{node_id}.log"
    idle = str(float(node_config.get("worker-idle-s", 900)))
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nestfed.flower.worker", "--socket", str(path), "--idle-s", idle],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    deadline = time.monotonic() + float(node_config.get("worker-start-s", 300))
    while time.monotonic() < deadline:
        conn = _connect(path)
        if conn is not None:
            return conn
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the nestfed worker for node {node_id} exited with code {proc.returncode}:\n{tail}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(
        f"the nestfed worker for node {node_id} did not listen on {path} within "
        f"{node_config.get('worker-start-s', 300)} s (log: {log})"
    )


def in_ray_actor() -> bool:
    """Whether this process is one of Ray's workers (the simulation engine's actors).

    A SuperNode's ClientApp process never imports Ray.

    Returns:
        True when Ray is imported and connected.
    """
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def forward(msg: Message, context: Context) -> Message:
    """Run a message through the node's worker; put the returned state into ``context``.

    In a Ray actor the message goes through the real ClientApp in this process instead.

    Args:
        msg: the message from the SuperNode.
        context: the ClientApp's Context; its ``state`` is replaced by the worker's.

    Returns:
        The reply the real ClientApp made (a TRAIN reply's ``process_age_s``: this process's age).

    Raises:
        RuntimeError: with the worker's error (its type, message and traceback) when the ClientApp
            raised there, or when the connection failed twice.
    """
    if in_ray_actor():
        from nestfed.flower.client_app import app as client_app  # the actor lives across messages: load once

        return client_app(msg, context)
    entered = process_age_s()
    payload = [serde.message_to_proto(msg).SerializeToString(), serde.context_to_proto(context).SerializeToString()]
    for attempt in (1, 2):  # once more with a fresh worker: this one may have left on its idle time as we connected
        try:
            with connect_worker(context.node_id, dict(context.node_config)) as conn:
                send(conn, payload)
                answer = receive(conn)
            break
        except (ConnectionError, BrokenPipeError) as exc:
            if attempt == 2:
                raise RuntimeError(
                    f"nestfed worker for node {context.node_id}: the connection failed twice ({exc})"
                ) from exc
    if answer[0] != b"ok":
        raise RuntimeError(f"nestfed worker: {answer[1].decode(errors='replace')}")
    reply = serde.message_from_proto(ProtoMessage.FromString(answer[1]))
    context.state = serde.recorddict_from_proto(ProtoRecordDict.FromString(answer[2]))
    if reply.has_content() and "metrics" in reply.content.metric_records:
        metrics = reply.content.metric_records["metrics"]
        if "process_age_s" in metrics:
            metrics["process_age_s"] = entered
    return reply


app = ClientApp()
app.query()(forward)
app.train()(forward)
app.evaluate()(forward)
