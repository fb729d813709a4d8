import torch

from nestfed.adapters.lora import get_adapter_state, inject_lora, set_adapter_state
from nestfed.frozen_prefix import causal_lm_loss, first_adapted_layer, lm_logits, prefix_features


def test_split_forward_equals_full_model(tiny):
    m = tiny.model
    inject_lora(m, ("q_proj", "v_proj"), rank=4, scaling=1.0, layers=(1,))
    set_adapter_state(m, {k: torch.randn_like(v) for k, v in get_adapter_state(m).items()})
    assert first_adapted_layer(m) == 1
    ids = torch.randint(0, 258, (3, 20))
    full = m(ids).logits
    h = prefix_features(m, ids, 1, batch_size=2)
    assert h.shape == (3, 20, 64)
    torch.testing.assert_close(lm_logits(m, hidden=h, start=1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lm_logits(m, ids), full, rtol=1e-5, atol=1e-5)


def test_causal_lm_loss_matches_hf_and_ignores_masked(tiny_llama):
    m = tiny_llama.model
    ids = torch.randint(0, 258, (2, 12))
    labels = ids.clone()
    labels[:, :5] = -100
    out = m(ids, labels=labels)
    torch.testing.assert_close(causal_lm_loss(out.logits, labels), out.loss, rtol=1e-5, atol=1e-6)
