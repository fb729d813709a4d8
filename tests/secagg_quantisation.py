"""Flower's SecAgg+ sum simulated for tests: each client's encoded vector
(nestfed.federation.secure_sum.encode) quantised to ``q`` levels over [-clip, clip] with stochastic
rounding, summed, dequantised and decoded, as the secure protocol would hand the server."""

from __future__ import annotations

import torch

from nestfed.federation.secure_sum import decode, encode


def quantised_sum(ins, replies, n, lay, clip: float, q: int, seed: int = 1):
    """The decoded SecureSum of ``replies`` ({cid: Reply}) to instructions ``ins`` with n_k ``n``
    over layout ``lay``, through SecAgg+'s quantisation (clip c, Q = ``q`` levels)."""
    scale = 1.0 / max(n.values())
    gen = torch.Generator().manual_seed(seed)
    total = None
    for c in sorted(replies):
        vec, _ = encode(ins[c].arrays, replies[c].arrays, n[c], lay, scale, clip)
        quant = []
        for v in vec:
            x = (v.clamp(-clip, clip) + clip) * q / (2 * clip)
            lo = x.floor()
            quant.append(lo + (torch.rand(x.shape, generator=gen, dtype=torch.float64) < x - lo))
        total = quant if total is None else [a + b for a, b in zip(total, quant)]
    deq = [t * (2 * clip) / q - len(replies) * clip for t in total]
    return decode(deq, lay, scale, sorted(replies))
