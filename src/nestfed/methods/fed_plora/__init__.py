"""Fed-PLoRA (Zhang, Hu and Xu, "Heterogeneous Federated Fine-Tuning with Parallel One-Rank
Adaptation", ICLR 2026, arXiv 2602.16936; public code: github.com/TNI-playground/Fed-PLoRA): the
rank-R adapter is read as R parallel rank-1 modules; each client trains the r_k modules it can
afford and folds the other R - r_k into its frozen weights ("Select-N-Fold"); the server averages
each module over the clients that trained it (docs/methods.md section 9).

Sources read here: the abstract, the four ICLR reviews, two third-party summaries of the method
section (papernotes, English and Chinese) and one reading note of its sections 3.2-3.5. The
paper's body and the public code were not available to read (no stored copy), so the equations
below are as those sources restate them, section numbers from the reading note, equation numbers
unknown; no public-code deviation could be checked.

Paper, per LoRA layer, round t, K_i^t the set of r_i module indices client i trains:

    Delta W = sum_{j=1}^R B_(j) A_(j),  B_(j) = B[:, j], A_(j) = A[j, :]      (PLoRA, section 3.2;
                                                                           exactly B A)
    W_i^t = W^0 + sum_{j not in K_i^t} B_(j)^{t-1} A_(j)^{t-1}                (Select-N-Fold, 3.3)
    client i trains B_(j), A_(j) for j in K_i^t on top of W_i^t; K_i^t drawn at random
    Q_(j)^t = {i : j in K_i^t},  Abar_(j) = mean over Q_(j)^t of A_{i,(j)}, Bbar_(j) likewise
                                                      (each module averaged over its own clients)
    N_Agg^t <= sum_j 1/|Q_(j)^t| sum_{i in Q_(j)^t} (||B_{i,(j)} - Bbar_(j)||_2
                                                      + ||A_{i,(j)} - Abar_(j)||_2)
                                                                   (aggregation noise, section 3.4)

The fold makes the client start from exactly the global model (the paper's zero initialisation
noise); the server broadcasts all R modules (the downlink is R modules whatever r_i, the reviews'
noted cost), the client uploads its r_i.

Here (nestfed.methods.fed_plora.strategy):

- The fold is exact and done by the server's payload: a client receives its selected modules as
  its trainable LoRA of rank r_k (A[K], B[:, K]) and the others as its layers' frozen residual
  ``merged_B @ merged_A`` = s B[:, not K] A[not K] (nestfed.nn.lora; the residual FLoRA and RAVAN
  use), which is W^0 + s sum_{j not in K} B_(j) A_(j) kept factorised instead of added into the
  dense W^0 (the same forward up to float rounding, cheaper, and a quantised base stays
  quantised). Folding the untrained modules into the frozen weights is mathematically the same
  forward, and the same gradient for the trained ones, as keeping them in the LoRA with their
  gradients masked; a mask is the fold only while nothing else moves the masked entries (AdamW's
  decoupled weight decay shrinks every parameter that has a gradient, zero or not) and without
  LoRA dropout (a folded module, as part of W, sees no dropout; ``lora.lora_dropout`` defaults
  to 0). tests/methods/test_fed_plora.py checks the three forms against each other.
- *Decision*, selection (``[fed_plora] selection``): ``random``, the paper's: K_k^t is r_k of the
  R indices drawn uniformly without replacement, fresh every round, from the seed rule's stream
  ``fed_plora_select`` of (federation.seed, round, client) (nestfed.seeds), so a resumed run draws
  the same modules; one K for every layer of the client (the paper's K_i^t carries no layer
  index). The server draws it and sends it (``fed_plora_modules``, sorted), and recomputes it when
  it aggregates. ``prefix`` (ours, an ablation): the first r_k modules every round, a fixed
  selection (modules above the smallest rank then train only on the clients that reach them).
- *Decision*, weights (``[fed_plora] weighting``): ``examples`` (the default), module j's mean over
  Q_j with weights n_k; ``uniform``, the plain mean 1/|Q_j| as the paper's aggregation-noise bound
  writes it. The default is nestfed's weighting for every rule and FedIT's (FedAvg with n_k), which
  summaries of the paper say Fed-PLoRA reduces to at equal ranks; the two agree when the clients
  hold equal data. A module no replying client trained keeps its value (the paper is silent).
- *Decision*, scale: every client runs the global scale s = scale(r_max) on its trained modules
  and its fold (a module is the global adapter's column and row, so it means the same on every
  client); under ``lora.scaling = "rank"`` that is lora_alpha / r_max for every client. The paper
  does not state how its LoRA scale enters PLoRA.
- Elastic ranks: a client at a lower rank this round trains that many modules (and folds the
  rest). Heterogeneous ranks are the point of the method.
- Degenerate case: every client at r_k = R trains every module, receives the whole adapter with
  nothing folded, and the aggregate is FedAvg's n_k-weighted mean bit for bit.
- Robust rules and central DP apply per group of modules held by the same clients this round
  (each module's members are its Q_j; the DP denominator is q times the expected number of
  federation clients holding a module, sum_k r_k / R under ``random``). A server optimiser steps
  the aggregate as a pseudo-gradient (modules no client trained have none). Every client deploys
  the whole global adapter (its fold plus its modules is the global model).
- Refused: secure aggregation (a client's reply rows are its selected modules, not a rank prefix,
  and secure sums count rows by prefix; a rebuild of the per-module means from sums is not
  written).
"""

from __future__ import annotations

from dataclasses import dataclass

from nestfed.config.capabilities import GLOBAL_ADAPTER, MEAN_AGGREGATOR, RANK_PREFIX_CLIENTS
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method

SELECTIONS = ("random", "prefix")
WEIGHTINGS = ("examples", "uniform")


@dataclass(frozen=True)
class FedPLoRAOptions:
    """Options of ``[fed_plora]``.

    Attributes:
        selection: which r_k of the R rank-1 modules a client trains each round, ``random`` (the
            paper's: drawn uniformly without replacement every round from the seed rule's stream
            ``fed_plora_select`` of (federation.seed, round, client); the rest folded into its
            frozen weights) or ``prefix`` (ours, an ablation: the first r_k every round).
        weighting: the weights of each module's mean over the clients that trained it, ``examples``
            (n_k, the default: FedAvg's) or ``uniform`` (1/|Q_j|, the paper's bound's mean).

    Raises:
        ValueError: naming the field, for any other value.
    """

    selection: str = "random"
    weighting: str = "examples"

    def __post_init__(self) -> None:
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection: unknown selection '{self.selection}' (known: {', '.join(SELECTIONS)})")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting: unknown weighting '{self.weighting}' (known: {', '.join(WEIGHTINGS)})")


METHOD = lora_method(
    "fed_plora",
    "R parallel rank-1 modules; each client trains r_k of them (drawn each round) and folds the "
    "rest into its frozen weights; each module averaged over the clients that trained it "
    "(Zhang et al., ICLR 2026)",
    "nestfed.methods.fed_plora.strategy",
    sections={"fed_plora": FedPLoRAOptions},
    capabilities=RANK_PREFIX_CLIENTS | MEAN_AGGREGATOR | GLOBAL_ADAPTER | {C.RESUME},
    refusals={
        C.SECURE_AGGREGATION: "a client's reply holds the modules it drew, not a rank prefix, and secure sums "
        "count rows by prefix; a rebuild of each module's mean over its own clients from sums is not written",
    },
)
