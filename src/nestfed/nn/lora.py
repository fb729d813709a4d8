"""LoRA Linear layers evaluable at any prefix sub-rank, injected by name pattern.

A `LoraLinear` wraps a frozen ``base_layer`` and adds ``s * B[:, :r] A[:r] x``
(Hu et al., 2021), where ``lora_A.weight`` is A: [rank, in] and ``lora_B.weight`` is
B: [out, rank], named as in PEFT, so a module path ``model.layers.0.self_attn.q_proj`` carries
the state keys ``...q_proj.lora_A.weight`` and ``...q_proj.lora_B.weight``.

The active sub-rank r <= rank selects the prefix A[:r], B[:, :r] (PreLort, arXiv 2606.15963,
section 2.1). The scale s is fixed per layer when it is built (docs/methods.md section 1: by default
s = lora_alpha / r_max at every sub-rank and client), so a prefix of a high-rank adapter computes
exactly what a low-rank adapter with the same rows computes.

Optionally a layer carries a frozen low-rank residual ``merged_B @ merged_A`` (FLoRA's merge of
the stacked global update into the base weights, kept factorised: exact and cheap), and optionally a
trainable core M between frozen A and B (``lora_core``, a variant of nestfed.nn.lora_core: Fed-SB's
R, RAVAN's gated heads), when the update is ``s * B M A x``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from nestfed.nn.keys import LAYER_INDEX, PEFT_PREFIX, layer_indices, module_of, peft_key
from nestfed.nn.lora_core import LoraCore, make_core
from nestfed.nn.placement import trainable_dtype
from nestfed.nn.quantization import dense_dtype
from nestfed.seeds import stream_seed

__all__ = [
    "PEFT_PREFIX",
    "LoraLinear",
    "active_rank",
    "get_adapter_state",
    "init_adapter_state",
    "inject_lora",
    "lora_modules",
    "module_of",
    "module_shapes",
    "peft_key",
    "set_active_rank",
    "set_adapter_state",
    "target_module_names",
]


class LoraLinear(nn.Module):
    """A frozen Linear plus a prefix-truncatable LoRA update.

    A and B live on the base layer's device, in float32 beside a half-precision base
    (nestfed.nn.placement.trainable_dtype), else in the base's dtype. B starts at zero.

    Args:
        base_layer: the frozen ``nn.Linear`` (weight [out, in]).
        rank: number of LoRA rows held.
        scaling: s, multiplied into the LoRA path at every sub-rank.
        dropout: PEFT's lora_dropout on the LoRA path's input (train mode only).

    Attributes:
        lora_A: A, its weight [rank, in].
        lora_B: B, its weight [out, rank].
        active_rank: the prefix sub-rank r forward evaluates; None = the full held rank.
        lora_core: None (plain LoRA) or a core variant M [r, r] between A and B (`set_core`;
            then the update is s B M A x at the full rank, and only the core trains).

    Raises:
        ValueError: for a negative rank.
    """

    def __init__(self, base_layer: nn.Linear, rank: int, scaling: float, dropout: float = 0.0):
        super().__init__()
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        self.base_layer = base_layer
        self.in_features = base_layer.in_features
        self.out_features = base_layer.out_features
        self.scaling = float(scaling)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()  # as PEFT's: train mode only
        self.lora_A = nn.Linear(self.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False)
        self.active_rank: int | None = None  # None = the full held rank
        self.register_buffer("merged_A", None, persistent=False)
        self.register_buffer("merged_B", None, persistent=False)
        self.lora_core: LoraCore | None = None
        for m in (self.lora_A, self.lora_B):
            m.to(device=base_layer.weight.device, dtype=trainable_dtype(dense_dtype(base_layer)))
        with torch.no_grad():
            self.lora_B.weight.zero_()

    @property
    def rank(self) -> int:
        """Number of LoRA rows currently held (the client's rank r_k)."""
        return self.lora_A.weight.shape[0]

    def set_weights(self, A: torch.Tensor, B: torch.Tensor) -> None:
        """Replace the adapter by copies of A and B; r may differ from before.

        Args:
            A: [r, in] the down-projection.
            B: [out, r] the up-projection.

        Raises:
            ValueError: on shapes that do not fit the base layer or each other.
        """
        r = A.shape[0]
        if A.shape != (r, self.in_features) or B.shape != (self.out_features, r):
            raise ValueError(
                f"LoRA shapes A {tuple(A.shape)}, B {tuple(B.shape)} do not fit "
                f"in={self.in_features}, out={self.out_features}"
            )
        w = self.base_layer.weight
        dtype = trainable_dtype(dense_dtype(self.base_layer))
        self.lora_A.weight = nn.Parameter(A.detach().to(w.device, dtype).clone())
        self.lora_B.weight = nn.Parameter(B.detach().to(w.device, dtype).clone())
        self.lora_A.out_features = self.lora_B.in_features = r
        self.active_rank = None

    def set_merged(self, A: torch.Tensor | None, B: torch.Tensor | None) -> None:
        """Set the frozen residual delta W = B @ A, or remove it.

        Args:
            A: [R, in]; None removes the residual.
            B: [out, R].
        """
        if A is None:
            self.merged_A = self.merged_B = None
            return
        w, dtype = self.base_layer.weight, dense_dtype(self.base_layer)  # a float residual beside a quantised base
        self.merged_A = A.detach().to(w.device, dtype)
        self.merged_B = B.detach().to(w.device, dtype)

    def set_core(self, kind: str | None, core: torch.Tensor | None = None) -> None:
        """Install a core variant between A and B, or remove it (plain LoRA).

        Args:
            kind: the variant (nestfed.nn.lora_core); None removes the core.
            core: [r, q] its weights (h = r / q stacked heads of [q, q]) with r = rank.

        Raises:
            ValueError: when r differs from the rank or q does not divide it.
            KeyError: for an unknown kind.
        """
        if kind is None:
            self.lora_core = None
            return
        made = make_core(kind, core, self.lora_A.weight)  # A is in the trainable dtype, also beside a quantised base
        if made.rank != self.rank:
            raise ValueError(f"a core of rank {made.rank} ({tuple(core.shape)}) between factors of rank {self.rank}")
        self.lora_core = made

    def delta_weight(self, r: int | None = None) -> torch.Tensor:
        """Compute the LoRA update as a dense matrix (for tests and merges).

        Args:
            r: the prefix sub-rank; None = the full rank (the only one a layer with a core has).

        Returns:
            s * B[:, :r] @ A[:r], [out, in]; with a core, s * B M A.

        Raises:
            ValueError: for a sub-rank of a layer with a core.
        """
        r = self.rank if r is None else r
        if self.lora_core is not None:
            if r != self.rank:
                raise ValueError("a layer with a core has no prefix sub-ranks")
            return self.scaling * self.lora_B.weight @ self.lora_core.matrix() @ self.lora_A.weight
        return self.scaling * self.lora_B.weight[:, :r] @ self.lora_A.weight[:r]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the base layer plus the residual and the LoRA update at the active sub-rank.

        Args:
            x: [..., in] inputs.

        Returns:
            [..., out], in the base layer's output dtype.

        Raises:
            ValueError: for a sub-rank of a layer with a core.
        """
        out = self.base_layer(x)
        if self.merged_A is not None:
            out = out + (x @ self.merged_A.T) @ self.merged_B.T
        if self.lora_core is not None:
            return out + self._core_forward(x)
        r = self.rank if self.active_rank is None else self.active_rank
        if r > 0:
            A = self.lora_A.weight[:r]  # [r, in]
            B = self.lora_B.weight[:, :r]  # [out, r]
            x = self.lora_dropout(x)
            if x.dtype == A.dtype:
                out = out + ((x @ A.T) @ B.T) * self.scaling
            else:  # half-precision activations, float32 adapter (nestfed.nn.placement)
                out = out + (((x.to(A.dtype) @ A.T) @ B.T) * self.scaling).to(out.dtype)
        return out

    def _core_forward(self, x: torch.Tensor) -> torch.Tensor:
        """s B M A x at the full rank (a sub-rank is refused: M mixes every direction). x [..., in]."""
        if self.active_rank not in (None, self.rank):
            raise ValueError(f"a layer with a core runs only its full rank {self.rank}, not {self.active_rank}")
        A, B = self.lora_A.weight, self.lora_B.weight
        x = self.lora_dropout(x)
        y = (self.lora_core(x.to(A.dtype) @ A.T) @ B.T) * self.scaling
        return y.to(x.dtype)


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    """Find all LoRA layers of a model.

    Args:
        model: the model searched.

    Returns:
        ``{module path: layer}``, paths like ``model.layers.0.self_attn.q_proj``.
    """
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def target_module_names(
    model: nn.Module, target_modules: tuple[str, ...] | list[str], layers: tuple[int, ...] | list[int] = ()
) -> list[str]:
    """List the paths of the ``nn.Linear`` modules to adapt.

    Args:
        model: the model searched.
        target_modules: names matched against the last path component (``q_proj``) or, when a
            name contains a regex character, as a regex fully matching the whole path.
        layers: decoder-layer indices to keep (negative counts from the top); empty = every layer.

    Returns:
        The module paths, in the model's order.

    Raises:
        ValueError: when nothing matches or a layer index is out of range.
    """
    num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    wanted_layers: set[int] | None = None
    if layers:
        if num_layers is None:
            raise ValueError("lora.layers needs a model with config.num_hidden_layers")
        wanted_layers = set(layer_indices(layers, num_layers, "lora.layers"))
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or isinstance(module, LoraLinear):
            continue
        if name.endswith("base_layer") or ".lora_" in name:
            continue
        leaf = name.rsplit(".", 1)[-1]
        ok = any((re.fullmatch(t, name) if re.search(r"[\\^$*+?\[\](){}|]", t) else leaf == t) for t in target_modules)
        if not ok:
            continue
        if wanted_layers is not None:
            m = LAYER_INDEX.search("." + name + ".")
            if m is None or int(m.group(1)) not in wanted_layers:
                continue
        names.append(name)
    if not names:
        raise ValueError(f"lora.target_modules {list(target_modules)} matched no Linear layer")
    return names


def inject_lora(
    model: nn.Module, target_modules, rank: int, scaling: float, layers=(), dropout: float = 0.0
) -> list[str]:
    """Replace each target ``nn.Linear`` by a `LoraLinear` of the given rank (B = 0).

    A zero-initialised B leaves the outputs unchanged.

    Args:
        model: the model, changed in place.
        target_modules: as `target_module_names` takes them.
        rank: the rank of every layer.
        scaling: s of every layer.
        layers: decoder-layer indices to adapt (negative counts from the top); empty = every layer.
        dropout: PEFT's lora_dropout on the LoRA path's input.

    Returns:
        The adapted module paths.

    Raises:
        ValueError: as `target_module_names` does.
    """
    names = target_module_names(model, target_modules, layers)
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, LoraLinear(getattr(parent, leaf), rank, scaling, dropout))
    return names


def set_active_rank(model: nn.Module, r: int | None) -> None:
    """Evaluate every LoRA layer at a prefix sub-rank.

    Args:
        model: the model with LoRA layers.
        r: the sub-rank; None = each layer's full rank.

    Raises:
        ValueError: when r exceeds a layer's held rank.
    """
    for name, m in lora_modules(model).items():
        if r is not None and r > m.rank:
            raise ValueError(f"sub-rank {r} exceeds the rank {m.rank} held by {name}")
        m.active_rank = r


@contextmanager
def active_rank(model: nn.Module, r: int | None) -> Iterator[None]:
    """Evaluate at a prefix sub-rank inside a ``with`` block (`set_active_rank`).

    Args:
        model: the model with LoRA layers.
        r: the sub-rank; None = each layer's full rank.

    Yields:
        Nothing; the full rank is restored on exit.

    Raises:
        ValueError: when r exceeds a layer's held rank.
    """
    set_active_rank(model, r)
    try:
        yield
    finally:
        set_active_rank(model, None)


def get_adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Read the adapter as a flat dict of detached CPU copies.

    Args:
        model: the model with LoRA layers.

    Returns:
        ``{PEFT key: tensor}``: lora_A keys hold [r, in], lora_B keys hold [out, r].
    """
    state = {}
    for name, m in lora_modules(model).items():
        state[peft_key(name, "lora_A")] = m.lora_A.weight.detach().cpu().clone()
        state[peft_key(name, "lora_B")] = m.lora_B.weight.detach().cpu().clone()
    return state


def set_adapter_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load an adapter into the LoRA layers; the rank follows the tensors' shapes.

    Args:
        model: the model with LoRA layers.
        state: ``{PEFT key: tensor}``, A [r, in] and B [out, r] of every layer.

    Raises:
        KeyError: when a layer's A or B is missing or a key names no LoRA layer.
        ValueError: on shapes that do not fit a layer.
    """
    modules = lora_modules(model)
    seen = set()
    for key in state:
        name, kind = module_of(key)
        if not kind.startswith("lora_"):
            raise KeyError(f"adapter state key {key} is not a LoRA matrix")
        if name not in modules:
            raise KeyError(f"adapter key {key} names no LoRA layer of the model")
        seen.add(name)
    for name, m in modules.items():
        a, b = peft_key(name, "lora_A"), peft_key(name, "lora_B")
        if a not in state or b not in state:
            raise KeyError(f"adapter state lacks {a} or {b}")
        m.set_weights(state[a], state[b])


def init_adapter_state(shapes: dict[str, tuple[int, int]], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Draw a fresh global adapter: A ~ PEFT's Kaiming-uniform(a=sqrt(5)) init, B = 0.

    Deterministic for a seed: each module draws from its own generator, seeded by the seed rule's
    stream ``lora_init/<module path>`` (nestfed.seeds).

    Args:
        shapes: ``{module path: (out, in)}``.
        rank: the adapter's rank.
        seed: the run's initialisation seed.

    Returns:
        PEFT-keyed tensors, A: [rank, in], B: [out, rank].
    """
    state = {}
    for name, (out_f, in_f) in sorted(shapes.items()):
        g = torch.Generator().manual_seed(stream_seed(seed, 0, 0, f"lora_init/{name}"))
        bound = 1.0 / math.sqrt(in_f)  # kaiming_uniform_(a=sqrt(5)) on [rank, in]
        state[peft_key(name, "lora_A")] = (torch.rand(rank, in_f, generator=g) * 2 - 1) * bound
        state[peft_key(name, "lora_B")] = torch.zeros(out_f, rank)
    return state


def module_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Read the shape of every LoRA layer.

    Args:
        model: the model with LoRA layers.

    Returns:
        ``{module path: (out, in)}``.
    """
    return {n: (m.out_features, m.in_features) for n, m in lora_modules(model).items()}
