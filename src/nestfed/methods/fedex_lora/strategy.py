"""fedex_lora: the server strategy and the client hooks (the method is declared in nestfed.methods.fedex_lora)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nestfed.config import ExperimentConfig
from nestfed.federation.aggregation import one_adapter, pad_rank, weighted_mean
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState, Reply
from nestfed.federation.strategy import LoraSettings, LoraStrategy, copy_state, examples
from nestfed.methods.fedex_lora import FedExLoRAOptions
from nestfed.methods.implementation import lora_implementation, lora_settings
from nestfed.nn.keys import merged_key, module_of, peft_key

Factors = tuple[torch.Tensor, torch.Tensor]  # (rows [q, in], columns [out, q]): columns @ rows


@dataclass(frozen=True)
class ClientFactors:
    """One replying client of a layer.

    Attributes:
        A: [r_k, in] its trained A.
        B: [out, r_k] its trained B.
        p: its weight p_k (n_k / N or 1 / K, ``[fedex_lora] weighting``).
        s: its LoRA scale s_k.
    """

    A: torch.Tensor
    B: torch.Tensor
    p: float
    s: float


def nonzero_columns(rows: torch.Tensor, cols: torch.Tensor) -> Factors:
    """The factor pairs whose column of ``cols`` is not all zero (a zero column adds nothing to cols @ rows).

    Args:
        rows: [q, in].
        cols: [out, q].

    Returns:
        The kept rows [q', in] and columns [out, q'].
    """
    keep = cols.ne(0).any(dim=0)
    return rows[keep], cols[:, keep]


def client_fold(A: torch.Tensor, B: torch.Tensor, rank: int, s_global: float, s_client: float) -> Factors:
    """Factors of s Bbar Abar - s_k Bbar[:, :r_k] Abar[:r_k], added to a client's frozen residual.

    With them a client of rank r_k runs the global model exactly (this module's decision for
    heterogeneous ranks). With s_k = s: the tail, rows s Abar[r_k:] and columns Bbar[:, r_k:] (empty
    at r_k = r_max); else rows [s Abar; -s_k Abar[:r_k]] and columns [Bbar, Bbar[:, :r_k]]. Zero
    columns are dropped.

    Args:
        A: Abar [r_max, in].
        B: Bbar [out, r_max].
        rank: the client's rank r_k.
        s_global: the global scale s.
        s_client: the client's scale s_k.

    Returns:
        The rows [q, in] and columns [out, q].

    Raises:
        ValueError: when rank exceeds r_max.
    """
    if rank > A.shape[0]:
        raise ValueError(f"rank {rank} exceeds the global rank {A.shape[0]}")
    if s_client == s_global:
        rows, cols = s_global * A[rank:], B[:, rank:]
    else:
        rows = torch.cat([s_global * A, -s_client * A[:rank]], dim=0)
        cols = torch.cat([B, B[:, :rank]], dim=1)
    return nonzero_columns(rows, cols)


def round_residual(
    A_old: torch.Tensor,
    B_old: torch.Tensor,
    clients: Sequence[ClientFactors],
    A_new: torch.Tensor,
    B_new: torch.Tensor,
    s_global: float,
) -> Factors:
    """Factors of one round's residual (FedEx-LoRA's residual, extended to heterogeneous ranks).

    The residual, with d_j = sum_k p_k (s - s_k [r_k > j]), is

        sum_j d_j B_old[:, j] A_old[j] + sum_k p_k s_k B_k A_k - s B_new A_new

    The first term is the part of the old global LoRA that clients of rank r_k <= j ran frozen
    (module docstring); it is zero at equal ranks and one scale. Rows carry the coefficients; zero
    columns are dropped.

    Args:
        A_old: the global Abar [r_max, in] before the round.
        B_old: the global Bbar [out, r_max] before the round.
        clients: the replying clients (weights p_k summing to 1).
        A_new: Abar after the round.
        B_new: Bbar after the round.
        s_global: the global scale s.

    Returns:
        The rows [q, in] and columns [out, q].
    """
    r_max = A_old.shape[0]
    d = [sum(c.p * (s_global - (c.s if c.A.shape[0] > j else 0.0)) for c in clients) for j in range(r_max)]
    rows = [torch.tensor(d, dtype=A_old.dtype)[:, None] * A_old]
    cols = [B_old]
    for c in clients:
        rows.append((c.p * c.s) * c.A)
        cols.append(c.B)
    rows.append(-s_global * A_new)
    cols.append(B_new)
    keep = torch.tensor(d) != 0
    rows[0], cols[0] = rows[0][keep], cols[0][:, keep]
    return nonzero_columns(torch.cat(rows, dim=0), torch.cat(cols, dim=1))


def compact(rows: torch.Tensor, cols: torch.Tensor) -> Factors:
    """The residual cols @ rows, written with at most min(out, in) terms.

    Unchanged when R <= min(out, in); else written densely as an exact factorisation: rows = I [in,
    in] and cols = the dense [out, in] residual when in <= out, otherwise rows = the dense residual
    and cols = I [out, out]. The dense residual is computed in float64 and rounded once to the
    factors' dtype.

    Args:
        rows: [R, in].
        cols: [out, R].

    Returns:
        The rows and columns.
    """
    out_f, in_f = cols.shape[0], rows.shape[1]
    if rows.shape[0] <= min(out_f, in_f):
        return rows, cols
    dense = (cols.double() @ rows.double()).to(rows.dtype)
    if in_f <= out_f:
        return torch.eye(in_f, dtype=rows.dtype), dense
    return dense, torch.eye(out_f, dtype=rows.dtype)


def lora_modules_of(arrays: Arrays) -> list[str]:
    """Module paths of the ``lora_A`` keys of a payload, sorted.

    Args:
        arrays: the payload.

    Returns:
        The module paths.
    """
    return sorted(module_of(k)[0] for k in arrays if k.endswith("lora_A.weight"))


class FedExLoRA(LoraStrategy):
    """Global state per layer: Abar, Bbar and the exact residual (module docstring).

    Abar ``lora_A`` [r_max, in], Bbar ``lora_B`` [out, r_max], and the residual ``merged_A`` [R,
    in], ``merged_B`` [out, R].

    Args:
        settings: the LoRA numbers.
        options: ``[fedex_lora]``; the defaults (n_k / N weights) when None.
    """

    name = "fedex_lora"

    def __init__(self, settings: LoraSettings, options: FedExLoRAOptions | None = None):
        self.o = options if options is not None else FedExLoRAOptions()
        super().__init__(settings, self.o)

    def weights(self, replies: dict[int, Reply]) -> dict[int, float]:
        """The unnormalised client weights: n_k (``examples``) or 1 (``uniform``: p_k = 1 / K).

        Args:
            replies: {cid: reply} of the round.

        Returns:
            {cid: weight}.
        """
        if self.o.weighting == "uniform":
            return {c: 1.0 for c in replies}
        return examples(replies)

    def initialize(self, shapes: dict[str, tuple[int, int]], clients: list[ClientInfo]) -> GlobalState:
        """The usual initial adapter (A random, B = 0) and an empty residual (R = 0)."""
        state = super().initialize(shapes, clients)
        for m, (out_f, in_f) in sorted(shapes.items()):
            state.arrays[merged_key(m, "A")] = torch.zeros(0, in_f)
            state.arrays[merged_key(m, "B")] = torch.zeros(out_f, 0)
        return state

    def client_arrays(self, state: GlobalState, rank: int) -> Arrays:
        """Abar[:r_k], Bbar[:, :r_k] and the frozen residual: the global stack, then `client_fold`.

        So the client runs the global model exactly.
        """
        s_global, s_client = self.s.scale(self.s.r_max), self.s.scale(rank)
        out = {}
        for m in lora_modules_of(state.arrays):
            A, B = state.arrays[peft_key(m, "lora_A")], state.arrays[peft_key(m, "lora_B")]
            rows, cols = client_fold(A, B, rank, s_global, s_client)
            out[peft_key(m, "lora_A")] = A[:rank].clone()
            out[peft_key(m, "lora_B")] = B[:, :rank].clone()
            out[merged_key(m, "A")] = torch.cat([state.arrays[merged_key(m, "A")], rows], dim=0)
            out[merged_key(m, "B")] = torch.cat([state.arrays[merged_key(m, "B")], cols], dim=1)
        return out

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """Abar, Bbar: zero-padded means with weights p_k; the residual gains the round's factors, compacted.

        The weights are `weights`; the factors `round_residual`'s; the compaction
        `compact`.
        """
        new = copy_state(state)
        n = self.weights(replies)
        total = sum(n.values())
        cids = sorted(replies)
        s_global = self.s.scale(self.s.r_max)
        weights = [n[c] for c in cids]
        for m in lora_modules_of(state.arrays):
            a_key, b_key = peft_key(m, "lora_A"), peft_key(m, "lora_B")
            A_new = weighted_mean([pad_rank(replies[c].arrays[a_key], 0, self.s.r_max) for c in cids], weights)
            B_new = weighted_mean([pad_rank(replies[c].arrays[b_key], 1, self.s.r_max) for c in cids], weights)
            clients = [
                ClientFactors(
                    replies[c].arrays[a_key],
                    replies[c].arrays[b_key],
                    n[c] / total,
                    self.s.scale(replies[c].arrays[a_key].shape[0]),
                )
                for c in cids
            ]
            rows, cols = round_residual(state.arrays[a_key], state.arrays[b_key], clients, A_new, B_new, s_global)
            rows = torch.cat([state.arrays[merged_key(m, "A")], rows], dim=0)
            cols = torch.cat([state.arrays[merged_key(m, "B")], cols], dim=1)
            new.arrays[merged_key(m, "A")], new.arrays[merged_key(m, "B")] = compact(rows, cols)
            new.arrays[a_key], new.arrays[b_key] = A_new, B_new
        return new

    def deploy(self, state: GlobalState, cid: int | None = None) -> tuple[Arrays, float]:
        """Client cid's payload at its scale s_k (the global model exactly); None: the global one at scale s."""
        r = self.s.r_max if cid is None else self.rank_of(state, cid)
        return self.client_arrays(state, r), self.s.scale(r)

    def export(self, state: GlobalState) -> tuple[Arrays, float]:
        """One PEFT adapter at scale 1 whose product is the global delta exactly.

        Per layer A = [merged_A; s Abar] (shape [R + r_max, in]) and B = [merged_B, Bbar] (shape
        [out, R + r_max]), zero-padded to the largest R + r_max over the layers (PEFT needs one
        rank; zero rows add nothing).
        """
        return one_adapter(state.arrays, self.s.scale(self.s.r_max))


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> FedExLoRA:
    return FedExLoRA(lora_settings(cfg), cfg.section("fedex_lora"))


IMPLEMENTATION = lora_implementation(_strategy)
