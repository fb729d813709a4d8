"""The strategy interface: configure a round per client, aggregate the replies.

A strategy is pure: it sees tensors and numbers, never data or models (docs/architecture.md).
Each LoRA method is a small subclass of :class:`LoraStrategy` that overrides one or two hooks
(Flower's shape: ``configure`` and ``aggregate`` as separate methods; nestfed.federation.loop owns
the only round loop).

Instruction config keys every LoRA strategy sends: ``rank`` (r_k), ``scaling`` (s), ``round``,
``seed`` (the federation's); a method adds its own in :meth:`LoraStrategy.client_config`, read by
its client hooks (nestfed.federation.hooks).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Protocol

from nestfed.config import check_rank
from nestfed.federation.aggregation import pad_rank, rank_prefix, truncate_rank, weighted_mean
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState, Instruction, Reply, SecureSum
from nestfed.federation.robust import Block, BlockRule
from nestfed.nn.keys import rank_dim
from nestfed.nn.lora import init_adapter_state


class Strategy(Protocol):
    """What the runners (embedded or Flower) need from a federated method."""

    name: str

    def initialize(self, shapes: dict[str, tuple[int, int]], clients: list[ClientInfo]) -> GlobalState:
        """The round-0 global state for LoRA layers of shapes {module: (out, in)}."""

    def configure(self, rnd: int, state: GlobalState, clients: list[ClientInfo]) -> dict[int, Instruction]:
        """One instruction per sampled client for round ``rnd`` (1-based)."""

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """The new global state from the validated replies of round ``rnd``."""

    def robust_aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply], rule: BlockRule) -> GlobalState:
        """The new global state with each rank block combined by ``rule`` (a robust rule or central
        DP, nestfed.federation.robust). Called only for a method that declares ROBUST_AGGREGATION
        (nestfed.config.capabilities)."""

    def aggregate_secure(self, rnd: int, state: GlobalState, secure: SecureSum) -> GlobalState:
        """The new global state rebuilt from secure sums alone (nestfed.federation.secure_sum).
        Called only for a method that declares SECURE_AGGREGATION."""

    def deploy(self, state: GlobalState, cid: int | None = None) -> tuple[Arrays, float]:
        """The adapter client ``cid`` would run (its rank prefix; None = the full global), and its scale s."""

    def export(self, state: GlobalState) -> tuple[Arrays, float]:
        """The final global adapter as PEFT LoRA arrays (one rank for all layers) and its scale s."""

    def export_files(self, state: GlobalState) -> dict[str, Arrays]:
        """Further arrays the run directory keeps, {file name: arrays} (e.g. memory rules)."""


@dataclass(frozen=True)
class LoraSettings:
    """The numbers a LoRA strategy needs: r_max, lora_alpha, the scaling convention, seeds.

    scaling ``fixed``: s = lora_alpha / r_max at every rank; ``rank``: s = lora_alpha / r_k.
    """

    r_max: int
    lora_alpha: float
    scaling: str = "fixed"
    init_seed: int = 0
    seed: int = 0

    def scale(self, rank: int) -> float:
        """The LoRA scale s used by a client of rank ``rank`` (and by the global model at r_max)."""
        if self.scaling == "fixed":
            return self.lora_alpha / self.r_max
        return self.lora_alpha / rank


class LoraStrategy:
    """Shared behaviour of strategies whose global state is one LoRA adapter of rank r_max.

    Subclasses implement :meth:`aggregate` and may override :meth:`client_config`. ``options``:
    the method's options dataclass (nestfed.methods), or None. Global state meta holds ``ranks``:
    {cid (str): current rank}.
    """

    name = "lora"

    def __init__(self, settings: LoraSettings, options: Any = None):
        self.s = settings
        self.options = options

    # -- state ---------------------------------------------------------------------------------
    def initialize(self, shapes: dict[str, tuple[int, int]], clients: list[ClientInfo]) -> GlobalState:
        for c in clients:
            check_rank(c.rank, self.s.r_max, f"client {c.cid}")
        arrays = init_adapter_state(shapes, self.s.r_max, self.s.init_seed)
        return GlobalState(arrays, {"ranks": {str(c.cid): c.rank for c in clients}})

    def rank_of(self, state: GlobalState, cid: int) -> int:
        """The client's current rank (HetLoRA may have pruned it)."""
        return int(state.meta["ranks"][str(cid)])

    # -- configure -----------------------------------------------------------------------------
    def client_config(self, rnd: int, state: GlobalState, client: ClientInfo, rank: int) -> dict[str, Any]:
        """Method-specific instruction config for one client (override to add keys)."""
        return {}

    def client_arrays(self, state: GlobalState, rank: int) -> Arrays:
        """The payload sent to a client of this rank (default: the rank prefix of the global adapter,
        as views of the state: an instruction costs no copy until it is serialised)."""
        return rank_prefix(state.arrays, rank)

    def reply_keys(self, sent: Arrays) -> list[str]:
        """Keys the client must send back (default: the LoRA matrices it trains, A and B)."""
        return [k for k in sent if rank_dim(k) is not None]

    def expected_shapes(self, sent: Arrays, rank: int) -> dict[str, tuple[int, ...]]:
        """Shapes of the reply's arrays (default: those of the sent arrays with the reply keys)."""
        return {k: tuple(sent[k].shape) for k in self.reply_keys(sent)}

    def configure(self, rnd: int, state: GlobalState, clients: list[ClientInfo]) -> dict[int, Instruction]:
        out = {}
        for c in clients:
            r = self.rank_of(state, c.cid)
            if c.round_rank:  # an elastic rank this round: the prefix of that rank (nestfed.federation.population)
                r = min(r, c.round_rank)
            sent = self.client_arrays(state, r)
            config = {"rank": r, "scaling": self.s.scale(r), "round": rnd, "seed": self.s.seed}
            config.update(self.client_config(rnd, state, c, r))
            out[c.cid] = Instruction(sent, config, self.expected_shapes(sent, r), self.may_shrink_rank)
        return out

    may_shrink_rank = False

    # -- aggregate -----------------------------------------------------------------------------
    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        raise NotImplementedError

    def aggregate_secure(self, rnd: int, state: GlobalState, secure: SecureSum) -> GlobalState:
        """Refused unless a subclass writes its rebuild from sums (and its method declares
        SECURE_AGGREGATION). Raises NotImplementedError."""
        raise NotImplementedError(f"{self.name} does not rebuild its aggregate from secure sums")

    def robust_aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply], rule: BlockRule) -> GlobalState:
        """One block of zero-padded updates, every replying client a member (ZeroPad's and HetLoRA's
        padding; at equal ranks plain FedAvg's update space).

        A reply's update is its array minus the global array's prefix of the same rank, padded with
        zeros to r_max; ``base`` is the n_k-weighted mean of the padded prefixes the clients started
        from (what ZeroPad averages besides the updates: with the ``mean`` rule this is exactly the
        padded parameter mean), the global values for arrays without a rank dimension.
        """
        new = copy_state(state)
        n = examples(replies)
        cids = sorted(replies)
        deltas: dict[int, Arrays] = {c: {} for c in cids}
        base: Arrays = {}
        for key in sorted(replies[cids[0]].arrays):
            g = state.arrays[key]
            d = rank_dim(key)
            starts = []
            for c in cids:
                v = replies[c].arrays[key]
                o = g if d is None else g.narrow(d, 0, v.shape[d])
                deltas[c][key] = (v - o) if d is None else pad_rank(v - o, d, g.shape[d])
                starts.append(o if d is None else pad_rank(o, d, g.shape[d]))
            base[key] = weighted_mean(starts, [n[c] for c in cids])
        block = Block(
            "all", deltas, n, len(state.meta.get("ranks", {})) or len(cids), base, {k: state.arrays[k] for k in base}
        )
        new.arrays.update(rule(block))
        return new

    # -- deploy / export -----------------------------------------------------------------------
    def deploy(self, state: GlobalState, cid: int | None = None) -> tuple[Arrays, float]:
        r = self.s.r_max if cid is None else self.rank_of(state, cid)
        return truncate_rank(state.arrays, r), self.s.scale(r)

    def export(self, state: GlobalState) -> tuple[Arrays, float]:
        return {k: v.clone() for k, v in state.arrays.items()}, self.s.scale(self.s.r_max)

    def export_files(self, state: GlobalState) -> dict[str, Arrays]:
        return {}


def lora_keys(arrays: Arrays) -> list[str]:
    """The LoRA keys of a payload, sorted."""
    return sorted(k for k in arrays if rank_dim(k) is not None)


def reply_rank(reply: Reply) -> int:
    """The rank r of a reply's LoRA matrices (A: [r, in]; B: [out, r]; validated to agree), the rank
    its client trained. Raises ValueError for a reply without LoRA matrices."""
    for k, v in reply.arrays.items():
        d = rank_dim(k)
        if d is not None:
            return int(v.shape[d])
    raise ValueError("the reply holds no LoRA matrix")


def examples(replies: dict[int, Reply]) -> dict[int, float]:
    """n_k of each replying client, as floats (FedAvg weights)."""
    return {cid: float(r.num_examples) for cid, r in replies.items()}


def copy_state(state: GlobalState) -> GlobalState:
    """A deep copy (aggregation never mutates the state it was given)."""
    return GlobalState({k: v.clone() for k, v in state.arrays.items()}, copy.deepcopy(state.meta))
