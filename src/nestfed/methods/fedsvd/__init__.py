"""FedSVD (Lee, Park, Lee, Wagner, Seong, Bocklet, Lee and Hwang, "FedSVD: Adaptive
Orthogonalization for Private Federated Learning with LoRA", NeurIPS 2025, arXiv 2505.12805; its
method section; public code: github.com/seanie12/fed-svd, ``misc/utils.py`` ``reinit_lora`` and
``fedmm/fedavg/server.py``): clients train only B, A frozen (as FFA-LoRA); the server averages the
B's, forms the product with the previous A and re-factorises it by SVD, so that A becomes the
orthonormal right singular vectors of the mean update (docs/methods.md, "The 2025 baselines").

Paper (one rank r, one scale s), per LoRA layer and round:

    Bbar = sum_k p_k B_k                      (B_k [out, r]: client k's trained B, A frozen)
    Bbar A = U S V^T                          (thin SVD of the [out, in] product; A [r, in] the previous A)
    A' = V_r^T  [r, in]                       (orthonormal rows: the top-r right singular vectors)
    B' = U_r S_r  [out, r]

Since Bbar A has rank <= r, B' A' = Bbar A exactly: the refactorisation changes the factors, never
the model; it is FFA-LoRA's aggregate written in the basis of its own singular vectors (the paper's
point: an orthonormal A bounds B's gradients under DP-SGD, and A follows the principal directions
of the updates instead of staying at its random start).

Here:

- The SVD is taken without forming Bbar A (QR of A^T, SVD of the small [out, r] core, float64);
  each singular pair is signed so that the largest-magnitude entry of its U column is positive, so
  the factors do not depend on the LAPACK build's sign choice (exact resume).
- Weights (``[fedsvd] weighting``): p_k = n_k / N (``examples``, the default and the authors' code's
  default) or 1 / K (``uniform``, the code's ``--balanced``).
- ``[fedsvd] period``: re-factorise in every ``period``-th round (1, the default and the paper's:
  every round); in the other rounds the server only averages B (FFA-LoRA). The authors' code has
  this as ``recalculate_svd_period`` (beside a warm-up, not built here).
- *Decision* (heterogeneous ranks; the paper uses one rank): client k of rank r_k trains
  B[:, :r_k] against the frozen A[:r_k] at its scale s_k; the mean product is
  M = sum_k p_k s_k B_k A[:r_k] = s (sum_k p_k (s_k / s) pad(B_k)) A (zero-padded to r_max, exact)
  and the server stores the rank-r_max SVD factors of M / s. Because the singular pairs are sorted,
  client k's prefix A'[:r_k], B'[:, :r_k] is the best rank-r_k approximation of the mean update
  (Eckart-Young, as FlexLoRA's redistribution), sent with B multiplied by s / s_k so that the
  client runs s B'[:, :r_k] A'[:r_k] (the identity under the default ``lora.scaling = "fixed"``).
  A reply below the client's own rank (elastic ranks) is aggregated at the rank it trained.
- Round 0: A is the usual random start and B = 0; a layer whose mean product is exactly zero keeps
  its factors (an SVD of zero would give B = 0 and an arbitrary A).

Deviations of public code from the paper, found while reading it (none is copied): the authors'
code refactorises the server model's B A after its ``ffa`` aggregation, which is the paper's rule.
FedLLM-Factory's ``alg/fedsvd.py`` calls ``torch.svd`` (which returns V, not V^T) and takes
``V[:r, :]``, the first r rows of V instead of its first r columns transposed: its new A is not
the top right singular vectors (and has the wrong shape when in > out).

Refused: a robust rule or central DP (the rule re-factorises the mean product, which does not cut
into rank blocks of the factors), a server optimiser (two SVD factorisations differ by a rotation,
not by an update) and secure aggregation (its rebuild from sums is not written).
"""

from __future__ import annotations

from dataclasses import dataclass

from nestfed.config.capabilities import GLOBAL_ADAPTER, RANK_PREFIX_CLIENTS
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method

WEIGHTINGS = ("examples", "uniform")


@dataclass(frozen=True)
class FedSVDOptions:
    """Options of ``[fedsvd]``.

    Attributes:
        weighting: the weights p_k of the mean of B, ``examples`` (n_k / N, the default and the
            authors' code's) or ``uniform`` (1 / K, the code's ``--balanced``).
        period: re-factorise by SVD in every ``period``-th round, an integer >= 1 (1, the default
            and the paper's: every round; the others only average B, as FFA-LoRA).

    Raises:
        ValueError: naming the field for any other value.
    """

    weighting: str = "examples"
    period: int = 1

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting: unknown weighting '{self.weighting}' (known: {', '.join(WEIGHTINGS)})")
        if isinstance(self.period, bool) or not isinstance(self.period, int) or self.period < 1:
            raise ValueError(f"period: {self.period!r} is not a count of rounds (an integer >= 1)")


METHOD = lora_method(
    "fedsvd",
    "A frozen on the clients, only B trained; the server re-factorises mean(B) A by SVD, "
    "A = its top right singular vectors (Lee et al., NeurIPS 2025)",
    "nestfed.methods.fedsvd.strategy",
    sections={"fedsvd": FedSVDOptions},
    capabilities=RANK_PREFIX_CLIENTS | GLOBAL_ADAPTER | {C.RESUME},
    refusals={
        C.ROBUST_AGGREGATION: "FedSVD re-factorises the mean product mean(B) A by SVD, which does not cut "
        "into rank blocks of A and B, so a robust rule or central DP over the blocks would not be its rule "
        "(a norm bound, validation.max_update_norm, does apply; docs/trust.md)",
        C.SERVER_OPTIMIZER: "its aggregate is a fresh SVD factorisation: the new factors differ from the "
        "state's by a change of basis, not an update, so there is no pseudo-gradient to step",
        C.SECURE_AGGREGATION: "its rebuild from sums (the mean of B, then the SVD) is not written",
    },
)
