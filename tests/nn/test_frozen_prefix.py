import pytest
import torch
from torch.nn import functional as F

from nestfed.evaluation.lm import evaluate_lm
from nestfed.federation.training import Batch
from nestfed.nn.frozen_prefix import (
    causal_lm_loss,
    first_adapted_layer,
    labelled_length,
    labelled_logits,
    lm_logits,
    prefix_features,
)
from nestfed.nn.lora import get_adapter_state, inject_lora, set_adapter_state


@pytest.mark.slow
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


@pytest.mark.slow
def test_labelled_logits_equal_full_head_on_labelled_positions_and_same_loss_and_grads(tiny_llama):
    m = tiny_llama.model
    inject_lora(m, ("q_proj", "v_proj"), rank=4, scaling=1.0)
    set_adapter_state(m, {k: torch.randn_like(v) for k, v in get_adapter_state(m).items()})
    ids = torch.randint(0, 258, (3, 16))
    labels = torch.full_like(ids, -100)
    labels[0, 5] = ids[0, 5]  # one answer token (multiple choice)
    labels[1, 9:] = ids[1, 9:]  # a response (instruction tuning)
    labels[2, 1:] = ids[2, 1:]  # every token (causal LM)
    full = lm_logits(m, ids)
    logits, targets = labelled_logits(m, labels, ids)
    assert logits.shape == (1 + 7 + 15, 258)
    sel = torch.cat([full[0, 4:5], full[1, 8:15], full[2, 0:15]])
    torch.testing.assert_close(logits, sel, rtol=1e-5, atol=1e-5)
    assert targets.tolist() == labels[0, 5:6].tolist() + labels[1, 9:].tolist() + labels[2, 1:].tolist()
    # the training loss and its gradients equal the full-head cross-entropy's
    params = [p for p in m.parameters() if p.requires_grad]
    g_ref = torch.autograd.grad(causal_lm_loss(lm_logits(m, ids), labels), params)
    loss = Batch(labels, ids).loss(m)
    torch.testing.assert_close(loss, causal_lm_loss(full, labels), rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(loss, params), g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_evaluate_accuracy_from_letter_logits_matches_a_hand_count(tiny_llama):
    m = tiny_llama.model
    ids = torch.randint(0, 258, (5, 10))
    letters = [65, 66, 67, 68]
    labels = torch.full_like(ids, -100)
    gold = torch.tensor([65, 66, 67, 68, 65])
    labels[:, 7] = gold
    full = lm_logits(m, ids).detach()
    want = (torch.tensor(letters)[full[:, 6, letters].argmax(1)] == gold).float().mean().item()
    ce = F.cross_entropy(full[:, 6], gold).item()
    out = evaluate_lm(m, labels, input_ids=ids, batch_size=2, letter_ids=letters)
    assert abs(out["accuracy"] - want) < 1e-9 and abs(out["loss"] - ce) < 1e-5 and out["tokens"] == 5.0


def test_right_padding_after_the_last_label_is_never_computed(tiny_llama):
    """labelled_length by hand; prefix_features with lengths runs each (longest-first) batch only to
    its longest row and matches the full computation where it is read; labelled_logits on a batch
    whose labels end early equals the full head's at the labelled positions."""
    labels = torch.tensor([[-100, 5, -100, -100], [-100, -100, -100, -100], [1, 2, 3, 4]])
    assert labelled_length(labels).tolist() == [2, 0, 4]
    m = tiny_llama.model
    inject_lora(m, ("q_proj", "v_proj"), rank=4, scaling=1.0, layers=(1,))
    set_adapter_state(m, {k: torch.randn_like(v) for k, v in get_adapter_state(m).items()})
    ids = torch.randint(0, 258, (5, 24))
    lengths = torch.tensor([7, 24, 3, 11, 0])
    full = prefix_features(m, ids, 1, batch_size=2)
    calls = []
    hook = m.model.layers[0].register_forward_hook(lambda mod, a, out: calls.append(a[0].shape[1]))
    trimmed = prefix_features(m, ids, 1, batch_size=2, lengths=lengths)
    hook.remove()
    assert calls == [24, 7, 1]  # rows (1, 3), (0, 2), (4,): each batch to its longest row
    for r, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(trimmed[r, :n], full[r, :n], rtol=1e-5, atol=1e-5)
    lab = torch.full_like(ids, -100)
    lab[0, 6] = ids[0, 6]
    lab[1, 10] = ids[1, 10]
    ref = lm_logits(m, hidden=full, start=1)
    calls.clear()
    hook = m.model.layers[1].register_forward_hook(lambda mod, a, out: calls.append(a[0].shape[1]))
    logits, targets = labelled_logits(m, lab[:2], hidden=trimmed[:2], start=1)
    hook.remove()
    assert calls == [11]
    torch.testing.assert_close(logits, torch.stack([ref[0, 5], ref[1, 9]]), rtol=1e-5, atol=1e-5)
    assert targets.tolist() == [int(ids[0, 6]), int(ids[1, 10])]
