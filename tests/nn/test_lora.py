import pytest
import torch

from nestfed.nn.frozen_prefix import lm_logits
from nestfed.nn.lora import (
    LoraLinear,
    active_rank,
    get_adapter_state,
    init_adapter_state,
    inject_lora,
    lora_modules,
    module_of,
    module_shapes,
    peft_key,
    set_adapter_state,
    target_module_names,
)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def test_zero_initialised_lora_leaves_logits_unchanged(tiny):
    ids = torch.randint(0, 258, (2, 12))
    ref = tiny.model(ids).logits
    inject_lora(tiny.model, TARGETS, rank=8, scaling=2.0)
    assert len(lora_modules(tiny.model)) == 8  # 4 targets x 2 layers
    assert torch.equal(lm_logits(tiny.model, ids), ref)


def test_prefix_subrank_equals_low_rank_adapter_with_same_rows():
    torch.manual_seed(1)
    base = torch.nn.Linear(6, 5)
    big = LoraLinear(base, rank=4, scaling=0.5)
    A, B = torch.randn(4, 6), torch.randn(5, 4)
    big.set_weights(A, B)
    small = LoraLinear(base, rank=2, scaling=0.5)
    small.set_weights(A[:2], B[:, :2])
    x = torch.randn(3, 6)
    big.active_rank = 2
    assert torch.allclose(big(x), small(x), atol=1e-6)
    # and the hand-written formula: W x + b + s * B[:, :2] A[:2] x
    expected = x @ base.weight.T + base.bias + 0.5 * x @ A[:2].T @ B[:, :2].T
    assert torch.allclose(small(x), expected, atol=1e-6)
    assert torch.allclose(big.delta_weight(2), 0.5 * B[:, :2] @ A[:2], atol=1e-6)


def test_active_rank_context_restores_and_rejects_too_high(tiny_llama):
    m = tiny_llama.model
    inject_lora(m, TARGETS, rank=4, scaling=1.0)
    with active_rank(m, 2):
        assert all(layer.active_rank == 2 for layer in lora_modules(m).values())
    assert all(layer.active_rank is None for layer in lora_modules(m).values())
    with pytest.raises(ValueError, match="exceeds"):
        with active_rank(m, 5):
            pass


def test_layers_selection_and_regex(tiny_llama):
    m = tiny_llama.model
    assert target_module_names(m, ("q_proj",), layers=(-1,)) == ["model.layers.1.self_attn.q_proj"]
    assert target_module_names(m, (r"model\.layers\.0\.mlp\..*",)) == [
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.0.mlp.down_proj",
    ]
    with pytest.raises(ValueError, match="matched no Linear"):
        target_module_names(m, ("nope",))
    with pytest.raises(ValueError, match="out of range"):
        target_module_names(m, ("q_proj",), layers=(5,))


def test_state_roundtrip_uses_peft_names_and_follows_rank(tiny_llama):
    m = tiny_llama.model
    inject_lora(m, ("q_proj",), rank=4, scaling=1.0)
    shapes = module_shapes(m)
    assert shapes["model.layers.0.self_attn.q_proj"] == (64, 64)
    st = init_adapter_state(shapes, rank=3, seed=7)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert key in st and st[key].shape == (3, 64)
    assert torch.count_nonzero(st[peft_key("model.layers.0.self_attn.q_proj", "lora_B")]) == 0
    assert torch.equal(st[key], init_adapter_state(shapes, rank=3, seed=7)[key])
    assert not torch.equal(st[key], init_adapter_state(shapes, rank=3, seed=8)[key])
    set_adapter_state(m, st)
    assert lora_modules(m)["model.layers.0.self_attn.q_proj"].rank == 3
    back = get_adapter_state(m)
    assert set(back) == set(st) and all(torch.equal(back[k], st[k]) for k in st)
    assert module_of(key) == ("model.layers.0.self_attn.q_proj", "lora_A")
    with pytest.raises(KeyError):
        set_adapter_state(m, {k: v for k, v in st.items() if "lora_B" not in k})
