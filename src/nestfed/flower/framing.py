"""What the FAB's ClientApp (nestfed.flower.node_forwarder) and the node's worker
(nestfed.flower.worker) share, with the standard library only: the framing of their Unix-socket
requests and answers, and a process's age (how a reply reports the start-up cost of the process
that received its message)."""

from __future__ import annotations

import os
import socket
import struct

HEADER = struct.Struct(">Q")  # a count or a length, as nestfed.flower.worker frames requests and answers


def process_age_s() -> float:
    """Seconds since this process started, read from Linux /proc.

    Returns:
        The process's age in seconds, or -1.0 where unknown.
    """
    try:
        start_ticks = int(open(f"/proc/{os.getpid()}/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return -1.0


def send(conn: socket.socket, parts: list[bytes]) -> None:
    """Send byte strings: their count, then each length-prefixed (8 bytes, big-endian).

    Args:
        conn: the connected socket.
        parts: the byte strings, in order.
    """
    conn.sendall(HEADER.pack(len(parts)) + b"".join(HEADER.pack(len(p)) + p for p in parts))


def receive(conn: socket.socket) -> list[bytes]:
    """Receive what `send` sent.

    Args:
        conn: the connected socket.

    Returns:
        The byte strings, in the order sent.

    Raises:
        ConnectionError: when the peer closes the connection mid-message.
    """

    def exactly(n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = conn.recv(min(left, 1 << 20))
            if not chunk:
                raise ConnectionError("the peer closed the connection mid-message (a crashed worker: see its log)")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    (count,) = HEADER.unpack(exactly(HEADER.size))
    return [exactly(HEADER.unpack(exactly(HEADER.size))[0]) for _ in range(count)]
