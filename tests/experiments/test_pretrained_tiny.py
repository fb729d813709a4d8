"""tiny-llama-mqar: pretrained once into the model cache (atomically, seeded), then loaded like any
backbone; before that, loading it names what builds it."""

import json

import pytest
import torch

from nestfed.config import ModelConfig
from nestfed.errors import ConfigError
from nestfed.experiments.pretrained_tiny import ensure_pretrained, mqar_layout, pretrain_mqar
from nestfed.nn.backbone import byte_tokenizer, load_backbone


@pytest.mark.slow
def test_it_is_pretrained_once_and_then_loaded(tmp_path, one_thread):
    cfg = ModelConfig(name="tiny-llama-mqar", cache_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="is pretrained once by nestfed.experiments.pretrained_tiny"):
        load_backbone(cfg)
    said = []
    path = ensure_pretrained(cfg, said.append, steps=20)
    assert path == tmp_path / "tiny-llama-mqar-seed0" and said and "pretraining tiny-llama-mqar" in said[0]
    facts = json.loads((path / "pretraining.json").read_text())
    assert facts["steps"] == 20 and facts["rows"] == 20 * 32 and 0 <= facts["full_attention_recall"] <= 1
    assert not list(tmp_path.glob(".*"))  # no temporary folder left beside it
    stamp = (path / "config.json").stat().st_mtime_ns
    assert ensure_pretrained(cfg, steps=20) == path and (path / "config.json").stat().st_mtime_ns == stamp
    bb = load_backbone(cfg)
    assert bb.model.config.num_attention_heads == 2 and len(bb.tokenizer) == 258
    assert all(not p.requires_grad for p in bb.model.parameters())
    again, _, _ = pretrain_mqar(0, steps=20)  # the same seed gives the same weights
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), bb.model.state_dict().values()))
    assert ensure_pretrained(ModelConfig(name="tiny-llama"), steps=20) is None


def test_the_layout_keeps_keys_and_values_apart():
    task = mqar_layout(byte_tokenizer())
    assert not set(task.vocab.keys) & set(task.vocab.values)
    assert set(task.fillers) == set(task.vocab.keys) | set(task.vocab.values)
