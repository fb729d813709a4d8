"""FedNL's client side (arXiv 2605.16350, sections 3-4): the memory rules in their own AdamW group
(``[fednl] rule_lr``, no weight decay), the constant gate's schedule and the window dropout per
local step, and, when only the rules travel, the client's own LoRA kept between rounds.

Kept state: ``kept`` = the client's own LoRA on q, k, v (``travel = "rules"`` or ``"none"``),
initialised once from the run's LoRA seed exactly as the global adapter would be, then trained and
kept; ``kept_rules`` = the client's own memory rules (``travel = "none"``, the local-only baseline:
received once, then trained and kept; a constant gate's alpha still follows the run's schedule).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nestfed.federation.hooks import ClientHooks, FitContext
from nestfed.federation.messages import Arrays
from nestfed.methods.fednl.options import FedNLOptions
from nestfed.nn.keys import rank_dim
from nestfed.nn.lora import init_adapter_state, module_shapes
from nestfed.nn.memory import (
    alpha_schedule,
    is_constant_alpha_key,
    memory_rules,
    set_constant_alpha,
    set_dropped_heads,
)
from nestfed.seeds import stream_seed

KEPT = "kept"
KEPT_RULES = "kept_rules"


class FedNLHooks(ClientHooks):
    """FedNL's client: the rules' own learning rate, the constant gate's schedule, the window dropout.

    When only the rules travel, the client keeps its own LoRA between rounds (module docstring).

    Args:
        keep_lora: the client keeps its LoRA (``travel = "rules"``).
        memory: the [fednl] section (a ``constant`` gate follows alpha_start -> alpha_end over
            alpha_warmup_steps local steps of the run).
        local_steps: train.local_steps.
        init_seed: lora.init_seed.
        keep_rules: the client also keeps its memory rules (``travel = "none"``, local-only; implies
            keep_lora).
    """

    def __init__(
        self, keep_lora: bool, memory: FedNLOptions, local_steps: int, init_seed: int, keep_rules: bool = False
    ):
        self.keep_lora = keep_lora or keep_rules
        self.keep_rules = keep_rules
        self.keeps_state = self.keep_lora
        self.memory = memory
        self.local_steps = local_steps
        self.init_seed = init_seed

    def arrays_to_load(self, ctx: FitContext, arrays: Arrays) -> Arrays:
        """The received rules plus the client's own LoRA (from its last round, or fresh: A Kaiming-uniform, B = 0)."""
        if not self.keep_lora:
            return arrays
        if KEPT not in ctx.state:
            ctx.state[KEPT] = init_adapter_state(module_shapes(ctx.model), int(ctx.config["rank"]), self.init_seed)
        return {**self._own_rules(ctx.state, arrays), **{k: v.clone() for k, v in ctx.state[KEPT].items()}}

    def _own_rules(self, state: dict[str, Arrays], arrays: Arrays) -> Arrays:
        """The received arrays with the client's kept rules in place of the received ones
        (``keep_rules``; a constant gate's alpha stays as received: the schedule sets it)."""
        if not self.keep_rules or KEPT_RULES not in state:
            return arrays
        own = {k: v.clone() for k, v in state[KEPT_RULES].items() if not is_constant_alpha_key(k)}
        return {**arrays, **own}

    def param_groups(self, ctx: FitContext, params: list[nn.Parameter]) -> list[dict[str, Any]]:
        """LoRA at ``train.lr``; every memory-rule parameter in its own group at ``rule_lr``, no weight decay.

        The references' recipe: Infini-attention's gate at 0.01, LoLCATs' and TPTT's rules apart
        from the LoRA.
        """
        rule_ids = {id(p) for r in memory_rules(ctx.model).values() for p in r.parameters()}
        rules = [p for p in params if id(p) in rule_ids]
        rest = [p for p in params if id(p) not in rule_ids]
        groups = [{"params": rest}] if rest else []
        if rules:
            groups.append({"params": rules, "lr": self.memory.rule_lr, "weight_decay": 0.0})
        return groups

    def before_steps(self, ctx: FitContext, params: list[nn.Parameter]) -> dict[str, float]:
        """No head starts a round with its softmax output suppressed."""
        set_dropped_heads(ctx.model, None)
        return {}

    def before_step(self, ctx: FitContext, step: int) -> None:
        """Set a constant gate to the schedule's value, and draw this step's suppressed heads.

        The schedule's step is the run's local step (round - 1) * local_steps + step
        (docs/methods.md: scheduled from 0.01 to 0.5 over the first steps); the window dropout's
        heads come from `dropped_heads`.
        """
        m = self.memory
        if m.gate == "constant":
            done = (ctx.round - 1) * self.local_steps + step
            set_constant_alpha(ctx.model, alpha_schedule(done, m.alpha_start, m.alpha_end, m.alpha_warmup_steps))
        if m.window_dropout > 0:
            g = torch.Generator().manual_seed(stream_seed(ctx.seed, ctx.round, ctx.cid, f"window_dropout/{step}"))
            set_dropped_heads(ctx.model, dropped_heads(ctx.model, m.window_dropout, m.window_dropout_scope, g))

    def after_steps(self, ctx: FitContext) -> dict[str, float]:
        """Evaluation never suppresses a softmax head."""
        set_dropped_heads(ctx.model, None)
        return {}

    def reply_arrays(self, ctx: FitContext, out: Arrays) -> Arrays:
        """With ``keep_lora`` the trained LoRA stays here and only the rules are sent."""
        if not self.keep_lora:
            return out
        kept = {k: v for k, v in out.items() if rank_dim(k) is not None}
        ctx.state[KEPT] = kept
        rules = {k: v for k, v in out.items() if k not in kept}
        if self.keep_rules:  # local-only: the rules are sent (validated, then ignored by the server)
            ctx.state[KEPT_RULES] = {k: v.clone() for k, v in rules.items()}
        return rules

    def evaluation_arrays(self, state: dict[str, Arrays], arrays: Arrays) -> Arrays:
        """The deployed rules plus the client's own LoRA (rules mode); its own rules too (``travel = "none"``)."""
        if not arrays or KEPT not in state:
            return arrays
        return {**self._own_rules(state, arrays), **state[KEPT]}


def dropped_heads(model: nn.Module, fraction: float, scope: str, g: torch.Generator) -> dict[int, torch.Tensor]:
    """One step's window dropout (arXiv 2510.05901's Scheduled Sliding-window Dropout).

    ``scope = "steps"``: with probability ``fraction`` every head of every memory layer at once,
    else none; ``"heads"``: each head of each layer on its own with probability ``fraction``.

    Args:
        model: the backbone with its memory layers.
        fraction: the dropout probability.
        scope: ``steps`` or ``heads``.
        g: the random stream.

    Returns:
        {memory layer: [H] bool, True where the head's softmax output is suppressed}.
    """
    rules = memory_rules(model)
    if scope == "steps":
        on = bool(torch.rand((), generator=g) < fraction)
        return {i: torch.full((r.num_heads,), on) for i, r in rules.items()}
    return {i: torch.rand(r.num_heads, generator=g) < fraction for i, r in rules.items()}
