"""Fed-SB (Singhal, Ponkshe, Vartak, Varshney and Vepakomma, "Fed-SB: A Silver Bullet for Extreme
Communication Efficiency and Performance in (Private) Federated LoRA Fine-Tuning", arXiv
2502.15436; its method section): LoRA-SB's update Delta W = B R A with B [out, r] and A [r, in]
frozen, clients train only R [r, r], and the server averages R:

    R^agg = (1/c) sum_i R_i,        Delta W^agg = B R^agg A = (1/c) sum_i B R_i A

(the paper's aggregation, over its c clients, as its authors' project page and summaries state
it; the paper's own text, and so its equation numbers, could not be read here), so the aggregate
is exactly the mean of the clients' updates and a client's upload is r^2 numbers per layer
whatever the number of clients (docs/methods.md section 7).

Here (nestfed.methods.fed_sb.strategy; the layer variant is nestfed.nn.lora_core.SquareCore):

- The update is s B R A with nestfed's LoRA scale s (``lora.scaling``). Only R travels (key
  ``...lora_core.weight`` [r, r]), in both directions: the server and every client draw A and B
  from the LoRA seed (nestfed.methods.fed_sb.frozen_factors), the paper's one-time distribution
  of the frozen adapters done by the seed.
- *Decision* (weights): R^agg = sum_k (n_k / N) R_k, FedAvg's weights like every nestfed rule;
  the paper's (and its public code's) 1/c is the same when the clients hold equal data.
- Where the public code (CERT-Lab/fed-sb, read in its fork putssander/fed-sb at 3515e04 and
  223f345) deviates from the paper: its multi-round script
  (fed/CR/multiround_train_cr_fed.py) appends every client's R to one list created before the
  round loop and never cleared, so round t's aggregate is the mean over the clients of rounds
  1..t, not over the round's c clients as R^agg = (1/c) sum_i R_i says; nestfed averages the
  round's replies only. Its single-round aggregation (fed/fed_agg.py,
  ``aggregate_models_fed_sb``) is the paper's plain mean.
- *Decision* (initialisation): LoRA-SB initialises B, R, A from a truncated SVD of an
  approximation of the first full fine-tuning step. The public code
  (``estimate_and_process_grads_torch`` and ``find_and_initialize_grad``) takes
  -lr_eff sign(sum of full-weight gradients over ``num_samples`` = 170 examples), its SVD
  U S V^T at rank r, and sets B = U, A = V^T, R = S, the adapter starting at that truncated step
  (lora_alpha = r, so s = 1). The gradient is computed on the *whole training set before it is
  split among the clients*: pooled client data on one machine, which a federation does not have.
  nestfed draws B with orthonormal columns
  and A with orthonormal rows (seeded QR of Gaussian draws, stream ``fed_sb_init/<module>``, the
  same on every node) and starts R at 0, so round 1 starts from the backbone. A federated
  gradient initialisation (clients' summed sign-gradients, itself a round of communication) is not
  built.
- *Decision* (ranks): one rank for every client, as the public code runs it. Summaries of the
  paper say it also takes clients of different ranks, which we could not read; heterogeneous and
  elastic ranks are refused: a client at a lower rank would train a block of R while running the
  rest frozen, a rule not written here (its reply would not be a prefix of R's rows, which the
  secure sums need).
- Robust rules and central DP apply to R as one block (the default block rule over the replies;
  R is the update's whole parameterisation); a server optimiser steps R (A and B never move, so
  their pseudo-gradient is 0). Secure aggregation gives the rule exactly: R's rows are its rank
  dimension (row j feeds B's column j; nestfed.nn.keys.rank_dim), every client holds every row,
  and the new R is G + S / N from the sum S of the n_k-weighted updates (``aggregate_secure``),
  so replies also fold into running sums (``federation.hold_replies``).
- Options (``[fed_sb]``, `FedSBOptions`): ``lr``, the core's own learning rate.
- Export: one PEFT LoRA adapter of rank r, A' = A and B' = B R at scale s (B' A' = B R A exactly;
  nestfed.federation.aggregation.fold_cores). Its rank prefixes are no model a client runs (R mixes
  every direction), so it does not declare ``EXPORT_AT_RANK``.
"""

from __future__ import annotations

from dataclasses import dataclass

from nestfed.config.capabilities import MEAN_AGGREGATOR
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method


@dataclass(frozen=True)
class FedSBOptions:
    """Options of ``[fed_sb]``.

    Attributes:
        lr: the core's own AdamW learning rate on the clients (>= 0; 0 = ``train.lr``): R moves
            about sqrt(out / 3r) times less per step than LoRA at one rate (docs/methods.md section
            7).

    Raises:
        ValueError: when lr < 0.
    """

    lr: float = 0.0

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")


#: what the core methods (Fed-SB, RAVAN) can do, and why they refuse the rest
CORE_CAPABILITIES = MEAN_AGGREGATOR | {C.SECURE_AGGREGATION, C.RESUME, C.GLOBAL_MODEL}
CORE_REFUSALS = {
    C.EXPORT_AT_RANK: "the exported adapter (A, B M) is exact at rank r only: the core M mixes every "
    "direction, so no rank prefix is a model a client runs",
}

METHOD = lora_method(
    "fed_sb",
    "A and B frozen, clients train only R [r, r] between them; R averaged exactly, "
    "r^2 numbers per layer (Singhal et al. 2025)",
    "nestfed.methods.fed_sb.strategy",
    sections={"fed_sb": FedSBOptions},
    capabilities=CORE_CAPABILITIES,
    refusals={
        **CORE_REFUSALS,
        C.HETEROGENEOUS_RANKS: "every client trains one R [r, r] between the same frozen A and B at one "
        "rank (the paper's setting; a lower-rank client's block rule is not written)",
    },
)
