"""FedSLM's SVD-derived compressed models: ranks, nesting, reconstruction, logits, no dense W."""

import pytest
import torch
from torch import nn

from nestfed.nn.footprint import weight_bytes
from nestfed.nn.frozen_prefix import lm_logits
from nestfed.nn.lora import inject_lora
from nestfed.nn.svd import (
    DEFAULT_TARGET,
    SVDLinear,
    compute_bases,
    derive_compressed,
    layer_ranks,
    load_bases,
    parameter_bytes,
    project,
    rank_for_ratio,
    reconstruct,
    save_bases,
    select_layers,
    svd_modules,
    target_linear_names,
)

FULL = 100.0  # a ratio large enough for full rank at every layer of the tiny models


def test_rank_for_ratio_hand_computed():
    # floor(rho * out * in / (out + in)): 0.5 * 576 * 576 / 1152 = 144; 0.5 * 1536 * 576 / 2112 = 209.45
    assert rank_for_ratio(576, 576, 0.5) == 144
    assert rank_for_ratio(1536, 576, 0.5) == 209
    assert rank_for_ratio(576, 192, 0.3) == 43  # 0.3 * 110592 / 768 = 43.2
    assert rank_for_ratio(64, 64, FULL) == 64  # capped at min(out, in)
    assert rank_for_ratio(3, 3, 0.01) == 1  # at least 1
    with pytest.raises(ValueError, match="ratio must be > 0"):
        rank_for_ratio(4, 4, 0.0)


def test_svd_linear_forward_equals_dense_u_sigma_vt():
    U, _ = torch.linalg.qr(torch.randn(6, 3))
    V, _ = torch.linalg.qr(torch.randn(5, 3))
    sigma = torch.tensor([[3.0, 0.5, 0.0], [0.0, 2.0, -1.0], [0.25, 0.0, 1.0]])
    bias = torch.arange(6.0)
    layer = SVDLinear(U, V, sigma, bias)
    x = torch.randn(2, 4, 5)
    assert torch.allclose(layer(x), x @ (U @ sigma @ V.T).T + bias, atol=1e-6)
    assert torch.allclose(layer.weight_equivalent(), U @ sigma @ V.T)
    with pytest.raises(ValueError, match="must be"):
        SVDLinear(U, V, torch.zeros(2, 2))


def test_default_target_is_every_attention_and_mlp_projection(tiny):
    names = target_linear_names(tiny.model, DEFAULT_TARGET)
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
    assert leaves == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert len(names) == 7 * tiny.model.config.num_hidden_layers
    assert "lm_head" not in names
    with pytest.raises(ValueError, match="matched no Linear"):
        target_linear_names(tiny.model, r"nothing\.here")
    with pytest.raises(ValueError, match="not a valid regex"):
        target_linear_names(tiny.model, r"(unclosed")


@pytest.mark.slow
def test_bases_are_nested_prefixes_across_ratios(tiny_llama):
    model = tiny_llama.model
    bases = compute_bases(model, [0.3, 0.5, 0.7])
    ranks = {rho: layer_ranks(bases, rho) for rho in (0.3, 0.5, 0.7)}
    models = {rho: derive_compressed(model, bases, rho) for rho in (0.3, 0.5, 0.7)}
    name = "model.layers.0.mlp.up_proj"  # [128, 64]: r = floor(rho * 128 * 64 / 192)
    assert [ranks[rho][name] for rho in (0.3, 0.5, 0.7)] == [12, 21, 29]
    for lo, hi in ((0.3, 0.5), (0.5, 0.7)):
        for n in bases:
            a, b = models[lo].get_submodule(n), models[hi].get_submodule(n)
            r = a.rank
            assert r <= b.rank
            assert torch.equal(a.U, b.U[:, :r]) and torch.equal(a.V, b.V[:, :r])
            assert torch.equal(a.sigma, b.sigma[:r, :r])  # diag(S) prefixes too
    # the bases are orthonormal and the core starts at diag(S)
    f = bases[name]
    assert torch.allclose(f.U.T @ f.U, torch.eye(f.U.shape[1]), atol=1e-5)
    assert torch.allclose(f.V.T @ f.V, torch.eye(f.V.shape[1]), atol=1e-5)
    assert torch.all(f.S[:-1] >= f.S[1:])


def test_reconstruction_error_falls_with_rank_and_vanishes_at_full_rank(tiny_llama):
    model = tiny_llama.model
    name = "model.layers.1.self_attn.o_proj"
    W = model.get_submodule(name).weight
    bases = compute_bases(model, [FULL], pattern=r".*layers\.1\.self_attn\.o_proj")
    f = bases[name]
    errors = []
    for r in range(1, f.S.shape[0] + 1):
        Wr = reconstruct(f.U[:, :r], torch.diag(f.S[:r]), f.V[:, :r])
        errors.append(float((W - Wr).norm()))
        # Eckart-Young: the error is the norm of the discarded singular values
        assert errors[-1] == pytest.approx(float(f.S[r:].norm()), rel=1e-3, abs=1e-4)
    assert all(a > b for a, b in zip(errors, errors[1:]))
    assert errors[-1] < 1e-4 * float(W.norm())
    # projecting W back onto the full bases recovers diag(S)
    assert torch.allclose(project(W, f.U, f.V), torch.diag(f.S), atol=1e-4)


def test_full_rank_compressed_model_reproduces_the_backbone_logits(tiny):
    model = tiny.model
    bases = compute_bases(model, [FULL])
    small = derive_compressed(model, bases, FULL)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        ref = lm_logits(model, ids)
        got = lm_logits(small, ids)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    # a truncated model does not (the test can fail)
    half = derive_compressed(model, bases, 0.3)
    with torch.no_grad():
        assert (lm_logits(half, ids) - ref).abs().max() > 1e-2


def test_derived_model_shares_untouched_tensors_and_leaves_the_backbone_alone(tiny_llama):
    model = tiny_llama.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bases = compute_bases(model, [0.5])
    small = derive_compressed(model, bases, 0.5)
    assert small.model.embed_tokens.weight is model.model.embed_tokens.weight  # shared, not copied
    assert isinstance(model.model.layers[0].self_attn.q_proj, nn.Linear)  # backbone untouched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(p.requires_grad for p in small.parameters())
    assert len(svd_modules(small)) == 14


def test_no_dense_weight_in_forward_or_backward(tiny_llama):
    """Every parameter, buffer and tensor saved for backward of an SVD layer is thinner than W."""
    model = tiny_llama.model
    bases = compute_bases(model, [0.5])
    small = derive_compressed(model, bases, 0.5)
    dense_shapes = {tuple(model.get_submodule(n).weight.shape) for n in bases}
    dense_shapes |= {s[::-1] for s in dense_shapes}
    for m in svd_modules(small).values():
        for t in list(m.parameters()) + list(m.buffers()):
            assert tuple(t.shape) not in dense_shapes
            assert t.numel() < m.out_features * m.in_features
    saved = []
    layer = small.model.layers[0].mlp.up_proj
    layer.sigma.requires_grad_(True)
    x = torch.randn(3, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        y = layer(x)
    y.sum().backward()
    assert saved and not any(s in dense_shapes for s in saved)
    assert layer.sigma.grad is not None and tuple(layer.sigma.grad.shape) == (layer.rank, layer.rank)


def test_bytes_scale_with_the_ratio(tiny_llama):
    model = tiny_llama.model
    bases = compute_bases(model, [0.3, 0.7])
    full = parameter_bytes(model)["total"]
    compressed = [derive_compressed(model, bases, rho) for rho in (0.3, 0.7)]
    small, large = (parameter_bytes(m)["total"] for m in compressed)
    assert small < large
    # W (nestfed.nn.footprint.weight_bytes), the compressed methods' model sizes, is the same count
    assert [weight_bytes(m) for m in (model, *compressed)] == [full, small, large]
    linear = sum(model.get_submodule(n).weight.numel() * 4 for n in bases)
    # U, V hold about rho * |W| (floor), Sigma adds r^2 per layer
    core = sum(r * r * 4 for r in layer_ranks(bases, 0.3).values())
    assert full - linear + 0.3 * linear - 4 * 4 * 14 * 128 <= small <= full - linear + 0.3 * linear + core


def test_derive_from_a_model_with_lora_uses_the_frozen_base_weight(tiny_llama):
    model = tiny_llama.model
    W = model.model.layers[1].self_attn.q_proj.weight.clone()
    inject_lora(model, ("q_proj",), rank=2, scaling=1.0)
    bases = compute_bases(model, [FULL], pattern=r".*layers\.1\.self_attn\.q_proj")
    f = bases["model.layers.1.self_attn.q_proj"]
    assert torch.allclose(f.U @ torch.diag(f.S) @ f.V.T, W, atol=1e-5)
    small = derive_compressed(model, bases, FULL)
    assert isinstance(small.model.layers[1].self_attn.q_proj, SVDLinear)


def test_select_layers_and_bases_round_trip(tmp_path, tiny_llama):
    names = ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj", "lm_head"]
    assert select_layers(names, (-1,), 2) == ["model.layers.1.mlp.up_proj"]
    assert select_layers(names, (), 2) == names
    with pytest.raises(ValueError, match="out of range"):
        select_layers(names, (2,), 2)
    bases = compute_bases(tiny_llama.model, [0.5], pattern=r".*layers\.0\.mlp\..*")
    save_bases(bases, tmp_path / "b.safetensors", {"ratio": "0.5"})
    back, meta = load_bases(tmp_path / "b.safetensors")
    assert meta == {"ratio": "0.5"} and back.keys() == bases.keys()
    assert all(torch.equal(back[n].U, bases[n].U) and torch.equal(back[n].S, bases[n].S) for n in bases)
