"""FedEx-LoRA (Singhal, Ponkshe and Vepakomma, "Exact Aggregation for Federated and Efficient
Fine-Tuning of Foundation Models", arXiv 2410.09432, ACL 2025; its method section): FedAvg of A and B, plus the
residual the averaging misses folded into the frozen weights, so the aggregated model is exactly
the weighted mean of the clients' models (docs/methods.md, "Baselines reviewers ask for").

Paper (one rank r, one scale s, its aggregation rule, section 3 "Method"): Abar = (1/K) sum_k A_k,
Bbar = (1/K) sum_k B_k and W0 <- W0 + (1/K) sum_k s B_k A_k - s Bbar Abar on the server and every
client: the paper and its authors' code average the K clients with equal weights 1/K.

Weights (``[fedex_lora] weighting``, `FedExLoRAOptions`): p_k = n_k / N (``examples``, the
default) or p_k = 1 / K (``uniform``, the paper's). The formulas below hold for either. *Decision*
(the default): n_k / N, the weighting of every other nestfed rule, so that a comparison weighs the
clients alike and the states pinned before the option existed stay bit-identical (a run directory
without the section resumes as it ran). ``uniform`` is the paper's rule exactly. Public code read
for this (none copied): FedLLM-Factory's ``alg/fedexlora.py`` mixes the two weightings (the mean
product with n_k / N, Abar, Bbar and their product with 1/K) and adds the residual without the LoRA
scale, so its model is the mean of the clients' only when n_k are equal and s = 1; the FedEx rule
in the FedSVD authors' code (seanie12/fed-svd) uses one weighting throughout (n_k / N, or 1/K with
its ``--balanced``) and the scale.

Here (nestfed.nn.lora keeps a layer's frozen residual factorised as ``merged_B @ merged_A``, as
FLoRA does):

- The residual is kept exactly as a stack of factors, ``merged_A`` [R, in] (rows carry the
  scales) and ``merged_B`` [out, R]: each round appends rows p_k s_k A_k with columns B_k, and rows
  -s Abar with columns Bbar. The global model is W0 + merged_B merged_A + s Bbar Abar with
  s = scale(r_max).
- *Decision* (heterogeneous ranks, beyond the paper): Abar and Bbar are zero-padded means to r_max
  (ZeroPad's); a client of rank r_k trains the prefix Abar[:r_k], Bbar[:, :r_k] at its scale s_k,
  and the rest of the global model is folded into the frozen residual it receives
  (`client_fold`): s Bbar Abar - s_k Bbar[:, :r_k] Abar[:r_k]. So every client starts each
  round from exactly the global model, and the mean of the clients' models after training is
  G + sum_k p_k s_k (B_k A_k - Bbar[:, :r_k] Abar[:r_k]) with G the global delta; the round's
  residual (`round_residual`) therefore also carries sum_j d_j Bbar[:, j] Abar[j] with
  d_j = sum_k p_k (s - s_k [r_k > j]) (zero at equal ranks and one scale: the paper's rule).
- *Decision* (bytes): as FLoRA, the downlink is the whole residual stack (a client that skipped
  rounds is still exact). It grows by about sum_k r_k + r_max rows a round; once it exceeds
  min(out, in) rows it is replaced by the dense residual written as an exact factorisation
  (`compact`: [W, I] or [I, W]), so it never holds more than min(out, in) rows (at that cap
  the downlink carries the dense residual plus an identity factor).
- Exactness: the factors are exact; float32 rounding of their entries (and of the dense residual
  after compaction) is the only error.

deploy(state, cid) is client cid's prefix and fold (the global model exactly); export() writes one
PEFT adapter at scale 1, A = [merged_A; s Abar], B = [merged_B, Bbar] (rank R + r_max, zero-padded
to the largest over the layers), whose product is the global delta exactly. Its rank prefixes are
not models a client runs (it does not declare ``EXPORT_AT_RANK``: the mechanism reports skip it). A robust rule
or central DP is refused: every client's exact product enters the residual, which no rule over the
A and B blocks would guard; so is a server optimiser (the residual's arrays change shape).
"""

from __future__ import annotations

from dataclasses import dataclass

from nestfed.config.capabilities import RANK_PREFIX_CLIENTS
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method

WEIGHTINGS = ("examples", "uniform")


@dataclass(frozen=True)
class FedExLoRAOptions:
    """Options of ``[fedex_lora]``.

    Attributes:
        weighting: the client weights p_k of the means and of the residual: ``examples`` (p_k = n_k
            / N, the default: every other nestfed rule's weights, and the states pinned before the
            option existed) or ``uniform`` (p_k = 1 / K, the paper's and its authors' code's).

    Raises:
        ValueError: naming the field for any other value.
    """

    weighting: str = "examples"

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting: unknown weighting '{self.weighting}' (known: {', '.join(WEIGHTINGS)})")


METHOD = lora_method(
    "fedex_lora",
    "FedAvg of A and B plus the exact residual mean(s_k B_k A_k) - s Bbar Abar "
    "folded into the frozen weights (Singhal et al., ACL 2025)",
    "nestfed.methods.fedex_lora.strategy",
    sections={"fedex_lora": FedExLoRAOptions},
    capabilities=RANK_PREFIX_CLIENTS | {C.RESUME},
    refusals={
        C.ROBUST_AGGREGATION: "FedEx-LoRA folds every client's exact product s_k B_k A_k into the frozen "
        "residual, which a rule over the A and B blocks would not guard (a norm bound, "
        "validation.max_update_norm, does apply; docs/trust.md)",
        C.SERVER_OPTIMIZER: "its frozen residual is a stack of factors that grows every round (until it "
        "is compacted to the dense residual), so its arrays do not keep their shapes and there is no "
        "pseudo-gradient to step",
        C.SECURE_AGGREGATION: "it folds every client's exact product into the frozen residual, which a "
        "sum of updates loses",
    },
)
