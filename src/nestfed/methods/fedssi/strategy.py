"""fedssi: the server strategy and the client hooks (the method is declared in nestfed.methods.fedssi)."""

from __future__ import annotations

import torch
from torch import nn

from nestfed.config import ExperimentConfig
from nestfed.federation.hooks import ClientHooks, FitContext
from nestfed.federation.messages import Arrays
from nestfed.federation.training import Batch
from nestfed.methods.fedavg.strategy import FedAvg
from nestfed.methods.fedssi import FedSSIOptions
from nestfed.methods.implementation import lora_implementation, lora_settings


class FedSSI(FedAvg):
    """FedAvg on the server; the surrogate and the importance-weighted term are the clients'."""

    name = "fedssi"


def surrogate_importance(
    ctx: FitContext, params: list[nn.Parameter], anchors: list[torch.Tensor], o: FedSSIOptions
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """FedSSI's parameter importance from a personalised surrogate model (PSM).

    The surrogate starts at the global theta and takes ``psm_steps`` AdamW steps (lr = train.lr) on
    CE + q(lambda)/2 ||v - theta_global||^2 with q(lambda) = (1 - lambda) / (2 lambda) (eq. 5), over
    batches of the seed rule's stream ``surrogate``. Along its path the synaptic-intelligence
    contribution s_i = sum_steps -g_i * dv_i (g the CE gradient, eq. 6) gives Omega_i = max(s_i, 0)
    / ((v_i - theta_global,i)^2 + xi) (eq. 7; Zenke et al. 2017).

    Decision: Omega is rescaled to mean 1 over all parameters (AdamW's step sizes make the raw
    magnitudes depend on the learning rate), so ``c`` weighs a mean-one importance; with zero steps
    Omega = 1. The parameters are restored to the anchors.

    Args:
        ctx: the client's round (its model, batches and ``train.lr``).
        params: the trained parameters.
        anchors: theta_global, one tensor per parameter.
        o: ``[fedssi]``.

    Returns:
        Omega per parameter, and {"psm_loss": mean CE over the surrogate steps} (empty with zero
            steps).
    """
    if o.psm_steps <= 0:
        return [torch.ones_like(a) for a in anchors], {}
    q = (1.0 - o.psm_lambda) / (2.0 * o.psm_lambda)
    opt = torch.optim.AdamW(params, lr=ctx.train.lr, weight_decay=0.0)
    s = [torch.zeros_like(a) for a in anchors]
    losses = []
    for batch in ctx.batches(o.psm_steps, "surrogate"):
        opt.zero_grad(set_to_none=True)
        loss = batch.loss(ctx.model)
        loss.backward()
        losses.append(loss.item())
        grads = [p.grad.detach().clone() for p in params]
        before = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, a in zip(params, anchors):
                p.grad.add_(q * (p - a))
        opt.step()
        with torch.no_grad():
            for i, p in enumerate(params):
                s[i] -= grads[i] * (p - before[i])
    with torch.no_grad():
        omega = [si.clamp(min=0) / ((p - a) ** 2 + o.xi) for si, p, a in zip(s, params, anchors)]
        total = sum(float(w.sum()) for w in omega)
        count = sum(w.numel() for w in omega)
        mean = total / max(count, 1)
        omega = [w / mean if mean > 0 else torch.ones_like(w) for w in omega]
        for p, a in zip(params, anchors):
            p.copy_(a)
            p.grad = None
    return omega, {"psm_loss": sum(losses) / len(losses)}


class SSIHooks(ClientHooks):
    """The surrogate's importance before the steps, then CE + c * sum_i Omega_i (theta_i - theta_global,i)^2 (eq. 2).

    Args:
        options: ``[fedssi]``.
    """

    def __init__(self, options: FedSSIOptions):
        self.o = options

    def before_steps(self, ctx: FitContext, params: list[nn.Parameter]) -> dict[str, float]:
        """The anchors and the surrogate's importance; returns ``psm_loss``."""
        anchors = [p.detach().clone() for p in params]
        ctx.scratch["anchor"] = list(zip(params, anchors))
        omega, metrics = surrogate_importance(ctx, params, anchors, self.o)
        ctx.scratch["importance"] = omega
        return metrics

    def step_loss(self, ctx: FitContext, batch: Batch) -> float:
        """Backpropagates the regularised loss; returns the CE alone (nats per token)."""
        loss = batch.loss(ctx.model)
        total = loss
        if self.o.c > 0:
            total = loss + batch.share * self.o.c * sum(
                (w * (p - a) ** 2).sum() for (p, a), w in zip(ctx.scratch["anchor"], ctx.scratch["importance"])
            )
        total.backward()
        return loss.item()


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> FedSSI:
    return FedSSI(lora_settings(cfg), cfg.section("fedssi"))


IMPLEMENTATION = lora_implementation(_strategy, hooks=lambda cfg: SSIHooks(cfg.section("fedssi")))
