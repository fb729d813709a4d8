"""The frozen prefix computes what the model computes, whatever its attention: sliding-window
layers (Qwen2 ``use_sliding_window``) and eager attention get the masks the model's own forward
builds (nestfed.nn.layer_inputs); without them the logits differ (checked, so the test can fail)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from nestfed.config import ModelConfig
from nestfed.errors import ConfigError
from nestfed.nn.backbone import byte_tokenizer, load_backbone, tiny_model
from nestfed.nn.frozen_prefix import lm_logits, prefix_features
from nestfed.nn.layer_inputs import check_architecture, decoder_inputs, layer_types, positional_mask

COMMON = dict(
    vocab_size=258,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def qwen2_sliding(attn: str = "sdpa") -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=0))
    model.set_attn_implementation(attn)
    return model.eval()


def llama(attn: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**COMMON))
    model.set_attn_implementation(attn)
    return model.eval()


def maskless_logits(model, ids):
    """The frozen prefix as it was: every layer with attention_mask=None and one rotary embedding."""
    inner = model.model
    h = inner.embed_tokens(ids)
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    pe = inner.rotary_emb(h, position_ids=pos)
    for layer in inner.layers:
        out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        h = out[0] if isinstance(out, tuple) else out
    return model.lm_head(inner.norm(h))


@pytest.mark.slow
@pytest.mark.parametrize(
    "build",
    [lambda: qwen2_sliding("sdpa"), lambda: qwen2_sliding("eager"), lambda: llama("eager")],
    ids=["qwen2-window-sdpa", "qwen2-window-eager", "llama-eager"],
)
@torch.no_grad()
def test_prefix_logits_equal_the_models_own(build):
    model = build()
    ids = torch.randint(0, 258, (2, 48), generator=torch.Generator().manual_seed(1))
    want = model(input_ids=ids).logits
    assert torch.allclose(lm_logits(model, ids), want, atol=1e-5, rtol=0)
    hidden = prefix_features(model, ids, start=1, batch_size=1)  # the split path: layer 0 cached
    assert torch.allclose(lm_logits(model, hidden=hidden, start=1), want, atol=1e-5, rtol=0)
    assert (maskless_logits(model, ids) - want).abs().max() > 1e-2  # what the masks fix


@torch.no_grad()
def test_full_causal_sdpa_is_unchanged_and_needs_no_mask():
    model = llama("sdpa")
    ids = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(2))
    masks, _ = decoder_inputs(model, model.model.embed_tokens(ids), torch.arange(24).unsqueeze(0))
    assert masks == [None, None]  # SDPA's is_causal path, as before
    assert torch.equal(lm_logits(model, ids), maskless_logits(model, ids))


def test_an_attention_type_we_cannot_build_is_refused_by_name():
    model = llama("sdpa")
    model.model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ConfigError, match="chunked_attention"):
        layer_types(model)


def test_positional_masks_take_the_implementations_format():
    """Queries at 4, 5 over cached keys 0..5 (window 2, one sink; a layer window of 5 hides key 0
    from query 5): boolean for SDPA, additive for eager, the same pattern; flash attention refused."""
    config = llama("sdpa").config
    q, k = torch.arange(4, 6), torch.arange(0, 6)
    seen = [[True, False, False, True, True, False], [True, False, False, False, True, True]]
    assert positional_mask(config, q, k, torch.float32, window=2, sink=1)[0, 0].tolist() == seen
    own = positional_mask(config, q, k, torch.float32, window=2, sink=1, own_window=5)[0, 0]
    assert own.tolist() == [seen[0], [False] + seen[1][1:]]
    assert positional_mask(config, torch.arange(3, 6), k, torch.float32, window=3)[0, 0].tolist() == [
        [False, True, True, True, False, False],
        [False, False, True, True, True, False],
        [False, False, False, True, True, True],
    ]
    config._attn_implementation = "eager"
    additive = positional_mask(config, q, k, torch.float32, window=2, sink=1)[0, 0]
    assert torch.equal(additive, torch.where(torch.tensor(seen), 0.0, torch.finfo(torch.float32).min))
    config._attn_implementation = "flash_attention_2"
    with pytest.raises(ConfigError, match="flash_attention_2"):
        positional_mask(config, q, k, torch.float32, window=2)


def test_models_nestfed_cannot_compute_exactly_are_refused_by_name(tmp_path):
    for name in ("tiny-llama", "tiny-qwen2", "tiny-gemma3"):
        check_architecture(load_backbone(ModelConfig(name=name)).model)
    gemma = tiny_model("gemma3", len(byte_tokenizer(bos=True)))
    gemma.config.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match="final_logit_softcapping = 30.0"):
        check_architecture(gemma)
    mistral = MistralForCausalLM(MistralConfig(**COMMON))
    with pytest.raises(ConfigError, match="MistralForCausalLM \\(model_type 'mistral'\\)"):
        check_architecture(mistral)
    mistral.save_pretrained(tmp_path / "mistral")
    byte_tokenizer().save_pretrained(tmp_path / "mistral")
    with pytest.raises(ConfigError, match="model_type 'mistral'"):  # before any run uses it
        load_backbone(ModelConfig(name=str(tmp_path / "mistral")))
