"""A short causal depthwise convolution over time, the one DeltaNet puts on q, k and v.

Source: flash-linear-attention's ``ShortConvolution`` (``fla/modules/convolution.py``; Yang et al.
2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence Length", section 3.3:
"we found it crucial"): each channel c is convolved with its own kernel of K taps over the
current and the K - 1 previous tokens,

    y[b, t, c] = sum_{j < K} weight[c, j] * x[b, t - K + 1 + j, c]      (x before the first token = 0)

A stream carries the last K - 1 inputs (the ``tail``) from one chunk to the next, so that a chunked
pass equals one pass over the whole sequence (tested). `identity_taps` gives the kernel that
passes x through unchanged (the last tap 1, the others 0): a freshly built convolution changes
nothing.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def identity_taps(channels: int, size: int) -> torch.Tensor:
    """Build the identity kernel: weight[:, -1] = 1, every other tap 0.

    Args:
        channels: C, the channels.
        size: K, the taps per channel.

    Returns:
        The kernel [channels, size], float32.
    """
    w = torch.zeros(channels, size)
    w[:, -1] = 1.0
    return w


def causal_conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
    """Convolve each channel causally over time with its own kernel (the module docstring's y).

    Args:
        x: [B, T, C] inputs.
        weight: [C, K] kernels, one per channel.
        tail: [B, n, C] up to K - 1 inputs that precede x (a stream's previous chunk); zeros where
            there are fewer, or when None.

    Returns:
        y [B, T, C], in x's dtype.

    Raises:
        ValueError: when x's channels differ from weight's.
    """
    B, T, C = x.shape
    if weight.shape[0] != C:
        raise ValueError(f"causal_conv: x has {C} channels, the kernel {weight.shape[0]}")
    K = weight.shape[1]
    prev = x.new_zeros(B, K - 1, C)
    if tail is not None and tail.shape[1] and K > 1:
        n = min(tail.shape[1], K - 1)
        prev[:, K - 1 - n :] = tail[:, -n:].to(x.dtype)
    xp = torch.cat([prev, x], dim=1).transpose(1, 2)  # [B, C, T + K - 1]
    return F.conv1d(xp, weight.to(x.dtype).unsqueeze(1), groups=C).transpose(1, 2)


def next_tail(x: torch.Tensor, tail: torch.Tensor | None, size: int) -> torch.Tensor:
    """Keep the inputs a stream carries to its next chunk (detached).

    Args:
        x: [B, T, C] this chunk's inputs.
        tail: [B, n, C] the previous tail, which precedes x; none when None.
        size: K, the kernel's taps.

    Returns:
        The last ``size - 1`` inputs, [B, min(size - 1, n + T), C].
    """
    x = x.detach() if tail is None else torch.cat([tail, x.detach()], dim=1)
    return x[:, x.shape[1] - min(size - 1, x.shape[1]) :]
