"""Aggregation arithmetic shared by the strategies: rank truncation, zero-padding, weighted means
and low-rank norms. Pure functions of tensors and numbers (no model, no data).

Rank dimension: dim 0 of ``lora_A`` [r, in], dim 1 of ``lora_B`` [out, r].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nestfed.federation.messages import Arrays
from nestfed.nn.keys import merged_key, module_of, peft_key, rank_dim
from nestfed.nn.lora_core import CORE_KINDS, core_matrix


def truncate_rank(arrays: Arrays, r: int) -> Arrays:
    """Truncate every LoRA matrix to its rank-r prefix (A[:r], B[:, :r]), as copies.

    Args:
        arrays: a payload {PEFT key: tensor}; arrays without a rank dimension pass unchanged.
        r: the rank to keep.

    Returns:
        The truncated payload (same keys).

    Raises:
        ValueError: when r exceeds a matrix's rank.
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


def rank_prefix(arrays: Arrays, r: int) -> Arrays:
    """Take `truncate_rank`'s rank-r prefix as views of ``arrays`` (no copy).

    For payloads that are only read and serialised.

    Args:
        arrays: a payload {PEFT key: tensor}; arrays without a rank dimension pass unchanged.
        r: the rank to keep.

    Returns:
        The payload of views (same keys).

    Raises:
        ValueError: when r exceeds a matrix's rank.
    """
    out = {}
    for k, v in arrays.items():
        d = rank_dim(k)
        if d is not None and r > v.shape[d]:
            raise ValueError(f"{k}: cannot truncate rank {v.shape[d]} to {r}")
        out[k] = v if d is None else v.narrow(d, 0, r)
    return out


def merge_prefix(kept: torch.Tensor | None, trained: torch.Tensor, dim: int) -> torch.Tensor:
    """Replace the first ``trained.shape[dim]`` entries of ``kept`` along ``dim`` by ``trained``.

    What a client keeps after training only a prefix of its rank (an elastic rank).

    Args:
        kept: the factor the client held before training, or None when nothing is kept.
        trained: the trained prefix.
        dim: the rank dimension.

    Returns:
        A copy of ``kept`` with its prefix replaced; a copy of ``trained`` when it covers all of
        ``kept`` (or more) or ``kept`` is None.
    """
    if kept is None or kept.shape[dim] <= trained.shape[dim]:
        return trained.detach().clone()
    out = kept.detach().clone()
    out.narrow(dim, 0, trained.shape[dim]).copy_(trained.detach())
    return out


def pad_rank(t: torch.Tensor, dim: int, r_max: int) -> torch.Tensor:
    """Zero-pad a tensor along ``dim`` to size r_max (ZeroPad / HetLoRA).

    Args:
        t: the tensor.
        dim: the rank dimension.
        r_max: the size to pad to.

    Returns:
        ``t`` itself when it already has size r_max, else a padded copy.

    Raises:
        ValueError: when t is larger than r_max along ``dim``.
    """
    r = t.shape[dim]
    if r > r_max:
        raise ValueError(f"rank {r} exceeds r_max {r_max}")
    if r == r_max:
        return t
    shape = list(t.shape)
    shape[dim] = r_max - r
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def lowrank_norm(B: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """Compute ||B @ A||_F without forming the [out, in] product.

    Uses ||BA||_F^2 = sum((B^T B) * (A A^T)), O(r^2 (in + out)) instead of O(r in out);
    differentiable (0 with a finite gradient where the product is 0).

    Args:
        B: [out, r] the up factor.
        A: [r, in] the down factor.

    Returns:
        A 0-dim tensor, the Frobenius norm.
    """
    sq = ((B.T @ B) * (A @ A.T)).sum()
    # sqrt has an infinite slope at 0 (a zero-initialised B): give 0 there, and a finite gradient
    return torch.where(sq > 0, sq.clamp_min(1e-30).sqrt(), sq * 0)


def weighted_mean(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Average same-shaped tensors, sum_k w_k t_k / sum_k w_k, as one matmul over the stack.

    Args:
        tensors: the K tensors, all of one shape.
        weights: K weights (e.g. example counts).

    Returns:
        The weighted mean, of the tensors' shape and dtype.

    Raises:
        ValueError: on an empty list or a non-positive weight sum.
    """
    if not tensors:
        raise ValueError("nothing to average")
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    if w.sum() <= 0:
        raise ValueError(f"weights must sum to a positive number, got {w.tolist()}")
    w = (w / w.sum()).to(tensors[0].dtype)
    stacked = torch.stack([t.reshape(-1) for t in tensors])  # [K, numel]
    return (w @ stacked).reshape(tensors[0].shape)


def fold_cores(arrays: Arrays) -> Arrays:
    """Fold every layer's trainable core into its B.

    The core is ``lora_core`` / ``lora_heads`` [r, q] (nestfed.nn.lora_core): B' = B blockdiag(heads)
    [out, r], A unchanged, so that B' A = B M A exactly (the plain LoRA adapter PEFT loads).

    Args:
        arrays: a payload {PEFT key: tensor}.

    Returns:
        The payload without its core keys and with folded B's; other arrays as they are.

    Raises:
        KeyError: when a layer with a core lacks its B.
    """
    cores = {}
    for k in arrays:
        try:
            module, kind = module_of(k)
        except KeyError:
            continue
        if kind in CORE_KINDS:
            cores[k] = module
    out = {k: v for k, v in arrays.items() if k not in cores}
    for k, module in cores.items():
        b = peft_key(module, "lora_B")
        out[b] = arrays[b] @ core_matrix(arrays[k]).to(arrays[b].dtype)
    return out


def one_adapter(arrays: Arrays, scale: float) -> tuple[Arrays, float]:
    """Turn a payload into one PEFT LoRA adapter of a single rank, and its scale.

    Without merged factors and with one rank for every layer, the arrays and ``scale`` are
    returned as they are. Otherwise, per layer, A' = [merged_A; scale A] and B' = [merged_B, B] at
    scale 1, zero-padded to the largest rank over the layers: B' A' = merged_B merged_A + scale B A
    exactly (zero rows add nothing): FedEx-LoRA's export, and ``nestfed export --client`` for
    FLoRA's and FedEx-LoRA's clients. A trainable core is folded into B first (`fold_cores`:
    Fed-SB, RAVAN).

    Args:
        arrays: {PEFT key: tensor}: lora_A [r, in], lora_B [out, r], and optionally merged_A
            [R, in], merged_B [out, R] at scale 1.
        scale: the LoRA scale of lora_B lora_A.

    Returns:
        The adapter's arrays and its scale (1.0 when rebuilt).

    Raises:
        ValueError: for a key that is not a LoRA or merged factor (e.g. memory rules or SVD cores,
            which PEFT's LoRA cannot hold), or a layer missing A or B.
    """
    for k in arrays:
        try:
            module_of(k)
        except KeyError:
            raise ValueError(f"payload key {k} is not a LoRA factor: a PEFT LoRA adapter cannot hold it") from None
    arrays = fold_cores(arrays)
    modules = sorted({module_of(k)[0] for k in arrays})
    merged = any(merged_key(m, "A") in arrays for m in modules)
    ranks = {v.shape[rank_dim(k)] for k, v in arrays.items() if rank_dim(k) is not None}
    if not merged and len(ranks) == 1:
        return dict(arrays), scale
    parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for m in modules:
        a_list, b_list = [], []
        if merged_key(m, "A") in arrays:
            a_list.append(arrays[merged_key(m, "A")])
            b_list.append(arrays[merged_key(m, "B")])
        if peft_key(m, "lora_A") in arrays:
            a_list.append(scale * arrays[peft_key(m, "lora_A")])
            b_list.append(arrays[peft_key(m, "lora_B")])
        if len(a_list) != len(b_list) or not a_list:
            raise ValueError(f"{m}: a LoRA layer needs both A and B")
        parts[m] = (torch.cat(a_list, 0), torch.cat(b_list, 1))
    r = max(a.shape[0] for a, _ in parts.values())
    out: Arrays = {}
    for m, (a, b) in parts.items():
        out[peft_key(m, "lora_A")], out[peft_key(m, "lora_B")] = pad_rank(a, 0, r), pad_rank(b, 1, r)
    return out, 1.0
