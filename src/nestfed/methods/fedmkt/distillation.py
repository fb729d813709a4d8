"""Logit knowledge on a shared public text, as FedMKT exchanges it (Fan et al., COLING 2025,
"FedMKT: Federated Mutual Knowledge Transfer for Large and Small Language Models", section 3).

Knowledge of a model on public blocks [N, T] = its top-k next-token log-probabilities
(``values`` [N, T, k] float16, ``indices`` [N, T, k] int32; FuseLLM/FedMKT keep the top logits
only) plus its per-block cross-entropy on the public text (``ce`` [N] float32, nats/token).
One tokenizer everywhere, so no token alignment is needed (docs/methods.md section 2).

Selection (FedMKT's DualMinCE, as in its public code: ``distill_strategy = "greater"`` picks,
per block, the distribution of the candidate with the largest reward exp(-CE)): for each block
the target is the candidate with the lowest CE, the learner's own knowledge included, so a learner
never distils from a teacher worse than itself on that block.
Loss: lm_weight * CE(labels) + (1 - lm_weight) * CE(target distribution, learner) (FedMKT's code:
lm_loss_weight = 0.9).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F

from nestfed.nn.frozen_prefix import causal_lm_loss

VALUES, INDICES, CE = "public.values", "public.indices", "public.ce"


@torch.no_grad()
def knowledge(logits: torch.Tensor, labels: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Top-k knowledge of a model's logits on public blocks.

    Args:
        logits: [N, T, V].
        labels: [N, T] (-100 ignored).
        k: tokens kept per position, in [1, V].

    Returns:
        {VALUES: [N, T, k] float16 log-probs, INDICES: [N, T, k] int32, CE: [N] float32}, in host
            memory (they travel) whatever device the logits are on.

    Raises:
        ValueError: for k < 1 or k > V.
    """
    V = logits.shape[-1]
    if not 1 <= k <= V:
        raise ValueError(f"topk must be in [1, {V}], got {k}")
    labels = labels.to(logits.device)
    logp = F.log_softmax(logits.float(), dim=-1)
    values, indices = logp.topk(k, dim=-1)
    ce = torch.stack([causal_lm_loss(logits[i : i + 1], labels[i : i + 1]) for i in range(logits.shape[0])])
    return {VALUES: values.to(torch.float16).cpu(), INDICES: indices.to(torch.int32).cpu(), CE: ce.float().cpu()}


def merge_knowledge(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate knowledge computed batch by batch along the block dimension.

    Args:
        parts: knowledge dicts, in block order.

    Returns:
        One knowledge dict over all blocks.
    """
    return {key: torch.cat([p[key] for p in parts]) for key in (VALUES, INDICES, CE)}


def select_min_ce(candidates: Sequence[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """DualMinCE: per block, the knowledge of the candidate with the lowest CE.

    Args:
        candidates: knowledge dicts over the same N blocks.

    Returns:
        The selected knowledge over the N blocks, and the chosen candidate index per block [N]
            (int64; ties go to the first candidate).

    Raises:
        ValueError: when there is no candidate or the shapes differ.
    """
    if not candidates:
        raise ValueError("no knowledge to select from")
    shapes = {tuple(c[VALUES].shape) for c in candidates}
    if len(shapes) != 1:
        raise ValueError(f"knowledge of different shapes: {sorted(shapes)}")
    ce = torch.stack([c[CE] for c in candidates])  # [C, N]
    choice = ce.argmin(0)  # [N]
    out = {}
    for key in (VALUES, INDICES, CE):
        stacked = torch.stack([c[key] for c in candidates])  # [C, N, ...]
        out[key] = stacked[choice, torch.arange(choice.shape[0])]
    return out, choice


def dense_target(values: torch.Tensor, indices: torch.Tensor, vocab: int) -> torch.Tensor:
    """The top-k distribution as a dense probability tensor, renormalised over the k kept tokens, zero elsewhere.

    Args:
        values: [B, T, k] log-probs.
        indices: [B, T, k] token ids.
        vocab: V.

    Returns:
        [B, T, V] probabilities.
    """
    p = torch.softmax(values.float(), dim=-1)
    out = torch.zeros(*values.shape[:-1], vocab, dtype=p.dtype, device=p.device)
    return out.scatter_(-1, indices.long(), p)


def mutual_loss(
    logits: torch.Tensor, labels: torch.Tensor, target: dict[str, torch.Tensor], lm_weight: float
) -> torch.Tensor:
    """FedMKT's objective on public blocks: lm_weight * CE(labels) + (1 - lm_weight) * soft CE.

    The soft CE is -sum_v p_target(v) log q(v), averaged over positions.

    Args:
        logits: [B, T, V] the learner's logits.
        labels: [B, T].
        target: knowledge of the same B blocks (VALUES, INDICES).
        lm_weight: in [0, 1].

    Returns:
        The 0-dim loss in nats.

    Raises:
        ValueError: for lm_weight outside [0, 1].
    """
    if not 0.0 <= lm_weight <= 1.0:
        raise ValueError(f"lm_weight must be in [0, 1], got {lm_weight}")
    lm = causal_lm_loss(logits, labels.to(logits.device))
    p = dense_target(target[VALUES].to(logits.device), target[INDICES].to(logits.device), logits.shape[-1])
    soft = -(p * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()
    return lm_weight * lm + (1.0 - lm_weight) * soft
