"""fed_sb: the server strategy (the method is declared in nestfed.methods.fed_sb), and the core
strategy it shares with RAVAN (nestfed.methods.ravan): frozen factors A, B and a trainable core
between them (nestfed.nn.lora_core), the core averaged exactly.

Only cores travel: the clients draw A and B from the seed themselves
(nestfed.methods.fed_sb.frozen_factors.CoreHooks); the payload's core key installs the core
variant on each LoRA layer (nestfed.nn.arrays.apply_arrays), which trains only the core and replies
with it.
"""

from __future__ import annotations

import torch

from nestfed.config import ExperimentConfig
from nestfed.federation.aggregation import fold_cores, pad_rank, weighted_mean
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState, Reply
from nestfed.federation.robust import Block, BlockRule
from nestfed.federation.secure_sum import SecureSum
from nestfed.federation.strategy import LoraStrategy, copy_state, examples
from nestfed.methods.fed_sb.frozen_factors import RANK, SEED, STREAM, CoreHooks, frozen_factors, frozen_heads_key
from nestfed.methods.implementation import lora_implementation, lora_settings
from nestfed.nn.keys import lora_core_key, module_of, peft_key


def update_mean(g: torch.Tensor, replies: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """sum_k p_k X_k over the clients' whole cores, as they ran them.

    Client k's core is its reply X_k [t_k, q] on the rows it trained and the sent global core g on
    the others: g + sum_k p_k pad(X_k - g[:t_k]), the n_k-weighted mean (p_k = w_k / sum w). With
    every t_k = r it is the weighted mean of the replies, bit for bit.

    Args:
        g: [r, q] the sent global core.
        replies: the clients' cores, [t_k, q] each.
        weights: the w_k.

    Returns:
        The new core [r, q].

    Raises:
        ValueError: for a reply with more rows than g.
    """
    full = []
    for x in replies:
        if x.shape[0] > g.shape[0]:
            raise ValueError(f"a reply of {x.shape[0]} core rows, the global core has {g.shape[0]}")
        f = g.clone()
        f[: x.shape[0]] = x
        full.append(f)
    return weighted_mean(full, weights)


class CoreStrategy(LoraStrategy):
    """Frozen factors A, B and a trainable core between them, averaged exactly (Fed-SB's and RAVAN's server).

    Global state per layer: the frozen factors ``lora_A`` [r, in] and ``lora_B`` [out, r] and the
    core (key kind `kind`) [r, q]: h = `heads` heads [q, q] stacked row-wise, h q = r =
    r_max (nestfed.nn.lora_core).

    A client of rank r_k (a multiple of q) receives the core's first r_k rows and, below r, the
    other heads, which it runs as a frozen residual with A and B drawn from the seed
    (nestfed.methods.fed_sb.frozen_factors), so it runs the global model exactly, at the global
    scale s = scale(r_max); it trains its prefix of the core and sends back only that, [r_k, q].

    The server sets the core to `update_mean` (rows a client did not train count at the values
    it ran); A and B never change, so s B M A is exactly the n_k-weighted mean of the clients' s B
    M_k A (M linear in the core). At r_k = r (Fed-SB's only case) there is no residual.
    """

    name = "core"
    kind = "lora_core"
    stream = "core_init"

    def heads(self) -> int:
        """h, the number of heads the core of rank r_max is cut into (Fed-SB: 1).

        Returns:
            h.
        """
        return 1

    def head_rank(self) -> int:
        """q = r_max / h.

        Returns:
            q.
        """
        return self.s.r_max // self.heads()

    def initialize(self, shapes: dict[str, tuple[int, int]], clients: list[ClientInfo]) -> GlobalState:
        """Frozen orthonormal factors (`frozen_factors`) and a zero core, so round 1 starts from the backbone.

        Raises:
            ValueError: for an r_max that h heads do not divide, or a client rank that is not a
                multiple of q up to r_max.
        """
        h, r = self.heads(), self.s.r_max
        if r % h:
            raise ValueError(f"rank {r} is not a multiple of the {h} heads")
        for c in clients:
            if c.rank % self.head_rank() or not 0 < c.rank <= r:
                raise ValueError(f"client {c.cid}: rank {c.rank} is not a multiple of {self.head_rank()} up to {r}")
        arrays: Arrays = {}
        for m, (out_f, in_f) in sorted(shapes.items()):
            A, B = frozen_factors(out_f, in_f, r, self.s.init_seed, m, self.stream)
            arrays[peft_key(m, "lora_A")], arrays[peft_key(m, "lora_B")] = A, B
            arrays[lora_core_key(m, self.kind)] = torch.zeros(r, r // h)
        return GlobalState(arrays, {"ranks": {str(c.cid): c.rank for c in clients}})

    def core_keys(self, arrays: Arrays) -> list[str]:
        """The core keys of a payload, sorted.

        Args:
            arrays: the payload.

        Returns:
            The keys.
        """
        suffix = f".{self.kind}.weight"
        return sorted(k for k in arrays if k.endswith(suffix))

    def client_config(self, rnd: int, state: GlobalState, client: ClientInfo, rank: int) -> dict:
        """The global scale for every client and what it draws its frozen factors from (LoRA seed, r, stream)."""
        return {"scaling": self.s.scale(self.s.r_max), SEED: self.s.init_seed, RANK: self.s.r_max, STREAM: self.stream}

    def client_arrays(self, state: GlobalState, rank: int) -> Arrays:
        """The core's first r_k rows [r_k, q] (views) and, below r, the other heads under ``frozen_heads``.

        The heads are [r - r_k, q]; never A or B (the client draws them from the seed).
        """
        out: Arrays = {}
        for key in self.core_keys(state.arrays):
            core = state.arrays[key]
            if rank % core.shape[1] or not 0 < rank <= core.shape[0]:
                raise ValueError(
                    f"rank {rank} is not a multiple of the head rank {core.shape[1]} up to {core.shape[0]}"
                )
            out[key] = core[:rank]
            if rank < core.shape[0]:
                out[frozen_heads_key(module_of(key)[0])] = core[rank:]
        return out

    def reply_keys(self, sent: Arrays) -> list[str]:
        """Only the cores come back."""
        return self.core_keys(sent)

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """Each core: `update_mean` of the replies with n_k weights; A and B unchanged."""
        new = copy_state(state)
        n = examples(replies)
        cids = sorted(replies)
        weights = [n[c] for c in cids]
        for key in self.core_keys(state.arrays):
            new.arrays[key] = update_mean(state.arrays[key], [replies[c].arrays[key] for c in cids], weights)
        return new

    def robust_aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply], rule: BlockRule) -> GlobalState:
        """One block of every reply's core update, zero-padded to r rows, added to the global core.

        Rows a client did not train count as no change; under the n_k-weighted mean rule this is
        `aggregate` (docs/trust.md).
        """
        new = copy_state(state)
        keys = self.core_keys(state.arrays)
        start = {k: state.arrays[k] for k in keys}
        deltas = {}
        for c, reply in replies.items():
            deltas[c] = {}
            for k in keys:
                x = reply.arrays[k]
                deltas[c][k] = pad_rank(x - start[k][: x.shape[0]], 0, start[k].shape[0])
        holders = len(state.meta.get("ranks", {})) or len(replies)
        new.arrays.update(rule(Block("all", deltas, examples(replies), holders, start, start)))
        return new

    def aggregate_secure(self, rnd: int, state: GlobalState, secure: SecureSum) -> GlobalState:
        """`aggregate` from secure sums alone: each core gets G + S / N.

        S is the sum of the n_k-weighted updates zero-padded to r rows and N = C[0] the round's
        total n_k (nestfed.federation.secure_sum).
        """
        new = copy_state(state)
        total = float(secure.counts[0])
        for key, s in secure.sums.items():
            g = state.arrays[key]
            new.arrays[key] = (g.double() + pad_rank(s.double(), 0, g.shape[0]) / total).to(g.dtype)
        return new

    def deploy(self, state: GlobalState, cid: int | None = None) -> tuple[Arrays, float]:
        """The whole global model at the global scale, for every client."""
        return {k: v.clone() for k, v in state.arrays.items()}, self.s.scale(self.s.r_max)

    def export(self, state: GlobalState) -> tuple[Arrays, float]:
        """A plain PEFT LoRA adapter of rank r_max at scale s: A' = A, B' = B blockdiag(core).

        So B' A' = B M A exactly (nestfed.federation.aggregation.fold_cores).
        """
        return fold_cores(state.arrays), self.s.scale(self.s.r_max)


class FedSB(CoreStrategy):
    """Fed-SB: the core is one R [r, r] (module docstring of nestfed.methods.fed_sb)."""

    name = "fed_sb"
    kind = "lora_core"
    stream = "fed_sb_init"


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> FedSB:
    return FedSB(lora_settings(cfg))


IMPLEMENTATION = lora_implementation(_strategy, hooks=lambda cfg: CoreHooks(cfg.section("fed_sb").lr))
