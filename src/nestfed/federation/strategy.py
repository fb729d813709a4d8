"""The strategy interface: configure a round per client, aggregate the replies.

A strategy is pure: it sees tensors and numbers, never data or models (docs/architecture.md).
Each LoRA method is a small subclass of `LoraStrategy` that overrides one or two hooks
(Flower's shape: ``configure`` and ``aggregate`` as separate methods; nestfed.federation.loop owns
the only round loop).

Instruction config keys every LoRA strategy sends: ``rank`` (r_k), ``scaling`` (s), ``round``,
``seed`` (the federation's); a method adds its own in `LoraStrategy.client_config`, read by
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
        """Build the round-0 global state.

        Args:
            shapes: the LoRA layers' weight shapes, {module: (out, in)}.
            clients: every client of the federation (its id, rank r_k and example count n_k).

        Returns:
            The global state before round 1.

        Raises:
            ValueError: when a client's rank exceeds r_max (`LoraStrategy`).
        """

    def configure(self, rnd: int, state: GlobalState, clients: list[ClientInfo]) -> dict[int, Instruction]:
        """Instruct the sampled clients for one round.

        Args:
            rnd: the round, 1-based.
            state: the global state before the round.
            clients: the clients sampled this round.

        Returns:
            One instruction per sampled client, {cid: instruction}.
        """

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """Aggregate the validated replies of a round into the new global state.

        Args:
            rnd: the round, 1-based.
            state: the global state the round started from (never mutated).
            replies: the replies that passed validation, {cid: reply}.

        Returns:
            The new global state.
        """

    def robust_aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply], rule: BlockRule) -> GlobalState:
        """Aggregate the replies with each rank block combined by a robust or private rule.

        Called only for a method that declares ROBUST_AGGREGATION (nestfed.config.capabilities).

        Args:
            rnd: the round, 1-based.
            state: the global state the round started from (never mutated).
            replies: the replies that passed validation, {cid: reply}.
            rule: combines one block of updates (a robust rule or central DP,
                nestfed.federation.robust).

        Returns:
            The new global state.
        """

    def aggregate_secure(self, rnd: int, state: GlobalState, secure: SecureSum) -> GlobalState:
        """Rebuild the new global state from secure sums alone (nestfed.federation.secure_sum).

        Called only for a method that declares SECURE_AGGREGATION.

        Args:
            rnd: the round, 1-based.
            state: the global state the round started from (never mutated).
            secure: the summed, zero-padded updates and counts of the replying clients.

        Returns:
            The new global state.

        Raises:
            NotImplementedError: when the method has no rebuild from sums (`LoraStrategy`'s default).
        """

    def deploy(self, state: GlobalState, cid: int | None = None) -> tuple[Arrays, float]:
        """Give the adapter a client would run.

        Args:
            state: the global state.
            cid: the client; None for the full global adapter at r_max.

        Returns:
            The adapter's arrays (the client's rank prefix) and its LoRA scale s.
        """

    def export(self, state: GlobalState) -> tuple[Arrays, float]:
        """Give the final global adapter as PEFT LoRA arrays (one rank for all layers).

        Args:
            state: the final global state.

        Returns:
            The adapter's arrays (copies) and its LoRA scale s.
        """

    def export_files(self, state: GlobalState) -> dict[str, Arrays]:
        """Give further arrays the run directory keeps (e.g. memory rules).

        Args:
            state: the final global state.

        Returns:
            {file name: arrays}; empty when there are none.
        """


@dataclass(frozen=True)
class LoraSettings:
    """The numbers a LoRA strategy needs: r_max, lora_alpha, the scaling convention, seeds.

    Attributes:
        r_max: the global adapter's rank.
        lora_alpha: LoRA's alpha.
        scaling: ``fixed`` (default): s = lora_alpha / r_max at every rank; ``rank``:
            s = lora_alpha / r_k.
        init_seed: the seed of the global adapter's initialisation.
        seed: the federation's seed (sent to every client).
    """

    r_max: int
    lora_alpha: float
    scaling: str = "fixed"
    init_seed: int = 0
    seed: int = 0

    def scale(self, rank: int) -> float:
        """Give the LoRA scale s used by a client of a rank (and by the global model at r_max).

        Args:
            rank: the client's rank r_k.

        Returns:
            The scale s.
        """
        if self.scaling == "fixed":
            return self.lora_alpha / self.r_max
        return self.lora_alpha / rank


class LoraStrategy:
    """Shared behaviour of strategies whose global state is one LoRA adapter of rank r_max.

    Subclasses implement `aggregate` and may override `client_config`. Global state meta holds
    ``ranks``: {cid (str): current rank}.

    Args:
        settings: r_max, lora_alpha, scaling and seeds.
        options: the method's options dataclass (nestfed.methods), or None.
    """

    name = "lora"

    def __init__(self, settings: LoraSettings, options: Any = None):
        self.s = settings
        self.options = options

    # -- state ---------------------------------------------------------------------------------
    def initialize(self, shapes: dict[str, tuple[int, int]], clients: list[ClientInfo]) -> GlobalState:
        """Initialise the global adapter at r_max (seeded) and record each client's rank."""
        for c in clients:
            check_rank(c.rank, self.s.r_max, f"client {c.cid}")
        arrays = init_adapter_state(shapes, self.s.r_max, self.s.init_seed)
        return GlobalState(arrays, {"ranks": {str(c.cid): c.rank for c in clients}})

    def rank_of(self, state: GlobalState, cid: int) -> int:
        """Give a client's current rank (HetLoRA may have pruned it).

        Args:
            state: the global state (its meta ``ranks``).
            cid: the client.

        Returns:
            The rank r_k.
        """
        return int(state.meta["ranks"][str(cid)])

    # -- configure -----------------------------------------------------------------------------
    def client_config(self, rnd: int, state: GlobalState, client: ClientInfo, rank: int) -> dict[str, Any]:
        """Give the method-specific instruction config for one client (override to add keys).

        Args:
            rnd: the round, 1-based.
            state: the global state before the round.
            client: the client.
            rank: the rank it trains at this round.

        Returns:
            Further config keys (default: none).
        """
        return {}

    def client_arrays(self, state: GlobalState, rank: int) -> Arrays:
        """Give the payload sent to a client of a rank.

        Default: the rank prefix of the global adapter, as views of the state (an instruction costs
        no copy until it is serialised).

        Args:
            state: the global state before the round.
            rank: the client's rank this round.

        Returns:
            The arrays to send.
        """
        return rank_prefix(state.arrays, rank)

    def reply_keys(self, sent: Arrays) -> list[str]:
        """Give the keys a client must send back.

        Args:
            sent: the arrays sent to the client.

        Returns:
            The reply's keys (default: the LoRA matrices it trains, A and B).
        """
        return [k for k in sent if rank_dim(k) is not None]

    def expected_shapes(self, sent: Arrays, rank: int) -> dict[str, tuple[int, ...]]:
        """Give the shapes a client's reply must have (the validation's reference).

        Args:
            sent: the arrays sent to the client.
            rank: the client's rank this round.

        Returns:
            {key: shape} (default: those of the sent arrays with the reply keys).
        """
        return {k: tuple(sent[k].shape) for k in self.reply_keys(sent)}

    def configure(self, rnd: int, state: GlobalState, clients: list[ClientInfo]) -> dict[int, Instruction]:
        """Send each client its rank prefix with rank, scaling, round, seed and the method's keys."""
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
        """Refuse: each method's subclass implements its own aggregation (raises NotImplementedError)."""
        raise NotImplementedError

    def aggregate_secure(self, rnd: int, state: GlobalState, secure: SecureSum) -> GlobalState:
        """Refuse, unless a subclass writes its rebuild from sums (raises NotImplementedError)."""
        raise NotImplementedError(f"{self.name} does not rebuild its aggregate from secure sums")

    def robust_aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply], rule: BlockRule) -> GlobalState:
        """Combine one block of zero-padded updates, every replying client a member.

        ZeroPad's and HetLoRA's padding; at equal ranks plain FedAvg's update space.

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
        """Truncate the global adapter to the client's rank (r_max for None)."""
        r = self.s.r_max if cid is None else self.rank_of(state, cid)
        return truncate_rank(state.arrays, r), self.s.scale(r)

    def export(self, state: GlobalState) -> tuple[Arrays, float]:
        """Copy the global adapter at r_max."""
        return {k: v.clone() for k, v in state.arrays.items()}, self.s.scale(self.s.r_max)

    def export_files(self, state: GlobalState) -> dict[str, Arrays]:
        """Keep no further files."""
        return {}


def lora_keys(arrays: Arrays) -> list[str]:
    """List the LoRA keys of a payload.

    Args:
        arrays: a payload.

    Returns:
        Its keys with a rank dimension, sorted.
    """
    return sorted(k for k in arrays if rank_dim(k) is not None)


def reply_rank(reply: Reply) -> int:
    """Give the rank its client trained: the rank r of a reply's LoRA matrices.

    Args:
        reply: a validated reply (A: [r, in], B: [out, r], their ranks agree).

    Returns:
        The rank r.

    Raises:
        ValueError: when the reply holds no LoRA matrix.
    """
    for k, v in reply.arrays.items():
        d = rank_dim(k)
        if d is not None:
            return int(v.shape[d])
    raise ValueError("the reply holds no LoRA matrix")


def examples(replies: dict[int, Reply]) -> dict[int, float]:
    """Give each replying client's example count n_k (FedAvg weights).

    Args:
        replies: {cid: reply}.

    Returns:
        {cid: n_k as a float}.
    """
    return {cid: float(r.num_examples) for cid, r in replies.items()}


def copy_state(state: GlobalState) -> GlobalState:
    """Copy a global state deeply (aggregation never mutates the state it was given).

    Args:
        state: the state.

    Returns:
        Its deep copy (arrays cloned, meta deep-copied; the optimiser state is not carried).
    """
    return GlobalState({k: v.clone() for k, v in state.arrays.items()}, copy.deepcopy(state.meta))
