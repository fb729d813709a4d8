"""A round's accepted replies, held up to a bound and then folded into running sums, so the server's
memory for a mean-type rule does not grow with the number of replies (docs/scale.md).

Up to ``hold`` accepted replies are kept and handed to the strategy's own ``aggregate`` (or its
robust / central-DP form): exactly what the round loop did before, bit for bit. When one more
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

from dataclasses import dataclass, field
from typing import Any

import torch

from nestfed.federation.messages import GlobalState, Instruction, Reply, SecureSum
from nestfed.federation.relative_screen import RelativeScreen
from nestfed.federation.safeguards import Safeguards
from nestfed.federation.secure_sum import Layout, common_rank, decode, layout
from nestfed.federation.strategy import Strategy
from nestfed.federation.update import block_norms
from nestfed.nn.keys import rank_dim


def reply_bytes(reply: Reply) -> int:
    """Bytes of a reply's tensors (what holding it costs)."""
    return int(sum(t.numel() * t.element_size() for t in reply.arrays.values()))


@dataclass
class ReplyFolder:
    """The accepted replies of one round (see the module docstring).

    strategy, safeguards: the round's rule; rnd, state: the round and the global state its
    instructions came from; instructions: {cid: Instruction} (their ``expect`` give the sums'
    layout, their arrays the updates' origins); hold: replies kept before folding (>= 1); n_max:
    the largest n_k a reply of this round may carry (the sampled clients' declared n_k: screening
    caps or rejects a larger one), which scales the sums' encoding into (0, 1]; screen: the round's
    default screen (nestfed.federation.relative_screen): held replies are screened against each other
    when they are folded or aggregated, later arrivals against those accepted before them; the
    replies it rejects are in ``rejected`` ({cid: reason}) and never reach the aggregate;
    secure: whether the method declares secure aggregation (its ``aggregate_secure`` is its rule
    rebuilt from sums, nestfed.config.capabilities), without which replies are never folded.
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

    def _fold(self, cid: int, reply: Reply) -> None:
        """Add w_k (X_k - P_k) to each key's sum in place (rows up to r_k) and w_k to the counts of
        rows < r_k, w_k = n_k * scale: what :func:`~nestfed.federation.secure_sum.encode` would add
        unclipped, without padding a copy of every update."""
        if self._sums is None:
            self._sums = [torch.zeros(shape, dtype=torch.float64) for shape in self._layout.values()]
            self._sums.append(torch.zeros(common_rank(self._layout), dtype=torch.float64))
        sent, w = self.instructions[cid].arrays, reply.num_examples * self._scale
        rank = 0
        for total, k in zip(self._sums, self._layout):
            x, d = reply.arrays[k], rank_dim(k)
            delta = x.detach().to(torch.float64) - sent[k].detach().to(torch.float64)
            total.narrow(d, 0, delta.shape[d]).add_(delta, alpha=w)
            rank = delta.shape[d]
        self._sums[-1][:rank] += w
        self._folded.append(cid)

    @property
    def screening(self) -> bool:
        return self.screen is not None and self.screen.ratio > 0

    def block_norms(self, cid: int, reply: Reply) -> dict[str, float] | None:
        """The reply's update norms per rank block when the round screens them, else None."""
        return block_norms(self.instructions[cid].arrays, reply.arrays, self.screen.ends) if self.screening else None

    def add(self, cid: int, reply: Reply, norms: dict[str, float] | None = None) -> None:
        """One validated reply that passed Safeguards.screen; ``norms``: its :meth:`block_norms`
        (measured here when not given)."""
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
            self._fold(cid, reply)
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
        """Screen the held replies against each other (each block against the lower median of the
        held norms); drop the rejected ones; return every rejection of the round so far."""
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
        """For the metrics line: ``held_replies`` (replies in memory at the end), ``held_bytes`` and
        ``folded_replies`` (replies folded into sums)."""
        return {"held_replies": len(self.held), "held_bytes": self.held_bytes, "folded_replies": len(self._folded)}

    def aggregate(self) -> tuple[GlobalState, dict[str, Any]]:
        """The round's aggregate and its trust facts: the strategy's rule over the held replies, or
        its rebuild from the sums (Safeguards.aggregate / aggregate_secure, the server optimiser's
        step included)."""
        self.settle()
        if self._sums is None:
            return self.safeguards.aggregate(self.strategy, self.rnd, self.state, self.held)
        secure: SecureSum = decode(self._sums, self._layout, self._scale, self._folded)
        return self.safeguards.aggregate_secure(self.strategy, self.rnd, self.state, secure)
