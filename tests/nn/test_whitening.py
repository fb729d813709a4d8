"""Activation-aware (whitened) SVD, SVD-LLM section 3.1: exactness at full rank, least output error
on the calibration activations, nested prefixes, the dual-basis projection, calibration hooks."""

import pytest
import torch
from torch import nn

from nestfed.nn.frozen_prefix import lm_logits
from nestfed.nn.lora import inject_lora
from nestfed.nn.svd import compute_bases, derive_compressed, layer_ranks, load_bases, project, reconstruct, save_bases
from nestfed.nn.whitening import second_moments, token_hash, whitened_svd, whitening_factor

FULL = 100.0  # full rank at every layer


class Toy(nn.Module):
    """One float64 Linear [16, 24] without bias (the tests give its C directly)."""

    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = nn.Linear(24, 16, bias=False, dtype=torch.float64)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(16, 24, generator=g, dtype=torch.float64))


def correlated_inputs(n=400, d=24, seed=1):
    """X [n, d] with strongly correlated, unequally scaled features (what LLM inputs look like)."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    scales = torch.logspace(1, -2, d, dtype=torch.float64)
    return torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.diag(scales) @ Q.T


def truncated(f, r):
    """W_r = U[:, :r] diag(S[:r]) V[:, :r]^T [out, in]."""
    return reconstruct(f.U[:, :r], torch.diag(f.S[:r]), f.V[:, :r])


def test_full_rank_whitened_bases_reproduce_w_and_the_backbone_logits(tiny):
    model = tiny.model
    ids = torch.randint(0, model.config.vocab_size, (8, 32))  # 256 tokens >= the widest input (128)
    C = second_moments(model, ids)
    bases = compute_bases(model, [FULL], whitening=C)
    for name, f in bases.items():
        W = model.get_submodule(name).weight
        assert f.D is not None and f.V.shape == f.D.shape
        assert torch.allclose(f.U @ torch.diag(f.S) @ f.V.T, W, atol=1e-5)
        assert torch.allclose(f.D.T @ f.V, torch.eye(f.V.shape[1]), atol=1e-4)  # dual basis
        assert torch.allclose(f.U.T @ f.U, torch.eye(f.U.shape[1]), atol=1e-5)
        assert torch.all(f.S[:-1] >= f.S[1:])
    small = derive_compressed(model, bases, FULL)
    test = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.allclose(lm_logits(small, test), lm_logits(model, test), atol=1e-4, rtol=1e-4)


def test_truncated_whitened_svd_minimises_the_output_error_on_the_calibration_activations():
    """||(W - W_r) X^T||_F^2 is the tail sum of the squared singular values of W L (L L^T = X^T X,
    computed here independently), and strictly below plain SVD's at every truncated rank."""
    model, X = Toy(), correlated_inputs()
    W = model.proj.weight.detach()
    C = {"proj": X.T @ X / X.shape[0]}
    white = compute_bases(model, [FULL], pattern="proj", whitening=C, damping=0.0)["proj"]
    plain = compute_bases(model, [FULL], pattern="proj")["proj"]
    S_wl = torch.linalg.svdvals(W @ torch.linalg.cholesky(X.T @ X))
    for r in (1, 4, 8, 12, 15):
        err_white = float(((W - truncated(white, r)) @ X.T).pow(2).sum())
        err_plain = float(((W - truncated(plain, r)) @ X.T).pow(2).sum())
        assert err_white == pytest.approx(float(S_wl[r:].pow(2).sum()), rel=1e-6)
        assert err_white < 0.9 * err_plain
    # with damping the output error still beats plain SVD's (the damped optimum trades only W's norm)
    damped = compute_bases(model, [FULL], pattern="proj", whitening=C)["proj"]
    for r in (1, 4, 8, 12, 15):
        assert ((W - truncated(damped, r)) @ X.T).norm() < ((W - truncated(plain, r)) @ X.T).norm()


@pytest.mark.slow
def test_whitened_truncation_beats_plain_svd_on_a_tiny_models_own_activations(tiny_llama):
    """Every layer of the tiny Llama at rho = 0.3, the activations recorded independently of
    second_moments (forward hooks on the Linear modules, the full model's forward)."""
    model = tiny_llama.model
    ids = torch.randint(0, model.config.vocab_size, (8, 32))
    white = compute_bases(model, [0.3], whitening=second_moments(model, ids))
    plain = compute_bases(model, [0.3])
    acts = {}

    def record(name):
        def hook(_module, args):
            acts[name] = args[0].reshape(-1, args[0].shape[-1])

        return hook

    hooks = [model.get_submodule(n).register_forward_pre_hook(record(n)) for n in white]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    for name, r in layer_ranks(white, 0.3).items():
        W, X = model.get_submodule(name).weight, acts[name]
        e_white = ((W - truncated(white[name], r)) @ X.T).norm()
        e_plain = ((W - truncated(plain[name], r)) @ X.T).norm()
        assert e_white < e_plain, name


def test_whitened_bases_are_nested_prefixes_across_ratios(tiny_llama):
    model = tiny_llama.model
    C = second_moments(model, torch.randint(0, model.config.vocab_size, (8, 32)))
    bases = compute_bases(model, [0.3, 0.5, 0.7], whitening=C)
    models = {rho: derive_compressed(model, bases, rho) for rho in (0.3, 0.5, 0.7)}
    for lo, hi in ((0.3, 0.5), (0.5, 0.7)):
        for n in bases:
            a, b = models[lo].get_submodule(n), models[hi].get_submodule(n)
            r = a.rank
            assert r < b.rank or r == b.rank == min(a.out_features, a.in_features)
            assert torch.equal(a.U, b.U[:, :r]) and torch.equal(a.V, b.V[:, :r])
            assert torch.equal(a.sigma, b.sigma[:r, :r])
    # bases computed for the smallest ratio alone are the prefixes of those for the largest
    alone = compute_bases(model, [0.3], whitening=C)
    for n, f in alone.items():
        r = f.S.shape[0]
        assert torch.equal(f.U, bases[n].U[:, :r]) and torch.equal(f.V, bases[n].V[:, :r])
        assert torch.equal(f.D, bases[n].D[:, :r]) and torch.equal(f.S, bases[n].S[:r])
        assert torch.allclose(f.D.T @ f.V, torch.eye(r), atol=1e-4)  # every prefix keeps D^T V = I


def test_projection_onto_whitened_bases_recovers_a_hand_built_core():
    """W = U M V^T projects to M[:r, :r] with the dual basis (U^T W V does not: V is not
    orthonormal); for any W the result is the least-squares core in the activation norm."""
    model, X = Toy(), correlated_inputs()
    f = compute_bases(model, [FULL], pattern="proj", whitening={"proj": X.T @ X / len(X)}, damping=0.0)["proj"]
    R = f.S.shape[0]  # 16
    M = (torch.arange(R * R, dtype=torch.float64).reshape(R, R) % 7 - 3.0) / 4 + torch.eye(R, dtype=torch.float64)
    W = reconstruct(f.U, M, f.V)
    for r in (1, 5, 11, R):
        assert torch.allclose(project(W, f.U[:, :r], f.V[:, :r], f.D[:, :r]), M[:r, :r], atol=1e-8)
    assert not torch.allclose(project(W, f.U, f.V), M, atol=1e-2)  # the orthonormal formula is wrong here
    # a W outside the bases' span: min_Sigma ||(W - U_r Sigma V_r^T) L||_F solved with a pseudo-inverse
    W = torch.randn(16, 24, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    L = torch.linalg.cholesky(X.T @ X)
    for r in (3, 9):
        U, V = f.U[:, :r], f.V[:, :r]
        ls = U.T @ (W @ L) @ torch.linalg.pinv(V.T @ L)
        assert torch.allclose(project(W, U, V, f.D[:, :r]), ls, atol=1e-8)


def test_second_moments_are_the_linear_inputs_outer_products(tiny_llama):
    """q/k/v share the normed hidden state: C = x^T x / N computed by hand from layer 0's input norm;
    a LoRA-wrapped layer is hooked at its base layer (same C)."""
    model = tiny_llama.model
    ids = torch.randint(0, model.config.vocab_size, (3, 16))
    model.train()
    C = second_moments(model, ids, batch_size=2)
    assert model.training  # evaluated in eval mode, the mode restored afterwards
    model.eval()
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids)).reshape(-1, 64).double()
    for leaf in ("q_proj", "k_proj", "v_proj"):
        got = C[f"model.layers.0.self_attn.{leaf}"]
        assert got.dtype == torch.float64 and torch.allclose(got, x.T @ x / 48, atol=1e-10)
    inject_lora(model, ("q_proj",), rank=2, scaling=1.0)
    again = second_moments(model, ids, names=["model.layers.0.self_attn.q_proj"])
    assert torch.allclose(again["model.layers.0.self_attn.q_proj"], C["model.layers.0.self_attn.q_proj"], atol=1e-10)
    with pytest.raises(ValueError, match="non-empty"):
        second_moments(model, torch.zeros(0, 4, dtype=torch.long))


def test_whitening_factor_normalises_damps_and_retries():
    X = correlated_inputs(n=50)
    X[:, 0] = 0.0  # an input that never fires: C is singular
    C = X.T @ X / 50
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.cholesky(C / C.diagonal().mean())
    L = whitening_factor(C, damping=0.0)  # retried with more damping
    extra = L @ L.T - C / C.diagonal().mean()
    eps = float(extra.diagonal().mean())
    assert 1e-6 <= eps <= 1e-1 and torch.allclose(extra, eps * torch.eye(24, dtype=torch.float64), atol=1e-8)
    L1 = whitening_factor(3.0 * C, damping=1e-2)  # scale-free: C and 3 C give one factor
    assert torch.allclose(L1, whitening_factor(C, damping=1e-2))
    assert torch.allclose(L1 @ L1.T, C / C.diagonal().mean() + 1e-2 * torch.eye(24, dtype=torch.float64))
    with pytest.raises(ValueError, match="zero trace"):
        whitening_factor(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="square"):
        whitening_factor(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="needs C of shape"):
        whitened_svd(torch.zeros(3, 4), torch.eye(3))


def test_isotropic_inputs_give_the_plain_svd():
    """C proportional to I: the whitened factors are the plain ones (S equal, bases up to sign)."""
    model = Toy()
    white = compute_bases(model, [0.5], pattern="proj", whitening={"proj": 5.0 * torch.eye(24)}, damping=0.0)["proj"]
    plain = compute_bases(model, [0.5], pattern="proj")["proj"]
    assert torch.allclose(white.S, plain.S, rtol=1e-5)
    assert torch.allclose(
        (white.U * plain.U).sum(0).abs(), torch.ones(white.U.shape[1], dtype=torch.float64), atol=1e-5
    )
    assert torch.allclose(white.D, white.V, atol=1e-10)


def test_compute_bases_errors_and_whitened_bases_round_trip(tmp_path, tiny_llama):
    model = tiny_llama.model
    ids = torch.randint(0, model.config.vocab_size, (8, 32))
    C = second_moments(model, ids, pattern=r".*layers\.0\.mlp\..*")
    with pytest.raises(ValueError, match="no input second moment"):
        compute_bases(model, [0.5], pattern=r".*layers\.0\..*", whitening=C)
    bad = dict(C)
    bad["model.layers.0.mlp.up_proj"] = torch.eye(3)
    with pytest.raises(ValueError, match="up_proj: whitened SVD"):
        compute_bases(model, [0.5], pattern=r".*layers\.0\.mlp\..*", whitening=bad)
    bases = compute_bases(model, [0.5], pattern=r".*layers\.0\.mlp\..*", whitening=C)
    save_bases(bases, tmp_path / "w.safetensors", {"whitening": "activation"})
    back, meta = load_bases(tmp_path / "w.safetensors")
    assert meta == {"whitening": "activation"}
    assert all(torch.equal(back[n].D, bases[n].D) and torch.equal(back[n].V, bases[n].V) for n in bases)
    plain = compute_bases(model, [0.5], pattern=r".*layers\.0\.mlp\..*")
    save_bases(plain, tmp_path / "p.safetensors")
    assert all(f.D is None and f.dual() is f.V for f in load_bases(tmp_path / "p.safetensors")[0].values())


def test_token_hash_tells_calibration_texts_apart():
    a = torch.arange(12).reshape(3, 4)
    assert token_hash(a) == token_hash(a.clone().to(torch.int32))
    assert token_hash(a) != token_hash(a.reshape(4, 3))
    b = a.clone()
    b[2, 3] = 0
    assert token_hash(a) != token_hash(b) and len(token_hash(a)) == 16
