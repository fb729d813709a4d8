"""RAVAN (Raje, Askin, Jhunjhunwala and Joshi, "Ravan: Multi-Head Low-Rank Adaptation for Federated
Fine-Tuning", NeurIPS 2025, arXiv 2506.05568; its method section): the update of a layer is a sum of
h heads

    Delta W = sum_{i=1}^{h} s_i B_i H_i A_i,        B_i [out, q], H_i [q, q], A_i [q, in],

with B_i and A_i frozen at their initialisation; clients train the cores H_i and the scalar scales
s_i and upload s_i H_i, which the server averages, so that

    Delta W^agg = sum_i B_i (sum_k p_k s_{i,k} H_{i,k}) A_i = sum_k p_k Delta W_k

exactly; the upload is h q^2 numbers per layer (r q for total rank r = h q), whatever the number of
clients, and the scales let training concentrate on the useful heads (docs/methods.md section 7).
The equations are the abstract's and the public implementation's; the paper's text, and so its
equation numbers, could not be read here.

Here (nestfed.methods.ravan.strategy, on Fed-SB's core strategy; the layer variant is
nestfed.nn.lora_core.GatedHeads):

- The LoRA rank r = r_max (``lora.ranks``) is the total rank h q; ``[ravan] heads`` is h
  (`RavanOptions`; it must divide r), ``[ravan] lr`` the heads' own learning rate. The
  update is s sum_i g_i B_i H_i A_i with nestfed's LoRA scale s (``lora.scaling``) and the
  paper's s_i called gates g_i.
- A = [A_1; ...; A_h] (shape [r, in]) and B = [B_1, ..., B_h] (shape [out, r]) are drawn from
  the LoRA seed by the server and every client (nestfed.methods.fed_sb.frozen_factors) and never
  travel; the payload carries the heads (key ``...lora_heads.weight``: H = [H_1; ...; H_h], shape
  [r, q]). The gates start at 1 on every client each round and never travel: the reply is the
  stacked g_i H_i [r, q], the server's H_i^agg = sum_k (n_k / N) g_{i,k} H_{i,k} and the global
  gates are 1 (as in FedLLM-Factory's RAVAN, which resets the global s_i to 1 after folding them
  into H_i).
- *Decision* (initialisation): H_i = 0, so round 1 starts from the backbone; the stacked B has
  orthonormal columns and the stacked A orthonormal rows (seeded QR of Gaussian draws, stream
  ``ravan_init/<module>``, the same on every node), so the heads span mutually orthogonal
  subspaces. FedLLM-Factory's RAVAN (alg/ravan.py) draws every B_i and A_i from a standard normal
  (torch.randn: entries of size 1, so ||B_i H_i A_i x|| grows with sqrt(in out)) and H_i = 0,
  s_i = 1; the paper compares initialisations in an ablation, which we could not read here.
- *Decision* (weights): n_k / N, as FedLLM-Factory's RAVAN and every nestfed rule.
- FedLLM-Factory's RAVAN (alg/ravan.py, the public implementation read here) also differs in two
  conventions: each of its heads has the full LoRA rank (``--lora_rank`` r per head, total rank
  h r, an upload of h r^2 numbers per layer; nestfed cuts the LoRA rank into h heads of r / h), and
  its update carries no LoRA scale (nestfed's s = lora_alpha / r multiplies the sum of heads).
- Heterogeneous and elastic ranks (the paper's computational heterogeneity: a client of less
  compute trains only some of the heads): a client of rank r_k (``lora.ranks``, a multiple of q)
  receives its first r_k / q heads and the others (``frozen_heads``), which it runs as its frozen
  residual (s B_i H_i A_i with s_i = 1, as ``merged_B @ merged_A``:
  nestfed.methods.fed_sb.frozen_factors.client_payload), so it runs the global model exactly, at
  the global scale; it trains and sends only its heads' s_i H_i [r_k, q]. *Decisions* (the paper also
  selects heads by other rules, which we could not read here): the heads a client trains are the
  first ones (nestfed's prefix convention, so an elastic rank works the same way); a head a client
  did not train counts in the mean at the value it ran, the global one, so
  H^agg = H + sum_k p_k pad(s H_k - H[:r_k]) and the aggregate stays exactly the n_k-weighted mean
  of the clients' models (RAVAN's exactness). A head only high-rank clients train is then moved by
  their data share of each round's mean update, not replaced by their mean.
- Robust rules, central DP, secure aggregation and a server optimiser act on the stacked heads as
  Fed-SB's on R; export at a rank is refused for Fed-SB's reason (nestfed.methods.fed_sb). The
  export is one PEFT LoRA adapter of rank r: A' = A, B' = B blockdiag(H_1, ..., H_h) at scale s.
"""

from __future__ import annotations

from dataclasses import dataclass

from nestfed.config import ExperimentConfig, r_max
from nestfed.config.capabilities import RANK_PREFIX_CLIENTS
from nestfed.methods.fed_sb import CORE_CAPABILITIES, CORE_REFUSALS
from nestfed.methods.method import lora_method


@dataclass(frozen=True)
class RavanOptions:
    """Options of ``[ravan]``.

    Attributes:
        heads: h, the number of heads the LoRA rank r is cut into (>= 1, dividing r; 4 as
            FedLLM-Factory's default, whose heads each have the full rank r instead).
        lr: the heads' and scales' own AdamW learning rate on the clients (>= 0; 0 = ``train.lr``;
            docs/methods.md section 7 on their step size).

    Raises:
        ValueError: for heads < 1 or lr < 0.
    """

    heads: int = 4
    lr: float = 0.0

    def __post_init__(self) -> None:
        if self.heads < 1:
            raise ValueError(f"heads must be >= 1, got {self.heads}")
        if self.lr < 0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")


def _check(cfg: ExperimentConfig) -> None:
    """r_max must be a multiple of the heads, and every client rank a multiple of a head's rank
    q = r_max / h (a client trains whole heads). Raises ValueError naming ``ravan.heads``."""
    h, r = cfg.section("ravan").heads, r_max(cfg)
    if r % h:
        raise ValueError(f"ravan.heads: {h} heads do not divide the LoRA rank {r} (each head has rank r / h)")
    ranks = sorted(set(cfg.lora.ranks) | set(cfg.population.support(r)))
    odd = [k for k in ranks if k % (r // h)]
    if odd:
        raise ValueError(
            f"ravan.heads: client ranks {odd} are not multiples of the head rank {r // h} = {r} / {h} "
            "(a client trains whole heads)"
        )


METHOD = lora_method(
    "ravan",
    "sum of h heads s_i B_i H_i A_i, B_i and A_i frozen; clients train H_i and s_i, "
    "s_i H_i averaged exactly (Raje et al. 2025)",
    "nestfed.methods.ravan.strategy",
    sections={"ravan": RavanOptions},
    check_config=_check,
    capabilities=CORE_CAPABILITIES | RANK_PREFIX_CLIENTS,
    refusals=CORE_REFUSALS,
)
