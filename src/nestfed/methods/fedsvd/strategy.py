"""fedsvd: the server strategy and the client hooks (the method is declared in nestfed.methods.fedsvd)."""

from __future__ import annotations

import torch

from nestfed.config import ExperimentConfig
from nestfed.federation.aggregation import pad_rank, truncate_rank, weighted_mean
from nestfed.federation.hooks import ClientHooks
from nestfed.federation.messages import Arrays, GlobalState, Reply
from nestfed.federation.strategy import LoraSettings, LoraStrategy, copy_state, examples
from nestfed.methods.fedsvd import FedSVDOptions
from nestfed.methods.implementation import lora_implementation, lora_settings
from nestfed.nn.keys import module_of, peft_key


def product_svd(B: torch.Tensor, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The thin SVD of B A without forming the [out, in] product (FedSVD's server step).

    With the reduced QR A^T = Q R (Q [in, q_a], R [q_a, r]), B A = (B R^T) Q^T, and the SVD of the
    small core B R^T = U S W^T gives B A = U S (W^T Q^T). Float64 throughout. Signs: the
    largest-magnitude entry of each column of U is positive (the first on ties).

    Args:
        B: [out, r].
        A: [r, in].

    Returns:
        U [out, q], S [q] (descending, >= 0) and Vh [q, in] (orthonormal rows), q = min(out, q_a).

    Raises:
        ValueError: when the shapes do not chain.
    """
    if B.dim() != 2 or A.dim() != 2 or B.shape[1] != A.shape[0]:
        raise ValueError(f"factors B {tuple(B.shape)} and A {tuple(A.shape)} do not chain into one [out, in]")
    Q, R = torch.linalg.qr(A.double().T)  # [in, q_a], [q_a, r]
    U, S, Wh = torch.linalg.svd(B.double() @ R.T, full_matrices=False)  # core [out, q_a]
    Vh = Wh @ Q.T
    sign = torch.sign(U[U.abs().argmax(dim=0), torch.arange(U.shape[1])])
    sign[sign == 0] = 1.0
    return U * sign, S, Vh * sign[:, None]


def refactorise(B: torch.Tensor, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """FedSVD's re-factorisation of B A at B's rank r: A' = V_r^T [r, in], B' = U_r S_r [out, r].

    From `product_svd`, so B' A' = B A (B A has rank <= r) and A' has orthonormal rows. When
    the SVD has fewer than r pairs (out < r) the missing rows of A' and columns of B' are zero.

    Args:
        B: [out, r].
        A: [r, in].

    Returns:
        A' and B' in A's and B's dtypes, or None when B A = 0 (the caller keeps its factors).

    Raises:
        ValueError: as `product_svd` raises it.
    """
    U, S, Vh = product_svd(B, A)
    if S.numel() == 0 or float(S[0]) == 0.0:
        return None
    r = B.shape[1]
    q = min(r, S.shape[0])
    A_new = torch.zeros(r, A.shape[1], dtype=torch.float64)
    B_new = torch.zeros(B.shape[0], r, dtype=torch.float64)
    A_new[:q] = Vh[:q]
    B_new[:, :q] = U[:, :q] * S[:q]
    return A_new.to(A.dtype), B_new.to(B.dtype)


def lora_modules_of(arrays: Arrays) -> list[str]:
    """Module paths of the ``lora_A`` keys of a payload, sorted.

    Args:
        arrays: the payload.

    Returns:
        The module paths.
    """
    return sorted(module_of(k)[0] for k in arrays if k.endswith("lora_A.weight"))


class FedSVD(LoraStrategy):
    """Global state: ``lora_A`` [r_max, in] and ``lora_B`` [out, r_max] at the global scale s.

    A has orthonormal rows after the first re-factorisation (module docstring of
    nestfed.methods.fedsvd).

    Args:
        settings: the LoRA numbers.
        options: ``[fedsvd]``; the defaults when None.
    """

    name = "fedsvd"

    def __init__(self, settings: LoraSettings, options: FedSVDOptions | None = None):
        self.o = options if options is not None else FedSVDOptions()
        super().__init__(settings, self.o)

    def reply_keys(self, sent: Arrays) -> list[str]:
        """Only B comes back (A is frozen on the client)."""
        return [k for k in sent if k.endswith("lora_B.weight")]

    def client_arrays(self, state: GlobalState, rank: int) -> Arrays:
        """The rank-r_k prefix, B multiplied by s / s_k so that the client runs s B[:, :r_k] A[:r_k].

        The factor is 1 under ``fixed`` scaling.

        Raises:
            ValueError: when rank exceeds r_max.
        """
        out = truncate_rank(state.arrays, rank)
        factor = self.s.scale(self.s.r_max) / self.s.scale(rank)
        if factor != 1.0:
            out = {k: (v * factor if k.endswith("lora_B.weight") else v) for k, v in out.items()}
        return out

    def weights(self, replies: dict[int, Reply]) -> dict[int, float]:
        """The unnormalised client weights: n_k (``examples``) or 1 (``uniform``).

        Args:
            replies: {cid: reply} of the round.

        Returns:
            {cid: weight}.
        """
        return {c: 1.0 for c in replies} if self.o.weighting == "uniform" else examples(replies)

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """Per layer: Bbar = sum_k p_k (s_k / s) pad(B_k), then (every ``period``-th round) `refactorise`.

        The product re-factorised is Bbar A with the state's A; a zero product keeps (A, Bbar).
        """
        new = copy_state(state)
        w = self.weights(replies)
        cids = sorted(replies)
        s_global = self.s.scale(self.s.r_max)
        svd_round = rnd % self.o.period == 0
        for m in lora_modules_of(state.arrays):
            a_key, b_key = peft_key(m, "lora_A"), peft_key(m, "lora_B")
            padded = []
            for c in cids:
                b = replies[c].arrays[b_key]
                factor = self.s.scale(b.shape[1]) / s_global
                padded.append(pad_rank(b if factor == 1.0 else b * factor, 1, self.s.r_max))
            B_bar = weighted_mean(padded, [w[c] for c in cids])
            new.arrays[b_key] = B_bar
            if svd_round:
                pair = refactorise(B_bar, state.arrays[a_key])
                if pair is not None:
                    new.arrays[a_key], new.arrays[b_key] = pair
        return new

    def deploy(self, state: GlobalState, cid: int | None = None) -> tuple[Arrays, float]:
        """Client cid's prefix at its scale s_k (`client_arrays`); None: the global factors at s."""
        r = self.s.r_max if cid is None else self.rank_of(state, cid)
        return self.client_arrays(state, r), self.s.scale(r)


class FedSVDHooks(ClientHooks):
    """A stays frozen on the client: only B trains and travels back."""

    train_a = False


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> FedSVD:
    return FedSVD(lora_settings(cfg), cfg.section("fedsvd"))


IMPLEMENTATION = lora_implementation(_strategy, hooks=lambda cfg: FedSVDHooks())
