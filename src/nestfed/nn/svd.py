"""FedSLM's compressed client models: Linear layers factorised as U Sigma V^T from one SVD of the
backbone (arXiv 2607.29071, step 1 "SVD-based model derivation"; docs/methods.md section 2).

For each selected Linear W [out, in] the server computes W = U S V^T once. Group i (compression
ratio rho_i) gets, per layer, rank r_i = min(min(out, in), floor(rho_i * out * in / (out + in)))
(docs/methods.md decision: the U/V storage r (out + in) is then rho_i times that of W), frozen bases
U_i = U[:, :r_i] and V_i = V[:, :r_i], and a trainable core Sigma_i [r_i, r_i] that starts as
diag(S[:r_i]). Every group's bases are prefixes of the bases of a larger group (nested truncation
of the same SVD), which is what makes cross-group fusion well defined (nestfed.methods.fedslm.strategy).

Two factorisations (``compression.whitening``): ``"none"``, the plain SVD above (U and V
orthonormal, truncation minimises ||W - W_r||_F); ``"activation"`` (default), SVD-LLM's whitened
SVD (nn/whitening.py): W L = U S Vw^T with L L^T the damped input second moment on
calibration text, V = L^{-T} Vw (not orthonormal) and a dual basis D = L Vw (D^T V = I), so that
truncation minimises the layer's output error on the calibration activations. Both keep the
nested-prefix property, so the strategy's core-space fusion is exact for either (checked against
nestfed.methods.fedslm.strategy: reconstructions are linear in the cores, and the next round's M[:r, :r] is
`project` with the dual basis); only `project` needs D.

An `SVDLinear` computes x -> ((x V) Sigma^T) U^T (+ bias): two thin matmuls and an
r x r one; no [out, in] matrix is formed in forward or backward (tested through the shapes of
every parameter, buffer and saved tensor).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from nestfed.io import atomic
from nestfed.nn.keys import PEFT_PREFIX, layer_indices, layer_of
from nestfed.nn.placement import trainable_dtype
from nestfed.nn.targets import DEFAULT_TARGET, base_linear, target_linear_names
from nestfed.nn.whitening import DAMPING, whitened_svd

__all__ = [
    "CORE_SUFFIX",
    "DEFAULT_TARGET",
    "core_key",
    "SVDFactors",
    "SVDLinear",
    "base_linear",
    "compute_bases",
    "derive_compressed",
    "layer_ranks",
    "load_bases",
    "project",
    "rank_for_ratio",
    "reconstruct",
    "save_bases",
    "select_layers",
    "svd_modules",
    "target_linear_names",
]


CORE_SUFFIX = ".sigma"


def core_key(module: str) -> str:
    """Name the payload key of an SVD layer's core (a model parameter, loaded by nestfed.nn.arrays.apply_arrays).

    Args:
        module: the module path.

    Returns:
        ``base_model.model.<module>.sigma``.
    """
    return f"{PEFT_PREFIX}{module}{CORE_SUFFIX}"


class SVDLinear(nn.Module):
    """A Linear layer held as frozen bases and a core: y = x V Sigma^T U^T + b.

    Source: arXiv 2607.29071 step 1, the client layer x -> U_i Sigma_i V_i^T x.

    Args:
        U: [out, r], held as a frozen buffer.
        V: [in, r], held as a frozen buffer.
        sigma: [r, r], held as an ``nn.Parameter`` created with ``requires_grad=False`` (the client
            trainer switches it on when the payload ships it; float32 beside half-precision bases,
            nestfed.nn.placement).
        bias: [out] or None, frozen (copied from the original layer).

    Raises:
        ValueError: when the shapes disagree.
    """

    def __init__(self, U: torch.Tensor, V: torch.Tensor, sigma: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        r = U.shape[1]
        if U.dim() != 2 or V.dim() != 2 or V.shape[1] != r or tuple(sigma.shape) != (r, r):
            raise ValueError(
                f"SVDLinear: U {tuple(U.shape)}, V {tuple(V.shape)}, sigma {tuple(sigma.shape)} "
                "must be [out, r], [in, r], [r, r]"
            )
        if bias is not None and tuple(bias.shape) != (U.shape[0],):
            raise ValueError(f"SVDLinear: bias {tuple(bias.shape)} does not fit out = {U.shape[0]}")
        self.out_features, self.in_features, self.rank = U.shape[0], V.shape[0], r
        self.register_buffer("U", U.detach().contiguous().clone())
        self.register_buffer("V", V.detach().contiguous().clone())
        self.sigma = nn.Parameter(sigma.detach().to(trainable_dtype(U.dtype)).clone(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer: ((x V) Sigma^T) U^T + b.

        Args:
            x: [..., in] inputs.

        Returns:
            [..., out], in x's dtype.
        """
        h = x @ self.V
        if h.dtype == self.sigma.dtype:
            out = (h @ self.sigma.T) @ self.U.T
        else:  # half-precision bases and activations, a float32 core (nestfed.nn.placement)
            out = (h.to(self.sigma.dtype) @ self.sigma.T).to(h.dtype) @ self.U.T
        return out if self.bias is None else out + self.bias

    def weight_equivalent(self) -> torch.Tensor:
        """Form the dense weight (for tests and the server's merges, never used in forward).

        Returns:
            U Sigma V^T, [out, in].
        """
        return reconstruct(self.U, self.sigma, self.V)


@dataclass
class SVDFactors:
    """The leading singular triplets of one Linear weight W [out, in].

    R is the largest rank any group uses at this layer; a group of rank r takes the prefixes
    (of D too: D[:, :r]^T V[:, :r] = I_r).

    Attributes:
        U: [out, R] left singular vectors.
        S: [R] singular values, descending.
        V: [in, R] right singular vectors (not orthonormal for whitened bases).
        D: [in, R] the dual basis of whitened bases (D^T V = I); None for plain SVD, where D = V.
    """

    U: torch.Tensor
    S: torch.Tensor
    V: torch.Tensor
    D: torch.Tensor | None = None

    def dual(self) -> torch.Tensor:
        """Give the basis `project` pairs with V.

        Returns:
            D [in, R]; V itself when V is orthonormal.
        """
        return self.V if self.D is None else self.D


def rank_for_ratio(out_features: int, in_features: int, ratio: float) -> int:
    """Choose a layer's rank for a compression ratio (docs/methods.md section 2).

    Args:
        out_features: out, W's rows.
        in_features: in, W's columns.
        ratio: rho, the fraction of W's parameter count the bases U, V may use; a ratio of
            (out + in) / min(out, in) or more gives full rank.

    Returns:
        r = min(min(out, in), floor(ratio * out * in / (out + in))), at least 1.

    Raises:
        ValueError: for ratio <= 0.
    """
    if not ratio > 0:
        raise ValueError(f"compression ratio must be > 0, got {ratio}")
    r = math.floor(ratio * out_features * in_features / (out_features + in_features) + 1e-9)
    return max(1, min(min(out_features, in_features), r))


def compute_bases(
    model: nn.Module,
    ratios: list[float],
    pattern: str = DEFAULT_TARGET,
    whitening: dict[str, torch.Tensor] | None = None,
    damping: float | None = None,
) -> dict[str, SVDFactors]:
    """Compute one SVD per selected Linear, truncated to the largest rank any ratio needs (server side, once).

    Cost: a full SVD per layer; cache the result with `save_bases`.

    Args:
        model: the backbone.
        ratios: the groups' compression ratios.
        pattern: a regex over module paths, selecting the layers.
        whitening: None for the plain SVD of W (U, V orthonormal, D None; computed in float32:
            float64 took 3-4x longer here, 197 s for SmolLM2's 210 projections on 2 busy cores), or
            ``{module path: C [in, in]}``, the input second moments of every selected Linear on
            calibration text (`nestfed.nn.whitening.second_moments`), for SVD-LLM's whitened
            SVD (`nestfed.nn.whitening.whitened_svd`, float64; V not orthonormal, D its dual).
        damping: eps of the whitening relative to C's mean diagonal; None =
            `nestfed.nn.whitening.DAMPING`.

    Returns:
        ``{module path: SVDFactors}`` with R = rank_for_ratio(out, in, max(ratios)), stored in the
        weight's dtype.

    Raises:
        ValueError: for a bad ratio, a pattern matching nothing, a selected layer without its C, or
            a C of the wrong shape or not usable.
    """
    if not ratios:
        raise ValueError("no compression ratios given")
    top = max(ratios)
    for rho in ratios:
        rank_for_ratio(1, 1, rho)  # validates
    out = {}
    for name in target_linear_names(model, pattern):
        W = base_linear(model.get_submodule(name)).weight.detach()
        R = rank_for_ratio(W.shape[0], W.shape[1], top)
        if whitening is None:
            U, S, Vh = torch.linalg.svd(W.float(), full_matrices=False)
            V, D = Vh.T, None
        elif name not in whitening:
            raise ValueError(f"{name}: no input second moment for the whitened SVD")
        else:
            try:
                U, S, V, D = whitened_svd(W, whitening[name].to(W.device), DAMPING if damping is None else damping)
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
        out[name] = SVDFactors(*(None if t is None else t[..., :R].to(W.dtype).contiguous() for t in (U, S, V, D)))
    return out


def layer_ranks(bases: dict[str, SVDFactors], ratio: float) -> dict[str, int]:
    """Choose every layer's rank for one group.

    Args:
        bases: ``{module path: SVDFactors}``.
        ratio: the group's compression ratio.

    Returns:
        ``{module path: r_i}``.

    Raises:
        ValueError: when the ratio needs more rank than the bases hold (R).
    """
    ranks = {}
    for name, f in bases.items():
        r = rank_for_ratio(f.U.shape[0], f.V.shape[0], ratio)
        if r > f.S.shape[0]:
            raise ValueError(f"{name}: ratio {ratio} needs rank {r} but the bases hold {f.S.shape[0]}")
        ranks[name] = r
    return ranks


def derive_compressed(
    model: nn.Module, bases: dict[str, SVDFactors], ratio: float, cores: dict[str, torch.Tensor] | None = None
) -> nn.Module:
    """Derive a compressed copy of a model for one compression ratio.

    Each Linear in ``bases`` becomes an `SVDLinear` with U[:, :r], V[:, :r] and its core.
    Every other parameter and buffer (embeddings, norms, LM head) is shared with ``model``, not
    copied.

    Args:
        model: the backbone.
        bases: ``{module path: SVDFactors}``.
        ratio: rho, the group's compression ratio.
        cores: ``{module path: [r, r]}`` (e.g. a fused core projected onto this group); a layer it
            leaves out, or all when None, starts at diag(S[:r]).

    Returns:
        The copy, frozen (no parameter requires grad) and in eval mode.

    Raises:
        ValueError: for a ratio the bases cannot serve or a core of the wrong shape.
    """
    ranks = layer_ranks(bases, ratio)
    replaced = {id(base_linear(model.get_submodule(n)).weight) for n in bases}
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    shell = _copy_structure(model, memo)
    for name, f in bases.items():
        r = ranks[name]
        sigma = torch.diag(f.S[:r]) if cores is None or name not in cores else cores[name]
        if tuple(sigma.shape) != (r, r):
            raise ValueError(f"{name}: core {tuple(sigma.shape)}, expected ({r}, {r}) for ratio {ratio}")
        old = shell.get_submodule(name)
        parent_name, _, leaf = name.rpartition(".")
        parent = shell.get_submodule(parent_name) if parent_name else shell
        setattr(parent, leaf, SVDLinear(f.U[:, :r], f.V[:, :r], sigma, base_linear(old).bias))
    assert not any(id(p) in replaced for p in shell.parameters())
    for p in shell.parameters():
        p.requires_grad_(False)
    return shell.eval()


def _copy_structure(model: nn.Module, memo: dict[int, torch.Tensor]) -> nn.Module:
    """A deep copy of the module tree that shares (does not copy) the tensors listed in memo."""
    return copy.deepcopy(model, memo=dict(memo))


def svd_modules(model: nn.Module) -> dict[str, SVDLinear]:
    """Find all SVD layers of a model.

    Args:
        model: the model searched.

    Returns:
        ``{module path: layer}``.
    """
    return {n: m for n, m in model.named_modules() if isinstance(m, SVDLinear)}


def select_layers(names: list[str], layers: tuple[int, ...] | list[int], num_layers: int) -> list[str]:
    """Keep the module paths that lie in some decoder layers.

    Args:
        names: module paths.
        layers: decoder-layer indices (negative counts from the top); empty = all.
        num_layers: the model's decoder layers.

    Returns:
        The paths among ``names`` in those layers, in their order.

    Raises:
        ValueError: for an index out of range.
    """
    if not layers:
        return list(names)
    wanted = set(layer_indices(layers, num_layers, "compression.train_layers"))
    return [n for n in names if layer_of(n) in wanted]


def reconstruct(U: torch.Tensor, sigma: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Reconstruct a weight from its bases and core (FedSLM step 3's W_i).

    Args:
        U: [out, r].
        sigma: [r, r].
        V: [in, r].

    Returns:
        W = U Sigma V^T, [out, in].
    """
    return U @ sigma @ V.T


def project(W: torch.Tensor, U: torch.Tensor, V: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
    """Project a weight onto bases: the least-squares best core.

    docs/methods.md section 2, the decision for the next round's start. Either way W = U M V^T
    projects to M[:r, :r]. U^T W V with non-orthonormal V is NOT a least-squares core.

    Args:
        W: [out, in] the weight.
        U: [out, r] orthonormal.
        V: [in, r].
        D: None when V is orthonormal (plain SVD; D = V, least squares in the Frobenius norm), else
            the dual basis of whitened bases (``SVDFactors.D[:, :r]``, D = L L^T V with D^T V = I;
            least squares in the activation norm ||(.) L||_F, L L^T the damped normalised input
            second moment, nn/whitening.py).

    Returns:
        Sigma = U^T W D, [r, r].
    """
    return U.T @ W @ (V if D is None else D)


def parameter_bytes(model: nn.Module) -> dict[str, int]:
    """Measure the bytes a model holds.

    Tensors shared between several modules are counted once (by storage).

    Args:
        model: the model.

    Returns:
        ``{"parameters", "trainable" (requires_grad), "buffers", "total"}``, bytes.
    """
    seen: set[int] = set()

    def size(ts) -> int:
        total = 0
        for t in ts:
            key = t.untyped_storage().data_ptr()
            if key in seen:
                continue
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return total

    params = list(model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    p_bytes = size(params)
    b_bytes = size(list(model.buffers()))
    return {"parameters": p_bytes, "trainable": trainable, "buffers": b_bytes, "total": p_bytes + b_bytes}


def save_bases(bases: dict[str, SVDFactors], path, metadata: dict[str, str] | None = None) -> None:
    """Write bases to a safetensors file, atomically.

    Args:
        bases: ``{module path: SVDFactors}``; the keys are ``<module>.U``, ``.S``, ``.V`` and, for
            whitened bases, ``.D``.
        path: the file.
        metadata: string metadata stored in the file's header.
    """
    tensors = {}
    for name, f in bases.items():
        tensors.update({f"{name}.U": f.U.contiguous(), f"{name}.S": f.S.contiguous(), f"{name}.V": f.V.contiguous()})
        if f.D is not None:
            tensors[f"{name}.D"] = f.D.contiguous()
    atomic.write_tensors(path, tensors, metadata or {})


def load_bases(path) -> tuple[dict[str, SVDFactors], dict[str, str]]:
    """Read bases written by `save_bases`.

    Args:
        path: the file.

    Returns:
        (``{module path: SVDFactors}``, metadata); D is None where the file holds none (plain SVD).

    Raises:
        ValueError: when a module lacks one of U, S, V.
    """
    with safe_open(str(path), framework="pt") as fh:
        meta = dict(fh.metadata() or {})
    raw = load_file(str(path))
    names = sorted({k.rsplit(".", 1)[0] for k in raw})
    out = {}
    for n in names:
        try:
            out[n] = SVDFactors(raw[f"{n}.U"], raw[f"{n}.S"], raw[f"{n}.V"], raw.get(f"{n}.D"))
        except KeyError:
            raise ValueError(f"{path}: bases of {n} lack one of U, S, V") from None
    return out, meta
