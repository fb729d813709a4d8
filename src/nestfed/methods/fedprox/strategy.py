"""fedprox: the server strategy and the client hooks (the method is declared in nestfed.methods.fedprox)."""

from __future__ import annotations

from torch import nn

from nestfed.config import ExperimentConfig
from nestfed.federation.hooks import ClientHooks, FitContext
from nestfed.federation.messages import Arrays
from nestfed.federation.training import Batch
from nestfed.methods.fedavg.strategy import FedAvg
from nestfed.methods.implementation import lora_implementation, lora_settings


class FedProx(FedAvg):
    """FedAvg on the server; the proximal term is the clients' (`ProxHooks`)."""

    name = "fedprox"


class ProxHooks(ClientHooks):
    """CE + mu/2 * sum ||theta - theta_global||^2 over the trained parameters (eq. 2).

    The anchors theta_global are the received values, kept in ``ctx.scratch["anchor"]``.

    Args:
        mu: the proximal weight (``fedprox.mu``).
    """

    def __init__(self, mu: float):
        self.mu = mu

    def before_steps(self, ctx: FitContext, params: list[nn.Parameter]) -> dict[str, float]:
        """Keep the received values of the trained parameters as the anchors."""
        ctx.scratch["anchor"] = [(p, p.detach().clone()) for p in params]
        return {}

    def step_loss(self, ctx: FitContext, batch: Batch) -> float:
        """Backpropagates CE + the proximal term; returns the CE alone (nats per token)."""
        loss = batch.loss(ctx.model)
        total = loss
        if self.mu > 0:
            total = loss + batch.share * 0.5 * self.mu * sum(((p - a) ** 2).sum() for p, a in ctx.scratch["anchor"])
        total.backward()
        return loss.item()


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> FedProx:
    return FedProx(lora_settings(cfg), cfg.section("fedprox"))


IMPLEMENTATION = lora_implementation(_strategy, hooks=lambda cfg: ProxHooks(cfg.section("fedprox").mu))
