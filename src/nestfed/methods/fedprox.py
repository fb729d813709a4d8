"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar and Smith, "Federated Optimization in
Heterogeneous Networks", MLSys 2020): FedAvg's aggregation, with the proximal term
mu/2 ||theta - theta_global||^2 added to every client's local loss (eq. 2).

Options: section ``[fedprox]`` (:class:`FedProxOptions`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from nestfed.config import ExperimentConfig
from nestfed.federation.hooks import ClientHooks, FitContext
from nestfed.federation.messages import Arrays
from nestfed.federation.training import Batch
from nestfed.methods.fedavg import FedAvg
from nestfed.methods.method import lora_method, lora_settings


@dataclass(frozen=True)
class FedProxOptions:
    """mu: the proximal weight (>= 0; 0 is FedAvg exactly)."""

    mu: float = 0.01

    def __post_init__(self) -> None:
        if self.mu < 0:
            raise ValueError(f"mu must be >= 0, got {self.mu}")


class FedProx(FedAvg):
    """FedAvg on the server; the proximal term is the clients' (:class:`ProxHooks`)."""

    name = "fedprox"


class ProxHooks(ClientHooks):
    """CE + mu/2 * sum ||theta - theta_global||^2 over the trained parameters (eq. 2); the anchors
    theta_global are the received values, kept in ``ctx.scratch["anchor"]``."""

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


METHOD = lora_method("fedprox", "FedAvg with the proximal term mu/2 ||theta - theta_global||^2 on every client "
                     "(Li et al. 2020)", _strategy, hooks=lambda cfg: ProxHooks(cfg.section("fedprox").mu),
                     sections={"fedprox": FedProxOptions}, equal_ranks=True)
