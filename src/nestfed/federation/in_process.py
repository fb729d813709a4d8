"""The embedded transport: clients run one after another in this process.

Every payload is serialised and read back in both directions (nestfed.federation.payload), so
the bytes counted are the bytes a wire would carry and a client never shares a tensor with the
server.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from nestfed.config.capabilities import Capability
from nestfed.federation.messages import Arrays, Instruction, Reply
from nestfed.federation.payload import decode, encode
from nestfed.federation.run_dir import KEPT, ClientState
from nestfed.federation.transport import FitResults


class Trainer(Protocol):
    """The client side of an embedded run.

    nestfed.federation.client.ClientTrainer, or a method's own (clients of several model groups,
    knowledge-distilling clients).

    Attributes:
        client_state: {cid: {group: arrays}} the clients keep between rounds.
    """

    client_state: ClientState

    def fit(self, cid: int, instruction: Instruction) -> Reply:
        """Train a client from an instruction.

        Args:
            cid: the client's id.
            instruction: the arrays and config the server sent.

        Returns:
            The client's reply (trained arrays, example count, metrics).
        """

    def evaluate(self, cid: int, arrays: Arrays, scaling: float) -> dict[str, float]:
        """Evaluate a client's model on its held-out data, as the client runs the arrays.

        Args:
            cid: the client's id.
            arrays: the arrays to evaluate (the client's kept state mixed in).
            scaling: the LoRA scale.

        Returns:
            The held-out metrics.
        """

    def evaluate_as_sent(self, cid: int, arrays: Arrays, scaling: float) -> dict[str, float]:
        """Evaluate ``arrays`` exactly as given on a client's held-out data.

        Args:
            cid: the client's id.
            arrays: the arrays to evaluate (without the client's kept state).
            scaling: the LoRA scale.

        Returns:
            The held-out metrics.
        """


@dataclass
class InProcessTransport:
    """Deliver instructions to a trainer in client-id order, and evaluate every client in process.

    Attributes:
        trainer: the clients' trainer.
        client_state_home: where the clients' kept state lives: run_dir.KEPT, checkpointed with
            the round.
        asks: what the transport asks of the method: nothing beyond the config, in process.
    """

    trainer: Trainer
    client_state_home: ClassVar[str] = KEPT  # the clients' kept state is checkpointed with the round
    asks: ClassVar[Mapping[Capability, str]] = {}  # in process: nothing beyond the config

    def open(self) -> dict[str, Any]:
        """Nothing to add to the round-0 line."""
        return {}

    def fit(
        self, rnd: int, instructions: dict[int, Instruction], on_reply: Callable[[int, Reply], None] | None = None
    ) -> FitResults:
        """Train each client in turn on what crossed the (simulated) wire; each reply crosses it back."""
        out = FitResults()
        for cid, ins in instructions.items():
            sent = Instruction(decode(encode(ins.arrays)), dict(ins.config))
            reply = self.trainer.fit(cid, sent)
            back = Reply(decode(encode(reply.arrays)), reply.num_examples, reply.metrics)
            if on_reply is None:
                out.replies[cid] = back
            else:
                on_reply(cid, back)
        return out

    def evaluate(
        self, rnd: int, deployments: Mapping[int, tuple[Arrays, float]], as_sent: bool = False
    ) -> dict[str, dict[str, float]]:
        """Evaluate each listed client under its deployment, in this process, one at a time."""
        run = self.trainer.evaluate_as_sent if as_sent else self.trainer.evaluate
        out = {}
        for cid in deployments:
            arrays, scale = deployments[cid]
            out[str(cid)] = run(cid, arrays, scale)
        return out

    def client_state(self) -> ClientState:
        """The trainer's kept client state (checkpointed with the round)."""
        return self.trainer.client_state

    def restore_client_state(self, state: ClientState | None) -> None:
        """Hand a resumed checkpoint's client state back to the trainer."""
        self.trainer.client_state = state or {}
