"""The short causal convolution (DeltaNet's ShortConvolution): identity taps pass x through, a
chunked pass with the carried tail equals one pass, and it is causal and per channel."""

import torch

from nestfed.nn.causal_conv import causal_conv, identity_taps, next_tail


def test_identity_taps_pass_the_signal_through():
    x = torch.randn(2, 7, 5)
    assert torch.equal(causal_conv(x, identity_taps(5, 4)), x)


def test_hand_computed_taps_and_causality():
    x = torch.arange(1.0, 6.0).view(1, 5, 1)  # one channel: 1 2 3 4 5
    w = torch.tensor([[0.5, -1.0, 2.0]])  # y_t = 0.5 x_{t-2} - x_{t-1} + 2 x_t
    y = causal_conv(x, w).flatten().tolist()
    assert y == [2.0, 3.0, 4.5, 6.0, 7.5]  # x before the first token counts as 0
    x2 = x.clone()
    x2[0, 4, 0] = 100.0  # a later token changes nothing earlier
    assert causal_conv(x2, w).flatten().tolist()[:4] == y[:4]


def test_chunks_with_the_carried_tail_equal_one_pass():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 11, 6, generator=g), torch.randn(6, 4, generator=g)
    ref = causal_conv(x, w)
    for chunk in (1, 2, 5):
        tail, outs = None, []
        for s in range(0, 11, chunk):
            part = x[:, s : s + chunk]
            outs.append(causal_conv(part, w, tail))
            tail = next_tail(part, tail, 4)
            assert tail.shape[1] == min(3, s + part.shape[1])
        assert torch.allclose(torch.cat(outs, 1), ref, atol=1e-6), chunk
