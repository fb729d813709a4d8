"""A trainable core between a LoRA layer's frozen factors: the LoRA variants of Fed-SB and RAVAN.

A plain `nestfed.nn.lora.LoraLinear` adds ``s B A x`` (A: [r, in], B: [out, r]). A layer
that holds a *core* (its ``lora_core`` submodule, one of the variants below) adds ``s B M A x``
instead, where M [r, r] is the core's matrix; A and B stay frozen and only the core trains. As in
PEFT's LoRA variants (DoRA beside plain LoRA), the variant is an object the layer holds, not a flag:
a layer without a core computes exactly what it computed before this module existed.

The variants, each installed by the payload key that carries it (nestfed.nn.keys.lora_core_key):

- `SquareCore` (``lora_core`` [r, r], Fed-SB, arXiv 2502.15436): M = R, one dense r x r
  matrix. The reply is R.
- `GatedHeads` (``lora_heads`` [r, q], RAVAN, NeurIPS 2025): the heads H_i [q, q] stacked
  row-wise, H = [H_1; ...; H_h], r = h q; A = [A_1; ...; A_h], B = [B_1, ..., B_h], and
  M = blockdiag(g_1 H_1, ..., g_h H_h), so s B M A = s sum_i g_i B_i H_i A_i. The gates g_i [h] train
  with the heads, start at 1 every round and never travel: the reply is the folded g_i H_i (RAVAN's
  upload of s_i H_i).

A core is held as [r, q] (Fed-SB: q = r, one head): its row j feeds B's column j, so dim 0 is the
core's rank dimension (nestfed.nn.keys.rank_dim), as A's is: the round loop's sums, secure sums
and rank blocks treat it like A. Both keep the core in the trainable dtype of the base layer
(nestfed.nn.placement.trainable_dtype).
"""

from __future__ import annotations

import torch
from torch import nn

from nestfed.nn.keys import lora_core_key
from nestfed.nn.placement import trainable_dtype

__all__ = ["CORE_KINDS", "GatedHeads", "LoraCore", "SquareCore", "core_kind_of", "core_matrix", "make_core"]


def core_matrix(core: torch.Tensor) -> torch.Tensor:
    """Build the block-diagonal matrix of a core's heads.

    Args:
        core: [r, q] the heads H_1, ..., H_h stacked row-wise (h = r / q).

    Returns:
        M = blockdiag(H_1, ..., H_h), [r, r].

    Raises:
        ValueError: when q does not divide r.
    """
    r, q = core.shape
    if q == 0 or r % q:
        raise ValueError(f"a LoRA core must be [h q, q], got {tuple(core.shape)}")
    return torch.block_diag(*core.reshape(r // q, q, q))


class LoraCore(nn.Module):
    """What a core variant provides (the protocol `nestfed.nn.lora.LoraLinear` calls).

    Args:
        core: [r, q] the heads stacked row-wise (h = r / q heads of [q, q]; r = the layer's rank).
        like: a tensor of the layer's (A's): the core goes to its device, in the trainable dtype of
            its dtype.

    Attributes:
        weight: the core's trainable heads stacked row-wise, [r, q].
        kind: the payload key kind that carries it.

    Raises:
        ValueError: when q does not divide r.
    """

    kind = ""

    def __init__(self, core: torch.Tensor, like: torch.Tensor):
        super().__init__()
        core_matrix(core)  # checks the shape
        self.weight = nn.Parameter(core.detach().to(like.device, trainable_dtype(like.dtype)).clone())

    @property
    def rank(self) -> int:
        """The rank r of the factors the core sits between."""
        return self.weight.shape[0]

    @property
    def heads(self) -> int:
        """The number of heads, h = r / q."""
        return self.weight.shape[0] // self.weight.shape[1]

    def matrix(self) -> torch.Tensor:
        """Build M, the block-diagonal matrix of the (gated) heads.

        Returns:
            M [r, r].
        """
        return core_matrix(self.gated())

    def gated(self) -> torch.Tensor:
        """Give the heads as they act (by default as held).

        Returns:
            The heads [r, q].
        """
        return self.weight

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Apply M head by head: no [r, r] matrix is formed.

        Args:
            z: [..., r] A x.

        Returns:
            M A x, [..., r].
        """
        r, q = self.weight.shape
        heads = self.gated().reshape(r // q, q, q)
        zs = z.reshape(*z.shape[:-1], r // q, q)
        return torch.einsum("...hj,hij->...hi", zs, heads).reshape(z.shape)

    def trainable(self) -> list[nn.Parameter]:
        """List the parameters that train (A and B stay frozen).

        Returns:
            The core's trainable parameters.
        """
        return [self.weight]

    def reply(self) -> torch.Tensor:
        """Give what the client sends back.

        Returns:
            The heads as they act, [r, q] (a detached copy).
        """
        return self.gated().detach().clone()


class SquareCore(LoraCore):
    """Fed-SB's R: one dense [r, r] core (h = 1).

    Args:
        core: [r, r] R.
        like: a tensor of the layer's (A's): the core goes to its device, in the trainable dtype of
            its dtype.

    Raises:
        ValueError: when the core is not square.
    """

    kind = "lora_core"

    def __init__(self, core: torch.Tensor, like: torch.Tensor):
        super().__init__(core, like)
        if core.shape[0] != core.shape[1]:
            raise ValueError(f"Fed-SB's core is one [r, r] matrix, got {tuple(core.shape)}")


class GatedHeads(LoraCore):
    """RAVAN's heads H = [H_1; ...; H_h] [r, q] with their gates g_i [h] (the paper's s_i).

    Args:
        core: [r, q] the heads stacked row-wise (h = r / q heads of [q, q]; r = the layer's rank).
        like: a tensor of the layer's (A's): the core goes to its device, in the trainable dtype of
            its dtype.

    Attributes:
        gates: g [h], trainable, 1 on load.

    Raises:
        ValueError: when q does not divide r.
    """

    kind = "lora_heads"

    def __init__(self, core: torch.Tensor, like: torch.Tensor):
        super().__init__(core, like)
        self.gates = nn.Parameter(torch.ones(self.heads, device=self.weight.device, dtype=self.weight.dtype))

    def gated(self) -> torch.Tensor:
        """Give g_i H_i stacked: each head's q rows times its gate.

        Returns:
            The gated heads [r, q].
        """
        return self.gates.repeat_interleave(self.weight.shape[1])[:, None] * self.weight

    def trainable(self) -> list[nn.Parameter]:
        """List the heads and their gates."""
        return [self.weight, self.gates]


CORE_KINDS: dict[str, type[LoraCore]] = {SquareCore.kind: SquareCore, GatedHeads.kind: GatedHeads}


def core_kind_of(arrays: dict[str, torch.Tensor], module: str) -> str | None:
    """Find the core kind a payload carries for a module.

    Args:
        arrays: the payload, ``{key: tensor}``.
        module: the module path.

    Returns:
        The kind (a key of CORE_KINDS), None for a plain LoRA layer.

    Raises:
        ValueError: when it carries two.
    """
    kinds = [k for k in CORE_KINDS if lora_core_key(module, k) in arrays]
    if len(kinds) > 1:
        raise ValueError(f"{module}: the payload carries two cores ({', '.join(kinds)})")
    return kinds[0] if kinds else None


def make_core(kind: str, core: torch.Tensor, like: torch.Tensor) -> LoraCore:
    """Build a core variant.

    Args:
        kind: the variant, a key of CORE_KINDS.
        core: [r, q] its weights.
        like: a tensor whose device the core goes to, in the trainable dtype of its dtype.

    Returns:
        The core.

    Raises:
        KeyError: for an unknown kind.
        ValueError: for a shape the variant does not take.
    """
    return CORE_KINDS[kind](core, like)
