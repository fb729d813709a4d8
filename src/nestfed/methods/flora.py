"""FLoRA (Wang et al., NeurIPS 2024): stacking-based aggregation, merged into the base each round.

The server forms the exact sum sum_k p_k s_k B_k A_k (p_k = n_k / N) by stacking: A_stack rows are
the p_k s_k A_k, B_stack columns the B_k, so B_stack @ A_stack equals the sum with no cross terms.
The stack is merged into the base weights (kept factorised as each layer's frozen
``merged_B @ merged_A``, accumulated over rounds), and every client starts each round from a fresh
LoRA of its own rank (A random, B = 0). The server and the clients use the same scale s_k (the
public code's scaling mismatch is avoided), and every client's update enters the sum (its FedIT
branch's first-client-only average is avoided).

Downlink: the whole accumulated stack, so a client that skipped rounds is still exact (stateless
clients); it grows by sum_k r_k rows per round, which the byte accounting shows.
"""

from __future__ import annotations

import torch

from nestfed.config import ExperimentConfig
from nestfed.federation.hooks import ClientHooks, FitContext
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState, Reply
from nestfed.federation.strategy import LoraStrategy, copy_state, examples
from nestfed.methods.method import lora_method, lora_settings
from nestfed.nn.keys import PEFT_PREFIX, merged_key, peft_key
from nestfed.nn.lora import init_adapter_state, module_shapes
from nestfed.seeds import stream_seed


def modules_of(arrays: Arrays) -> list[str]:
    """Module paths present in a FLoRA state (from its merged_A keys), sorted."""
    return sorted(k[len(PEFT_PREFIX): -len(".merged_A")] for k in arrays if k.endswith(".merged_A"))


class FLoRA(LoraStrategy):
    """Global state: merged_A [R, in] and merged_B [out, R] per layer, R = all stacked ranks so far."""

    name = "flora"

    def initialize(self, shapes: dict[str, tuple[int, int]], clients: list[ClientInfo]) -> GlobalState:
        state = super().initialize(shapes, clients)  # validates ranks
        arrays = {}
        for m, (out_f, in_f) in sorted(shapes.items()):
            arrays[merged_key(m, "A")] = torch.zeros(0, in_f)
            arrays[merged_key(m, "B")] = torch.zeros(out_f, 0)
        return GlobalState(arrays, state.meta)

    def client_arrays(self, state: GlobalState, rank: int) -> Arrays:
        return {k: v.clone() for k, v in state.arrays.items()}

    def expected_shapes(self, sent: Arrays, rank: int) -> dict[str, tuple[int, ...]]:
        out = {}
        for m in modules_of(sent):
            out[peft_key(m, "lora_A")] = (rank, sent[merged_key(m, "A")].shape[1])
            out[peft_key(m, "lora_B")] = (sent[merged_key(m, "B")].shape[0], rank)
        return out

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
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
        return {k: v.clone() for k, v in state.arrays.items()}, 1.0

    def export(self, state: GlobalState) -> tuple[Arrays, float]:
        out = {}
        for m in modules_of(state.arrays):
            out[peft_key(m, "lora_A")] = state.arrays[merged_key(m, "A")].clone()
            out[peft_key(m, "lora_B")] = state.arrays[merged_key(m, "B")].clone()
        return out, 1.0


class FLoRAHooks(ClientHooks):
    """Every round the client starts from a fresh LoRA of its rank r_k (A random, B = 0), drawn
    from the seed rule's stream ``fresh_lora`` of (lora.init_seed, round, client); the received
    stack is loaded as each layer's frozen residual."""

    def __init__(self, init_seed: int):
        self.init_seed = init_seed

    def arrays_to_load(self, ctx: FitContext, arrays: Arrays) -> Arrays:
        """The received stack plus a fresh LoRA of rank ``rank`` (A [r, in] random, B [out, r] = 0)."""
        seed = stream_seed(self.init_seed, ctx.round, ctx.cid, "fresh_lora")
        arrays.update(init_adapter_state(module_shapes(ctx.model), int(ctx.config["rank"]), seed))
        return arrays


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> FLoRA:
    return FLoRA(lora_settings(cfg))


METHOD = lora_method("flora", "stack the clients' p_k s_k B_k A_k exactly, merge into the base every round, "
                     "fresh LoRA per round (Wang et al. 2024)", _strategy,
                     hooks=lambda cfg: FLoRAHooks(cfg.lora.init_seed),
                     robust_aggregation="FLoRA stacks every client's exact product B_k A_k, each in its own "
                     "subspace: a coordinate-wise or distance rule over them means nothing (a norm bound, "
                     "validation.max_update_norm, does apply; docs/trust.md)",
                     server_optimizer="its global state is a stack that grows by sum_k r_k rows every round (the "
                     "clients' exact products, merged into the base), so no array keeps its shape and there is no "
                     "pseudo-gradient to step")
