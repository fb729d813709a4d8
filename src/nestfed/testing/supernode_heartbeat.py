"""``flower-supernode`` with a shorter heartbeat, so that the SuperLink notices a killed node sooner.

Flower 1.42 fixes a SuperNode's heartbeat interval at 30 s
(``flwr.common.constant.HEARTBEAT_DEFAULT_INTERVAL``, no option) and the SuperLink marks a node
offline after two intervals without one, so a test that kills a node waits about 60 s before the
round sees it gone. This entry point sets the interval in the two modules that read it (the
SuperNode's Fleet connection, which announces it to the SuperLink, and the heartbeat sender), then
runs ``flower-supernode`` with the remaining arguments. Nothing else changes; the SuperLink checks
the interval against its own bounds (10-1800 s).

Usage::

    python -m nestfed.testing.supernode_heartbeat SECONDS [flower-supernode arguments]
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    """Run ``flower-supernode`` with the heartbeat interval argv[0] (seconds).

    Args:
        argv: the interval in seconds, then flower-supernode's arguments.

    Returns:
        flower-supernode's exit status.

    Raises:
        SystemExit: with a one-line message when the interval is missing or not an integer.
    """
    if not argv or not argv[0].isdigit():
        raise SystemExit("usage: python -m nestfed.testing.supernode_heartbeat SECONDS [flower-supernode args]")
    interval = int(argv[0])
    import flwr.supercore.heartbeat as sender
    import flwr.supernode.fleet_http_connection as connection
    from flwr.supernode.cli import flower_supernode

    connection.HEARTBEAT_DEFAULT_INTERVAL = interval
    sender.HEARTBEAT_DEFAULT_INTERVAL = interval
    sys.argv = ["flower-supernode", *argv[1:]]
    return flower_supernode() or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
