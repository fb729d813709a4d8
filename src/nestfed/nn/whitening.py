"""Activation-aware ("whitened") SVD of a Linear layer: SVD-LLM's truncation-aware data whitening
(Wang et al. 2024, arXiv 2403.07378, section 3.1), our documented decision beyond FedSLM's plain
SVD (docs/methods.md section 2 leaves the factorisation implicit).

Plain truncated SVD minimises ||W - W_r||_F, which treats every input direction alike; an LLM's
inputs are far from isotropic, so that error says little about the layer's outputs. Whitening
minimises the output error on calibration activations X [N, in] instead:

    C = X^T X / N,  m = mean(diag(C))        (second moment [in, in], units: activation^2)
    C / m + eps I = L L^T                    (Cholesky, L [in, in] lower triangular)
    W L = U S Vw^T                           (SVD, U [out, k], S [k], Vw [in, k], k = min(out, in))
    W = U S V^T  with  V = L^{-T} Vw         ([in, k]; NOT orthonormal: V^T L L^T V = I)

and truncating at rank r gives W_r = U[:, :r] diag(S[:r]) V[:, :r]^T with
||(W - W_r) L||_F^2 = sum_{j >= r} S_j^2, the least possible over rank-r matrices
(Eckart-Young in the whitened space); with eps = 0 this is exactly ||(W - W_r) X^T||_F^2 / (N m).
The layer is still x -> ((x V) Sigma^T) U^T, so `nestfed.nn.svd.SVDLinear` is
unchanged. eps > 0 (damping, `DAMPING`) trades a little of that optimum for robustness:
the result minimises ||(W - W_r) X^T||^2 / (N m) + eps ||W - W_r||_F^2, and its output error on X
is still no larger than plain SVD's at the same rank (plain SVD minimises the second term alone).

Dual basis. Because V is not orthonormal, the least-squares core of a dense W for the bases is
not U^T W V. Under the activation norm ||(.) L||_F it is U^T W D with D = L Vw = L L^T V
[in, k] (D^T V = I). Every prefix keeps both properties (D[:, :r]^T V[:, :r] = I_r and the projection of
U M V^T onto the rank-r prefixes is M[:r, :r]), so FedSLM's nested groups and its core-space
aggregation (nestfed.methods.fedslm.strategy: the fused W_g = U M V^T is represented by M, and group g's next
core is M[:r_g, :r_g]) stay exact without any change: fusion averages reconstructions, which are
linear in the cores whatever the bases, and M[:r_g, :r_g] is U_g^T W_g D_g, the least-squares core
under the activation norm (the docs/methods.md decision, with that norm in place of Frobenius).

Scale. C is normalised to unit mean diagonal before damping: the bases' subspaces and the product
U S V^T do not depend on the scale of C, but S does, and S is where the cores start and what AdamW
(compression.core_lr) steps on; after normalisation, C proportional to I gives exactly the plain
SVD (up to signs) and S keeps the order of magnitude of W's singular values.

Calibration uses only the server's unlabeled text (held out from every client, data/held_out.py):
no client data leave the clients.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from nestfed.nn.frozen_prefix import final_hidden
from nestfed.nn.targets import DEFAULT_TARGET, base_linear, target_linear_names

#: eps of C + eps I relative to C's mean diagonal (GPTQ's default dampening of 1%).
DAMPING = 1e-2
#: On a failed Cholesky the damping is multiplied by 10, at most this many times.
MAX_RETRIES = 6


def second_moments(
    model: nn.Module,
    input_ids: torch.Tensor,
    names: list[str] | None = None,
    pattern: str | None = None,
    batch_size: int = 8,
) -> dict[str, torch.Tensor]:
    """Collect each target Linear's input second moment C = X^T X / N on token batches.

    Source: SVD-LLM (arXiv 2403.07378) section 3.1, the calibration step of its data whitening.
    Runs under torch.no_grad in eval mode (the mode is restored). N = B * T tokens. Memory: 8 in^2
    bytes per module (about 1.1 GB for all 210 projections of SmolLM2-135M, 140 MB for its top four
    layers).

    Args:
        model: a Llama/Qwen2-family causal LM (run through
            `nestfed.nn.frozen_prefix.final_hidden`, no LM head), frozen; LoRA-wrapped layers
            are hooked at their ``base_layer`` (the SVD is of the pretrained W, its input is the
            wrapper's input).
        input_ids: [B, T] calibration blocks; every token counts (packed blocks, no padding).
        names: module paths to collect; None = those matching ``pattern``.
        pattern: a regex over module paths; None = `nestfed.nn.svd.DEFAULT_TARGET`.
        batch_size: sequences per forward.

    Returns:
        ``{module path: C}``, C [in, in] float64 in host memory.

    Raises:
        ValueError: for a pattern matching nothing, empty input_ids, or a layer no activation
            reached.
    """
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"calibration input_ids must be a non-empty [B, T] tensor, got {tuple(input_ids.shape)}")
    names = names if names is not None else target_linear_names(model, pattern or DEFAULT_TARGET)
    sums: dict[str, torch.Tensor] = {}
    handles = []

    def hook(name):
        def pre(_module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            if name in sums:
                sums[name].addmm_(x.T, x)
            else:
                sums[name] = x.T @ x

        return pre

    for name in names:
        handles.append(base_linear(model.get_submodule(name)).register_forward_pre_hook(hook(name)))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for i in range(0, input_ids.shape[0], batch_size):
                final_hidden(model, input_ids=input_ids[i : i + batch_size])
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    missing = [n for n in names if n not in sums]
    if missing:
        raise ValueError(f"no calibration activations reached {missing[:3]} (is the layer used in forward?)")
    return {n: (sums[n] / input_ids.numel()).cpu() for n in names}


def whitening_factor(C: torch.Tensor, damping: float = DAMPING) -> torch.Tensor:
    """Factor a normalised, damped second moment: L L^T = C / mean(diag(C)) + eps I.

    Source: SVD-LLM (arXiv 2403.07378) section 3.1 (its whitening matrix is this Cholesky factor;
    the normalisation and damping are ours, the damping as in GPTQ). When the Cholesky
    factorisation fails, eps is multiplied by 10 (starting from max(damping, 1e-6)), at most
    `MAX_RETRIES` times.

    Args:
        C: [in, in] symmetric positive semi-definite second moment (any scale).
        damping: eps relative to the normalised unit mean diagonal (0 allowed when C is positive
            definite).

    Returns:
        L [in, in], lower triangular, float64.

    Raises:
        ValueError: when C is not square, not finite, has zero trace, or is still not positive
            definite.
    """
    if C.dim() != 2 or C.shape[0] != C.shape[1]:
        raise ValueError(f"second moment must be square [in, in], got {tuple(C.shape)}")
    C = C.double()
    scale = C.diagonal().mean()
    if not torch.isfinite(C).all() or not scale > 0:
        raise ValueError("second moment is not finite or has zero trace (no input activation)")
    C = (C + C.T) / (2 * scale)
    eye = torch.eye(C.shape[0], dtype=C.dtype, device=C.device)
    eps = float(damping)
    for _ in range(MAX_RETRIES + 1):
        L, info = torch.linalg.cholesky_ex(C + eps * eye)
        if int(info) == 0:
            return L
        eps = max(eps, 1e-6) * 10
    raise ValueError(f"second moment is not positive definite even with damping {eps / 10:g}")


def whitened_svd(
    W: torch.Tensor, C: torch.Tensor, damping: float = DAMPING
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compute the activation-aware SVD of a weight (the module docstring).

    Source: SVD-LLM (arXiv 2403.07378) section 3.1, truncation-aware data whitening. Cost: a
    Cholesky of [in, in] and an SVD of [out, in] in float64 (0.4-0.7 s for SmolLM2's 576 x 1536
    layers on one core).

    Args:
        W: [out, in] the weight.
        C: [in, in] its input second moment.
        damping: eps of `whitening_factor`.

    Returns:
        (U [out, k], S [k], V [in, k], D [in, k]) in float64, k = min(out, in), S descending:
        W = U diag(S) V^T exactly at this full rank k (whatever the damping), U orthonormal,
        V = L^{-T} Vw and the dual basis D = L Vw with D^T V = I (L from `whitening_factor`).

    Raises:
        ValueError: for mismatched shapes, or a C that is not usable (see `whitening_factor`).
    """
    if W.dim() != 2 or tuple(C.shape) != (W.shape[1], W.shape[1]):
        raise ValueError(
            f"whitened SVD: W {tuple(W.shape)} needs C of shape ({W.shape[1]}, {W.shape[1]}), got {tuple(C.shape)}"
        )
    L = whitening_factor(C, damping)
    U, S, Vh = torch.linalg.svd(W.double() @ L, full_matrices=False)
    Vw = Vh.T
    V = torch.linalg.solve_triangular(L.T, Vw, upper=True)
    return U, S, V, L @ Vw


def token_hash(input_ids: torch.Tensor) -> str:
    """Hash calibration token ids (shape and int64 values), for cache keys.

    Args:
        input_ids: [B, T] token ids.

    Returns:
        The first 16 hex digits of their SHA-256.
    """
    ids = input_ids.detach().to(torch.int64).contiguous().cpu()
    h = hashlib.sha256(str(tuple(ids.shape)).encode())
    h.update(ids.numpy().tobytes())
    return h.hexdigest()[:16]
