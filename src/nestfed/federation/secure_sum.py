"""Secure aggregation's arithmetic: what a client adds to the secure sum, and what a strategy rebuilds.

A strategy rebuilds its rule from sums alone (docs/secure_aggregation.md). Pure tensors; the
protocol that computes the sum without showing the server any single vector is Flower's SecAgg+
(nestfed.flower.secure).

Notation. Client k has rank r_k, n_k training examples, was sent the global prefix P_k (rank r_k
along each LoRA matrix's rank dimension, nestfed.nn.keys.rank_dim: dim 0 of ``lora_A`` [r, in],
dim 1 of ``lora_B`` [out, r]) and replies with its trained matrices X_k. Its update is
D_k = X_k - P_k. ``pad`` zero-pads along the rank dimension to the round's common rank r (the
largest rank of the round's instructions, at most r_max). The server learns only, per key,

    S = sum_k n_k pad(D_k)              (same shape as the padded matrix)
    C = sum_k n_k 1(j < r_k)             (one vector [r] for every key: rank row j's total weight)

over the clients whose vectors entered the sum. C[0] = N = sum_k n_k (every client has rank >= 1).

What the strategies rebuild, row j of the rank dimension of global matrix G (rank r_max; rows at or
above r have C[j] = 0):

- `segment_mean` (segment-wise aggregation in update space): G[j] + S[j] / C[j] where
  C[j] > 0, else G[j] unchanged. Row j is held exactly by the clients with r_k > j. When the
  distinct ranks of the federation are r_1 < r_2 < ..., the row j of segment [r_{l-1}, r_l) is held
  exactly by the clients with r_k >= r_l (no rank lies strictly inside a segment), so this is the
  segment's n_k-weighted mean update over its members.
- `padded_mean` (the zero-padded parameter mean): sum_k n_k pad(X_k) / N. With
  pad(X_k) = pad(P_k) + pad(D_k) and pad(P_k)[j] = G[j] 1(j < r_k): (G[j] C[j] + S[j]) / N. Rows no
  client holds become 0, as zero-padding gives. With one rank everywhere this is the plain
  n_k-weighted mean of the replies.

Encoding (`encode`): the client sends w_k pad(clip(D_k)) and the count vector w_k 1(j < r_k)
with w_k = n_k * scale, scale = 1 / n_max (the largest n_k of the federation), so every value lies
in [-c, c] for a clipping range c >= 1; `decode` divides the (quantised) sum by scale.

Quantisation: Flower's SecAgg+ maps each value x in [-c, c] to an integer (x + c) Q / (2c) with
stochastic rounding (error below one step 2c/Q) and sums K clients' integers modulo 2^32 (so
K Q < 2^32). The sum of K vectors is off by less than K 2c / Q per entry, so after decoding
|S' - S| and |C' - C| are below eps = `sum_error` = K 2c n_max / Q. Then, with m = S/C:
|segment_mean' - segment_mean| <= eps (1 + |m|) / (C[j] - eps) and |padded_mean' - padded_mean|
<= eps (1 + |G| + |new|) / (N - eps).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from nestfed.federation.messages import Arrays, SecureSum
from nestfed.nn.keys import rank_dim

Layout = dict[str, tuple[int, ...]]


def layout(expects: Iterable[Mapping[str, tuple[int, ...]]]) -> Layout:
    """Find the common padded shape of every reply key over a round's instructions.

    Args:
        expects: the instructions' ``expect`` ({key: shape} each).

    Returns:
        {key: the largest size of each dimension}, keys sorted.

    Raises:
        ValueError: for a key without a rank dimension (only LoRA matrices can be padded and
            counted per rank row), or instructions whose keys differ.
    """
    out: Layout = {}
    keys: set[str] | None = None
    for expect in expects:
        if keys is not None and set(expect) != keys:
            raise ValueError("secure aggregation needs the same reply keys from every client")
        keys = set(expect)
        for k, shape in expect.items():
            if rank_dim(k) is None:
                raise ValueError(f"{k}: secure aggregation sums LoRA matrices only (no rank dimension)")
            old = out.get(k)
            out[k] = tuple(shape) if old is None else tuple(max(a, b) for a, b in zip(old, shape))
    return dict(sorted(out.items()))


def common_rank(lay: Layout) -> int:
    """Give the rank r of a layout (every key's rank dimension).

    Args:
        lay: the layout (`layout`).

    Returns:
        The rank r.

    Raises:
        ValueError: when the keys disagree on the rank.
    """
    ranks = {shape[rank_dim(k)] for k, shape in lay.items()}
    if len(ranks) != 1:
        raise ValueError(f"secure aggregation needs one rank in the layout, got {sorted(ranks)}")
    return ranks.pop()


def _pad(t: torch.Tensor, dim: int, r: int) -> torch.Tensor:
    if t.shape[dim] == r:
        return t
    shape = list(t.shape)
    shape[dim] = r - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def encode(
    sent: Arrays, reply: Arrays, num_examples: int, lay: Layout, scale: float, clip: float
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Encode what one client adds to the secure sum (module docstring).

    The client validates its own update first (the server never sees it): every key of ``lay``
    present with the shape of what it was sent, one rank r_k for all keys, finite values, n_k > 0
    and n_k * scale <= 1.

    Args:
        sent: the arrays the client was sent (P_k).
        reply: its trained arrays (X_k).
        num_examples: n_k.
        lay: the round's layout (`layout`).
        scale: 1 / n_max; the client's weight is w_k = n_k * scale.
        clip: the clipping range c: entries of the update beyond [-clip, clip] are clipped.

    Returns:
        The vectors (float64 tensors w_k pad(clip(D_k)) in ``lay``'s key order, then the count
        vector [r]) and {"secure_clipped": how many entries were clipped, "secure_weight":
        n_k * scale}.

    Raises:
        ValueError: naming the fault, when the update fails its validation.
    """
    if not isinstance(num_examples, int) or num_examples <= 0:
        raise ValueError(f"num_examples must be a positive integer, got {num_examples!r}")
    w = num_examples * scale
    if not 0 < w <= 1 + 1e-12:
        raise ValueError(f"n_k * scale = {w} is outside (0, 1]: the server's n_max is below this client's n_k")
    r = common_rank(lay)
    out: list[torch.Tensor] = []
    clipped = 0
    ranks = set()
    for k, shape in lay.items():
        d = rank_dim(k)
        if k not in reply or k not in sent:
            raise ValueError(f"{k}: missing from the reply or the instruction")
        x, p = reply[k].detach().to(torch.float64), sent[k].detach().to(torch.float64)
        if tuple(x.shape) != tuple(p.shape):
            raise ValueError(f"{k}: shape {tuple(x.shape)}, sent {tuple(p.shape)}")
        if not torch.isfinite(x).all():
            raise ValueError(f"{k}: contains NaN or Inf")
        ranks.add(x.shape[d])
        delta = x - p
        clipped += int((delta.abs() > clip).sum())
        padded = _pad(delta.clamp(-clip, clip), d, r)
        if tuple(padded.shape) != tuple(shape):
            raise ValueError(f"{k}: padded shape {tuple(padded.shape)}, layout {tuple(shape)}")
        out.append(w * padded)
    if len(ranks) != 1:
        raise ValueError(f"the reply's LoRA matrices disagree on the rank: {sorted(ranks)}")
    counts = torch.zeros(r, dtype=torch.float64)
    counts[: ranks.pop()] = w
    out.append(counts)
    return out, {"secure_clipped": float(clipped), "secure_weight": float(w)}


def decode(total: list[torch.Tensor], lay: Layout, scale: float, clients: list[int]) -> SecureSum:
    """Decode the sum of `encode`'s vectors: every vector divided by ``scale``.

    Args:
        total: the summed vectors, in `encode`'s order (one per key of ``lay``, then the counts).
        lay: the round's layout.
        scale: the encoding's scale (1 / n_max).
        clients: the ids whose vectors are in the sum.

    Returns:
        The `SecureSum` (float64; clients sorted).

    Raises:
        ValueError: when the number of vectors or a summed shape disagrees with the layout.
    """
    if len(total) != len(lay) + 1:
        raise ValueError(f"the secure sum has {len(total)} vectors, the layout needs {len(lay) + 1}")
    sums = {}
    for (k, shape), t in zip(lay.items(), total):
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{k}: summed shape {tuple(t.shape)}, layout {tuple(shape)}")
        sums[k] = t.to(torch.float64) / scale
    return SecureSum(sums, total[-1].to(torch.float64) / scale, sorted(clients))


def plain_sum(
    sent: Mapping[int, Arrays], replies: Mapping[int, Arrays], num_examples: Mapping[int, int], lay: Layout
) -> SecureSum:
    """Sum the clients' updates exactly (unquantised, unclipped): what a perfect secure aggregation reveals.

    For tests and references.

    Args:
        sent: {cid: the arrays it was sent}.
        replies: {cid: its trained arrays}; the clients summed.
        num_examples: {cid: n_k}.
        lay: the round's layout.

    Returns:
        The `SecureSum` of the clients in ``replies``.

    Raises:
        ValueError: for no replies, or a reply that fails `encode`'s validation.
    """
    total: list[torch.Tensor] | None = None
    for c in sorted(replies):
        vec, _ = encode(sent[c], replies[c], num_examples[c], lay, 1.0 / max(num_examples.values()), float("inf"))
        total = vec if total is None else [a + b for a, b in zip(total, vec)]
    if total is None:
        raise ValueError("nothing to sum")
    return decode(total, lay, 1.0 / max(num_examples.values()), list(replies))


def _rows(counts: torch.Tensor, g: torch.Tensor, dim: int) -> torch.Tensor:
    """``counts`` (padded with zeros to g's rank) shaped to broadcast along ``dim`` of g."""
    r = g.shape[dim]
    if counts.shape[0] > r:
        raise ValueError(f"the secure sum has rank {counts.shape[0]}, the global matrix {r}")
    c = torch.zeros(r, dtype=torch.float64)
    c[: counts.shape[0]] = counts
    shape = [1] * g.dim()
    shape[dim] = r
    return c.reshape(shape)


def _padded_sum(s: torch.Tensor, g: torch.Tensor, dim: int) -> torch.Tensor:
    if s.shape[dim] > g.shape[dim]:
        raise ValueError(f"the secure sum has rank {s.shape[dim]}, the global matrix {g.shape[dim]}")
    return _pad(s.to(torch.float64), dim, g.shape[dim])


def segment_mean(g: torch.Tensor, s: torch.Tensor, counts: torch.Tensor, dim: int) -> torch.Tensor:
    """Rebuild the segment-wise mean: G[j] + S[j] / C[j] along ``dim`` where C[j] > 0, else G[j].

    See the module docstring.

    Args:
        g: the global matrix G (rank r_max).
        s: the summed padded updates S (rank <= r_max).
        counts: C [rank of s].
        dim: the rank dimension.

    Returns:
        The new matrix, of g's shape and dtype.

    Raises:
        ValueError: when the sum's rank exceeds the global matrix's.
    """
    c = _rows(counts, g, dim)
    s64 = _padded_sum(s, g, dim)
    held = c > 0
    new = torch.where(held, g.to(torch.float64) + s64 / torch.where(held, c, torch.ones_like(c)), g.to(torch.float64))
    return new.to(g.dtype)


def padded_mean(g: torch.Tensor, s: torch.Tensor, counts: torch.Tensor, dim: int) -> torch.Tensor:
    """Rebuild the zero-padded mean: (G[j] C[j] + S[j]) / N along ``dim``, N = C[0].

    The n_k-weighted mean of the zero-padded replies (module docstring).

    Args:
        g: the global matrix G (rank r_max).
        s: the summed padded updates S (rank <= r_max).
        counts: C [rank of s].
        dim: the rank dimension.

    Returns:
        The new matrix, of g's shape and dtype.

    Raises:
        ValueError: when N <= 0, or the sum's rank exceeds the global matrix's.
    """
    n = float(counts[0]) if counts.numel() else 0.0
    if n <= 0:
        raise ValueError("the secure sum holds no examples")
    c = _rows(counts, g, dim)
    return ((g.to(torch.float64) * c + _padded_sum(s, g, dim)) / n).to(g.dtype)


def sum_error(num_clients: int, clip: float, quantization_range: int, n_max: float) -> float:
    """Bound each decoded entry's error in S and C after SecAgg+'s quantisation (module docstring).

    Args:
        num_clients: K, the clients summed.
        clip: the clipping range c.
        quantization_range: Q, SecAgg+'s quantisation range.
        n_max: the largest n_k (the encoding's 1 / scale).

    Returns:
        eps = K 2c n_max / Q.
    """
    return num_clients * 2.0 * clip * n_max / quantization_range
