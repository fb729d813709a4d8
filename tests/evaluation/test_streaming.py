"""Streaming: chunked equals one pass, the carried state is bounded by the window, the plain
baseline's cache grows, and the binned-CE probe arithmetic."""

import pytest
import torch

from nestfed.evaluation.streaming import StreamStats, binned_ce, stream_nll, stream_nll_hf
from nestfed.nn.bounded_attention import bounded_layers
from nestfed.nn.causal_conv import identity_taps
from nestfed.nn.frozen_prefix import lm_logits
from nestfed.nn.memory import MemorySettings, install_memory, memory_rules, set_memory_enabled


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (the shared fixture in conftest.py)."""
    yield


def one_pass_nll(model, ids):
    logits = lm_logits(model, ids)
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    ).view(ids.shape[0], -1)


def memory_model(tiny, gate="dynamic", window=0, sink=0, beta_source="hidden"):
    model = tiny.model.double()
    settings = MemorySettings(
        gate=gate,
        alpha_init=0.4,
        window=window,
        chunk_size=8,
        beta_source=beta_source,
        beta_window=3,
        dynamic_kernel=5,
        sink=sink,
        output_gate=True,
    )
    for r in memory_rules(model).values():  # rebuild: a second call on one model replaces the settings
        r.settings = settings
    install_memory(model, settings)
    for b in bounded_layers(model).values():  # the same rebuild for the softmax path's bounds
        b.window, b.sink = window, sink
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for r in memory_rules(model).values():
            r.beta_weight.copy_(0.3 * torch.randn(r.beta_weight.shape, generator=g, dtype=torch.float64))
            if gate == "dynamic":
                r.gate_conv.weight.copy_(0.05 * torch.randn(r.gate_conv.weight.shape, generator=g, dtype=torch.float64))
            for name in ("conv_q", "conv_k", "conv_v"):  # taps off the identity, so the carried tail matters
                taps = getattr(r, name)
                taps.copy_(identity_taps(*taps.shape).double() + 0.3 * torch.randn(taps.shape, generator=g).double())
            r.out_gate_weight.copy_(0.3 * torch.randn(r.out_gate_weight.shape, generator=g, dtype=torch.float64))
    set_memory_enabled(model, True)
    return model


@pytest.mark.parametrize("beta_source", ["hidden", "keys"])
@pytest.mark.parametrize("window,sink", [(0, 0), (6, 0), (6, 2)])
def test_chunked_stream_equals_one_pass(tiny, window, sink, beta_source):
    """S, the KV cache (with its attention sinks), the short convolution's tail, beta's key tail
    and the dynamic gate's input tail carried across chunks give exactly the one-pass forward
    (same window, memory on)."""
    model = memory_model(tiny, window=window, sink=sink, beta_source=beta_source)
    ids = torch.randint(0, 250, (2, 29), generator=torch.Generator().manual_seed(2))
    ref = one_pass_nll(model, ids)
    if sink:  # the sinks change the output (so the test below can fail)
        assert not torch.allclose(ref, one_pass_nll(memory_model(tiny, window=window, beta_source=beta_source), ids))
    for chunk in (1, 5, 29):
        got = stream_nll(
            model, ids, chunk=chunk, mode="memory", window=window or 10_000, sink=sink, sink_positions="absolute"
        )
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, atol=1e-9, rtol=0), chunk


def test_full_mode_equals_the_backbone_and_hf_cache(tiny_llama):
    ids = torch.randint(0, 250, (1, 23), generator=torch.Generator().manual_seed(4))
    model = tiny_llama.model
    hf = stream_nll_hf(model, ids, chunk=7)
    ref = one_pass_nll(model, ids)
    assert torch.allclose(hf, ref, atol=1e-5)
    install_memory(model, MemorySettings())  # disabled memory: the backbone
    full = stream_nll(model, ids, chunk=7, mode="full")
    assert torch.allclose(full, ref, atol=1e-5)


def test_state_is_bounded_by_the_window_and_full_cache_grows(tiny_llama):
    model = tiny_llama.model
    install_memory(model, MemorySettings(gate="learned", alpha_init=0.2))
    set_memory_enabled(model, True)
    ids = torch.randint(0, 250, (1, 96), generator=torch.Generator().manual_seed(0))
    st = StreamStats()
    stream_nll(model, ids, chunk=8, mode="memory", window=16, stats=st)
    cfg = model.config
    D = cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_key_value_heads * 15 * D * 4  # window - 1 keys and values, fp32
    S = cfg.num_attention_heads * D * D * 4
    # the short convolution's conv_size - 1 = 3 raw q, k, v tokens (beta reads the layer's input: no tail)
    tail = 3 * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * D * 4
    per_layer = kv + S + tail
    assert st.state_bytes[2:] == [per_layer * cfg.num_hidden_layers] * (len(st.state_bytes) - 2)
    full = StreamStats()
    set_memory_enabled(model, False)
    stream_nll(model, ids, chunk=8, mode="full", stats=full)
    sinks = StreamStats()
    set_memory_enabled(model, True)
    stream_nll(model, ids, chunk=8, mode="memory", window=16, stats=sinks, sink=3)
    sink_kv = 2 * cfg.num_key_value_heads * 3 * D * 4 * cfg.num_hidden_layers
    assert sinks.state_bytes[2:] == [per_layer * cfg.num_hidden_layers + sink_kv] * (len(sinks.state_bytes) - 2)
    set_memory_enabled(model, False)
    grow = [b - a for a, b in zip(full.state_bytes, full.state_bytes[1:])]
    assert grow == [8 * 2 * cfg.num_key_value_heads * D * 4 * cfg.num_hidden_layers] * len(grow)


def test_streaming_needs_no_memory_module(tiny_llama):
    """Bounded attention alone (what a streamed evaluation of any method installs) streams the
    backbone: full mode equals one pass, a window long enough changes nothing, a short one does;
    the state holds KV caches only (no memory rule, no delta-rule state)."""
    from nestfed.nn.bounded_attention import install_bounded_attention

    model = tiny_llama.model
    ids = torch.randint(0, 250, (1, 40), generator=torch.Generator().manual_seed(6))
    ref = one_pass_nll(model, ids)
    install_bounded_attention(model, None, window=8, sink=0)
    assert memory_rules(model) == {} and set(bounded_layers(model)) == {0, 1}
    assert torch.allclose(stream_nll(model, ids, chunk=7, mode="full"), ref, atol=1e-5)
    assert torch.allclose(stream_nll(model, ids, chunk=7, mode="window", window=64), ref, atol=1e-5)
    st = StreamStats()
    short = stream_nll(model, ids, chunk=8, mode="window", window=4, stats=st)
    assert (short - ref).abs().max() > 1e-3  # the window really bounds the softmax path
    cfg = model.config
    D = cfg.hidden_size // cfg.num_attention_heads
    assert st.state_bytes[-1] == 2 * cfg.num_key_value_heads * 3 * D * 4 * cfg.num_hidden_layers  # window - 1 keys


def test_streaming_refuses_layers_without_memory(tiny_llama):
    install_memory(tiny_llama.model, MemorySettings(), layers=(1,))
    with pytest.raises(ValueError, match="layer 0 has none"):  # memory on layer 1 bounds layer 1 only
        stream_nll(tiny_llama.model, torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="stream mode"):
        stream_nll(tiny_llama.model, torch.zeros(1, 4, dtype=torch.long), mode="sliding")


def test_binned_ce():
    nll = torch.tensor([2.0, 2.0, 1.0, 3.0, 1.0])
    out = binned_ce(nll, 2)
    assert out == {"ce": [2.0, 2.0, 1.0], "relative": [1.0, 1.0, 0.5], "tokens": [2, 2, 1]}
    with pytest.raises(ValueError):
        binned_ce(torch.tensor([]), 2)


@pytest.mark.parametrize("sink", [0, 2])
def test_stream_evaluate_equals_the_one_pass_evaluation(tiny_llama, sink):
    """Streamed held-out metrics equal the one-pass ones under the same window (and, with sinks
    at their own positions, the same sinks)."""
    from nestfed.evaluation.lm import evaluate_lm

    model = memory_model(tiny_llama, gate="learned", window=6, sink=sink)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 250, (3, 21), generator=g)
    labels = torch.full_like(ids, -100)
    ends = [21, 15, 9]  # right-padded rows of different lengths, one labelled letter each
    letters = [65, 66, 67, 68]
    for r, e in enumerate(ends):
        ids[r, e - 1] = letters[r]
        labels[r, e - 1] = letters[r]
        ids[r, e:] = 0
    ref = evaluate_lm(model, labels, ids, letter_ids=letters)
    from nestfed.evaluation.streaming import stream_evaluate

    got = stream_evaluate(
        model, ids, labels, chunk=4, window=6, letter_ids=letters, sink=sink, sink_positions="absolute"
    )
    assert got["tokens"] == ref["tokens"] == 3
    assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5)  # evaluate_lm takes the CE in fp32
    assert got["accuracy"] == ref["accuracy"]


def test_cache_sink_positions_put_the_sinks_just_before_the_window():
    """StreamingLLM's positions within the cache. In a one-layer model a token's key and value depend
    only on the token (RoPE is relative), so a token-by-token stream with ``sink`` sinks and a
    ``window`` predicts token p + 1 exactly as one pass over [the sinks, the window ending at p]
    does at its last position. With absolute positions it does not (the sinks are p - j away).
    Storing the shifted sinks in the cache would compound the shift token after token: caught too."""
    from nestfed.nn.backbone import freeze, tiny_model

    model = freeze(tiny_model("llama", 256, seed=3, layers=1)).double()
    install_memory(model, MemorySettings())  # disabled: the backbone's attention, windowed in the stream
    W, S, N = 5, 2, 24
    ids = torch.randint(0, 250, (1, N), generator=torch.Generator().manual_seed(9))
    cache = stream_nll(model, ids, chunk=1, mode="window", window=W, sink=S)
    absolute = stream_nll(model, ids, chunk=1, mode="window", window=W, sink=S, sink_positions="absolute")
    for p in range(S + W - 1, N - 1):
        packed = torch.cat([ids[:, :S], ids[:, p - W + 1 : p + 1]], dim=1)  # [1, S + W]
        ref = torch.nn.functional.cross_entropy(lm_logits(model, packed)[:, -1], ids[:, p + 1])
        # RoPE's cos / sin come in fp32, so a composed rotation differs from a direct one by ~1e-9
        assert cache[0, p] == pytest.approx(float(ref), abs=1e-7), p
    late = slice(S + W + 2, N - 1)  # the sinks have moved by at least 3 positions
    assert (cache[:, late] - absolute[:, late]).abs().min() > 1e-5  # 300x the tolerance above
    # before the shift is positive both agree
    assert torch.equal(cache[:, : S + W - 1], absolute[:, : S + W - 1])
    with pytest.raises(ValueError, match="sink_positions"):
        stream_nll(model, ids, chunk=1, mode="window", window=W, sink=S, sink_positions="relative")


def test_cache_sink_positions_refuse_position_dependent_rope(tiny_llama):
    model = tiny_llama.model
    install_memory(model, MemorySettings())
    ids = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(1))
    model.model.rotary_emb.rope_type = "dynamic"
    with pytest.raises(ValueError, match="rope_type is 'dynamic'"):
        stream_nll(model, ids, chunk=4, mode="window", window=4, sink=1)
    absolute = stream_nll(model, ids, chunk=4, mode="window", window=4, sink=1, sink_positions="absolute")
    assert absolute.shape == (1, 11)


def test_a_streamed_evaluation_takes_the_window_of_enabled_memory_only(tiny_llama):
    """A baseline evaluated on a backbone that also carries another method's (disabled) memory
    layers streams as if they were not there: the window never depends on which method ran first."""
    import dataclasses

    from nestfed.config import TrainConfig
    from nestfed.data.clients import ClientData
    from nestfed.evaluation.client import evaluate_streamed
    from nestfed.nn.bounded_attention import install_bounded_attention

    model = tiny_llama.model
    ids = torch.randint(0, 250, (2, 40), generator=torch.Generator().manual_seed(7))
    d = ClientData(ids, ids.clone(), ids, ids.clone())
    train = TrainConfig(eval_stream_chunk=8, cache_frozen_prefix=False)
    install_bounded_attention(model)
    plain = evaluate_streamed(model, d, train)
    install_memory(model, MemorySettings(gate="constant", alpha_init=0.0, window=4))  # e.g. FedNL's, disabled
    assert evaluate_streamed(model, d, train) == plain  # window 1024 both times: the memory is off
    set_memory_enabled(model, True)  # alpha 0: only the window acts
    windowed = evaluate_streamed(model, d, train)
    assert windowed["loss"] != pytest.approx(plain["loss"], rel=1e-6)
    set_memory_enabled(model, False)
    assert evaluate_streamed(model, d, dataclasses.replace(train, eval_stream_window=4)) == pytest.approx(windowed)
