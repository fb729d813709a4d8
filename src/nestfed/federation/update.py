"""A client's update in update space: its reply minus what it was sent, its norm, and clipping.

Used by validation (norm bound), differential privacy (clip to C) and the attacks (which act on
the update). For a LoRA matrix whose rank the client shrank (HetLoRA's pruning) the update is
taken against the sent matrix's prefix of the same rank; an array the client was not sent is its
own update (the origin is zero). Arrays that are not floating point (FedMKT-style token indices)
are not part of an update: they are never counted, scaled or clipped.
"""

from __future__ import annotations

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


#: the block of an update's arrays that have no rank dimension (:func:`block_norms`)
WHOLE = "other"


def update_norm(sent: Arrays, reply: Arrays) -> float:
    """The L2 norm of the whole update (all arrays concatenated), computed in float64 (so that an
    overflowing update gets its true size, not inf): :func:`block_norms` with one block."""
    return block_norms(sent, reply, ()).get(WHOLE, 0.0)


def block_norms(sent: Arrays, reply: Arrays, ends: tuple[int, ...]) -> dict[str, float]:
    """{block label ``lo:hi`` or ``other``: L2 norm of the update's entries in it}, float64; a block
    the reply does not reach is absent. Blocks: [0, ends[0]), [ends[0], ends[1]), ... along the
    rank dimension (rows of lora_A [r, in], columns of lora_B [out, r]) and ``other`` for the arrays
    without one (all of them when ``ends`` is empty). A small reply's rank rows are gathered into
    one [r, entries] matrix per rank (a few kernels per reply, not per array). Raises ValueError as
    :func:`origin` does."""
    rows = torch.zeros(max(ends, default=0), dtype=torch.float64)
    other_sq, has_other = 0.0, False
    other_x: list[torch.Tensor] = []
    other_o: list[torch.Tensor] = []
    by_rank: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    flat = sum(v.numel() for v in reply.values()) <= FLAT_NUMEL
    for k, v in reply.items():
        if not v.is_floating_point():
            continue
        o = origin(sent, k, v)
        d = rank_dim(k)
        if d is None or not ends:
            other_x.append(v.reshape(-1))
            other_o.append(o.reshape(-1))
            if not flat:
                other_sq += float((other_x.pop().double() - other_o.pop().double()).pow(2).sum())
                has_other = True
            continue
        r = min(v.shape[d], rows.numel())
        xs, os_ = by_rank.setdefault(r, ([], []))
        xs.append(v.narrow(d, 0, r).movedim(d, 0).reshape(r, -1))  # [r, entries]: row i = rank dimension i
        os_.append(o.narrow(d, 0, r).movedim(d, 0).reshape(r, -1))
        if not flat:  # a large reply: one array at a time, no copy of all of it
            rows[:r] += (xs.pop().double() - os_.pop().double()).pow(2).sum(1)
    for r, (xs, os_) in by_rank.items():
        if xs:
            rows[:r] += (torch.cat(xs, 1).double() - torch.cat(os_, 1).double()).pow(2).sum(1)
    reach = max(by_rank, default=0)
    out: dict[str, float] = {}
    lo = 0
    for hi in ends:
        if lo < reach:
            out[f"{lo}:{hi}"] = float(rows[lo : min(hi, reach)].sum()) ** 0.5
        lo = hi
    if other_x:
        other_sq += float((torch.cat(other_x).double() - torch.cat(other_o).double()).pow(2).sum())
        has_other = True
    if has_other:
        out[WHOLE] = other_sq**0.5
    return out


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
