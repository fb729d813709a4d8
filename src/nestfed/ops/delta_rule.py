"""The delta-rule linear-attention memory (FedNL's inner loop), in three interchangeable forms.

The operator (Schlag, Irie and Schmidhuber 2021, "Linear Transformers Are Secretly Fast Weight
Programmers"; Yang, Wang, Zhang, Shen and Kim 2024, "Parallelizing Linear Transformers with the
Delta Rule over Sequence Length", NeurIPS 2024), in flash-linear-attention's layout and notation:

    S_0 = initial_state (or zeros)                                   S_t: [K, V] per (batch, head)
    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T
        = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = scale * S_t^T q_t

Each step is one gradient step of size beta_t on the regression loss 1/2 ||S^T k_t - v_t||^2:
the memory maps keys to values, and writing v under a unit-norm key with beta = 1 makes reading
that key return exactly v.

All three functions share one signature, that of ``fla.ops.delta_rule.chunk_delta_rule``
(non-head-first layout):

    f(q, k, v, beta, scale=1.0, initial_state=None, output_final_state=True, chunk_size=64)
        -> (o, final_state)

    q, k:           [B, T, H, K]   queries and keys (the FedNL layer L2-normalises k per head)
    v:              [B, T, H, V]   values
    beta:           [B, T, H]      write strengths, in (0, 1) for a contraction (a sigmoid)
    scale:          float          read-out scale, dimensionless
    initial_state:  [B, H, K, V]   S_0, or None for zeros
    o:              [B, T, H, V]   in the input dtype
    final_state:    [B, H, K, V]   S_T, or None when ``output_final_state`` is False

Units: every tensor is in the units of the activations it is built from; the operator is
linear in v and in S_0, and beta and scale are dimensionless.

Precision: bf16/fp16 inputs are computed in fp32 (``final_state`` is returned in that compute
dtype, fp32, as flash-linear-attention does, so that a state carried across calls does not lose
precision); fp32 and fp64 inputs are computed and returned in their own dtype.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable

import torch

__all__ = ["delta_rule", "delta_rule_chunkwise", "delta_rule_recurrent"]

_HALF = (torch.float16, torch.bfloat16)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half-precision inputs, else the input's own (fp32 or fp64) dtype."""
    return torch.float32 if dtype in _HALF else dtype


def _validate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int,
) -> tuple[int, int, int, int, int]:
    """Check shapes, dtypes and chunk_size; return (B, T, H, K, V). Raise ValueError naming the
    argument at fault."""
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, H, K] (4 dims), got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if T < 1:
        raise ValueError(f"q must have at least one token (T >= 1), got shape {tuple(q.shape)}")
    if tuple(k.shape) != (B, T, H, K):
        raise ValueError(f"k must have the shape of q, [B, T, H, K] = {(B, T, H, K)}, got {tuple(k.shape)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    V = v.shape[3]
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta must have shape [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share one dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
            raise ValueError("initial_state must be a floating-point torch.Tensor or None")
        if tuple(initial_state.shape) != (B, H, K, V):
            raise ValueError(
                f"initial_state must have shape [B, H, K, V] = {(B, H, K, V)}, got {tuple(initial_state.shape)}"
            )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return B, T, H, K, V


def delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The delta rule token by token: the reference, and the inference form (O(1) memory).

    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T,  o_t = scale * S_t^T q_t
    (Schlag et al. 2021; Yang et al. 2024, eq. 1), S_0 = ``initial_state`` or zeros.

    The loop splits the sequence once with ``unbind`` (indexing ``x[:, t]`` in the loop makes
    backward O(T^2)). Without autograd it holds one state; under autograd it keeps one K x V state
    per token for backward (T * B * H * K * V elements): use `delta_rule_chunkwise` to train.

    Args:
        q: [B, T, H, K] queries.
        k: [B, T, H, K] keys.
        v: [B, T, H, V] values.
        beta: [B, T, H] write strengths, dimensionless, in (0, 1).
        scale: read-out scale, dimensionless.
        initial_state: [B, H, K, V] S_0; zeros when None.
        output_final_state: return S_T when True, else None.
        chunk_size: ignored; accepted so that the three forms share one signature.

    Returns:
        The output o [B, T, H, V] in the input dtype, and final_state [B, H, K, V] in the compute
        dtype (None unless ``output_final_state``).

    Raises:
        ValueError: on a shape, dtype or chunk_size mismatch, naming the argument.
    """
    B, T, H, K, V = _validate(q, k, v, beta, initial_state, chunk_size)
    cdt = _compute_dtype(q.dtype)
    if initial_state is None:
        S = q.new_zeros(B, H, K, V, dtype=cdt)
    else:
        S = initial_state.to(cdt)
    outs = []
    with torch.autocast(q.device.type, enabled=False):  # in the compute dtype, under autocast too
        for q_t, k_t, v_t, b_t in zip(
            q.to(cdt).unbind(1), k.to(cdt).unbind(1), v.to(cdt).unbind(1), beta.to(cdt).unbind(1)
        ):
            # q_t, k_t: [B, H, K]; v_t: [B, H, V]; b_t: [B, H]
            v_old = (k_t.unsqueeze(-2) @ S).squeeze(-2)  # S^T k: [B, H, V]
            u_t = b_t.unsqueeze(-1) * (v_t - v_old)  # [B, H, V]
            S = S + k_t.unsqueeze(-1) * u_t.unsqueeze(-2)  # rank-1 write: [B, H, K, V]
            outs.append((q_t.unsqueeze(-2) @ S).squeeze(-2))  # S^T q: [B, H, V]
    o = torch.stack(outs, dim=1)
    if scale != 1.0:
        o = o * scale
    return o.to(q.dtype), (S if output_final_state else None)


def _chunked_view(x: torch.Tensor, B: int, H: int) -> torch.Tensor:
    """View a [N, B*H, C, D] buffer as [B, N, C, H, D] (no copy)."""
    N, _, C, D = x.shape
    return x.view(N, B, H, C, D).permute(1, 0, 3, 2, 4)


def _chunk_into(dst: torch.Tensor, x: torch.Tensor) -> None:
    """Copy x [B, T, H, D] into the chunked buffer dst [N, B*H, C, D] (any dtype, possibly a
    column slice of a wider buffer), zero-filling the padded tail of the last chunk."""
    B, T, H, D = x.shape
    N, _, C, _ = dst.shape
    d = _chunked_view(dst, B, H)  # [B, N, C, H, D]
    full, rest = divmod(T, C)
    if full:
        d[:, :full].copy_(x[:, : full * C].view(B, full, C, H, D))
    if rest:
        d[:, full, :rest].copy_(x[:, full * C :])
        d[:, full, rest:].zero_()


def _unchunk(x: torch.Tensor, B: int, T: int, H: int, dtype: torch.dtype) -> torch.Tensor:
    """[N, B*H, C, D] -> a new [B, T, H, D] tensor in ``dtype``, dropping the padding."""
    N, _, C, D = x.shape
    out = x.new_empty(B, T, H, D, dtype=dtype)
    src = _chunked_view(x, B, H)
    full, rest = divmod(T, C)
    if full:
        out[:, : full * C].view(B, full, C, H, D).copy_(src[:, :full])
    if rest:
        out[:, full * C :].copy_(src[:, full, :rest])
    return out


class _ChunkwiseDeltaRule(torch.autograd.Function):
    """Forward and hand-derived backward of the chunkwise WY form (see delta_rule_chunkwise).

    Layout inside: [N chunks, B*H, C, D], viewed as [N*B*H, C, D] for the batched matmuls, so
    that chunk n is one contiguous batch of B*H matrices for the sequential sweeps. Every
    tensor kept for backward goes through ``ctx.save_for_backward``. Not twice differentiable.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, initial_state, scale: float, chunk_size: int):
        with torch.autocast(q.device.type, enabled=False):  # the compute dtype is ours, not autocast's
            return _ChunkwiseDeltaRule._forward(ctx, q, k, v, beta, initial_state, scale, chunk_size)

    @staticmethod
    def backward(ctx, do, dfinal):
        with torch.autocast(ctx.device_type, enabled=False):  # bmm under autocast would return bf16
            return _ChunkwiseDeltaRule._backward(ctx, do, dfinal)

    @staticmethod
    def _forward(ctx, q, k, v, beta, initial_state, scale: float, chunk_size: int):
        ctx.device_type = q.device.type
        B, T, H, K = q.shape
        V = v.shape[-1]
        cdt = _compute_dtype(q.dtype)
        C = chunk_size
        N = math.ceil(T / C)
        BH = B * H
        NB = N * BH
        new = functools.partial(q.new_empty, dtype=cdt)
        # WQ[n] = [W_n; Q_n] ([2C, K] per chunk and head), so that one matmul per chunk gives
        # both W_n S_n (for U_n) and Q_n S_n (the inter-chunk read-out)
        WQ = new(N, BH, 2 * C, K)
        kc, vc, bc = new(N, BH, C, K), new(N, BH, C, V), new(N, BH, C, 1)
        _chunk_into(WQ[:, :, C:], q)
        _chunk_into(kc, k)
        _chunk_into(vc, v)
        _chunk_into(bc, beta.unsqueeze(-1))  # beta = 0 on padding: padded tokens write nothing
        WQ3 = WQ.view(NB, 2 * C, K)
        qc = WQ3[:, C:]
        kc, vc, bc = kc.view(NB, C, K), vc.view(NB, C, V), bc.view(NB, C, 1)
        kcT = kc.transpose(-1, -2)

        kk = torch.bmm(kc, kcT)  # K_c K_c^T, [NB, C, C]
        P = torch.bmm(qc, kcT).tril_()  # causal read-out mask, diagonal included
        # T_c = (I + tril(diag(beta) K K^T, -1))^{-1}; the solve never reads the diagonal
        eye_c = torch.eye(C, dtype=cdt, device=q.device)
        Tinv = torch.linalg.solve_triangular(
            (bc * kk).tril_(-1), eye_c.expand(NB, C, C), upper=False, unitriangular=True
        )
        Tb = Tinv * bc.transpose(-1, -2)  # T_c diag(beta)
        WQ3[:, :C].copy_(torch.bmm(Tb, kc))  # W = T_c diag(beta) K_c
        UpZ = new(N, BH, 2 * C, V)  # [U'_n; 0]
        UpZ3 = UpZ.view(NB, 2 * C, V)
        UpZ3[:, :C].copy_(torch.bmm(Tb, vc))  # U' = T_c diag(beta) V_c
        UpZ3[:, C:].zero_()

        # sequential over chunks only: [U_n; -Q_n S_n] = [U'_n; 0] - [W_n; Q_n] S_n and
        # S_{n+1} = S_n + K_n^T U_n, two batched matmuls per chunk
        S = new(N + 1, BH, K, V)  # S[n]: state at the start of chunk n
        if initial_state is None:
            S[0].zero_()
        else:
            S[0].copy_(initial_state.reshape(BH, K, V))
        UQ = new(N, BH, 2 * C, V)  # [U_n; -Q_n S_n]
        kTn = kcT.view(N, BH, K, C)
        for n in range(N):
            torch.baddbmm(UpZ[n], WQ[n], S[n], alpha=-1.0, out=UQ[n])
            torch.baddbmm(S[n], kTn[n], UQ[n, :, :C], out=S[n + 1])

        UQ3 = UQ.view(NB, 2 * C, V)
        U = UQ3[:, :C]
        out = torch.baddbmm(UQ3[:, C:], P, U, beta=-scale, alpha=scale)  # scale (Q S_n + P U_n)
        o = _unchunk(out.view(N, BH, C, V), B, T, H, q.dtype)
        final = S[N].reshape(B, H, K, V).clone()

        ctx.save_for_backward(WQ, kc, vc, bc, kk, P, Tinv, UQ, S)
        ctx.shape = (B, T, H, K, V, N, C)
        ctx.scale = scale
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, beta.dtype, None if initial_state is None else initial_state.dtype)
        ctx.set_materialize_grads(False)
        return o, final

    @staticmethod
    def _backward(ctx, do, dfinal):
        WQ, kc, vc, bc, kk, P, Tinv, UQ, S = ctx.saved_tensors
        B, T, H, K, V, N, C = ctx.shape
        BH = B * H
        NB = N * BH
        WQ3 = WQ.view(NB, 2 * C, K)
        qc = WQ3[:, C:]
        U = UQ.view(NB, 2 * C, V)[:, :C]
        SN = S[:N].view(NB, K, V)  # chunk-start states
        SNT = SN.transpose(-1, -2)
        # G[n] = [-dU_n; dO_n], so that dS_n = dS_{n+1} + [W_n; Q_n]^T G[n] is one matmul
        G = qc.new_empty(N, BH, 2 * C, V)
        G3 = G.view(NB, 2 * C, V)
        dO = G3[:, C:]
        if do is None:
            dO.zero_()
        else:
            _chunk_into(G[:, :, C:], do)
            if ctx.scale != 1.0:
                dO.mul_(ctx.scale)

        # read-out O = Q S_n + P U_n: dO -> U_n
        dUo = torch.bmm(P.transpose(-1, -2), dO).view(N, BH, C, V)

        # reverse sweep over chunks: dS[n] = dL/dS_n; dU_n = dUo_n + K_n dS_{n+1}
        dS = qc.new_empty(N + 1, BH, K, V)
        if dfinal is None:
            dS[N].zero_()
        else:
            dS[N].copy_(dfinal.reshape(BH, K, V))
        kn = kc.view(N, BH, C, K)
        WQTn = WQ.transpose(-1, -2)
        for n in range(N - 1, -1, -1):
            torch.baddbmm(dUo[n], kn[n], dS[n + 1], beta=-1.0, alpha=-1.0, out=G[n, :, :C])
            torch.baddbmm(dS[n + 1], WQTn[n], G[n], out=dS[n])

        # U = U' - W S and [W | U'] = T_c diag(beta) [K | V], so with Z = T^T (-dU):
        # d(beta V) = T^T dU' = -Z and d(beta K) = T^T dW = T^T (-dU S^T) = Z S^T.
        # G becomes [Z; dO], so that one matmul with S^T and one with U^T serve both halves.
        G3[:, :C].copy_(torch.bmm(Tinv.transpose(-1, -2), G3[:, :C]))
        Z = G3[:, :C]
        Y = torch.bmm(G3, SNT)  # [Z S^T; dO S^T], [NB, 2C, K]
        E = torch.bmm(G3, U.transpose(-1, -2))  # [Z U^T; dO U^T], [NB, 2C, C]
        dR_K = Y[:, :C]
        dP = E[:, C:].tril_()  # dL/dP, P = tril(Q K^T)
        # T_c = (I + Lb)^{-1}: dLb = -tril(T^T dT T^T, -1) = -tril(dR [W | U']^T, -1)
        #   = -tril(Z S^T W^T - Z U'^T, -1) = tril(Z U^T, -1) =: ZU   (as U' - W S = U)
        ZU = E[:, :C].tril_(-1)
        dQ = torch.baddbmm(Y[:, C:], dP, kc)
        dbeta = (dR_K * kc).sum(-1) - (Z * vc).sum(-1) + (ZU * kk).sum(-1)  # [NB, C]
        # Lb = tril(diag(beta) K K^T, -1): dK = (dkk + dkk^T) K with dkk = diag(beta) ZU
        dkk = bc * ZU
        dkk = dkk + dkk.transpose(-1, -2)
        dK = torch.bmm(dP.transpose(-1, -2), qc)  # via P = tril(Q K^T)
        dK.baddbmm_(U, dS[1:].view(NB, K, V).transpose(-1, -2))  # via S_{n+1} = S_n + K^T U
        dK.baddbmm_(dkk, kc)
        dK.addcmul_(dR_K, bc)  # via diag(beta) K
        dV = (Z * bc).neg_()  # via diag(beta) V

        q_dt, k_dt, v_dt, b_dt, s_dt = ctx.dtypes
        dq = _unchunk(dQ.view(N, BH, C, K), B, T, H, q_dt)
        dk = _unchunk(dK.view(N, BH, C, K), B, T, H, k_dt)
        dv = _unchunk(dV.view(N, BH, C, V), B, T, H, v_dt)
        dbeta = _unchunk(dbeta.view(N, BH, C, 1), B, T, H, b_dt).squeeze(-1)
        dh0 = None if s_dt is None else dS[0].reshape(B, H, K, V).to(s_dt)
        return dq, dk, dv, dbeta, dh0, None, None


def delta_rule_chunkwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The delta rule in chunkwise-parallel form (WY/UT transform), pure PyTorch, autograd.

    Source: Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over
    Sequence Length", section 3 (the WY representation of a product of Householder-like
    matrices, Bischof and Van Loan 1987, and the UT transform of Joffrain et al. 2006).

    Within a chunk of C tokens starting from state S_n (rows of K_c, V_c, Q_c are the chunk's
    tokens, D = diag(beta_c)):

        T_c    = (I + tril(D K_c K_c^T, -1))^{-1}                [C, C], unit lower triangular
        [W|U'] = T_c [D K_c | D V_c]                             all chunks at once
        U_n    = U' - W S_n          (row t: beta_t (v_t - S_{t-1}^T k_t), the written values)
        S_{n+1} = S_n + K_c^T U_n
        O_c    = scale * (Q_c S_n + tril(Q_c K_c^T) U_n)

    T_c is one batched unitriangular solve for all chunks (against the identity, so that the
    backward reuses it). Only the state recurrence runs sequentially, over the T / C chunks, as
    two batched matmuls per chunk: [U_n; -Q_c S_n] = [U'; 0] - [W; Q_c] S_n, then
    S_{n+1} = S_n + K_c^T U_n. Everything else is a few large batched matmuls over all chunks.
    The backward is derived by hand (a custom autograd.Function: one reverse sweep over the
    chunks, two batched matmuls per chunk, for dS_n and dU_n; the rest batched) and is checked
    against autograd through `delta_rule_recurrent` in the tests. Not twice
    differentiable.

    Works for any T and any ``chunk_size``: the last chunk is padded with q = k = v = 0 and
    beta = 0 (a padded token writes nothing), and the output is sliced back to T.
    Differentiable w.r.t. q, k, v, beta and initial_state.

    Memory kept for backward, in compute-dtype elements per (batch, head), with T' = T rounded
    up to a multiple of C: [W; Q] (2 T' K), K (T' K), V (T' V), beta (T'), K K^T, tril(Q K^T)
    and T_c (3 T' C), [U; -Q S] (2 T' V), and one state per chunk boundary ((T' / C + 1) K V).
    All of it is linear in T, with no per-token state: at C = 32 and K = V = 64 it is about
    610 elements (2.4 KB in fp32) per token and head, against about 4,400 (one K x V state per
    token plus its inputs) for autograd through the recurrence; bench/perf/delta_rule.py measures
    both. (flash-linear-attention goes further and recomputes the chunk states in backward.)

    Args:
        q: [B, T, H, K] queries.
        k: [B, T, H, K] keys.
        v: [B, T, H, V] values.
        beta: [B, T, H] write strengths, dimensionless, in (0, 1).
        scale: read-out scale, dimensionless.
        initial_state: [B, H, K, V] S_0; zeros when None.
        output_final_state: return S_T when True, else None.
        chunk_size: C, tokens per chunk (on a 2-core AVX2 CPU at K = V = 64, C = 32 is the
            fastest, about 1.2x faster than 64; see bench/perf/delta_rule.py).

    Returns:
        The output o [B, T, H, V] in the input dtype, and final_state [B, H, K, V] in the compute
        dtype (None unless ``output_final_state``).

    Raises:
        ValueError: on a shape, dtype or chunk_size mismatch, naming the argument.
    """
    _validate(q, k, v, beta, initial_state, chunk_size)
    o, final = _ChunkwiseDeltaRule.apply(q, k, v, beta, initial_state, float(scale), chunk_size)
    return o, (final if output_final_state else None)


@functools.lru_cache(maxsize=1)
def _fla_chunk_delta_rule() -> Callable | None:
    """``fla.ops.delta_rule.chunk_delta_rule`` if flash-linear-attention (the optional extra
    ``fla-core``) imports, else None. Imported lazily, once; any import failure means absent."""
    try:
        from fla.ops.delta_rule import chunk_delta_rule
    except Exception:  # noqa: BLE001 - ImportError, or a Triton/driver error at import time
        return None
    return chunk_delta_rule


def _use_fla(q: torch.Tensor) -> bool:
    """True when the fla kernel applies: CUDA tensors in bf16/fp16 and fla importable."""
    return q.is_cuda and q.dtype in _HALF and _fla_chunk_delta_rule() is not None


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The delta rule, dispatched to the fastest implementation available.

    Schlag et al. 2021; Yang et al. 2024, WY representation. On CUDA with bf16/fp16 inputs, when
    flash-linear-attention (``pip install fla-core``) imports, calls its Triton kernel
    ``fla.ops.delta_rule.chunk_delta_rule`` (layout [B, T, H, K], chunk size fixed at 64 by the
    kernel, so ``chunk_size`` is ignored there; fp32 is refused by that kernel). Otherwise (CPU,
    fp32/fp64, or fla absent) calls `delta_rule_chunkwise`. fla is imported lazily and its
    absence is never an error.

    Args:
        q: [B, T, H, K] queries.
        k: [B, T, H, K] keys.
        v: [B, T, H, V] values.
        beta: [B, T, H] write strengths, dimensionless, in (0, 1).
        scale: read-out scale, dimensionless.
        initial_state: [B, H, K, V] S_0; zeros when None.
        output_final_state: return S_T when True, else None.
        chunk_size: tokens per chunk for the PyTorch path.

    Returns:
        The output o [B, T, H, V] in the input dtype, and final_state [B, H, K, V] (fp32 for half
        inputs; None unless ``output_final_state``).

    Raises:
        ValueError: on a shape, dtype or chunk_size mismatch, naming the argument.
    """
    _validate(q, k, v, beta, initial_state, chunk_size)
    if _use_fla(q):
        fla_fn = _fla_chunk_delta_rule()
        extra = {}
        try:
            if "head_first" in inspect.signature(fla_fn).parameters:
                extra["head_first"] = False  # old fla versions defaulted to [B, H, T, K]
        except (TypeError, ValueError):  # no retrievable signature: rely on the default
            pass
        return fla_fn(
            q,
            k,
            v,
            beta.to(q.dtype),
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            **extra,
        )
    return delta_rule_chunkwise(
        q,
        k,
        v,
        beta,
        scale=scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        chunk_size=chunk_size,
    )
