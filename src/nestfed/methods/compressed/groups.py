"""Clients that run different models: route each client to the trainer of its model group.

Compressed clients hold one model per compression ratio (a group); each group's trainer trains
that group's model. The transport sees one trainer; `GroupedTrainer` dispatches by client
id and merges the groups' kept client state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nestfed.federation.in_process import Trainer
from nestfed.federation.messages import Arrays, Instruction, Reply
from nestfed.federation.run_dir import ClientState


@dataclass
class GroupedTrainer:
    """One trainer per model group, dispatching by client id.

    Attributes:
        trainers: {group: Trainer}.
        group_of: {cid: group}.
        initial: {group: payload} loaded when an evaluation receives an empty payload (round 0: each
            group's initial model, e.g. its cores diag(S)), so a group model left trained by an
            earlier run is never evaluated as "initial".

    Raises:
        KeyError: naming the client when it has no group.
    """

    trainers: dict[int, Trainer]
    group_of: dict[int, int]
    initial: dict[int, Arrays] = field(default_factory=dict)

    def _group(self, cid: int) -> int:
        if cid not in self.group_of:
            raise KeyError(f"client {cid}: no model group assigned")
        return self.group_of[cid]

    @property
    def client_state(self) -> ClientState:
        """Every group's clients' kept state, merged ({cid: {group name: arrays}})."""
        out: ClientState = {}
        for t in self.trainers.values():
            out.update(t.client_state)
        return out

    @client_state.setter
    def client_state(self, state: ClientState) -> None:
        for g, t in self.trainers.items():
            t.client_state = {cid: s for cid, s in state.items() if self.group_of.get(cid) == g}

    def trainer_for(self, cid: int) -> Trainer:
        """The trainer of a client's model group (its model, data and hooks).

        Args:
            cid: the client.

        Returns:
            The group's trainer.

        Raises:
            KeyError: naming the client when it has no group.
        """
        return self.trainers[self._group(cid)]

    def fit(self, cid: int, instruction: Instruction) -> Reply:
        """Train a client on its group's model.

        Args:
            cid: the client.
            instruction: the round's instruction.

        Returns:
            The client's reply.
        """
        return self.trainers[self._group(cid)].fit(cid, instruction)

    def evaluate_as_sent(self, cid: int, arrays: Arrays, scaling: float) -> dict[str, float]:
        """Refused: these clients run compressed models, and no global adapter is sent to evaluate as it is.

        The method does not declare ``EXPORT_AT_RANK``.

        Args:
            cid: the client.
            arrays: the arrays.
            scaling: the LoRA scale.

        Returns:
            Never: it always raises.

        Raises:
            TypeError: always.
        """
        raise TypeError("compressed clients have no global adapter to evaluate as sent")

    def evaluate(self, cid: int, arrays: Arrays, scaling: float) -> dict[str, float]:
        """Held-out metrics of a client on its group's model.

        Args:
            cid: the client.
            arrays: the payload; empty = the group's initial model.
            scaling: the LoRA scale.

        Returns:
            The held-out metrics.
        """
        g = self._group(cid)
        if not arrays:
            arrays = self.initial.get(g, {})
        return self.trainers[g].evaluate(cid, arrays, scaling)
