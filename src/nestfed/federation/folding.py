"""A round's accepted replies, held up to a bound and then folded into running sums.

So the server's memory for a mean-type rule does not grow with the number of replies
(docs/scale.md).

Up to ``hold`` accepted replies are kept and handed to the strategy's own ``aggregate`` (or its
robust / central-DP form): exactly the rule over every reply, bit for bit. When one more
arrives and the round can be rebuilt from sums (the method declares secure aggregation, so its
``aggregate_secure`` is its rule from sums, nestfed.config.capabilities; and no robust rule or
central DP needs the individual updates), the held replies are folded into the float64 sums
S = sum_k n_k pad(D_k) and C = sum_k n_k [j < r_k] (nestfed.federation.secure_sum, the sums secure
aggregation reveals) and every later reply is added on arrival and dropped; the strategy then
rebuilds its rule from the sums (``aggregate_secure``). The two paths agree to float32 rounding
(tested for every rule that folds); folding in another arrival order may move the last bit.

A rule that needs every update (a robust rule, central DP, HetLoRA's norm weights, FLoRA's,
FlexLoRA's and FedEx-LoRA's exact stacks, FedSLM's groups, FedNL's rules, which have no rank
dimension) holds them all; ``held_bytes`` in the metrics line says what it held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from nestfed.federation.messages import GlobalState, Instruction, Reply, SecureSum
from nestfed.federation.relative_screen import RelativeScreen
from nestfed.federation.safeguards import Safeguards
from nestfed.federation.secure_sum import Layout, common_rank, decode, layout
from nestfed.federation.strategy import Strategy
from nestfed.federation.update import Gathered, measure
from nestfed.nn.keys import rank_dim


def reply_bytes(reply: Reply) -> int:
    """Count the bytes of a reply's tensors (what holding it costs).

    Args:
        reply: the reply.

    Returns:
        The bytes of its arrays, numel x element size summed.
    """
    return int(sum(t.numel() * t.element_size() for t in reply.arrays.values()))


@dataclass
class ReplyFolder:
    """The accepted replies of one round (see the module docstring).

    Attributes:
        strategy: the round's rule.
        safeguards: the round's safeguards (robust rule, central DP, server optimiser).
        rnd: the round.
        state: the global state the round's instructions came from.
        instructions: {cid: Instruction}; their ``expect`` give the sums' layout, their arrays the
            updates' origins.
        hold: replies kept before folding (>= 1).
        n_max: the largest n_k a reply of this round may carry (the sampled clients' declared n_k:
            screening caps or rejects a larger one), which scales the sums' encoding into (0, 1].
        held: {cid: reply} held in memory (empty once folded).
        count: the replies accepted so far.
        held_bytes: the bytes of the held replies' tensors.
        screen: the round's default screen (nestfed.federation.relative_screen); None for none.
            Held replies are screened against each other when they are folded or aggregated, later
            arrivals against those accepted before them.
        secure: whether the method declares secure aggregation (its ``aggregate_secure`` is its
            rule rebuilt from sums, nestfed.config.capabilities), without which replies are never
            folded; default False.
        rejected: {cid: reason} of the replies the screen rejected; they never reach the aggregate.
    """

    strategy: Strategy
    safeguards: Safeguards
    rnd: int
    state: GlobalState
    instructions: dict[int, Instruction]
    hold: int
    n_max: int
    held: dict[int, Reply] = field(default_factory=dict)
    count: int = 0
    held_bytes: int = 0
    screen: RelativeScreen | None = None
    secure: bool = False
    rejected: dict[int, str] = field(default_factory=dict)
    _norms: dict[int, dict[str, float]] = field(default_factory=dict)
    _sums: list[torch.Tensor] | None = None
    _folded: list[int] = field(default_factory=list)
    _layout: Layout | None = None
    _scale: float = 1.0
    _foldable: bool | None = None
    _cols: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    _keys: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    _measured: tuple[int, Any, Gathered | None] | None = None

    @property
    def can_fold(self) -> bool:
        """Whether this round's rule can be rebuilt from sums (module docstring); decided once."""
        if self._foldable is None:
            self._foldable = self.secure and not self.safeguards.rule.active
            if self._foldable:
                try:
                    self._layout = layout(ins.expect for ins in self.instructions.values())
                except ValueError:  # an array without a rank dimension: no sum form
                    self._foldable = False
        return self._foldable

    @property
    def folded(self) -> bool:
        """Whether the replies went into sums."""
        return self._sums is not None

    def _columns(self) -> None:
        """The flat sums' layout (`nestfed.federation.update.Gathered`'s): {key: (rank
        dimension, first column of the lora_A-like sum [r, E_a] or first row of the lora_B-like sum
        [E_b, r], entries per rank row)}, keys in the layout's order."""
        self._cols, at = {}, [0, 0]
        for k, shape in self._layout.items():
            d = rank_dim(k)
            e = math.prod(shape) // shape[d]
            self._cols[k] = (d, at[d], e)
            at[d] += e
        self._keys = (
            tuple(k for k, c in self._cols.items() if c[0] == 0),
            tuple(k for k, c in self._cols.items() if c[0] == 1),
        )

    def _fold(self, cid: int, reply: Reply, gathered: Gathered | None = None) -> None:
        """Add w_k (X_k - P_k) to the flat sums' rank rows up to r_k in place and w_k to the counts of
        rows < r_k, w_k = n_k * scale: what `nestfed.federation.secure_sum.encode` would add
        unclipped, without padding a copy of every update. ``gathered``: the update already measured
        in the layout's order (two kernels then), else it is taken array by array."""
        if self._sums is None:
            self._columns()
            r = common_rank(self._layout)
            ea = sum(e for d, _, e in self._cols.values() if d == 0)
            eb = sum(e for d, _, e in self._cols.values() if d == 1)
            self._sums = [torch.zeros(r, ea, dtype=torch.float64), torch.zeros(eb, r, dtype=torch.float64)]
            self._sums.append(torch.zeros(r, dtype=torch.float64))
        sum_a, sum_b, counts = self._sums
        sent, w = self.instructions[cid].arrays, reply.num_examples * self._scale
        if gathered is not None and (gathered.keys_a, gathered.keys_b) == self._keys:
            rank = gathered.rank
            sum_a[:rank].add_(gathered.a, alpha=w)
            sum_b[:, :rank].add_(gathered.b, alpha=w)
        else:
            rank = 0
            for k, (d, at, e) in self._cols.items():
                delta = reply.arrays[k].detach().to(torch.float64) - sent[k].detach().to(torch.float64)
                rank = delta.shape[d]
                rows = delta.movedim(d, 0).reshape(rank, e)  # [r, entries]
                if d == 0:
                    sum_a[:rank, at : at + e].add_(rows, alpha=w)
                else:
                    sum_b[at : at + e, :rank].add_(rows.t(), alpha=w)
        counts[:rank] += w
        self._folded.append(cid)

    def _key_sums(self) -> list[torch.Tensor]:
        """The flat sums as `nestfed.federation.secure_sum.decode` takes them: one tensor per
        key in its layout shape, then the counts."""
        sum_a, sum_b, counts = self._sums
        out = []
        for k, shape in self._layout.items():
            d, at, e = self._cols[k]
            rows = sum_a[:, at : at + e] if d == 0 else sum_b[at : at + e].t()  # [r, entries]
            others = shape[:d] + shape[d + 1 :]
            out.append(rows.reshape(shape[d], *others).movedim(0, d).contiguous())
        return [*out, counts]

    @property
    def screening(self) -> bool:
        """Whether the round screens replies' block norms (a screen with a positive ratio)."""
        return self.screen is not None and self.screen.ratio > 0

    def block_norms(self, cid: int, reply: Reply) -> dict[str, float] | None:
        """Measure a reply's update norms per rank block, when the round screens them.

        Once the round folds, the update measured here is kept for `add` (one pass over it, not
        two).

        Args:
            cid: the replying client.
            reply: its reply.

        Returns:
            {block: L2 norm} (`nestfed.federation.update.block_norms`); None when the round does
            not screen.
        """
        if not self.screening:
            return None
        order = tuple(self._layout) if self._sums is not None else None
        norms, gathered = measure(self.instructions[cid].arrays, reply.arrays, self.screen.ends, order)
        self._measured = (cid, reply.arrays, gathered) if order is not None else None
        return norms

    def add(self, cid: int, reply: Reply, norms: dict[str, float] | None = None) -> None:
        """Take one validated reply that passed Safeguards.screen: hold it, fold it or reject it.

        Args:
            cid: the replying client.
            reply: its reply.
            norms: its `block_norms`; measured here when None.
        """
        self.count += 1
        if self.screening and norms is None:
            norms = self.block_norms(cid, reply)
        norms = norms or {}
        if self._sums is not None:
            why = self.screen.reason(norms, self.screen.accepted) if self.screening else None
            if why is not None:
                self._reject(cid, why)
                return
            if self.screening:
                self.screen.accept(norms)
            measured, self._measured = self._measured, None
            same = measured is not None and measured[0] == cid and measured[1] is reply.arrays  # not clipped since
            self._fold(cid, reply, measured[2] if same else None)
            return
        self.held[cid] = reply
        self._norms[cid] = norms
        self.held_bytes += reply_bytes(reply)
        if len(self.held) > self.hold and self.can_fold:
            self.settle()
            self._scale = 1.0 / max(self.n_max, 1)
            for c in sorted(self.held):
                self._fold(c, self.held[c])
            self.held, self.held_bytes = {}, 0

    def _reject(self, cid: int, why: str) -> None:
        self.rejected[cid] = why
        self.count -= 1

    def settle(self) -> dict[int, str]:
        """Screen the held replies against each other, and drop the rejected ones.

        Each block is screened against the lower median of the held norms.

        Returns:
            Every rejection of the round so far, {cid: reason}.
        """
        if not self.screening or not self._norms:
            return self.rejected
        among: dict[str, list[float]] = {}
        for norms in self._norms.values():
            for block, x in norms.items():
                among.setdefault(block, []).append(x)
        verdicts = {c: self.screen.reason(self._norms[c], among) for c in sorted(self._norms)}
        for c, why in verdicts.items():
            if why is None:
                self.screen.accept(self._norms[c])
            else:
                self._reject(c, why)
                self.held_bytes -= reply_bytes(self.held.pop(c))
        self._norms = {}
        return self.rejected

    def facts(self) -> dict[str, Any]:
        """Give the folder's facts for the metrics line.

        Returns:
            ``held_replies`` (replies in memory at the end), ``held_bytes`` and ``folded_replies``
            (replies folded into sums).
        """
        return {"held_replies": len(self.held), "held_bytes": self.held_bytes, "folded_replies": len(self._folded)}

    def aggregate(self) -> tuple[GlobalState, dict[str, Any]]:
        """Aggregate the round (the held replies settled first).

        Returns:
            The new global state and its trust facts: the strategy's rule over the held replies,
            or its rebuild from the sums (Safeguards.aggregate / aggregate_secure, the server
            optimiser's step included).
        """
        self.settle()
        if self._sums is None:
            return self.safeguards.aggregate(self.strategy, self.rnd, self.state, self.held)
        secure: SecureSum = decode(self._key_sums(), self._layout, self._scale, self._folded)
        return self.safeguards.aggregate_secure(self.strategy, self.rnd, self.state, secure)
