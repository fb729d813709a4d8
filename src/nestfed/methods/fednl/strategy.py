"""FedNL (Federated Nested Learning, arXiv 2605.16350, sections 3-4): the server averages the
rules that build each client's memory, never the memory itself.

theta = LoRA on q, k, v + every memory layer's beta projection and gate (nn/memory.py).
Level 0 (this class): FedAvg of theta weighted by n_k. Level 1 (the client): theta trained by
backpropagation through the memory trajectory (the chunkwise delta rule) with the causal-LM
loss. Level 2 (inference): S_t updated online by the delta rule; it never leaves the client.

``travel`` chooses what crosses the wire, so that both of the paper's communication accounts
can be measured (section 4.4): ``all`` -- LoRA and the rules; ``rules`` -- only the memory
rules (beta projections and gates), each client keeping its own LoRA (initialised from the
run's LoRA seed, as the global adapter would be; nestfed.methods.fednl.hooks); ``none`` -- the
local-only baseline: the rules are sent and validated but never aggregated, each client keeps
its own LoRA and rules.

The constant gate (docs/methods.md section 3: "scheduled from 0.01 to 0.5 over the first steps")
is set per local step on the client from ``alpha_schedule``; the global state carries the
schedule's value at the end of the last round, which the deployed model runs with.
"""

from __future__ import annotations

import torch

from nestfed.config import ExperimentConfig
from nestfed.federation.aggregation import weighted_mean
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState, Reply
from nestfed.federation.robust import BlockRule
from nestfed.federation.strategy import LoraSettings, LoraStrategy, copy_state, examples
from nestfed.methods.fednl.hooks import FedNLHooks
from nestfed.methods.fednl.options import FedNLOptions
from nestfed.methods.fednl.setup import install, memory_layers
from nestfed.methods.fednl.warmup import report
from nestfed.methods.implementation import lora_implementation, lora_settings
from nestfed.nn.keys import rank_dim
from nestfed.nn.memory import alpha_schedule, is_constant_alpha_key, is_memory_key


class FedNL(LoraStrategy):
    """FedAvg of theta (module docstring): LoRA when it travels, and the memory rules.

    Args:
        settings: the LoRA numbers.
        options: the [fednl] section (what travels; the constant gate's schedule).
        memory_init: the memory rules' starting arrays, payload-keyed (from
            `nestfed.nn.memory.fresh_rule_arrays`).
        local_steps: train.local_steps (the schedule counts local steps).

    Raises:
        ValueError: at `initialize`, without memory rules.
    """

    name = "fednl"

    def __init__(
        self,
        settings: LoraSettings,
        options: FedNLOptions,
        memory_init: Arrays,
        local_steps: int = 1,
    ):
        super().__init__(settings, options)
        self.travel = options.travel
        self.memory_init = memory_init
        self.memory = options
        self.local_steps = local_steps

    def alpha_at(self, step: int) -> float:
        """The constant gate's scheduled alpha after ``step`` local steps of the run.

        Args:
            step: local steps done in the run.

        Returns:
            alpha in [0, 1].
        """
        m = self.memory
        return alpha_schedule(step, m.alpha_start, m.alpha_end, m.alpha_warmup_steps)

    def _set_alpha(self, arrays: Arrays, step: int) -> None:
        for k in arrays:
            if is_constant_alpha_key(k):
                arrays[k] = torch.full_like(arrays[k], self.alpha_at(step))

    def initialize(self, shapes: dict[str, tuple[int, int]], clients: list[ClientInfo]) -> GlobalState:
        """The initial state: the LoRA (when it travels) and the memory rules, the constant gate at step 0."""
        travel = self.travel
        state = super().initialize(shapes, clients)
        rules = self.memory_init or {}
        if not rules or not all(is_memory_key(k) for k in rules):
            raise ValueError(
                "fednl: no memory rules to start from (the model needs memory layers: "
                "nestfed.nn.memory.install_memory, configured by the [fednl] section)"
            )
        arrays = {} if travel in ("rules", "none") else dict(state.arrays)
        arrays.update({k: v.detach().clone() for k, v in sorted(rules.items())})
        self._set_alpha(arrays, 0)
        return GlobalState(arrays, {**state.meta, "travel": travel})

    def reply_keys(self, sent: Arrays) -> list[str]:
        """Everything sent trains and comes back (LoRA when it travels, and the rules)."""
        return sorted(sent)

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """FedAvg of every travelling array (n_k weights), then the constant gate's schedule.

        With ``travel = "none"`` (local-only) the rules are left as they started.
        """
        new = copy_state(state)
        if self.travel == "none":
            self._set_alpha(new.arrays, rnd * self.local_steps)
            return new
        n = examples(replies)
        cids = sorted(replies)
        for key in sorted(state.arrays):
            new.arrays[key] = weighted_mean([replies[c].arrays[key] for c in cids], [n[c] for c in cids])
        self._set_alpha(new.arrays, rnd * self.local_steps)
        return new

    def robust_aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply], rule: BlockRule) -> GlobalState:
        """The equal-rank block of every travelling array combined by ``rule``, then the gate schedule."""
        new = super().robust_aggregate(rnd, state, replies, rule)
        self._set_alpha(new.arrays, rnd * self.local_steps)
        return new

    def export(self, state: GlobalState) -> tuple[Arrays, float]:
        """The LoRA part as a PEFT adapter (empty when only the rules travel: each client's LoRA is its own).

        The rules go to memory_rules.safetensors (`export_files`).
        """
        return ({k: v.clone() for k, v in state.arrays.items() if rank_dim(k) is not None}, self.s.scale(self.s.r_max))

    def export_files(self, state: GlobalState) -> dict[str, Arrays]:
        """``memory_rules.safetensors``: the global memory rules (beta, gates, convolutions, norms), payload-keyed.

        With the server's warm-up also ``memory_warmup.safetensors``, the warmed rules the
        federation started from.
        """
        out = {"memory_rules.safetensors": {k: v.clone() for k, v in state.arrays.items() if is_memory_key(k)}}
        if self.memory.warmup_steps:
            out["memory_warmup.safetensors"] = {k: v.clone() for k, v in self.memory_init.items()}
        return out


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> FedNL:
    return FedNL(lora_settings(cfg), cfg.section("fednl"), initial, cfg.train.local_steps)


def _hooks(cfg: ExperimentConfig) -> FedNLHooks:
    options = cfg.section("fednl")
    return FedNLHooks(
        options.travel == "rules",
        options,
        cfg.train.local_steps,
        cfg.lora.init_seed,
        keep_rules=options.travel == "none",
    )


IMPLEMENTATION = lora_implementation(
    _strategy,
    hooks=_hooks,
    setup=install,
    report=report,
    check_model=lambda prep, cfg: memory_layers(prep, cfg) and None,
)
