"""A client's update in update space: its reply minus what it was sent, its norm, and clipping.

Used by validation (norm bound), differential privacy (clip to C) and the attacks (which act on
the update). For a LoRA matrix whose rank the client shrank (HetLoRA's pruning) the update is
taken against the sent matrix's prefix of the same rank; an array the client was not sent is its
own update (the origin is zero). Arrays that are not floating point (FedMKT-style token indices)
are not part of an update: they are never counted, scaled or clipped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from nestfed.federation.messages import Arrays
from nestfed.nn.keys import rank_dim

#: the largest float32: an update whose squared norm exceeds it overflows every float32 mean or norm
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def origin(sent: Arrays, key: str, like: torch.Tensor) -> torch.Tensor:
    """Give what one of the reply's arrays started from.

    Args:
        sent: the arrays the server sent.
        key: the array's key.
        like: the reply's array.

    Returns:
        sent[key], narrowed to like's rank along the rank dimension when the client shrank it, in
        like's dtype; zeros when nothing was sent under ``key``.

    Raises:
        ValueError: when the shapes cannot be matched.
    """
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


#: the block of an update's arrays that have no rank dimension (`block_norms`)
WHOLE = "other"


def update_norm(sent: Arrays, reply: Arrays) -> float:
    """Compute the L2 norm of the whole update (all arrays concatenated): `block_norms` with one block.

    Computed in float64, so that an overflowing update gets its true size, not inf.

    Args:
        sent: the arrays the server sent.
        reply: the reply's arrays.

    Returns:
        The norm; 0.0 for an update with no floating-point array.

    Raises:
        ValueError: as `origin` does.
    """
    return block_norms(sent, reply, ()).get(WHOLE, 0.0)


def block_norms(sent: Arrays, reply: Arrays, ends: tuple[int, ...]) -> dict[str, float]:
    """Compute the L2 norm of the update in each rank block.

    Blocks: [0, ends[0]), [ends[0], ends[1]), ... along the rank dimension (rows of lora_A
    [r, in], columns of lora_B [out, r]) and ``other`` for the arrays without one (all of them
    when ``ends`` is empty).

    Args:
        sent: the arrays the server sent.
        reply: the reply's arrays.
        ends: the blocks' upper ends, ascending.

    Returns:
        {block label ``lo:hi`` or ``other``: L2 norm of the update's entries in it}, float64; a
        block the reply does not reach is absent.

    Raises:
        ValueError: as `origin` does.
    """
    return measure(sent, reply, ends)[0]


@dataclass(frozen=True)
class Gathered:
    """A small LoRA reply's update as two float64 matrices.

    Row i of ``a`` and column i of ``b`` are rank dimension i of every array.

    Attributes:
        keys_a: the lora_A-like keys, in ``a``'s order.
        a: [r, E_a] the lora_A-like arrays ([r, in], rank dimension 0) side by side.
        keys_b: the lora_B-like keys, in ``b``'s order.
        b: [E_b, r] the lora_B-like arrays ([out, r], rank dimension 1) stacked.
    """

    keys_a: tuple[str, ...]
    a: torch.Tensor
    keys_b: tuple[str, ...]
    b: torch.Tensor

    @property
    def rank(self) -> int:
        """The reply's rank r (rows of ``a``, columns of ``b``)."""
        return self.a.shape[0] if self.keys_a else self.b.shape[1]


def gather(sent: Arrays, reply: Arrays, order: Iterable[str] | None = None) -> Gathered | None:
    """Gather a small reply's update into a `Gathered`.

    Args:
        sent: the arrays the server sent.
        reply: the reply's arrays.
        order: the arrays' order; the reply's when None.

    Returns:
        The gathered update when it is small (at most FLAT_NUMEL entries) and every array is a
        floating-point 2-D LoRA matrix sent at the reply's shape and dtype, with one rank r for
        all; else None (`measure` then goes array by array).
    """
    xa, oa, ka, xb, ob, kb = [], [], [], [], [], []
    numel, rank = 0, None
    for k in reply if order is None else order:
        v, o, d = reply[k], sent.get(k), rank_dim(k)
        if d is None or v.dim() != 2 or o is None or o.shape != v.shape or o.dtype != v.dtype:
            return None
        if not v.is_floating_point() or rank not in (None, v.shape[d]):
            return None
        rank, numel = v.shape[d], numel + v.numel()
        (xa if d == 0 else xb).append(v)
        (oa if d == 0 else ob).append(o)
        (ka if d == 0 else kb).append(k)
    if rank is None or numel > FLAT_NUMEL:
        return None
    a = torch.cat(xa, 1).double() - torch.cat(oa, 1).double() if xa else torch.zeros(rank, 0, dtype=torch.float64)
    b = torch.cat(xb, 0).double() - torch.cat(ob, 0).double() if xb else torch.zeros(0, rank, dtype=torch.float64)
    return Gathered(tuple(ka), a, tuple(kb), b)


def _block_labels(per_row: list[float], ends: tuple[int, ...], reach: int) -> dict[str, float]:
    out: dict[str, float] = {}
    lo = 0
    for hi in ends:
        if lo < reach:
            out[f"{lo}:{hi}"] = math.fsum(per_row[lo : min(hi, reach)]) ** 0.5
        lo = hi
    return out


def measure(
    sent: Arrays, reply: Arrays, ends: tuple[int, ...], order: Iterable[str] | None = None
) -> tuple[dict[str, float], Gathered | None]:
    """Compute `block_norms`, and gather the update when it can be.

    The gathered form costs a few kernels per reply, not a few per array (a 1,000-client round of
    small adapters); a large reply goes one array at a time (no copy of all of it).

    Args:
        sent: the arrays the server sent.
        reply: the reply's arrays.
        ends: the blocks' upper ends, ascending.
        order: the gathered arrays' order; the reply's when None.

    Returns:
        The block norms, and the update gathered (`gather`) when it can be and its rank is at most
        max(ends), else None.

    Raises:
        ValueError: as `origin` does (a reply whose shapes cannot be matched to what was sent).
    """
    g = gather(sent, reply, order) if ends else None
    if g is not None and g.rank <= max(ends):
        per_row = (g.a.square().sum(1) + g.b.square().sum(0)).tolist()
        return _block_labels(per_row, ends, g.rank), g
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
    out = _block_labels(rows.tolist(), ends, max(by_rank, default=0))
    if other_x:
        other_sq += float((torch.cat(other_x).double() - torch.cat(other_o).double()).pow(2).sum())
        has_other = True
    if has_other:
        out[WHOLE] = other_sq**0.5
    return out, None


def scale_update(sent: Arrays, reply: Arrays, factor: float) -> Arrays:
    """Multiply a reply's update by a factor: origin + factor * (reply - origin).

    Args:
        sent: the arrays the server sent.
        reply: the reply's arrays.
        factor: the factor.

    Returns:
        The scaled reply (computed in float64, in the reply's dtypes; non-floating arrays as
        they are).

    Raises:
        ValueError: as `origin` does.
    """
    out = {}
    for k, v in reply.items():
        if not v.is_floating_point():
            out[k] = v
            continue
        o = origin(sent, k, v)
        out[k] = (o.double() + factor * (v.double() - o.double())).to(v.dtype)
    return out


def clip_update(sent: Arrays, reply: Arrays, bound: float) -> tuple[Arrays, float]:
    """Clip a reply's update to an L2 norm (scaled by min(1, bound / norm)).

    Args:
        sent: the arrays the server sent.
        reply: the reply's arrays.
        bound: the largest norm.

    Returns:
        The reply with its update clipped (``reply`` itself when within the bound), and the
        update's norm before clipping.

    Raises:
        ValueError: as `origin` does.
    """
    norm = update_norm(sent, reply)
    if norm <= bound:
        return reply, norm
    return scale_update(sent, reply, bound / norm), norm
