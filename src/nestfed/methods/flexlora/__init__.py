"""FlexLoRA (Bai, Chen, Ding, Zeng, Li and Chen, "Federated Fine-tuning of Large Language Models
under Heterogeneous Tasks and Client Resources", NeurIPS 2024, arXiv 2402.11505; its method
section: server aggregation and SVD-based weight redistribution).

Server, per LoRA layer (the paper's aggregation step): the n_k-weighted mean of the clients'
full-size updates, W = sum_k p_k s_k B_k A_k (p_k = n_k / N over the replying clients, s_k the
client's LoRA scale), then the SVD W = U S V^T; client k continues from the best rank-r_k
approximation of W, s_k B_k' A_k' = U[:, :r_k] S[:r_k] V[:, :r_k]^T (Eckart-Young), so the
clients' ranks may differ (docs/methods.md, "Baselines reviewers ask for").

What is exact and what is truncated:

- W is formed exactly, factorised (no [out, in] matrix): `product_svd` takes QR
  decompositions of the stacked factors and the SVD of the small core, in float64.
- The global state holds the rank-r_max truncation of W as one LoRA of rank r_max at the global
  scale s = scale(r_max) (``lora_A`` [r_max, in], ``lora_B`` [out, r_max]). W has rank at most
  min(sum_k r_k, out, in), so this truncation is exact when that is <= r_max and drops the
  singular values beyond r_max otherwise; the largest dropped share of ||W||_F^2 over the layers is
  kept as ``discarded_energy`` in the state's meta. Every client's payload is exactly its rank-r_k
  truncation of W, because r_k <= r_max and the SVD's rank-r_k truncation is the prefix of the
  rank-r_max one.
- *Decision* (the split of the singular values, left open by the paper): symmetric,
  B = U sqrt(S / s), A = sqrt(S / s) V^T, so both factors have equal column / row norms and
  s B A = U S V^T. A client of scale s_k receives the prefix multiplied by sqrt(s / s_k) on both
  factors (the identity under the default ``lora.scaling = "fixed"``).
- *Decision* (signs): each singular pair is signed so that the largest-magnitude entry of its U
  column is positive (the first on ties), so the factors do not depend on the LAPACK build's sign
  choice; they are deterministic on the same CPU kernels and thread count (exact resume).
- Round 0: the initial adapter has B = 0, so W = 0; the clients of round 1 receive the usual
  random-A / zero-B prefix (the state's meta ``svd_form`` is False until the first aggregation).
  A layer whose W is exactly zero keeps its previous factors (an SVD of zero would give A = 0 and
  B = 0, a point where neither factor has a gradient).

deploy(state, cid) is what client cid runs (its rank-r_k truncation at its scale s_k); export()
writes the global rank-r_max truncation at scale s. A robust rule or central DP is refused
(``robust_aggregation``): the server's rule lives in the space of full products, which does not cut
into rank blocks. A server optimiser is refused too (``server_optimizer``): the difference of two
SVD factorisations is not an update of the factors.
"""

from __future__ import annotations

from nestfed.config.capabilities import GLOBAL_ADAPTER, RANK_PREFIX_CLIENTS
from nestfed.config.capabilities import Capability as C
from nestfed.methods.method import lora_method

METHOD = lora_method(
    "flexlora",
    "n_k-weighted mean of the full products s_k B_k A_k, each client gets its rank-r_k truncated SVD (Bai et al. 2024)",
    "nestfed.methods.flexlora.strategy",
    capabilities=RANK_PREFIX_CLIENTS | GLOBAL_ADAPTER | {C.RESUME},
    refusals={
        C.ROBUST_AGGREGATION: "FlexLoRA averages full products s_k B_k A_k and re-factorises them by SVD: "
        "that space does not cut into rank blocks of A and B, so a coordinate-wise or distance rule "
        "over the factors would not be the method's rule (a norm bound, validation.max_update_norm, "
        "does apply; docs/trust.md)",
        C.SERVER_OPTIMIZER: "its aggregate is a fresh SVD factorisation of the mean product, whose "
        "factors are defined only up to the sign and order of the singular pairs: the aggregate minus "
        "the state is no update of the factors, so there is no pseudo-gradient to step",
        C.SECURE_AGGREGATION: "it averages full products s_k B_k A_k, not the factors a secure sum adds",
    },
)
