"""A deployment's attention window (model.attention_window): every layer's softmax attention is
bounded whatever the method, a memory never widens it, and a stream never sees past it."""

import pytest
import torch
from transformers import DynamicCache

from nestfed.config.schema import ModelConfig
from nestfed.evaluation.streaming import stream_nll
from nestfed.nn.backbone import load_backbone
from nestfed.nn.bounded_attention import bounded_layers, install_bounded_attention
from nestfed.nn.frozen_prefix import lm_logits
from nestfed.nn.memory import MemorySettings, install_memory

T = 40


def logits(backbone, ids):
    with torch.no_grad():
        return lm_logits(backbone.model, ids)


@pytest.fixture
def ids():
    return torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(0))


def test_a_window_wider_than_the_rows_is_the_backbone(ids):
    plain = load_backbone(ModelConfig(name="tiny-llama"))
    wide = load_backbone(ModelConfig(name="tiny-llama", attention_window=T))
    assert set(bounded_layers(wide.model)) == {0, 1} and all(b.fixed for b in bounded_layers(wide.model).values())
    torch.testing.assert_close(logits(wide, ids), logits(plain, ids), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("sinks", [0, 2])
def test_a_token_further_back_than_every_layers_window_changes_nothing_but_a_sink(ids, sinks):
    """Two layers of window W see back at most 2 (W - 1) tokens: a token further back than that
    cannot change a query's logits, unless it is a sink. Without the window it does."""
    W = 8
    windowed = load_backbone(ModelConfig(name="tiny-llama", attention_window=W, attention_sinks=sinks))
    plain = load_backbone(ModelConfig(name="tiny-llama"))
    other = ids.clone()
    other[:, 0] = (other[:, 0] + 1) % 256  # change the first token only
    reach = 2 * (W - 1)  # positions > reach cannot see token 0 through two windows
    far = slice(reach + 1, T)
    moved = (logits(windowed, other)[:, far] - logits(windowed, ids)[:, far]).abs().max()
    assert (moved > 1e-4) if sinks else (moved == 0)
    assert (logits(plain, other)[:, far] - logits(plain, ids)[:, far]).abs().max() > 1e-4
    near = slice(1, W)  # inside the window of token 0: the change is seen with or without it
    assert (logits(windowed, other)[:, near] - logits(windowed, ids)[:, near]).abs().max() > 1e-4


def test_a_memory_narrows_a_deployment_window_and_never_widens_it():
    for own, expected in ((0, 8), (16, 8), (4, 4)):
        b = load_backbone(ModelConfig(name="tiny-llama", attention_window=8, attention_sinks=2))
        install_memory(b.model, MemorySettings(window=own), [1])
        bounds = bounded_layers(b.model)
        assert bounds[1].window == expected and bounds[1].sink == 2 and bounds[1].fixed
        assert bounds[0].window == 8


def test_a_stream_never_sees_past_the_deployment_window(ids):
    """Streamed with no window of its own (0), a bounded model computes what one pass of it does;
    the plain model streamed the same way does not."""
    W = 8
    windowed = load_backbone(ModelConfig(name="tiny-llama", attention_window=W))
    one_pass = torch.nn.functional.cross_entropy(
        logits(windowed, ids)[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none"
    )  # [B, T - 1]
    streamed = stream_nll(windowed.model, ids, chunk=5, mode="full", window=0, sink_positions="absolute")
    torch.testing.assert_close(streamed, one_pass, rtol=1e-4, atol=1e-5)
    plain = load_backbone(ModelConfig(name="tiny-llama"))
    install_bounded_attention(plain.model)
    assert (stream_nll(plain.model, ids, chunk=5, mode="full", window=0) - one_pass).abs().max() > 1e-4
    assert all(b.window == W for b in bounded_layers(windowed.model).values())


@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("chunks", [(T,), (16, 1, 1, 1, 21), (5, 12, 23)])
def test_a_hugging_face_cache_keeps_the_deployment_window(ids, sinks, chunks):
    """Fed through a Hugging Face KV cache in chunks (prefill, one-token decode steps, chunks wider
    than the window), a bounded model computes what one pass of it does: the window counts the
    cache's keys, not the call's queries."""
    windowed = load_backbone(ModelConfig(name="tiny-llama", attention_window=8, attention_sinks=sinks))
    cache, parts, start = DynamicCache(), [], 0
    with torch.no_grad():
        for n in chunks:
            out = windowed.model(ids[:, start : start + n], past_key_values=cache, use_cache=True)
            parts.append(out.logits)
            start += n
    torch.testing.assert_close(torch.cat(parts, dim=1), logits(windowed, ids), rtol=1e-4, atol=1e-5)
