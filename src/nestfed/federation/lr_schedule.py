"""A client's learning-rate schedule (``train.lr_schedule``, ``warmup_steps``, ``lr_schedule_scope``).

It goes through transformers' schedules: constant, linear or cosine decay after a linear warmup,
each parameter group's rate scaled by the same factor.

Scope ``round``: the schedule runs over each round's ``local_steps`` and restarts every round.
Scope ``federation``: one schedule over ``rounds x local_steps`` steps; round t's local step s is
step ``(t - 1) x local_steps + s`` of it, so a client sampled in round t resumes the schedule
where the federation is, whatever it trained before.
"""

from __future__ import annotations

import torch
from torch.optim.lr_scheduler import LambdaLR

from nestfed.config.schema import TrainConfig

#: train.lr_schedule -> transformers' SchedulerType with a warmup
_NAMES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def lr_factor(train: TrainConfig, total_rounds: int):
    """Give the schedule as a function of its step.

    Transformers' own lambda for ``train.lr_schedule`` with ``train.warmup_steps`` over one round's
    or the federation's steps.

    Args:
        train: the client's settings.
        total_rounds: the federation's round count (for scope ``federation``).

    Returns:
        A function of the schedule's step (0-based) -> the factor on every group's learning rate.
    """
    from transformers import get_scheduler

    steps = train.schedule_steps(total_rounds)
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    kwargs = {"num_warmup_steps": train.warmup(total_rounds)}
    if train.lr_schedule != "constant":
        kwargs["num_training_steps"] = max(steps, 1)
    return get_scheduler(_NAMES[train.lr_schedule], probe, **kwargs).lr_lambdas[0]


def client_schedule(opt: torch.optim.Optimizer, train: TrainConfig, rnd: int, total_rounds: int) -> LambdaLR | None:
    """Build the scheduler of one client's local steps in a round.

    Args:
        opt: the client's optimiser.
        train: the client's settings.
        rnd: the round, 1-based.
        total_rounds: the federation's round count (0 when the instruction lacks it).

    Returns:
        The scheduler, to ``step()`` after every optimiser step; None for a constant rate without
        warmup (the optimiser untouched).

    Raises:
        ValueError: for scope ``federation`` without the federation's round count.
    """
    if train.lr_schedule == "constant" and train.warmup(max(total_rounds, 1)) == 0:
        return None
    if train.lr_schedule_scope == "federation" and total_rounds < 1:
        raise ValueError("train.lr_schedule_scope = 'federation' needs the federation's rounds in the instruction")
    factor = lr_factor(train, total_rounds)
    offset = (rnd - 1) * train.local_steps if train.lr_schedule_scope == "federation" else 0
    return LambdaLR(opt, lambda s: factor(offset + s))
