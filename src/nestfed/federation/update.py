"""A client's update in update space: its reply minus what it was sent, its norm, and clipping.

Used by validation (norm bound), differential privacy (clip to C) and the attacks (which act on
the update). For a LoRA matrix whose rank the client shrank (HetLoRA's pruning) the update is
taken against the sent matrix's prefix of the same rank; an array the client was not sent is its
own update (the origin is zero). Arrays that are not floating point (FedMKT-style token indices)
are not part of an update: they are never counted, scaled or clipped.
"""

from __future__ import annotations

import math

import torch

from nestfed.federation.messages import Arrays
from nestfed.nn.keys import rank_dim

#: the largest float32: an update whose squared norm exceeds it overflows every float32 mean or norm
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def origin(sent: Arrays, key: str, like: torch.Tensor) -> torch.Tensor:
    """What the reply's array ``key`` (``like``) started from: sent[key], narrowed to like's rank
    along the rank dimension when the client shrank it; zeros when nothing was sent under ``key``.
    Raises ValueError when the shapes cannot be matched."""
    s = sent.get(key)
    if s is None:
        return torch.zeros_like(like)
    if s.shape != like.shape:
        d = rank_dim(key)
        if d is None or s.dim() != like.dim() or like.shape[d] > s.shape[d]:
            raise ValueError(f"{key}: reply shape {tuple(like.shape)} does not match the sent {tuple(s.shape)}")
        s = s.narrow(d, 0, like.shape[d])
    return s.to(like.dtype)


#: below this many elements a reply's arrays are concatenated so its norm costs a few kernels, not a
#: few per array (a 1,000-client round of small adapters); above, one array at a time (no copy of all)
FLAT_NUMEL = 1 << 20


def update_norm(sent: Arrays, reply: Arrays) -> float:
    """The L2 norm of the whole update (all arrays concatenated), computed in float64 (so that an
    overflowing update gets its true size, not inf)."""
    floats = [(k, v) for k, v in reply.items() if v.is_floating_point()]
    if not floats:
        return 0.0
    if sum(v.numel() for _, v in floats) <= FLAT_NUMEL:
        x = torch.cat([v.reshape(-1).double() for _, v in floats])
        o = torch.cat([origin(sent, k, v).reshape(-1).double() for k, v in floats])
        return math.sqrt(float((x - o).pow(2).sum()))
    return math.sqrt(sum(float((v.double() - origin(sent, k, v).double()).pow(2).sum()) for k, v in floats))


def scale_update(sent: Arrays, reply: Arrays, factor: float) -> Arrays:
    """The reply whose update is multiplied by ``factor``: origin + factor * (reply - origin)."""
    out = {}
    for k, v in reply.items():
        if not v.is_floating_point():
            out[k] = v
            continue
        o = origin(sent, k, v)
        out[k] = (o.double() + factor * (v.double() - o.double())).to(v.dtype)
    return out


def clip_update(sent: Arrays, reply: Arrays, bound: float) -> tuple[Arrays, float]:
    """The reply with its update clipped to L2 norm ``bound`` (scaled by min(1, bound / norm)),
    and the update's norm before clipping."""
    norm = update_norm(sent, reply)
    if norm <= bound:
        return reply, norm
    return scale_update(sent, reply, bound / norm), norm
