"""The memory levers: micro-batches with gradient accumulation and activation checkpointing give
the gradients of the whole batch without them (float rounding apart), and keep less for backward."""

from __future__ import annotations

import pytest
import torch
from tiny_federation import tiny_config, tiny_run

from nestfed.config import ModelConfig
from nestfed.errors import ConfigError
from nestfed.federation.training import Batch
from nestfed.nn.backbone import load_backbone
from nestfed.nn.checkpointing import enable_activation_checkpointing
from nestfed.nn.lora import inject_lora, lora_modules


def _model(seed: int = 0):
    bb = load_backbone(ModelConfig(name="tiny-llama", device="cpu"))
    inject_lora(bb.model, ("q_proj", "v_proj"), 4, 2.0)
    g = torch.Generator().manual_seed(seed)
    params = []
    for m in lora_modules(bb.model).values():
        with torch.no_grad():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)
        params += [m.lora_A.weight, m.lora_B.weight]
    for p in params:
        p.requires_grad_(True)
    return bb.model, params


def _batch() -> Batch:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (5, 12), generator=g)
    labels = ids.clone()
    labels[1, :7] = -100  # rows with different numbers of labelled tokens
    labels[3, :10] = -100
    return Batch(labels, input_ids=ids)


def _grads(model, params, batches) -> tuple[float, list[torch.Tensor]]:
    for p in params:
        p.grad = None
    total = 0.0
    for b in batches:
        loss = b.loss(model)
        loss.backward()
        total += loss.item()
    return total, [p.grad.clone() for p in params]


def test_micro_batches_accumulate_the_whole_batch_gradient():
    model, params = _model()
    batch = _batch()
    whole_loss, whole = _grads(model, params, [batch])
    for size in (1, 2, 3):
        micro = batch.micro_batches(size)
        assert len(micro) == -(-5 // size) and sum(m.share for m in micro) == pytest.approx(1.0)
        loss, got = _grads(model, params, micro)
        assert loss == pytest.approx(whole_loss, rel=1e-6)
        for a, b in zip(whole, got):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert batch.micro_batches(0) == [batch] and batch.micro_batches(5) == [batch]
    # shares weigh rows by labelled next tokens (labels[:, 1:]): 11 + 5 + 11 + 2 + 11 = 40
    assert [m.share for m in batch.micro_batches(1)] == pytest.approx([11 / 40, 5 / 40, 11 / 40, 2 / 40, 11 / 40])


def _saved_bytes(model, batch) -> int:
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = batch.loss(model)
    loss.backward()
    return sum(seen.values())


def test_activation_checkpointing_same_gradients_less_saved():
    model, params = _model()
    model.train()
    batch = Batch(*([torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(5))] * 2))
    _, plain = _grads(model, params, [batch])
    plain_saved = _saved_bytes(model, batch)
    enable_activation_checkpointing(model)
    _, ckpt = _grads(model, params, [batch])
    ckpt_saved = _saved_bytes(model, batch)
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert ckpt_saved < 0.7 * plain_saved
    model.eval()  # evaluation does not checkpoint (nothing is saved without grad anyway)
    assert not any(getattr(m, "gradient_checkpointing", False) and m.training for m in model.modules())


def test_checkpointing_refused_for_a_model_without_it():
    with pytest.raises(ConfigError, match="Linear does not support activation checkpointing"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("method", ["fedprox", "prelort"])
def test_a_run_with_micro_batches_ends_where_the_whole_batch_run_ends(tmp_path, method):
    extra = ["fedprox.mu=0.5", "lora.ranks=[4]"] if method == "fedprox" else []
    whole = tiny_run(tmp_path / "a", tiny_config(f"strategy.name={method}", *extra))[0].arrays
    micro = tiny_run(tmp_path / "b", tiny_config(f"strategy.name={method}", "train.micro_batch_size=1", *extra))[
        0
    ].arrays
    assert whole.keys() == micro.keys()
    for k in whole:
        torch.testing.assert_close(micro[k], whole[k], rtol=1e-4, atol=1e-6)
