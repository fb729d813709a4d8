"""Aggregation arithmetic shared by the strategies: rank truncation, zero-padding, weighted means
and low-rank norms. Pure functions of tensors and numbers (no model, no data).

Rank dimension: dim 0 of ``lora_A`` [r, in], dim 1 of ``lora_B`` [out, r].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nestfed.federation.messages import Arrays
from nestfed.nn.keys import rank_dim


def truncate_rank(arrays: Arrays, r: int) -> Arrays:
    """The prefix of rank r of every LoRA matrix (A[:r], B[:, :r]); other arrays unchanged.

    Raises ValueError when r exceeds a matrix's rank.
    """
    out = {}
    for k, v in arrays.items():
        d = rank_dim(k)
        if d is None:
            out[k] = v
            continue
        if r > v.shape[d]:
            raise ValueError(f"{k}: cannot truncate rank {v.shape[d]} to {r}")
        out[k] = v.narrow(d, 0, r).clone()
    return out


def pad_rank(t: torch.Tensor, dim: int, r_max: int) -> torch.Tensor:
    """Zero-pad tensor t along ``dim`` to size r_max (ZeroPad / HetLoRA). Raises ValueError if larger."""
    r = t.shape[dim]
    if r > r_max:
        raise ValueError(f"rank {r} exceeds r_max {r_max}")
    if r == r_max:
        return t
    shape = list(t.shape)
    shape[dim] = r_max - r
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def lowrank_norm(B: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """||B @ A||_F for B: [out, r], A: [r, in] without forming the [out, in] product.

    Uses ||BA||_F^2 = sum((B^T B) * (A A^T)), O(r^2 (in + out)) instead of O(r in out);
    differentiable. Returns a 0-dim tensor.
    """
    sq = ((B.T @ B) * (A @ A.T)).sum()
    # sqrt has an infinite slope at 0 (a zero-initialised B): give 0 there, and a finite gradient
    return torch.where(sq > 0, sq.clamp_min(1e-30).sqrt(), sq * 0)


def weighted_mean(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum_k w_k t_k / sum_k w_k over same-shaped tensors, computed as one matmul over the stack.

    Raises ValueError on an empty list or a non-positive weight sum.
    """
    if not tensors:
        raise ValueError("nothing to average")
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    if w.sum() <= 0:
        raise ValueError(f"weights must sum to a positive number, got {w.tolist()}")
    w = (w / w.sum()).to(tensors[0].dtype)
    stacked = torch.stack([t.reshape(-1) for t in tensors])  # [K, numel]
    return (w @ stacked).reshape(tensors[0].shape)
