"""fed_sb: the server strategy (the method is declared in nestfed.methods.fed_sb), and the core
strategy it shares with RAVAN (nestfed.methods.ravan): frozen factors A, B and a trainable core
between them (nestfed.nn.lora_core), the core averaged exactly.

The clients run the default client hooks: the payload's core key installs the core variant on each
LoRA layer (nestfed.nn.arrays.apply_arrays), which then trains only the core and replies with it.
"""

from __future__ import annotations

import torch

from nestfed.config import ExperimentConfig
from nestfed.federation.aggregation import fold_cores, weighted_mean
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState, Reply
from nestfed.federation.secure_sum import SecureSum, segment_mean
from nestfed.federation.strategy import LoraStrategy, copy_state, examples
from nestfed.methods.implementation import lora_implementation, lora_settings
from nestfed.nn.keys import lora_core_key, peft_key
from nestfed.seeds import stream_seed


def orthonormal(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """A [rows, cols] matrix with orthonormal columns (rows >= cols) or orthonormal rows (rows <
    cols): the Q factor of a standard Gaussian draw (Gram-Schmidt by Householder QR), each
    direction signed so that R's diagonal is positive (Q is then unique for the draw)."""
    tall = rows >= cols
    gauss = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(gauss if tall else gauss.T)
    q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(()))
    return (q if tall else q.T).to(torch.float32)


def frozen_factors(out_f: int, in_f: int, rank: int, seed: int, module: str, stream: str) -> tuple:
    """(A [rank, in], B [out, rank]) for one layer: orthonormal rows of A and columns of B (where
    the shape allows), drawn from the seed rule's stream ``<stream>/<module>`` of ``seed``
    (nestfed.seeds: round 0, client 0), so every node draws the same factors."""
    g = torch.Generator().manual_seed(stream_seed(seed, 0, 0, f"{stream}/{module}"))
    A = orthonormal(rank, in_f, g)
    B = orthonormal(out_f, rank, g)
    return A, B


class CoreStrategy(LoraStrategy):
    """Global state per layer: the frozen factors ``lora_A`` [r, in] and ``lora_B`` [out, r] and
    the core (key kind :attr:`kind`) [r, q]: h = :meth:`heads` heads [q, q] stacked row-wise,
    h q = r = r_max (nestfed.nn.lora_core). Every client
    (one rank, r_max) receives all three and sends back only the core; the server sets the core to
    the n_k-weighted mean of the replies' cores, A and B never change, so s B M A is exactly the
    n_k-weighted mean of the clients' s B M_k A (M linear in the core)."""

    name = "core"
    kind = "lora_core"
    stream = "core_init"

    def heads(self) -> int:
        """h, the number of heads the core of rank r_max is cut into (Fed-SB: 1)."""
        return 1

    def initialize(self, shapes: dict[str, tuple[int, int]], clients: list[ClientInfo]) -> GlobalState:
        """Frozen orthonormal factors (:func:`frozen_factors`) and a zero core (so round 1 starts
        from the backbone). Raises ValueError for a client rank other than r_max, or an r_max that
        h heads do not divide."""
        for c in clients:
            if c.rank != self.s.r_max:
                raise ValueError(f"client {c.cid}: rank {c.rank}, but {self.name} needs every client at r_max")
        h, r = self.heads(), self.s.r_max
        if r % h:
            raise ValueError(f"rank {r} is not a multiple of the {h} heads")
        arrays: Arrays = {}
        for m, (out_f, in_f) in sorted(shapes.items()):
            A, B = frozen_factors(out_f, in_f, r, self.s.init_seed, m, self.stream)
            arrays[peft_key(m, "lora_A")], arrays[peft_key(m, "lora_B")] = A, B
            arrays[lora_core_key(m, self.kind)] = torch.zeros(r, r // h)
        return GlobalState(arrays, {"ranks": {str(c.cid): c.rank for c in clients}})

    def core_keys(self, arrays: Arrays) -> list[str]:
        """The core keys of a payload, sorted."""
        suffix = f".{self.kind}.weight"
        return sorted(k for k in arrays if k.endswith(suffix))

    def reply_keys(self, sent: Arrays) -> list[str]:
        """Only the cores come back."""
        return self.core_keys(sent)

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """Each core: the n_k-weighted mean of the replies' cores; A and B unchanged."""
        new = copy_state(state)
        n = examples(replies)
        cids = sorted(replies)
        for key in self.core_keys(state.arrays):
            new.arrays[key] = weighted_mean([replies[c].arrays[key] for c in cids], [n[c] for c in cids])
        return new

    def aggregate_secure(self, rnd: int, state: GlobalState, secure: SecureSum) -> GlobalState:
        """:meth:`aggregate` from secure sums alone: each core gets G + S / N, the n_k-weighted mean
        update added to the core the clients were sent, which is the weighted mean of the replies
        (every client holds every row: nestfed.federation.secure_sum.segment_mean)."""
        new = copy_state(state)
        for key, s in secure.sums.items():
            new.arrays[key] = segment_mean(state.arrays[key], s, secure.counts, 0)
        return new

    def export(self, state: GlobalState) -> tuple[Arrays, float]:
        """A plain PEFT LoRA adapter of rank r_max at scale s: A' = A, B' = B blockdiag(core), so
        B' A' = B M A exactly (nestfed.federation.aggregation.fold_cores)."""
        return fold_cores(state.arrays), self.s.scale(self.s.r_max)


class FedSB(CoreStrategy):
    """Fed-SB: the core is one R [r, r] (module docstring of nestfed.methods.fed_sb)."""

    name = "fed_sb"
    kind = "lora_core"
    stream = "fed_sb_init"


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> FedSB:
    return FedSB(lora_settings(cfg))


IMPLEMENTATION = lora_implementation(_strategy)
