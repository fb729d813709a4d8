"""raFLoRA (Wu, Hu, Min and Wang, "Preventing Rank Collapse in Federated Low-Rank Adaptation with
Client Heterogeneity", arXiv 2602.13486, v2 of 9 May 2026): heterogeneous-rank federated LoRA with
SVD-based allocation (FlexLoRA's redistribution, nestfed.methods.flexlora) whose server averages
each *rank partition* of the clients' updates over the clients that contribute to it
(docs/methods.md section 8).

What the paper says, as far as it could be read here (its abstract, v1 and v2, and its outline:
sections 3 Preliminaries, 4 Problem Analysis, 5 raFLoRA Method, appendices A "Proof of Rank
Collapse in Heterogeneous FedLoRA", B "A Mean-Field Analysis under General Non-IID Settings" and E
"Hyperparameter Settings for Main Experiments"; the stored copies of the paper, arxiv.org/html
v1 and the v2 markdown, hold only its opening, so the text of sections 3-5, its equations and their
numbers, and Algorithm 1 could not be reached, and no public code was found):

- *Rank collapse*: under SVD-based allocation the energy of the global update concentrates in the
  minimum shared rank. Cause: a mismatch between rank-agnostic aggregation weights and
  rank-dependent client contributions, which suppresses the higher-rank updates at a geometric
  rate over rounds.
- *raFLoRA*: decompose the local updates into rank partitions and aggregate each partition
  weighted by its effective client contributions; communication stays FlexLoRA's.
- A third-party machine reading of the paper (pith.science/p/2602.13486, not the authors') restates
  the rule as weighting "each rank level separately by the number of clients actually supplying
  updates at that rank": the holder sets C_j below, renormalised over, as both weightings here do
  (``uniform`` is exactly 1 / |C_j|).

The rule built here, per LoRA layer and round (notation of docs/methods.md section 5: p_k the
client weights, s_k client k's scale, s = scale(r_max), B, A the global factors):

    bounds   r_(1) < ... < r_(L): the distinct ranks the replies trained, and r_max
    P_j      = [r_(j-1), r_(j)), r_(0) = 0                          (the rank partitions)
    C_j      = {k : r_k >= r_(j)}                                  (the clients holding P_j)
    q_kj     = p_k / sum_{k' in C_j} p_k'                           (effective weights)
    W_j      = sum_{k in C_j} q_kj s_k B_k[:, P_j] A_k[P_j, :]      (C_j not empty)
             = s B[:, P_j] A[P_j, :]                                (C_j empty: the global's)
    W        = sum_j W_j, then FlexLoRA's redistribution: the state holds W's rank-r_max
               truncated SVD, client k continues from its rank-r_k truncation.

The partition products are exact (B A = sum_i B[:, i] A[i, :] splits along the rank index with no
cross terms), and W is factorised without an [out, in] matrix (flexlora's ``product_svd`` over the
stacked partition blocks). Under FlexLoRA (W = sum_k p_k s_k B_k A_k) a direction i in P_j that no
client moves is multiplied by sum_{k in C_j} p_k < 1 in every round: the geometric suppression the
paper names. Here the weights of each partition sum to 1, so a round in which no client moves
leaves W unchanged (tested).

Decisions (the paper's text being unreadable):

- *Effective contribution*: client k contributes to P_j when its trained rank covers it
  (r_k >= r_(j)), and its weight there is its federation weight renormalised over those clients,
  q_kj above: the reading of "rank-agnostic weights" (p_k summed over every client) against
  "rank-dependent contributions" (only C_j updates P_j) that makes each partition a mean of the
  updates that reach it. p_k = n_k / N (``[raflora] weighting = "examples"``, the default and every
  other rule's here) or 1 / K (``"uniform"``). Not built: weights that also scale with the size of
  each client's partition update.
- *Partition bounds* are the ranks the round's replies trained (an elastic reply counts at the rank
  it trained). The finer partitions of every rank in the federation (PreLort's R_fed) give the same
  W: the holder sets change only at the replies' ranks.
- *A partition no reply holds* (no sampled client of that rank, or [max r_k, r_max) when
  ``lora.r_max`` is above every rank) keeps the global state's component, as an update of zero:
  the n_k-weighted update mean of each partition is added to the global partition, which for a
  held partition is the same W (its starts are the global partition for every holder). FlexLoRA
  drops such a partition instead.
- Everything after W is FlexLoRA's: the symmetric split of the singular values, the canonical
  signs, round 0 (random A, B = 0) and a layer whose W is zero keeping its factors, the payload
  rescaled by sqrt(s / s_k), the ``svd_form`` and ``discarded_energy`` meta.

Degenerate cases (tested): when every reply trained r_max, the one partition is held by every
client, q_k = p_k, and the aggregate is FlexLoRA's bit for bit; identical clients of equal rank then
give FedAvg's product. When every client returns the global B unchanged (only A moved), W is
s B times PreLort's segment-wise aggregate of A (nestfed.methods.prelort, ``segment_average``).

Refused: a robust rule or central DP (the rule averages partition products s_k B_k[:, P_j]
A_k[P_j, :] and re-factorises them: no rank block of A and B carries them), a server optimiser (the
state is a fresh SVD factorisation, whose difference from the last is no update of the factors)
and secure aggregation (products are no sums of updates).
"""

from __future__ import annotations

from dataclasses import dataclass

from nestfed.config.capabilities import GLOBAL_ADAPTER, RANK_PREFIX_CLIENTS
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method

WEIGHTINGS = ("examples", "uniform")


@dataclass(frozen=True)
class RaFLoRAOptions:
    """Options of ``[raflora]``.

    Attributes:
        weighting: the client weights p_k that each rank partition renormalises over the clients
            holding it, ``examples`` (n_k / N, the default) or ``uniform`` (1 / K).

    Raises:
        ValueError: naming the field, for any other weighting.
    """

    weighting: str = "examples"

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting: unknown weighting '{self.weighting}' (known: {', '.join(WEIGHTINGS)})")


METHOD = lora_method(
    "raflora",
    "FlexLoRA's SVD allocation, but each rank partition of the clients' products averaged over the "
    "clients whose rank covers it (Wu et al. 2026, arXiv 2602.13486)",
    "nestfed.methods.raflora.strategy",
    sections={"raflora": RaFLoRAOptions},
    capabilities=RANK_PREFIX_CLIENTS | GLOBAL_ADAPTER | {C.RESUME},
    refusals={
        C.ROBUST_AGGREGATION: "raFLoRA averages the partition products s_k B_k[:, P] A_k[P, :] and "
        "re-factorises their sum by SVD: no rank block of A and B carries them, so a robust rule or "
        "central DP over the blocks would not be its rule (a norm bound, validation.max_update_norm, "
        "does apply; docs/trust.md)",
        C.SERVER_OPTIMIZER: "its aggregate is a fresh SVD factorisation of the partition-wise mean, "
        "defined only up to the sign and order of the singular pairs: the aggregate minus the state "
        "is no update of the factors, so there is no pseudo-gradient to step",
        C.SECURE_AGGREGATION: "it averages partition products s_k B_k[:, P] A_k[P, :], not the factors "
        "a secure sum adds",
    },
)
