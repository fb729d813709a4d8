"""FedMKT (Fan et al., "FedMKT: Federated Mutual Knowledge Transfer for Large and Small Language
Models", COLING 2025, section 3; docs/methods.md section 2's baseline for FedSLM).

No parameters travel: the server's LLM (here the full backbone with LoRA) and the clients' small
models (here the same SVD-compressed client models as FedSLM's groups, nestfed.methods.compressed,
trained through their cores)
exchange top-k logits on a shared public text (nestfed.methods.fedmkt.distillation). Per round t:

- configure: every client receives the server's knowledge (computed after round t - 1; in round 1
  the pretrained server's).
- client (nestfed.methods.fedmkt.clients): distils from it (DualMinCE against its own knowledge),
  trains on its private data, and replies with its knowledge on the public text. Its model stays
  on the client.
- aggregate: the server learner distils from the clients' knowledge (DualMinCE per public block
  over its own and every client's) on the public text, then computes its new knowledge.

The strategy keeps the arithmetic-free bookkeeping; the server's model work is the injected
``server`` (a `ServerLearner`), so the strategy itself stays a function of arrays.
State arrays: the server's LoRA (PEFT keys, never sent) and its knowledge (``public.*``).
"""

from __future__ import annotations

from typing import Any, Protocol

from nestfed.federation.messages import Arrays, ClientInfo, GlobalState, Instruction, Reply
from nestfed.methods.fedmkt.distillation import CE, INDICES, VALUES
from nestfed.nn.keys import rank_dim

KNOWLEDGE = (VALUES, INDICES, CE)


class ServerLearner(Protocol):
    """The server side of FedMKT: its model's knowledge and its distillation step."""

    scaling: float

    def knowledge(self, adapter: Arrays) -> Arrays:
        """The server model's knowledge on the public text under ``adapter``.

        Args:
            adapter: the server's LoRA arrays.

        Returns:
            The knowledge ({public.values, public.indices, public.ce}).
        """

    def distill(self, adapter: Arrays, teachers: list[Arrays], rnd: int) -> tuple[Arrays, dict[str, float]]:
        """Train the adapter on the public text from the teachers' knowledge.

        Args:
            adapter: the server's LoRA arrays at the round's start.
            teachers: the clients' knowledge, in client-id order.
            rnd: the round.

        Returns:
            The trained adapter and metrics.
        """


class FedMKT:
    """FedMKT's rounds around an injected `ServerLearner`.

    Args:
        server: the server's model work.
        initial_adapter: the server LoRA at round 0 (B = 0: the pretrained model).
        client_group: {cid: group} (recorded in each instruction for the client side).
        ratios: the groups' compression ratios (recorded likewise).
        seed: the federation's seed.
    """

    name = "fedmkt"

    def __init__(
        self,
        server: ServerLearner,
        initial_adapter: Arrays,
        client_group: dict[int, int],
        ratios: list[float],
        seed: int = 0,
    ):
        self.server = server
        self.initial_adapter = initial_adapter
        self.client_group = client_group
        self.ratios = ratios
        self.seed = seed

    def initialize(self, shapes: Any, clients: list[ClientInfo]) -> GlobalState:
        """The initial server adapter and its knowledge.

        Args:
            shapes: unused.
            clients: the federation's clients.

        Returns:
            The round-0 state.

        Raises:
            ValueError: for a client without a group.
        """
        for c in clients:
            if c.cid not in self.client_group:
                raise ValueError(f"client {c.cid}: no FedMKT client model (compression ratio) assigned")
        arrays = {k: v.clone() for k, v in self.initial_adapter.items()}
        arrays.update(self.server.knowledge(arrays))
        return GlobalState(arrays, {"ratios": list(self.ratios)})

    @staticmethod
    def adapter_of(state: GlobalState) -> Arrays:
        """The server LoRA held in the state (PEFT keys).

        Args:
            state: the global state.

        Returns:
            The LoRA arrays.
        """
        return {k: v for k, v in state.arrays.items() if rank_dim(k) is not None}

    def configure(self, rnd: int, state: GlobalState, clients: list[ClientInfo]) -> dict[int, Instruction]:
        """Every client receives the server's knowledge.

        Args:
            rnd: the round (1-based).
            state: the global state.
            clients: the sampled clients.

        Returns:
            {cid: instruction}.
        """
        sent = {k: state.arrays[k] for k in KNOWLEDGE}
        expect = {k: tuple(v.shape) for k, v in sent.items()}
        out = {}
        for c in clients:
            g = self.client_group[c.cid]
            config = {"scaling": 1.0, "round": rnd, "seed": self.seed, "group": g, "ratio": self.ratios[g]}
            out[c.cid] = Instruction({k: v.clone() for k, v in sent.items()}, config, dict(expect))
        return out

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """The server distils from the clients' knowledge (in client-id order) and refreshes its own.

        Args:
            rnd: the round.
            state: the global state.
            replies: {cid: reply carrying knowledge}.

        Returns:
            The new state, its meta's ``server`` the distillation's metrics.
        """
        teachers = [{k: replies[c].arrays[k] for k in KNOWLEDGE} for c in sorted(replies)]
        adapter, metrics = self.server.distill(self.adapter_of(state), teachers, rnd)
        arrays = dict(adapter)
        arrays.update(self.server.knowledge(adapter))
        meta = dict(state.meta)
        meta["server"] = metrics
        return GlobalState(arrays, meta)

    def deploy(self, state: GlobalState, cid: int | None = None) -> tuple[Arrays, float]:
        """The server's LoRA and scale; for a client, an empty payload (its model never leaves it).

        Args:
            state: the global state.
            cid: the client; None for the server.

        Returns:
            The arrays and the scale.
        """
        if cid is None:
            return self.adapter_of(state), self.server.scaling
        return {}, 1.0

    def export(self, state: GlobalState) -> tuple[Arrays, float]:
        """The server's LoRA (PEFT keys) and its scale.

        Args:
            state: the global state.

        Returns:
            The arrays and the scale.
        """
        return self.deploy(state, None)

    def export_files(self, state: GlobalState) -> dict[str, Arrays]:
        """No further files.

        Args:
            state: the global state.

        Returns:
            {}.
        """
        return {}
