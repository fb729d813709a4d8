"""LoRA-FAIR (Bian, Wang, Zhang and Xu, "LoRA-FAIR: Federated LoRA Fine-Tuning with Aggregation and
Initialization Refinement", ICCV 2025, arXiv 2411.14961; its method section, Eq. 8): the server
averages A and B and adds a correction dB to B so that (Bbar + dB) Abar is close to the mean of the
clients' products; every client starts the next round from the corrected pair (the paper's
"Avg-Initial"), and nothing is folded into the frozen weights (docs/methods.md, "The 2025
baselines").

Paper (one rank r, one scale), per LoRA layer and round, p_k = n_k / N:

    Abar = sum_k p_k A_k,  Bbar = sum_k p_k B_k,  dW = sum_k p_k B_k A_k
    dB* = argmin_dB  S(dW, (Bbar + dB) Abar) + lambda ||dB||          (Eq. 8)
    clients start from A = Abar, B = Bbar + dB*

with S the cosine similarity (as a loss: the correction term pulls (Bbar + dB) Abar towards dW's
direction), lambda = 0.01, solved by SGD on the server. The regulariser keeps Bbar + dB near Bbar
(the ablation without it aligns the product best and trains worst).

Implemented here (a *decision*; the paper's public code was not available to read): the
regularised least-squares form of Eq. 8, in closed form,

    dB* = argmin_dB ||(Bbar + dB) Abar - dW / s||_F^2 + lambda ||dB||_F^2
        = (dW / s - Bbar Abar) Abar^T (Abar Abar^T + lambda I)^+          [out, r]

(``+``: the pseudo-inverse, for lambda = 0 and a rank-deficient Abar). The squared Frobenius
distance replaces the cosine similarity and ||dB||_F^2 the paper's norm: the closed form needs no
server learning rate or step count, is deterministic (exact resume) and never forms an [out, in]
matrix (dW / s Abar^T = sum_k p_k (s_k / s) B_k (A_k Abar^T)). Unlike the cosine, it also matches
the product's scale. At lambda = 0 the corrected product is the projection of dW / s onto Abar's
row space, the best any B can do with A = Abar; that projection also maximises the paper's cosine
(which any positive multiple of it maximises too), so the two objectives agree at lambda = 0 up to
the product's scale, which the cosine leaves free. ``[lora_fair] lam`` (lambda, default 0.01: the
paper's value, though it weighs a different objective here; the scale of Abar Abar^T sets its
effect).

- *Decision* (heterogeneous ranks; the paper assumes one rank and leaves others to future work):
  Abar and Bbar are ZeroPad's zero-padded means to r_max; dW is the exact mean of the clients'
  products s_k B_k A_k; dB is [out, r_max]; client k starts from the prefix of (Bbar + dB, Abar) at
  its scale s_k (as ZeroPad). Elastic replies are aggregated at the rank they trained.
- At equal ranks with identical clients dW = Bbar Abar, so dB = 0: FedAvg. One client: its own
  adapter back.

Refused: a robust rule or central DP (dB is fitted to every client's exact product, which no rule
over the A and B blocks guards), a server optimiser (the correction is fitted to this round's mean
product; a server step on the pair would move it off that fit) and secure aggregation (the
products B_k A_k are no sums of updates).
"""

from __future__ import annotations

from dataclasses import dataclass

from nestfed.config.capabilities import GLOBAL_ADAPTER, RANK_PREFIX_CLIENTS
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method


@dataclass(frozen=True)
class LoraFairOptions:
    """Options of ``[lora_fair]``.

    Attributes:
        lam: lambda, the weight of ||dB||_F^2 in the server's least-squares correction, a number >=
            0 (0.01, the paper's value for its own objective; 0: the exact projection of the mean
            product onto Abar's row space).

    Raises:
        ValueError: naming the field for any other value.
    """

    lam: float = 0.01

    def __post_init__(self) -> None:
        if isinstance(self.lam, bool) or not isinstance(self.lam, int | float) or not float(self.lam) >= 0.0:
            raise ValueError(f"lam: {self.lam!r} is not a number >= 0")


METHOD = lora_method(
    "lora_fair",
    "FedAvg of A and B plus a least-squares correction dB to B so that (mean B + dB) mean A is close "
    "to mean(B_k A_k); clients start from the corrected pair (Bian et al., ICCV 2025)",
    "nestfed.methods.lora_fair.strategy",
    sections={"lora_fair": LoraFairOptions},
    capabilities=RANK_PREFIX_CLIENTS | GLOBAL_ADAPTER | {C.RESUME},
    refusals={
        C.ROBUST_AGGREGATION: "LoRA-FAIR fits its correction dB to every client's exact product B_k A_k, "
        "which a rule over the A and B blocks would not guard (a norm bound, validation.max_update_norm, "
        "does apply; docs/trust.md)",
        C.SERVER_OPTIMIZER: "its correction dB is fitted to the round's mean product; a server step on "
        "the aggregate would move the pair off that fit",
        C.SECURE_AGGREGATION: "its correction needs the clients' products B_k A_k, which no sum of updates gives",
    },
)
