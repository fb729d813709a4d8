"""A long-running process beside a SuperNode that keeps the node's client between messages.

flwr 1.42 starts a fresh ClientApp process for every message; importing torch, transformers and
nestfed and rebuilding the backbone cost seconds to tens of seconds per message (most of a
deployment round on a small model). The FAB's ClientApp is therefore a thin forwarder
(nestfed.flower.node_forwarder, flwr and the standard library only) that hands each message and
its Context to this worker over a Unix socket; the worker runs the real ClientApp
(nestfed.flower.client_app.app, mods included) on them in one process that lives across
messages, so its backbone, prepared data and trainer are built once per run, and sends back the
reply and the Context's state, which the forwarder puts back for the SuperNode to keep.

Protocol: one request per connection, each side sends a list of byte strings (a count, then
each length-prefixed, 8 bytes big-endian): the request is the message and the Context as
Flower's own protobufs (flwr.common.serde), the answer ``b"ok"``, the reply message and the
Context's state (protobufs), or ``b"error"`` and a text. The socket lives in a directory only its
user can enter (0700).

``python -m nestfed.flower.worker --socket PATH [--idle-s S]`` serves until ``S`` seconds pass
without a request (default 900), then removes its socket and exits; the next message starts a
new worker (which rebuilds once).
"""

from __future__ import annotations

import argparse
import os
import socket
import time
import traceback
from pathlib import Path

from flwr.common import serde
from flwr.proto.message_pb2 import Context as ProtoContext
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.supercore.task_identity import TaskIdentity
from google.protobuf.message import DecodeError

from nestfed.flower.client_app import app
from nestfed.flower.framing import receive, send


def handle(conn: socket.socket) -> None:
    """Serve one request: run the ClientApp on (message, context); answer the reply and the state.

    An exception of the ClientApp is answered as ``b"error"`` and its text, not raised.

    Args:
        conn: the accepted connection (the protocol: the module docstring).
    """
    raw_message, raw_context = receive(conn)
    message = serde.message_from_proto(ProtoMessage.FromString(raw_message))
    context = serde.context_from_proto(ProtoContext.FromString(raw_context))
    meta = message.metadata
    TaskIdentity.run_id, TaskIdentity.node_id = meta.run_id, meta.dst_node_id
    TaskIdentity.task_id = meta.dst_task_id
    try:
        reply = app(message, context)
    except Exception as exc:  # noqa: BLE001 - the forwarder re-raises it in the ClientApp process
        send(conn, [b"error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}".encode()])
        return
    send(
        conn,
        [
            b"ok",
            serde.message_to_proto(reply).SerializeToString(),
            serde.recorddict_to_proto(context.state).SerializeToString(),
        ],
    )


def serve(path: Path, idle_s: float) -> None:
    """Listen on a Unix socket and serve requests one at a time until idle, then remove the socket.

    Serving also stops when the socket file is replaced or removed (another worker took over).

    Args:
        path: the socket's path (a stale socket there is replaced); its folder is created 0700.
        idle_s: seconds without a request after which it stops.

    Raises:
        OSError: when the socket cannot be bound (another worker owns it).
    """
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(tmp))
    os.chmod(tmp, 0o600)
    srv.listen(8)
    os.replace(tmp, path)  # appears only once it accepts connections
    ours = os.stat(path).st_ino
    srv.settimeout(1.0)
    last = time.monotonic()
    try:
        while time.monotonic() - last < idle_s:
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                if not _still_ours(path, ours):  # replaced or removed: another worker took over
                    return
                continue
            with conn:
                conn.settimeout(None)
                try:
                    handle(conn)
                except (ConnectionError, DecodeError):
                    pass  # the forwarder went away; it reports its own error
            last = time.monotonic()
    finally:
        srv.close()
        if _still_ours(path, ours):
            path.unlink(missing_ok=True)


def _still_ours(path: Path, inode: int) -> bool:
    """Whether the socket file at ``path`` is still the one this worker bound."""
    try:
        return os.stat(path).st_ino == inode
    except OSError:
        return False


def main() -> None:
    """Command line: ``python -m nestfed.flower.worker --socket PATH [--idle-s S]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True, type=Path)
    parser.add_argument("--idle-s", type=float, default=900.0)
    args = parser.parse_args()
    serve(args.socket, args.idle_s)


if __name__ == "__main__":
    main()
