"""flexlora: the server strategy and the client hooks (the method is declared in nestfed.methods.flexlora)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from nestfed.config import ExperimentConfig
from nestfed.federation.aggregation import truncate_rank
from nestfed.federation.messages import Arrays, GlobalState, Reply
from nestfed.federation.strategy import LoraStrategy, copy_state, examples
from nestfed.methods.implementation import lora_implementation, lora_settings
from nestfed.nn.keys import module_of, peft_key, rank_dim

#: meta key: True once the state holds an SVD factorisation (False for the initial random-A adapter)
SVD_FORM = "svd_form"
#: meta key: the largest share of ||W||_F^2 over the layers that the rank-r_max truncation dropped
DISCARDED = "discarded_energy"


def product_svd(
    Bs: Sequence[torch.Tensor], As: Sequence[torch.Tensor], coeffs: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The thin SVD of W = sum_k c_k B_k A_k without forming W (FlexLoRA's redistribution SVD).

    With B = [B_1 ... B_K] (shape [out, R]) and A = [c_1 A_1; ...; c_K A_K] (shape [R, in], R = sum
    r_k), W = B A = Q_b (R_b R_a^T) Q_a^T from the reduced QR decompositions B = Q_b R_b and A^T =
    Q_a R_a, and the SVD of the small core R_b R_a^T gives W's. Float64 throughout. Signs: the
    largest-magnitude entry of each column of U is positive (the first on ties).

    Args:
        Bs: the B_k, [out, r_k] each.
        As: the A_k, [r_k, in] each.
        coeffs: the c_k (p_k s_k).

    Returns:
        U [out, q], S [q] (descending, >= 0) and Vh [q, in] with q = min(out, in, R).

    Raises:
        ValueError: on an empty list, lists of different lengths, or factors whose shapes do not
            chain.
    """
    if not Bs or len(Bs) != len(As) or len(As) != len(coeffs):
        raise ValueError(
            f"product_svd needs as many B, A and coefficients (>= 1), got {len(Bs)}, {len(As)}, {len(coeffs)}"
        )
    for b, a in zip(Bs, As):
        if (
            b.dim() != 2
            or a.dim() != 2
            or b.shape[1] != a.shape[0]
            or b.shape[0] != Bs[0].shape[0]
            or a.shape[1] != As[0].shape[1]
        ):
            raise ValueError(f"factors B {tuple(b.shape)} and A {tuple(a.shape)} do not chain into one [out, in]")
    B = torch.cat([b.double() for b in Bs], dim=1)  # [out, R]
    A = torch.cat([float(c) * a.double() for c, a in zip(coeffs, As)], dim=0)  # [R, in]
    Qb, Rb = torch.linalg.qr(B)  # [out, q1], [q1, R]
    Qa, Ra = torch.linalg.qr(A.T)  # [in, q2], [q2, R]
    Uc, S, Vch = torch.linalg.svd(Rb @ Ra.T, full_matrices=False)  # core [q1, q2]
    U, Vh = Qb @ Uc, Vch @ Qa.T
    cols = torch.arange(U.shape[1])
    sign = torch.sign(U[U.abs().argmax(dim=0), cols])
    sign[sign == 0] = 1.0
    return U * sign, S, Vh * sign[:, None]


def split_factors(
    U: torch.Tensor, S: torch.Tensor, Vh: torch.Tensor, rank: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """LoRA factors of the rank-``rank`` truncation of U diag(S) Vh at scale s.

    FlexLoRA section 3.2, with this module's symmetric split: A = sqrt(S / s) Vh, B = U sqrt(S / s),
    so s B A = U[:, :rank] diag(S[:rank]) Vh[:rank]. When fewer than ``rank`` singular triplets
    exist the missing rows of A and columns of B are zero. Float64.

    Args:
        U: [out, q] left singular vectors.
        S: [q] singular values, descending.
        Vh: [q, in] right singular vectors.
        rank: the truncation's rank.
        scale: the LoRA scale s, > 0.

    Returns:
        A [rank, in] and B [out, rank].

    Raises:
        ValueError: for rank < 1 or s <= 0.
    """
    if rank < 1 or not scale > 0:
        raise ValueError(f"rank must be >= 1 and the scale > 0, got rank {rank}, scale {scale}")
    q = min(rank, S.shape[0])
    root = (S[:q].double() / scale).sqrt()
    A = torch.zeros(rank, Vh.shape[1], dtype=torch.float64)
    B = torch.zeros(U.shape[0], rank, dtype=torch.float64)
    A[:q] = root[:, None] * Vh[:q].double()
    B[:, :q] = U[:, :q].double() * root
    return A, B


def lora_modules_of(arrays: Arrays) -> list[str]:
    """Module paths of the ``lora_A`` keys of a payload, sorted.

    Args:
        arrays: the payload.

    Returns:
        The module paths.
    """
    return sorted(module_of(k)[0] for k in arrays if k.endswith("lora_A.weight"))


class FlexLoRA(LoraStrategy):
    """Global state: the rank-r_max truncated SVD of the mean product (module docstring).

    ``lora_A`` [r_max, in] and ``lora_B`` [out, r_max] at the global scale; meta ``svd_form`` and
    ``discarded_energy``.
    """

    name = "flexlora"

    def client_arrays(self, state: GlobalState, rank: int) -> Arrays:
        """The rank-r_k truncation: the prefix of the global factors, rescaled once the state is an SVD.

        Both factors are multiplied by sqrt(s / s_k) once the state is an SVD (so s_k B' A' = the
        rank-r_k truncation of W); before, the plain prefix of the initial adapter (random A, zero
        B).

        Raises:
            ValueError: when rank exceeds r_max.
        """
        out = truncate_rank(state.arrays, rank)
        factor = math.sqrt(self.s.scale(self.s.r_max) / self.s.scale(rank))
        if state.meta.get(SVD_FORM) and factor != 1.0:
            out = {k: (v * factor if rank_dim(k) is not None else v) for k, v in out.items()}
        return out

    def layer_terms(
        self, state: GlobalState, replies: dict[int, Reply], module: str
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
        """The terms (B_i, A_i, c_i) of one layer's aggregate W = sum_i c_i B_i A_i.

        FlexLoRA's are every replying client's factors (sorted by cid) with c_k = p_k s_k,
        p_k = n_k / N over ``replies``, in the order `product_svd` takes them.

        Args:
            state: the global state before the round.
            replies: the round's replies by client id.
            module: the LoRA layer's module name.

        Returns:
            The lists of B_i [out, r_i], A_i [r_i, in] and the coefficients c_i.
        """
        a_key, b_key = peft_key(module, "lora_A"), peft_key(module, "lora_B")
        n = examples(replies)
        total = sum(n.values())
        cids = sorted(replies)
        As = [replies[c].arrays[a_key] for c in cids]
        Bs = [replies[c].arrays[b_key] for c in cids]
        return Bs, As, [n[c] / total * self.s.scale(a.shape[0]) for c, a in zip(cids, As)]

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """W = sum_i c_i B_i A_i per layer, stored as its rank-r_max truncated SVD at the global scale.

        The terms come from `layer_terms` (FlexLoRA's: sum_k p_k s_k B_k A_k), the SVD from
        `product_svd` and `split_factors`.
        """
        new = copy_state(state)
        s_global = self.s.scale(self.s.r_max)
        discarded = []
        for m in lora_modules_of(state.arrays):
            a_key, b_key = peft_key(m, "lora_A"), peft_key(m, "lora_B")
            U, S, Vh = product_svd(*self.layer_terms(state, replies, m))
            if S.numel() == 0 or float(S[0]) == 0.0:  # W = 0: keep the previous factors (module docstring)
                continue
            A, B = split_factors(U, S, Vh, self.s.r_max, s_global)
            dtype = state.arrays[a_key].dtype
            new.arrays[a_key], new.arrays[b_key] = A.to(dtype), B.to(dtype)
            energy = float((S**2).sum())
            discarded.append(float((S[self.s.r_max :] ** 2).sum()) / energy)
        new.meta[SVD_FORM] = True
        new.meta[DISCARDED] = max(discarded, default=0.0)
        return new

    def deploy(self, state: GlobalState, cid: int | None = None) -> tuple[Arrays, float]:
        """Client cid's rank-r_k truncation at its scale s_k (`client_arrays`); None: the global factors."""
        r = self.s.r_max if cid is None else self.rank_of(state, cid)
        return self.client_arrays(state, r), self.s.scale(r)


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> FlexLoRA:
    return FlexLoRA(lora_settings(cfg))


IMPLEMENTATION = lora_implementation(_strategy)
