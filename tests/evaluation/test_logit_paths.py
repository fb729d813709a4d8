"""Every logit path nestfed runs itself computes what the model computes: the frozen prefix (whole
and split at a cached layer), FedNL's memory layer (disabled, and enabled at alpha 0) and streaming
(``mode="full"``, any chunking) equal ``model(input_ids).logits`` for Llama, Qwen2 with a sliding
window on every layer, Qwen3 (per-head q/k norms) and Gemma-3 (a local layer with its own window and
rotary base below a global one, per-head q/k norms), under SDPA and eager attention alike: every
family nestfed accepts (nestfed.nn.layer_inputs.FAMILIES). A windowed stream is the same under
both implementations and equals the one-pass windowed memory path (before, eager attention added the
boolean window mask to its scores: 0.26 off at chunk 48 on the tiny Llama)."""

import pytest
import torch
from torch.nn import functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from nestfed.evaluation.streaming import stream_nll
from nestfed.nn.backbone import byte_tokenizer, freeze, tiny_model
from nestfed.nn.frozen_prefix import lm_logits, prefix_features
from nestfed.nn.memory import MemorySettings, install_memory, set_memory_enabled

FAMILIES = ["llama", "qwen2-window", "qwen3", "gemma3"]
IMPLEMENTATIONS = ["sdpa", "eager"]
VOCAB = len(byte_tokenizer())


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (the shared fixture in conftest.py)."""
    yield


def build(family: str, impl: str):
    """A tiny random model (hidden 64, 2 layers) of ``family`` under attention ``impl``."""
    torch.manual_seed(0)
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if family == "qwen2-window":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=True, sliding_window=8, max_window_layers=0))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=16))
    else:
        model = tiny_model(family, VOCAB)
    if family in ("qwen3", "gemma3"):  # q/k norms far from the identity, so a path that dropped them would show
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.2, 2.0)
                layer.self_attn.k_norm.weight.uniform_(0.2, 2.0)
    model.set_attn_implementation(impl)
    return freeze(model)


def ids_of(B: int, T: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB - 2, (B, T), generator=torch.Generator().manual_seed(seed))


def next_token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """NLL [B, T - 1] of tokens 1..T-1 under logits [B, T, V]."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none").view(
        ids.shape[0], -1
    )


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 2e-5, (got - want).abs().max()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_every_logit_path_equals_the_models_own(family, impl):
    model = build(family, impl)
    ids = ids_of(2, 40, seed=1)  # five times the sliding windows
    want = model(input_ids=ids).logits
    close(lm_logits(model, ids), want)
    close(lm_logits(model, hidden=prefix_features(model, ids, start=1, batch_size=1), start=1), want)
    install_memory(model, MemorySettings(gate="constant", alpha_init=0.0))
    close(lm_logits(model, ids), want)  # memory installed, disabled: the backbone's attention
    close(model(input_ids=ids).logits, want)
    set_memory_enabled(model, True)  # the linear path runs, mixed in at alpha 0
    close(lm_logits(model, ids), want)
    close(model(input_ids=ids).logits, want)
    set_memory_enabled(model, False)
    ref = next_token_nll(want, ids)
    for chunk in (1, 7, 40):
        close(stream_nll(model, ids, chunk=chunk, mode="full"), ref)


@pytest.mark.parametrize("family", ["qwen2-window", "gemma3"])
@torch.no_grad()
def test_the_layers_own_windows_and_rotary_bases_matter(family):
    """What the equalities above guard: the same weights computed with every layer full-attention
    (and, for Gemma-3, one rotary base for all layers) give other logits past the window."""
    model = build(family, "sdpa")
    ids = ids_of(1, 40, seed=2)
    want = model(input_ids=ids).logits
    model.config.layer_types = ["full_attention"] * len(model.config.layer_types)
    changed = (lm_logits(model, ids) - want).abs()
    assert changed[:, 8:].max() > 1e-2
    if family == "qwen2-window":  # within the window a full layer computes the same
        assert changed[:, :8].max() == 0


@pytest.mark.parametrize("sink_positions", ["absolute", "cache"])
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_windowed_streams_agree_under_eager_and_sdpa(family, sink_positions):
    ids = ids_of(1, 60, seed=3)
    got = {}
    for impl in IMPLEMENTATIONS:
        model = build(family, impl)
        install_memory(model, MemorySettings(gate="constant", alpha_init=0.0, window=6, sink=2))
        got[impl] = stream_nll(model, ids, chunk=5, mode="window", window=6, sink=2, sink_positions=sink_positions)
        if sink_positions == "absolute":  # the one-pass windowed path: FedNL's softmax path at alpha 0
            set_memory_enabled(model, True)
            close(got[impl], next_token_nll(lm_logits(model, ids), ids))
    close(got["eager"], got["sdpa"])
    assert got["sdpa"].isfinite().all()
