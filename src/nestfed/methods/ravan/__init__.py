"""RAVAN (Raje, Askin, Jhunjhunwala and Joshi, "Ravan: Multi-Head Low-Rank Adaptation for Federated
Fine-Tuning", NeurIPS 2025, arXiv 2506.05568; its method section): the update of a layer is a sum of
h heads

    Delta W = sum_{i=1}^{h} s_i B_i H_i A_i,        B_i [out, q], H_i [q, q], A_i [q, in],

with B_i and A_i frozen at their initialisation; clients train the cores H_i and the scalar scales
s_i and upload s_i H_i, which the server averages, so that

    Delta W^agg = sum_i B_i (sum_k p_k s_{i,k} H_{i,k}) A_i = sum_k p_k Delta W_k

exactly; the upload is h q^2 numbers per layer (r q for total rank r = h q), whatever the number of
clients, and the scales let training concentrate on the useful heads (docs/methods.md section 6).

Here (nestfed.methods.ravan.strategy, on Fed-SB's core strategy; the layer variant is
nestfed.nn.lora_core.GatedHeads):

- The LoRA rank r (``lora.ranks``, one for every client) is the total rank h q; ``[ravan] heads``
  is h (:class:`RavanOptions`; it must divide r). The update is s sum_i g_i B_i H_i A_i with
  nestfed's LoRA scale s (``lora.scaling``) and the paper's s_i called gates g_i.
- The payload carries A = [A_1; ...; A_h] [r, in], B = [B_1, ..., B_h] [out, r] and the heads
  (key ``...lora_heads.weight``: H = [H_1; ...; H_h] [r, q]). The gates start at 1 on every
  client each round and never travel: the reply is the stacked g_i H_i [r, q], the server's
  H_i^agg = sum_k (n_k / N) g_{i,k} H_{i,k} and the global gates are 1 (as in FedLLM-Factory's
  RAVAN, which resets the global s_i to 1 after folding them into H_i).
- *Decision* (initialisation): H_i = 0, so round 1 starts from the backbone; the stacked B has
  orthonormal columns and the stacked A orthonormal rows (seeded QR of Gaussian draws, stream
  ``ravan_init/<module>``, the same on every node), so the heads span mutually orthogonal
  subspaces. FedLLM-Factory's RAVAN (alg/ravan.py) draws every B_i and A_i from a standard normal
  (torch.randn: entries of size 1, so ||B_i H_i A_i x|| grows with sqrt(in out)) and H_i = 0,
  s_i = 1; the paper compares initialisations in an ablation, which we could not read here.
- *Decision* (weights): n_k / N, as FedLLM-Factory's RAVAN and every nestfed rule.
- *Decision* (ranks): one rank for every client. The paper handles clients of less compute by
  letting them train a subset of the heads; that is not built, so heterogeneous and elastic ranks
  are refused.
- Robust rules, central DP, secure aggregation and a server optimiser act on the stacked heads as
  Fed-SB's on R; export at a rank is refused for Fed-SB's reason (nestfed.methods.fed_sb). The
  export is one PEFT LoRA adapter of rank r: A' = A, B' = B blockdiag(H_1, ..., H_h) at scale s.
"""

from __future__ import annotations

from dataclasses import dataclass

from nestfed.config import ExperimentConfig, r_max
from nestfed.config.capabilities import Capability as C
from nestfed.methods.fed_sb import CORE_CAPABILITIES, CORE_REFUSALS
from nestfed.methods.method import lora_method


@dataclass(frozen=True)
class RavanOptions:
    """heads: h, the number of heads the LoRA rank r is cut into (>= 1, dividing r; FedLLM-Factory's
    default 4)."""

    heads: int = 4

    def __post_init__(self) -> None:
        if self.heads < 1:
            raise ValueError(f"heads must be >= 1, got {self.heads}")


def _check(cfg: ExperimentConfig) -> None:
    """The rank must be a multiple of the heads. Raises ValueError naming ``ravan.heads``."""
    h, r = cfg.section("ravan").heads, r_max(cfg)
    if r % h:
        raise ValueError(f"ravan.heads: {h} heads do not divide the LoRA rank {r} (each head has rank r / h)")


METHOD = lora_method(
    "ravan",
    "sum of h heads s_i B_i H_i A_i, B_i and A_i frozen; clients train H_i and s_i, "
    "s_i H_i averaged exactly (Raje et al. 2025)",
    "nestfed.methods.ravan.strategy",
    sections={"ravan": RavanOptions},
    check_config=_check,
    capabilities=CORE_CAPABILITIES,
    refusals={
        **CORE_REFUSALS,
        C.HETEROGENEOUS_RANKS: "every client trains all h heads at one rank (the paper's clients of "
        "less compute train a subset of the heads, which is not built)",
    },
)
