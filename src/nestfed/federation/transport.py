"""How instructions reach clients and replies come back: the ``Transport`` the round loop talks to
(nestfed.federation.loop), and what it brings back from a round (``FitResults``).

Two transports implement it: in process (nestfed.federation.in_process.InProcessTransport) and
Flower messages (nestfed.flower.transport.FlowerTransport). The loop never talks to a client
directly, like Flower's ``Strategy.start(grid)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from nestfed.config.capabilities import Capability
from nestfed.federation.messages import Arrays, Instruction, Reply, SecureSum
from nestfed.federation.run_files import ClientState


@dataclass
class FitResults:
    """What a transport brings back from one round's instructions.

    Attributes:
        replies: {cid: Reply} as received (decoded) and not yet handed to ``on_reply``; a transport
            given an ``on_reply`` hands each reply over as it arrives and keeps none.
        dropped: {cid: reason} for the clients that gave no usable reply.
        info: {cid: transport fields for the metrics line (bytes on the wire, node id, timings)}.
        round_info: the transport's fields for the round's line.
        secure: under secure aggregation, the sums that came back instead of replies; else None.
    """

    replies: dict[int, Reply] = field(default_factory=dict)
    dropped: dict[int, str] = field(default_factory=dict)
    info: dict[int, dict[str, Any]] = field(default_factory=dict)
    round_info: dict[str, Any] = field(default_factory=dict)
    secure: SecureSum | None = None


class Transport(Protocol):
    """How instructions reach clients and replies come back (in process, or Flower messages).

    Attributes:
        client_state_home: where the clients' kept state lives: run_dir.KEPT in the checkpoints,
            as ``client_state`` gives it; run_dir.ON_NODES on the nodes, which keep it themselves.
        asks: what the transport asks of the method, {capability: the setting that asks}
            (nestfed.config.capabilities: e.g. Flower and its secure aggregation), refused by the
            loop unless the method declares it.
    """

    client_state_home: str
    asks: Mapping[Capability, str]

    def open(self) -> dict[str, Any]:
        """Open the transport for round 0.

        Returns:
            Fields for the round-0 metrics line (e.g. the nodes that answered); {} for none.
        """

    def fit(
        self, rnd: int, instructions: dict[int, Instruction], on_reply: Callable[[int, Reply], None] | None = None
    ) -> FitResults:
        """Deliver one instruction per client and bring the replies back.

        Args:
            rnd: the round, from 1.
            instructions: {cid: instruction} of the clients to train this round.
            on_reply: called as ``on_reply(cid, reply)`` with each reply as it arrives (the
                transport then keeps it no longer); None collects the replies instead.

        Returns:
            The round's results: the replies in ``FitResults.replies`` when ``on_reply`` is None,
            the clients dropped with their reasons, the transport's fields for the metrics line.
        """

    def evaluate(
        self, rnd: int, deployments: Mapping[int, tuple[Arrays, float]], as_sent: bool = False
    ) -> dict[str, dict[str, float]] | None:
        """Measure each listed client's held-out metrics under its deployment.

        Args:
            rnd: the round (0: the initial state).
            deployments: {cid: (arrays, scale s)} of the clients to evaluate, each computed as it
                is read (``Deployments``).
            as_sent: evaluate the arrays exactly as sent (a global adapter measured on the
                client's data: the mechanism reports); False evaluates them as the client runs
                them, its kept state mixed in by its hooks.

        Returns:
            {str(cid): held-out metrics}; None when this transport does not evaluate.
        """

    def client_state(self) -> ClientState | None:
        """The clients' kept state to checkpoint.

        Returns:
            {cid: {group: arrays}}; None when the clients keep it themselves.
        """

    def restore_client_state(self, state: ClientState | None) -> None:
        """Give the clients the kept state of a resumed checkpoint.

        Args:
            state: the checkpoint's kept client state; None when it has none.
        """
