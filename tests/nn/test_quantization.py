"""``model.quantization``: the frozen backbone's linear layers held by bitsandbytes (nf4, int8).

Against the reference stack: transformers' ``BitsAndBytesConfig`` loading of the same weights holds
the same bytes, and PEFT's QLoRA step (the same adapter, batch and AdamW steps) lands on the same
adapter; the adapters stay float32; a zero LoRA leaves the quantised model's outputs unchanged."""

import pytest
import torch

pytest.importorskip("bitsandbytes")

from nestfed.config import ModelConfig  # noqa: E402
from nestfed.federation.training import Batch, train_on_blocks  # noqa: E402
from nestfed.nn.backbone import load_backbone, tiny_dir  # noqa: E402
from nestfed.nn.frozen_prefix import lm_logits  # noqa: E402
from nestfed.nn.lora import get_adapter_state, inject_lora, lora_modules, set_adapter_state  # noqa: E402
from nestfed.nn.quantization import bnb_config, is_quantized, quantization_state_bytes  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 4, 8.0


def reference(quantization: str):
    """The tiny Llama as transformers loads it quantised (what PEFT's QLoRA trains over)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    cfg = BitsAndBytesConfig(**bnb_config(ModelConfig(name="tiny-llama", quantization=quantization, device="cpu")))
    return AutoModelForCausalLM.from_pretrained(
        tiny_dir("tiny-llama", 0), quantization_config=cfg, dtype=torch.float32, device_map="cpu"
    )


def quantised(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if is_quantized(m) and ".lora_" not in n}


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_the_quantised_backbone_holds_what_transformers_loads(quantization):
    ours = quantised(load_backbone(ModelConfig(name="tiny-llama", quantization=quantization)).model)
    theirs = quantised(reference(quantization))
    assert sorted(ours) == sorted(theirs) and len(ours) == 2 * 7  # every decoder linear, not the LM head
    for name, m in ours.items():
        t = theirs[name]
        assert m.weight.dtype == t.weight.dtype == (torch.uint8 if quantization == "nf4" else torch.int8)
        assert torch.equal(m.weight, t.weight), name
        if quantization == "nf4":
            qs, qt = m.weight.quant_state, t.weight.quant_state
            assert torch.equal(qs.absmax, qt.absmax) and qs.nested and qt.nested
            assert torch.equal(qs.state2.absmax, qt.state2.absmax)
        else:
            assert torch.equal(m.weight.SCB, t.weight.SCB)


def adapter(model, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in get_adapter_state(model).items()}


def test_a_client_step_over_nf4_equals_peft_qlora_step():
    """Three AdamW steps with clipping over the same nf4 weights, adapter and batch: nestfed's
    training primitive (nestfed.federation.training) against PEFT's LoRA over transformers' 4-bit
    model. Equal losses and adapters (float rounding)."""
    from peft import LoraConfig, get_peft_model

    ours = load_backbone(ModelConfig(name="tiny-llama", quantization="nf4")).model
    inject_lora(ours, TARGETS, RANK, ALPHA / RANK)
    start = adapter(ours)
    set_adapter_state(ours, start)
    theirs = get_peft_model(reference("nf4"), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS)))
    loaded = theirs.load_state_dict(
        {k.replace(".weight", ".default.weight"): v for k, v in start.items()}, strict=False
    )
    assert not loaded.unexpected_keys
    theirs.train()  # as transformers' Trainer trains it (in eval mode bitsandbytes repacks nf4 for inference)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 258, (2, 24), generator=g)
    batch = Batch(labels=ids, input_ids=ids)

    params = [p for m in lora_modules(ours).values() for p in (m.lora_A.weight, m.lora_B.weight)]
    assert all(p.dtype == torch.float32 for p in params)
    our_losses = train_on_blocks(params, lambda idx: batch.loss(ours), 2, 3, 2, 1e-2, seed=0)

    peft_params = [p for n, p in theirs.named_parameters() if "lora_" in n]
    assert all(p.requires_grad for p in peft_params) and len(peft_params) == len(params)
    opt = torch.optim.AdamW(peft_params, lr=1e-2, weight_decay=0.0)
    their_losses = []
    for _ in range(3):
        loss = theirs(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(peft_params, 1.0)
        opt.step()
        their_losses.append(loss.item())

    assert our_losses == pytest.approx(their_losses, rel=1e-5)
    assert our_losses[-1] < our_losses[0]  # it trained
    after = {n.replace(".default.weight", ".weight"): p for n, p in theirs.named_parameters() if "lora_" in n}
    for k, v in get_adapter_state(ours).items():
        torch.testing.assert_close(v, after[k].detach(), rtol=1e-5, atol=1e-6)
        assert not torch.equal(v, start[k])


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_a_zero_lora_leaves_the_quantised_model_unchanged(quantization):
    plain = load_backbone(ModelConfig(name="tiny-llama", quantization=quantization)).model
    ids = torch.randint(0, 258, (2, 12))
    before = lm_logits(plain, ids)
    inject_lora(plain, TARGETS, RANK, 2.0)  # B = 0
    torch.testing.assert_close(lm_logits(plain, ids), before, rtol=0, atol=0)


def test_quantisation_changes_the_outputs_by_its_error_only():
    """nf4 and int8 logits stay near the float32 model's (quantisation error, not a broken layer),
    int8 nearer than nf4; the state beside the packed weights is counted."""
    ids = torch.randint(0, 258, (2, 12))
    full = lm_logits(load_backbone(ModelConfig(name="tiny-llama")).model, ids)
    errors = {}
    for q in ("int8", "nf4"):
        model = load_backbone(ModelConfig(name="tiny-llama", quantization=q)).model
        errors[q] = ((lm_logits(model, ids) - full).norm() / full.norm()).item()
        assert quantization_state_bytes(model) > 0
    assert 0 < errors["int8"] < errors["nf4"] < 0.2, errors


def test_the_footprint_counts_the_quantised_weights_and_their_state():
    """W for nf4: half a byte per quantised weight plus its constants; for int8 one byte plus a
    float32 scale per row; the embeddings and norms stay float32 (computed from the shapes)."""
    from nestfed.nn.footprint import weight_bytes

    full = load_backbone(ModelConfig(name="tiny-llama")).model
    linear = {n: m for n, m in full.named_modules() if type(m) is torch.nn.Linear and "lm_head" not in n}
    n_weights = sum(m.weight.numel() for m in linear.values())
    rows = sum(m.out_features for m in linear.values())
    dense = weight_bytes(full)
    rest = dense - 4 * n_weights  # embeddings (tied to the head) and norms, float32
    int8 = weight_bytes(load_backbone(ModelConfig(name="tiny-llama", quantization="int8")).model)
    assert int8 == rest + n_weights + 4 * rows
    nf4 = load_backbone(ModelConfig(name="tiny-llama", quantization="nf4", double_quant=False)).model
    blocks = n_weights // 64
    # absmax float32 per block of 64; each layer keeps its own copy of the 16-value NF4 code book
    assert weight_bytes(nf4) == rest + n_weights // 2 + 4 * blocks + 16 * 4 * len(linear)


def dequantized(model):
    """A float32 copy of the tiny Llama whose linear weights are the nf4 model's, dequantised (the
    naive reference: what the quantised layers must compute, forward and backward)."""
    import bitsandbytes.functional as bf

    dense = load_backbone(ModelConfig(name="tiny-llama")).model
    for name, m in quantised(model).items():
        w = bf.dequantize_4bit(m.weight.data, m.weight.quant_state).to(torch.float32)
        dense.get_submodule(name).weight.data.copy_(w)
    return dense


@pytest.mark.slow
def test_nf4_layers_compute_their_dequantised_weights_forward_and_backward_after_an_evaluation():
    """An evaluation first (eval mode, no gradients: what makes bitsandbytes 0.50 repack nf4 for a
    bfloat16 inference kernel without a backward on AVX512-BF16 CPUs), then a training pass: the
    logits and every LoRA gradient equal the dense model's with the dequantised weights."""
    nf4 = load_backbone(ModelConfig(name="tiny-llama", quantization="nf4")).model
    dense = dequantized(nf4)
    for m in (nf4, dense):
        inject_lora(m, TARGETS, RANK, 2.0)
    start = adapter(nf4)
    ids = torch.randint(0, 258, (2, 12), generator=torch.Generator().manual_seed(1))
    grads = []
    for m in (nf4, dense):
        set_adapter_state(m, start)
        m.eval()
        with torch.no_grad():
            evaluated = lm_logits(m, ids)
        m.train()
        params = [p for lm in lora_modules(m).values() for p in (lm.lora_A.weight, lm.lora_B.weight)]
        for p in params:
            p.requires_grad_(True)
        logits = lm_logits(m, ids)
        torch.testing.assert_close(logits, evaluated, rtol=1e-5, atol=1e-5)
        logits.square().mean().backward()
        assert all(p.grad is not None for p in params)
        grads.append((logits.detach(), [p.grad for p in params]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-4, atol=1e-5)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert grads[0][1][0].abs().sum() > 0  # the lowest LoRA layer gets a gradient through the layers above
