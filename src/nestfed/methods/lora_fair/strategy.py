"""lora_fair: the server strategy and the client hooks (the method is declared in nestfed.methods.lora_fair)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nestfed.config import ExperimentConfig
from nestfed.federation.aggregation import pad_rank, weighted_mean
from nestfed.federation.messages import Arrays, GlobalState, Reply
from nestfed.federation.strategy import LoraSettings, LoraStrategy, copy_state, examples
from nestfed.methods.implementation import lora_implementation, lora_settings
from nestfed.methods.lora_fair import LoraFairOptions
from nestfed.nn.keys import module_of, peft_key


def correction(
    A_bar: torch.Tensor,
    B_bar: torch.Tensor,
    As: Sequence[torch.Tensor],
    Bs: Sequence[torch.Tensor],
    coeffs: Sequence[float],
    lam: float,
) -> torch.Tensor:
    """LoRA-FAIR's correction dB [out, r] in its closed least-squares form.

    The minimiser of ||(Bbar + dB) Abar - T||_F^2 + lam ||dB||_F^2 with T = sum_k c_k B_k A_k
    (module docstring of nestfed.methods.lora_fair), that is

        dB = (T - Bbar Abar) Abar^T (Abar Abar^T + lam I)^+

    T Abar^T is formed as sum_k c_k B_k (A_k Abar^T), never as an [out, in] matrix. Float64 inside.

    Args:
        A_bar: [r, in] the mean A.
        B_bar: [out, r] the mean B.
        As: the clients' A_k, [r_k, in] each.
        Bs: the clients' B_k, [out, r_k] each.
        coeffs: the c_k (p_k s_k / s).
        lam: the regulariser's weight, >= 0.

    Returns:
        dB [out, r] in B_bar's dtype.

    Raises:
        ValueError: for lam < 0, lists of different lengths, or factors whose shapes do not chain.
    """
    if lam < 0 or len(As) != len(Bs) or len(Bs) != len(coeffs):
        raise ValueError(f"correction needs lam >= 0 and as many A, B and coefficients, got lam {lam}")
    Ab, Bb = A_bar.double(), B_bar.double()
    target = torch.zeros_like(Bb)  # T Abar^T [out, r]
    for A, B, c in zip(As, Bs, coeffs):
        if A.shape[1] != Ab.shape[1] or B.shape[0] != Bb.shape[0] or B.shape[1] != A.shape[0]:
            raise ValueError(f"factors B {tuple(B.shape)} and A {tuple(A.shape)} do not chain with the means")
        target += float(c) * B.double() @ (A.double() @ Ab.T)
    gram = Ab @ Ab.T  # [r, r]
    inverse = torch.linalg.pinv(gram + lam * torch.eye(gram.shape[0], dtype=torch.float64), hermitian=True)
    return ((target - Bb @ gram) @ inverse).to(B_bar.dtype)


def lora_modules_of(arrays: Arrays) -> list[str]:
    """Module paths of the ``lora_A`` keys of a payload, sorted.

    Args:
        arrays: the payload.

    Returns:
        The module paths.
    """
    return sorted(module_of(k)[0] for k in arrays if k.endswith("lora_A.weight"))


class LoraFair(LoraStrategy):
    """Global state: Abar ``lora_A`` [r_max, in] and the corrected Bbar + dB ``lora_B`` [out, r_max].

    Both at the global scale s; clients receive its rank-r_k prefix (the base class's).

    Args:
        settings: the LoRA numbers.
        options: ``[lora_fair]``; the defaults when None.
    """

    name = "lora_fair"

    def __init__(self, settings: LoraSettings, options: LoraFairOptions | None = None):
        self.o = options if options is not None else LoraFairOptions()
        super().__init__(settings, self.o)

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """Per layer: Abar, Bbar the n_k-weighted zero-padded means, then B = Bbar + `correction`.

        The coefficients are p_k s_k / s (p_k = n_k / N over ``replies``).
        """
        new = copy_state(state)
        n = examples(replies)
        total = sum(n.values())
        cids = sorted(replies)
        s_global = self.s.scale(self.s.r_max)
        for m in lora_modules_of(state.arrays):
            a_key, b_key = peft_key(m, "lora_A"), peft_key(m, "lora_B")
            As = [replies[c].arrays[a_key] for c in cids]
            Bs = [replies[c].arrays[b_key] for c in cids]
            A_bar = weighted_mean([pad_rank(a, 0, self.s.r_max) for a in As], [n[c] for c in cids])
            B_bar = weighted_mean([pad_rank(b, 1, self.s.r_max) for b in Bs], [n[c] for c in cids])
            coeffs = [n[c] / total * self.s.scale(a.shape[0]) / s_global for c, a in zip(cids, As)]
            new.arrays[a_key] = A_bar
            new.arrays[b_key] = B_bar + correction(A_bar, B_bar, As, Bs, coeffs, float(self.o.lam))
        return new


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> LoraFair:
    return LoraFair(lora_settings(cfg), cfg.section("lora_fair"))


IMPLEMENTATION = lora_implementation(_strategy)
