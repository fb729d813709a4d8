"""Payload keys and decoder-layer indices."""

import pytest

from nestfed.nn.keys import layer_indices, layer_of, merged_key, module_of, peft_key, rank_dim


def test_layer_indices_count_negatives_from_the_top_and_name_the_field():
    assert layer_indices([-1, 0, -1, 2], 4, "lora.layers") == [0, 2, 3]
    assert layer_indices([], 4, "x") == []
    for bad in (4, -5):
        with pytest.raises(ValueError, match=f"memory.layers: index {bad} out of range for 4 layers"):
            layer_indices([bad], 4, "memory.layers")


def test_keys_round_trip():
    k = peft_key("model.layers.3.self_attn.q_proj", "lora_A")
    assert k == "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"
    assert module_of(k) == ("model.layers.3.self_attn.q_proj", "lora_A") and rank_dim(k) == 0 and layer_of(k) == 3
    m = merged_key("model.layers.3.self_attn.q_proj", "B")
    assert module_of(m) == ("model.layers.3.self_attn.q_proj", "merged_B") and rank_dim(m) is None
    assert layer_of("lm_head") is None
    with pytest.raises(KeyError, match="not a LoRA payload key"):
        module_of("base_model.model.model.norm.weight")
