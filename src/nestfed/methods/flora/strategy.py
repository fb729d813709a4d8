"""flora: the server strategy and the client hooks (the method is declared in nestfed.methods.flora)."""

from __future__ import annotations

import torch

from nestfed.config import ExperimentConfig
from nestfed.federation.hooks import ClientHooks, FitContext
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState, Reply
from nestfed.federation.strategy import LoraStrategy, copy_state, examples
from nestfed.methods.implementation import lora_implementation, lora_settings
from nestfed.nn.keys import PEFT_PREFIX, merged_key, peft_key
from nestfed.nn.lora import init_adapter_state, module_shapes
from nestfed.seeds import stream_seed


def modules_of(arrays: Arrays) -> list[str]:
    """Module paths present in a FLoRA state (from its merged_A keys), sorted.

    Args:
        arrays: the state's arrays.

    Returns:
        The module paths.
    """
    return sorted(k[len(PEFT_PREFIX) : -len(".merged_A")] for k in arrays if k.endswith(".merged_A"))


class FLoRA(LoraStrategy):
    """Global state: merged_A [R, in] and merged_B [out, R] per layer, R = all stacked ranks so far."""

    name = "flora"

    def initialize(self, shapes: dict[str, tuple[int, int]], clients: list[ClientInfo]) -> GlobalState:
        """Empty stacks per layer: merged_A [0, in] and merged_B [out, 0]."""
        state = super().initialize(shapes, clients)  # validates ranks
        arrays = {}
        for m, (out_f, in_f) in sorted(shapes.items()):
            arrays[merged_key(m, "A")] = torch.zeros(0, in_f)
            arrays[merged_key(m, "B")] = torch.zeros(out_f, 0)
        return GlobalState(arrays, state.meta)

    def client_arrays(self, state: GlobalState, rank: int) -> Arrays:
        """The whole accumulated stack (a copy), whatever the rank."""
        return {k: v.clone() for k, v in state.arrays.items()}

    def expected_shapes(self, sent: Arrays, rank: int) -> dict[str, tuple[int, ...]]:
        """A fresh LoRA of the client's rank: lora_A [r_k, in] and lora_B [out, r_k]."""
        out = {}
        for m in modules_of(sent):
            out[peft_key(m, "lora_A")] = (rank, sent[merged_key(m, "A")].shape[1])
            out[peft_key(m, "lora_B")] = (sent[merged_key(m, "B")].shape[0], rank)
        return out

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """Stack every client's p_k s_k A_k and B_k onto the merged A and B (module docstring)."""
        new = copy_state(state)
        n = examples(replies)
        total = sum(n.values())
        cids = sorted(replies)
        for m in modules_of(state.arrays):
            a_parts, b_parts = [state.arrays[merged_key(m, "A")]], [state.arrays[merged_key(m, "B")]]
            for c in cids:
                A, B = replies[c].arrays[peft_key(m, "lora_A")], replies[c].arrays[peft_key(m, "lora_B")]
                a_parts.append(A * (n[c] / total) * self.s.scale(A.shape[0]))
                b_parts.append(B)
            new.arrays[merged_key(m, "A")] = torch.cat(a_parts, 0)
            new.arrays[merged_key(m, "B")] = torch.cat(b_parts, 1)
        return new

    def deploy(self, state: GlobalState, cid: int | None = None) -> tuple[Arrays, float]:
        """The whole stack, at scale 1 (the scales are in the stacked A)."""
        return {k: v.clone() for k, v in state.arrays.items()}, 1.0

    def export(self, state: GlobalState) -> tuple[Arrays, float]:
        """The stack as one PEFT LoRA of rank R (all stacked ranks), at scale 1."""
        out = {}
        for m in modules_of(state.arrays):
            out[peft_key(m, "lora_A")] = state.arrays[merged_key(m, "A")].clone()
            out[peft_key(m, "lora_B")] = state.arrays[merged_key(m, "B")].clone()
        return out, 1.0


class FLoRAHooks(ClientHooks):
    """Every round the client starts from a fresh LoRA of its rank r_k (A random, B = 0).

    The fresh LoRA is drawn from the seed rule's stream ``fresh_lora`` of (lora.init_seed, round,
    client); the received stack is loaded as each layer's frozen residual.

    Args:
        init_seed: ``lora.init_seed``.
    """

    def __init__(self, init_seed: int):
        self.init_seed = init_seed

    def arrays_to_load(self, ctx: FitContext, arrays: Arrays) -> Arrays:
        """The received stack plus a fresh LoRA of rank ``rank`` (A [r, in] random, B [out, r] = 0)."""
        seed = stream_seed(self.init_seed, ctx.round, ctx.cid, "fresh_lora")
        arrays.update(init_adapter_state(module_shapes(ctx.model), int(ctx.config["rank"]), seed))
        return arrays


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> FLoRA:
    return FLoRA(lora_settings(cfg))


IMPLEMENTATION = lora_implementation(_strategy, hooks=lambda cfg: FLoRAHooks(cfg.lora.init_seed))
