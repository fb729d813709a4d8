"""The trainable rules of one FedNL memory layer: how the layer is built (`MemorySettings`)
and what it computes beside softmax attention (`MemoryRule`, the attention's linear path).

The equations, each choice and its source are nestfed.nn.memory's (FedNL, arXiv 2605.16350,
sections 3-4), which installs these rules into a backbone's attention layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from nestfed.nn.bounded_attention import LayerStream
from nestfed.nn.causal_conv import causal_conv, identity_taps, next_tail
from nestfed.nn.gates import BETA_SOURCES, DYNAMIC_RANGE, GATE_SCOPES, GATES
from nestfed.ops.delta_rule import delta_rule, delta_rule_recurrent


@dataclass(frozen=True)
class MemorySettings:
    """How a memory layer is built (the module docstring gives each choice's source).

    Attributes:
        gate: ``constant`` | ``learned`` | ``dynamic``.
        alpha_init: the gate's start in [0, 1] (dynamic: clipped into (0.1, 0.9)).
        gate_scope: ``head`` (one gate per query head) or ``layer`` (one per layer; a constant gate
            is always one per layer).
        window: softmax sliding window in tokens (0 = unbounded).
        sink: tokens at the start that every windowed query still sees (attention sinks; 0 = none).
        beta_source: ``hidden`` (a projection of the layer's input) or ``keys`` (a causal average
            of ``beta_window`` raw keys).
        beta_window: raw keys in beta's average (``beta_source = "keys"``), >= 1.
        conv_size: taps of the short causal convolution on q, k, v (0 = none).
        norm_weight: a learned per-head weight on the normalised read.
        output_gate: a per-head output gate from the layer's input.
        dynamic_kernel: the dynamic gate's Conv1d width in tokens (docs/methods.md: 16), >= 1.
        chunk_size: tokens per chunk of the chunkwise delta rule in training (32 is fastest on a
            2-core CPU), >= 1.
        operator: ``chunkwise`` (training and streaming) or ``recurrent`` (the per-token reference).

    Raises:
        ValueError: naming the setting, for a value out of range.
    """

    gate: str = "learned"
    alpha_init: float = 0.5
    gate_scope: str = "head"
    window: int = 0
    sink: int = 0
    beta_source: str = "hidden"
    beta_window: int = 4
    conv_size: int = 4
    norm_weight: bool = True
    output_gate: bool = False
    dynamic_kernel: int = 16
    chunk_size: int = 32
    operator: str = "chunkwise"

    def __post_init__(self) -> None:
        for key, value, known in (
            ("gate", self.gate, GATES),
            ("gate_scope", self.gate_scope, GATE_SCOPES),
            ("beta_source", self.beta_source, BETA_SOURCES),
            ("operator", self.operator, ("chunkwise", "recurrent")),
        ):
            if value not in known:
                raise ValueError(f"{key}: unknown {key} '{value}' (known: {', '.join(known)})")
        if not 0.0 <= self.alpha_init <= 1.0:
            raise ValueError(f"alpha_init must be in [0, 1], got {self.alpha_init}")
        if self.window < 0 or self.sink < 0 or self.conv_size < 0:
            raise ValueError(
                f"window, sink and conv_size must be >= 0, got {self.window}, {self.sink}, {self.conv_size}"
            )
        if self.beta_window < 1 or self.dynamic_kernel < 1 or self.chunk_size < 1:
            raise ValueError("beta_window, dynamic_kernel and chunk_size must be >= 1")

    @property
    def gates(self) -> str:
        """How many gates a layer has: ``head`` or ``layer`` (a constant gate: ``layer``)."""
        return "layer" if self.gate == "constant" else self.gate_scope


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


class MemoryRule(nn.Module):
    """The trainable memory rules of one attention layer (FedNL's theta besides LoRA).

    The layer's linear path (nestfed.nn.bounded_attention.LinearPath) is `mix`. Which
    parameters exist depends on the `MemorySettings`.

    Args:
        hidden: the layer's input width.
        num_heads: H, query heads.
        num_kv_heads: H_kv, key/value heads.
        head_dim: D.
        settings: how the layer is built.

    Attributes:
        beta_weight: [H, hidden] (``beta_source = "hidden"``) or [H, D] (``"keys"``), zeros.
        beta_bias: [H], zeros.
        alpha: [1], a constant gate's alpha (detached in forward).
        gate_logit: [G], a learned gate's logits (G = H per head, 1 per layer).
        gate_conv: a dynamic gate's Conv1d(hidden, G, kernel).
        conv_q: [H * D, conv_size], the short convolution on q (identity taps at the start).
        conv_k: [H_kv * D, conv_size], on k.
        conv_v: [H_kv * D, conv_size], on v.
        norm_weight: [H, D], ones.
        out_gate_weight: [H, hidden], zeros.
        out_gate_bias: [H], zeros.
        enabled: whether the linear path runs (False: the layer computes exactly the backbone's
            attention).
        drop: [H] bool or None, the heads whose softmax output is suppressed (module docstring).
        knocked_out: the memory's read removed (module docstring).

    Raises:
        ValueError: when the head counts do not divide (H must be a multiple of H_kv).
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, settings: MemorySettings):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"attention heads {num_heads} are not a multiple of key/value heads {num_kv_heads}")
        s = self.settings = settings
        self.num_heads, self.num_kv_heads, self.head_dim, self.hidden = num_heads, num_kv_heads, head_dim, hidden
        H, D = num_heads, head_dim
        self.beta_weight = nn.Parameter(torch.zeros(H, hidden if s.beta_source == "hidden" else D))
        self.beta_bias = nn.Parameter(torch.zeros(H))
        G = H if s.gates == "head" else 1
        if s.gate == "constant":
            self.alpha = nn.Parameter(torch.tensor([float(s.alpha_init)]))
        elif s.gate == "learned":
            self.gate_logit = nn.Parameter(torch.full((G,), _logit(s.alpha_init)))
        else:
            lo, hi = DYNAMIC_RANGE
            a = min(max(s.alpha_init, lo + 1e-3), hi - 1e-3)
            self.gate_conv = nn.Conv1d(hidden, G, s.dynamic_kernel)
            with torch.no_grad():
                self.gate_conv.weight.zero_()
                self.gate_conv.bias.fill_(_logit((a - lo) / (hi - lo)))
        if s.conv_size:
            self.conv_q = nn.Parameter(identity_taps(H * D, s.conv_size))
            self.conv_k = nn.Parameter(identity_taps(num_kv_heads * D, s.conv_size))
            self.conv_v = nn.Parameter(identity_taps(num_kv_heads * D, s.conv_size))
        if s.norm_weight:
            self.norm_weight = nn.Parameter(torch.ones(H, D))
        if s.output_gate:
            self.out_gate_weight = nn.Parameter(torch.zeros(H, hidden))
            self.out_gate_bias = nn.Parameter(torch.zeros(H))
        self.enabled = False
        self.drop: torch.Tensor | None = None
        self.knocked_out = False

    # -- beta ------------------------------------------------------------------------------------
    def beta(
        self,
        k: torch.Tensor,
        tail: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Compute the write strengths beta.

        ``beta_source = "hidden"``: from the layer's input; ``"keys"``: from the raw keys, the
        average over the min(beta_window, tokens available) last keys.

        Args:
            k: [B, T, H_kv, D] the raw keys.
            tail: [B, n, H_kv, D] up to ``beta_window - 1`` raw keys that precede k (a stream's
                previous chunk), or None.
            valid: [B, T] bool, False at padding: pads are left out of every average and get beta 0
                (they write nothing), so a padded row computes what the unpadded one does.
            hidden_states: [B, T, hidden] the layer's input.

        Returns:
            beta [B, T, H] in (0, 1).

        Raises:
            ValueError: for the hidden source without hidden_states.
        """
        if self.settings.beta_source == "hidden":
            if hidden_states is None:
                raise ValueError("beta: beta_source = 'hidden' needs the layer's hidden_states")
            z = hidden_states @ self.beta_weight.to(hidden_states.dtype).T + self.beta_bias.to(hidden_states.dtype)
            beta = torch.sigmoid(z)
        else:
            beta = torch.sigmoid(self._key_average(k, tail, valid) + self.beta_bias.to(k.dtype))
        return beta if valid is None else beta * valid.to(beta.dtype)[:, :, None]

    def _key_average(self, k: torch.Tensor, tail: torch.Tensor | None, valid: torch.Tensor | None) -> torch.Tensor:
        """beta_weight . mean of the last ``beta_window`` raw keys, per query head: [B, T, H]."""
        bw = self.settings.beta_window
        n = 0 if tail is None else tail.shape[1]
        x = k if tail is None else torch.cat([tail.to(k.dtype), k], dim=1)
        T = k.shape[1]
        w = x.new_ones(x.shape[0], x.shape[1])
        if valid is not None:
            w[:, n:] = valid.to(x.dtype)
        csum = torch.cumsum(x * w[:, :, None, None], dim=1)
        pad = torch.cat([csum.new_zeros(csum.shape[0], 1, *csum.shape[2:]), csum], dim=1)
        counts = torch.cat([w.new_zeros(w.shape[0], 1), torch.cumsum(w, dim=1)], dim=1)  # [B, n + T + 1]
        end = torch.arange(n + 1, n + T + 1, device=k.device)
        start = (end - bw).clamp(min=0)
        kbar = (pad[:, end] - pad[:, start]) / (counts[:, end] - counts[:, start]).clamp(min=1).view(-1, T, 1, 1)
        kbar = kbar.repeat_interleave(self.num_heads // self.num_kv_heads, dim=2)  # [B, T, H, D]
        return torch.einsum("bthd,hd->bth", kbar, self.beta_weight.to(k.dtype))

    # -- gate ------------------------------------------------------------------------------------
    def gate(self, x: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
        """Compute the mixing weight alpha of the linear path.

        Args:
            x: [B, T, hidden] the attention input (a dynamic gate reads it; the others its dtype).
            tail: [B, n, hidden] the stream's previous inputs, for a dynamic gate; or None.

        Returns:
            alpha [1, 1, G, 1] (constant, learned; G = 1 or H) or [B, T, G, 1] (dynamic).
        """
        g = self.settings.gate
        if g == "constant":
            return self.alpha.detach().to(x.dtype).view(1, 1, 1, 1)
        if g == "learned":
            return torch.sigmoid(self.gate_logit).to(x.dtype).view(1, 1, -1, 1)
        kern = self.settings.dynamic_kernel
        prev = x.new_zeros(x.shape[0], kern - 1, x.shape[2])
        if tail is not None and tail.shape[1]:
            prev[:, kern - 1 - tail.shape[1] :] = tail.to(x.dtype)
        xp = torch.cat([prev, x], dim=1).transpose(1, 2)  # [B, hidden, T + kern - 1]
        z = F.conv1d(xp, self.gate_conv.weight.to(x.dtype), self.gate_conv.bias.to(x.dtype))  # [B, G, T]
        lo, hi = DYNAMIC_RANGE
        return (lo + (hi - lo) * torch.sigmoid(z)).transpose(1, 2).unsqueeze(-1)  # [B, T, G, 1]

    def alphas(self) -> list[float] | None:
        """Read the current alpha of each gate of a constant or learned gate.

        Returns:
            [1] or [H] values; None for a dynamic gate, whose alpha depends on the input.
        """
        if self.settings.gate == "constant":
            return [float(self.alpha.detach())]
        if self.settings.gate == "learned":
            return torch.sigmoid(self.gate_logit.detach().float()).tolist()
        return None

    def alpha_value(self) -> float | None:
        """Average the gates' current alphas (`alphas`).

        Returns:
            Their mean; None for a dynamic gate.
        """
        a = self.alphas()
        return None if a is None else sum(a) / len(a)

    # -- the linear path -----------------------------------------------------------------------
    def mix(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        hidden_states: torch.Tensor,
        soft: torch.Tensor,
        stream: LayerStream | None,
        valid: torch.Tensor | None,
    ) -> torch.Tensor:
        """Mix the delta-rule read with the softmax output: O = alpha * read + (1 - alpha) * soft.

        The module docstring gives the read. With ``knocked_out`` the softmax output comes back
        unchanged (alpha = 0); heads in ``drop`` return the read alone.

        Args:
            q: [B, T, H, D] queries, before RoPE.
            k: [B, T, H_kv, D] keys, before RoPE.
            v: [B, T, H_kv, D] values.
            hidden_states: [B, T, hidden] the layer's input.
            soft: [B, T, H, D] the softmax output.
            stream: a stream, whose ``state`` carries S [B, H, D, D] and the tails of the short
                convolution (``conv_tail``), beta's key average (``k_tail``) and the dynamic gate
                (``x_tail``); None outside one.
            valid: [B, T] bool, False at padding: pads write nothing and feed neither a
                convolution, beta nor the gate; None without padding.

        Returns:
            O [B, T, H, D].
        """
        if self.knocked_out:
            return soft
        state = None if stream is None else stream.state
        x = hidden_states if valid is None else hidden_states * valid.to(hidden_states.dtype)[:, :, None]
        q_lin, k_lin, v_lin = self.inputs(q, k, v, valid, state)
        beta = self.beta(k, None if state is None else state.get("k_tail"), valid, x)
        op = delta_rule_recurrent if self.settings.operator == "recurrent" else delta_rule
        o_lin, s_new = op(
            q_lin,
            k_lin,
            v_lin,
            beta,
            initial_state=None if state is None else state.get("S"),
            output_final_state=state is not None,
            chunk_size=self.settings.chunk_size,
        )
        read = self.read(o_lin, soft, x)
        alpha = self.gate(x, None if state is None else state.get("x_tail"))
        if self.drop is not None:  # window dropout: these heads' softmax output is suppressed this step
            alpha = torch.where(self.drop.to(alpha.device).view(1, 1, -1, 1), torch.ones_like(alpha), alpha)
        if state is not None:
            self._carry(state, s_new, q, k, v, x)
        return alpha * read + (1 - alpha) * soft

    def inputs(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        valid: torch.Tensor | None = None,
        state: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prepare what the delta rule reads and writes, through the short convolution and `memory_inputs`.

        Args:
            q: [B, T, H, D] the raw query projections.
            k: [B, T, H_kv, D] the raw key projections.
            v: [B, T, H_kv, D] the raw value projections.
            valid: [B, T] bool; pads (False) are zeroed before the convolution and write nothing.
            state: a stream's state; its ``conv_tail`` precedes q, k, v in the convolution.

        Returns:
            q_lin, k_lin, v_lin, each [B, T, H, D].
        """
        if valid is not None:
            keep = valid.to(q.dtype)[:, :, None, None]
            q, k, v = q * keep, k * keep, v * keep
        if self.settings.conv_size:
            q, k, v = self._convolved(q, k, v, None if state is None else state.get("conv_tail"))
        q_lin, k_lin, v_lin = memory_inputs(q, k, v)
        if valid is not None:
            keep = valid.to(k_lin.dtype)[:, :, None, None]
            k_lin, v_lin = k_lin * keep, v_lin * keep
        return q_lin, k_lin, v_lin

    def _convolved(self, q, k, v, tail: torch.Tensor | None):
        """q, k, v through their short convolutions, as one [B, T, (H + 2 H_kv) D] signal."""
        B, T = q.shape[:2]
        sizes = (q.shape[2] * q.shape[3], k.shape[2] * k.shape[3], v.shape[2] * v.shape[3])
        x = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        w = torch.cat([self.conv_q, self.conv_k, self.conv_v], dim=0)
        yq, yk, yv = causal_conv(x, w, tail).split(sizes, dim=-1)
        return yq.view_as(q), yk.view_as(k), yv.view_as(v)

    def read(self, o_lin: torch.Tensor, soft: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Compute the memory's contribution before the gate.

        Args:
            o_lin: [B, T, H, D] the delta rule's output.
            soft: [B, T, H, D] the softmax output, whose scale (per token and head) the read takes.
            x: [B, T, hidden] the layer's input (for the output gate).

        Returns:
            RMSNorm(o_lin) [B, T, H, D], times the per-head norm weight and output gate when the
            settings have them, times rms(soft), in soft's dtype.
        """
        out = _rms_norm(o_lin).to(soft.dtype)
        if self.settings.norm_weight:
            out = out * self.norm_weight.to(soft.dtype)
        if self.settings.output_gate:
            z = x @ self.out_gate_weight.to(x.dtype).T + self.out_gate_bias.to(x.dtype)  # [B, T, H]
            out = out * (2 * torch.sigmoid(z)).to(soft.dtype)[..., None]
        return out * soft.pow(2).mean(dim=-1, keepdim=True).add(1e-12).sqrt()

    def _carry(self, state: dict[str, torch.Tensor], s_new: torch.Tensor, q, k, v, x: torch.Tensor) -> None:
        """Update a stream's state after a chunk: S and the tails the next chunk needs."""
        s = self.settings
        state["S"] = s_new.detach()
        if s.beta_source == "keys":
            state["k_tail"] = next_tail(k, state.get("k_tail"), s.beta_window)
        if s.conv_size:
            B, T = q.shape[:2]
            raw = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
            state["conv_tail"] = next_tail(raw, state.get("conv_tail"), s.conv_size)
        if s.gate == "dynamic":
            state["x_tail"] = next_tail(x, state.get("x_tail"), s.dynamic_kernel)


def memory_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compute the delta rule's inputs from (convolved) projections.

    Args:
        q: [B, T, H, D].
        k: [B, T, H_kv, D].
        v: [B, T, H_kv, D].

    Returns:
        q_lin = l2norm(silu(q)), k_lin = l2norm(silu(k)), v_lin = v * D^-0.5, each [B, T, H, D]
        (k_lin and v_lin repeated to the H query heads).
    """
    D, G = q.shape[-1], q.shape[2] // k.shape[2]
    q_lin = F.normalize(F.silu(q), dim=-1)
    k_lin = F.normalize(F.silu(k), dim=-1).repeat_interleave(G, dim=2)
    return q_lin, k_lin, (v * D**-0.5).repeat_interleave(G, dim=2)


def _rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x^2 over the last dim) + eps), no weight."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
