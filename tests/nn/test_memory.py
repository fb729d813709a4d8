"""The FedNL dual-path layer: alpha = 0 is the backbone bit for bit, gradients reach theta (LoRA
on q, k, v, beta's projection, the gate) and nothing else, chunkwise and recurrent agree."""

import pytest
import torch

from nestfed.nn.bounded_attention import bounded_layers
from nestfed.nn.frozen_prefix import causal_lm_loss, lm_logits
from nestfed.nn.lora import inject_lora, lora_modules
from nestfed.nn.memory import (
    MemorySettings,
    alpha_schedule,
    install_memory,
    memory_arrays,
    memory_knocked_out,
    memory_rules,
    set_constant_alpha,
    set_dropped_heads,
    set_memory_enabled,
)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Every test here on one torch thread (the shared fixture in conftest.py)."""
    yield


def ids(T=40, B=2, seed=1):
    return torch.randint(0, 250, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("window", [0, 8])
def test_alpha_zero_reproduces_the_backbone_exactly(tiny, window):
    model = tiny.model
    x = ids()
    ref_hf = model(x).logits
    ref = lm_logits(model, x)
    inject_lora(model, ("q_proj", "k_proj", "v_proj"), rank=4, scaling=2.0)
    install_memory(model, MemorySettings(gate="constant", alpha_init=0.0, window=window if window else 0))
    set_memory_enabled(model, True)
    if window:  # a window longer than the sequence changes nothing
        for b in bounded_layers(model).values():
            b.window = x.shape[1]
    assert torch.equal(lm_logits(model, x), ref)
    assert torch.equal(model(x).logits, ref_hf)
    set_memory_enabled(model, False)
    assert torch.equal(lm_logits(model, x), ref)
    # and alpha > 0 does change the output (the linear path is really there)
    set_memory_enabled(model, True)
    set_constant_alpha(model, 0.3)
    assert (lm_logits(model, x) - ref).abs().max() > 1e-4


def test_gradients_reach_theta_only(tiny_llama):
    model = tiny_llama.model
    inject_lora(model, ("q_proj", "k_proj", "v_proj"), rank=4, scaling=2.0)
    install_memory(model, MemorySettings(gate="learned", alpha_init=0.3))
    set_memory_enabled(model, True)
    theta = {}
    for name, m in lora_modules(model).items():
        torch.nn.init.normal_(m.lora_B.weight, std=0.02)  # B = 0 would zero A's gradient
        theta[f"{name}.lora_A.weight"] = m.lora_A.weight
        theta[f"{name}.lora_B.weight"] = m.lora_B.weight
    for name, p in model.named_parameters():
        if ".memory." in name:
            theta[name] = p
    for p in theta.values():
        p.requires_grad_(True)
    frozen = [n for n, p in model.named_parameters() if p.requires_grad and n not in theta]
    assert frozen == []  # the backbone stays frozen: o_proj, MLPs, norms, embeddings, head
    x = ids()
    causal_lm_loss(lm_logits(model, x), x).backward()
    names = {n for n, p in model.named_parameters() if p.grad is not None}
    assert names == set(theta)  # every theta parameter gets a gradient, nothing else does
    for n in theta:
        assert theta[n].grad.abs().max() > 0, n
    # theta per layer: LoRA on q, k, v (6 matrices), beta_weight, beta_bias, gate_logit, the q/k/v
    # convolutions and the read's norm weight
    assert sum(".memory." in n for n in theta) == 7 * len(memory_rules(model))


@pytest.mark.parametrize("gate", ["constant", "learned", "dynamic"])
def test_chunkwise_and_recurrent_agree_inside_the_layer(tiny_llama, gate):
    model = tiny_llama.model.double()
    x = ids(T=37)
    install_memory(model, MemorySettings(gate=gate, alpha_init=0.5, chunk_size=8))
    set_memory_enabled(model, True)
    g = torch.Generator().manual_seed(3)
    for r in memory_rules(model).values():
        with torch.no_grad():
            r.beta_weight.copy_(0.3 * torch.randn(r.beta_weight.shape, generator=g, dtype=torch.float64))
            if gate == "dynamic":
                r.gate_conv.weight.copy_(0.05 * torch.randn(r.gate_conv.weight.shape, generator=g, dtype=torch.float64))
        for p in r.parameters():
            p.requires_grad_(True)
    outs, grads = [], []
    for op in ("chunkwise", "recurrent"):
        for r in memory_rules(model).values():
            r.settings = MemorySettings(gate=gate, alpha_init=0.5, chunk_size=8, operator=op)
            r.zero_grad(set_to_none=True)
        logits = lm_logits(model, x)
        causal_lm_loss(logits, x).backward()
        outs.append(logits.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert torch.allclose(outs[0], outs[1], atol=1e-10, rtol=0)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-10, rtol=1e-8), n


def test_beta_average_and_gate_ranges(tiny_llama):
    model = tiny_llama.model
    install_memory(
        model, MemorySettings(gate="dynamic", gate_scope="layer", alpha_init=0.3, beta_source="keys", beta_window=3)
    )
    rule = memory_rules(model)[0]
    k = torch.randn(1, 6, rule.num_kv_heads, rule.head_dim)
    with torch.no_grad():
        rule.beta_weight.fill_(1.0)
    beta = rule.beta(k)
    # token 4's beta reads the mean of keys 2, 3, 4 of its group
    kbar = k[:, 2:5].mean(1)  # [1, Hkv, D]
    G = rule.num_heads // rule.num_kv_heads
    expect = torch.sigmoid(kbar.repeat_interleave(G, dim=1).sum(-1))  # [1, H]
    assert torch.allclose(beta[:, 4], expect, atol=1e-6)
    # the chunked form with a tail equals the one-pass form
    assert torch.allclose(rule.beta(k[:, 4:], tail=k[:, 2:4]), beta[:, 4:], atol=1e-6)
    x = torch.randn(2, 5, rule.hidden)
    a = rule.gate(x)
    assert a.shape == (2, 5, 1, 1) and torch.allclose(a, torch.full_like(a, 0.3), atol=1e-5)
    with torch.no_grad():
        rule.gate_conv.weight.normal_(std=10.0)
    a = rule.gate(x)
    assert a.min() >= 0.1 - 1e-6 and a.max() <= 0.9 + 1e-6 and a.max() - a.min() > 0.1


def test_schedule_and_settings():
    assert alpha_schedule(0, 0.01, 0.5, 10) == 0.01
    assert abs(alpha_schedule(5, 0.01, 0.5, 10) - 0.255) < 1e-12
    assert alpha_schedule(50, 0.01, 0.5, 10) == 0.5
    with pytest.raises(ValueError, match="gate: unknown gate"):
        MemorySettings(gate="static")


@pytest.mark.parametrize(
    "settings,names",
    [
        (MemorySettings(), ("beta_bias", "beta_weight", "conv_k", "conv_q", "conv_v", "gate_logit", "norm_weight")),
        (
            MemorySettings(gate_scope="layer", alpha_init=0.05, beta_source="keys", conv_size=0, norm_weight=False),
            ("beta_bias", "beta_weight", "gate_logit"),
        ),
        (
            MemorySettings(output_gate=True, conv_size=0),
            ("beta_bias", "beta_weight", "gate_logit", "norm_weight", "out_gate_bias", "out_gate_weight"),
        ),
    ],
    ids=["reference", "tptt", "output-gate"],
)
def test_memory_arrays_name_parameters(tiny_llama, settings, names):
    model = tiny_llama.model
    install_memory(model, settings, layers=(-1,))
    arrays = memory_arrays(model)
    assert sorted(arrays) == [f"base_model.model.model.layers.1.self_attn.memory.{n}" for n in names]
    for k, v in arrays.items():
        assert torch.equal(model.get_parameter(k[len("base_model.model.") :]).detach(), v)


@torch.no_grad()
def test_a_disabled_memory_keeps_the_q_and_k_norms_of_qwen3():
    """Qwen3 normalises each head's q and k before RoPE; the memory layer's softmax path must too
    (before, installing the memory dropped them and moved the logits)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=258,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
    ).eval()
    for layer in model.model.layers:  # norms far from the identity, so dropping them would show
        layer.self_attn.q_norm.weight.uniform_(0.2, 3.0)
        layer.self_attn.k_norm.weight.uniform_(0.2, 3.0)
    x = ids()
    ref = model(x).logits
    install_memory(model, MemorySettings(gate="constant", alpha_init=0.0))
    assert torch.allclose(lm_logits(model, x), ref, atol=1e-5, rtol=0)
    set_memory_enabled(model, True)
    assert torch.allclose(model(x).logits, ref, atol=1e-5, rtol=0)  # alpha = 0: the backbone


@pytest.mark.parametrize("window,sink", [(0, 0), (4, 0), (4, 2)], ids=["full", "window", "window+sinks"])
@pytest.mark.parametrize("gate", ["learned", "dynamic"])
@torch.no_grad()
def test_left_padding_changes_nothing_in_the_memory_path(tiny_llama, gate, window, sink):
    """A row left-padded with 4 pads and a 0/1 attention mask gives the unpadded row's logits, and
    the pads' ids do not matter: pads write nothing into the delta-rule state and stay out of
    beta's average and the gate's convolution; under a window with attention sinks the sinks are
    the row's first real tokens, not its pads."""
    model = tiny_llama.model
    install_memory(
        model, MemorySettings(gate=gate, alpha_init=0.5, beta_window=4, dynamic_kernel=3, window=window, sink=sink)
    )
    set_memory_enabled(model, True)
    torch.manual_seed(3)
    for rule in memory_rules(model).values():
        rule.beta_weight.normal_(0, 1.0)
        if gate == "dynamic":
            rule.gate_conv.weight.normal_(0, 0.5)
    x = ids(T=12, B=1)
    want = model(x).logits
    mask = torch.tensor([[0] * 4 + [1] * 12])
    for pad_id in (0, 77):
        padded = torch.cat([torch.full((1, 4), pad_id), x], dim=1)
        got = model(padded, attention_mask=mask).logits[:, 4:]
        assert torch.allclose(got, want, atol=1e-5, rtol=0), (pad_id, (got - want).abs().max())
    assert all(b.padding is None for b in bounded_layers(model).values())  # cleared after the call


def _set_rules(model, g):
    """Random beta projections on every memory layer (so that beta differs from 0.5)."""
    with torch.no_grad():
        for r in memory_rules(model).values():
            r.beta_weight.copy_(0.3 * torch.randn(r.beta_weight.shape, generator=g))


@torch.no_grad()
def test_a_fresh_convolution_norm_and_output_gate_change_nothing(tiny_llama):
    """The reference layer's additions start at the identity (the convolution's taps, the norm's
    weight of ones, the output gate's 2 sigmoid(0) = 1): a fresh layer computes what the plain
    layer with the same beta and gate computes; moved off their start, each changes the output."""
    x = ids()
    outs = {}
    for name, extra in {
        "plain": dict(conv_size=0, norm_weight=False, output_gate=False),
        "reference": dict(conv_size=4, norm_weight=True, output_gate=True),
    }.items():
        model = tiny_llama.model
        for layer in model.model.layers:  # install_memory keeps a layer's memory: take it off to rebuild
            if hasattr(layer.self_attn, "memory"):
                del layer.self_attn.memory
        install_memory(model, MemorySettings(gate="learned", alpha_init=0.4, **extra))
        set_memory_enabled(model, True)
        _set_rules(model, torch.Generator().manual_seed(0))
        outs[name] = lm_logits(model, x)
    assert torch.allclose(outs["plain"], outs["reference"], atol=1e-6, rtol=0)
    rule = memory_rules(tiny_llama.model)[0]
    for name in ("conv_k", "norm_weight", "out_gate_bias"):
        p = getattr(rule, name)
        saved = p.clone()
        p.add_(0.5)
        assert (lm_logits(tiny_llama.model, x) - outs["reference"]).abs().max() > 1e-4, name
        p.copy_(saved)


@torch.no_grad()
def test_knockout_is_the_window_alone_and_dropped_heads_read_the_memory_alone(tiny_llama):
    """memory_knocked_out gives exactly a gate of 0 (the windowed softmax path); a head in
    ``drop`` gives exactly a gate of 1 at that head (the memory's read alone) and leaves the
    other heads as they were."""
    model = tiny_llama.model
    x = ids()
    install_memory(model, MemorySettings(gate="constant", alpha_init=0.0, window=6))
    set_memory_enabled(model, True)
    _set_rules(model, torch.Generator().manual_seed(1))
    window_alone = lm_logits(model, x)
    set_constant_alpha(model, 0.3)
    mixed = lm_logits(model, x)
    assert (mixed - window_alone).abs().max() > 1e-3
    with memory_knocked_out(model):
        assert torch.equal(lm_logits(model, x), window_alone)
    assert torch.equal(lm_logits(model, x), mixed)  # restored after the block

    attn = model.model.layers[0].self_attn
    seen = {}
    real = attn.o_proj.forward
    attn.o_proj.forward = lambda h: seen.setdefault("o", h.clone()) is not None and real(h)
    rule = memory_rules(model)[0]
    H = rule.num_heads
    outs = {}
    for label, alpha, drop in (("alpha 0.3", 0.3, None), ("alpha 1", 1.0, None), ("drop head 1", 0.3, [1])):
        set_constant_alpha(model, alpha)
        set_dropped_heads(model, None if drop is None else {0: torch.tensor([h in drop for h in range(H)])})
        seen.clear()
        lm_logits(model, x)
        outs[label] = seen["o"].view(*seen["o"].shape[:2], H, -1)
    set_dropped_heads(model, None)
    attn.o_proj.forward = real
    assert torch.allclose(outs["drop head 1"][:, :, 1], outs["alpha 1"][:, :, 1], atol=1e-6)
    for h in (0, 2, 3):
        assert torch.allclose(outs["drop head 1"][:, :, h], outs["alpha 0.3"][:, :, h], atol=1e-6)
