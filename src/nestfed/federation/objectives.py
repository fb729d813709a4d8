"""Local objectives: one function per method, called by the client trainer for every batch.

Each objective computes the loss of one batch, calls ``backward()`` itself (so that PreLort's
sub-rank passes free their graphs one at a time) and returns the loss value in nats per token.
Signature: ``objective(model, batch, config) -> float`` where ``batch`` is a :class:`Batch`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from nestfed.adapters.lora import active_rank, lora_modules
from nestfed.federation.aggregation import lowrank_norm
from nestfed.frozen_prefix import labelled_logits


@dataclass
class Batch:
    """A training batch: labels [B, T]; input_ids [B, T] or hidden [B, T, d] entering layer ``start``."""

    labels: torch.Tensor
    input_ids: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    start: int = 0

    def loss(self, model: nn.Module) -> torch.Tensor:
        """Mean next-token cross-entropy (nats per labelled token) of the model on this batch (the LM
        head runs on the labelled positions only: frozen_prefix.labelled_logits)."""
        logits, targets = labelled_logits(model, self.labels, self.input_ids, self.hidden, self.start)
        return F.cross_entropy(logits.float(), targets)


def plain(model: nn.Module, batch: Batch, config: dict[str, Any]) -> float:
    """The causal-LM (or response-only / answer-letter) cross-entropy at the client's full rank."""
    loss = batch.loss(model)
    loss.backward()
    return loss.item()


def nested(model: nn.Module, batch: Batch, config: dict[str, Any]) -> float:
    """PreLort's local objective (arXiv 2606.15963, eq. in section 2.2):
    L_k = 1/|R_k| sum_{r in R_k} CE(f(.; theta, r)), one forward/backward per sub-rank r.

    config["subranks"]: R_k (sorted ranks <= r_k). Raises KeyError without it.
    """
    ranks = list(config["subranks"])
    total = 0.0
    for r in ranks:
        with active_rank(model, r):
            loss = batch.loss(model) / len(ranks)
            loss.backward()
        total += loss.item()
    return total


def tail_size(rank: int, tail: float) -> int:
    """HetLoRA's number of regularised tail dimensions: ceil(tail * rank), 0 when rank is 1."""
    return 0 if rank <= 1 else min(rank - 1, max(1, math.ceil(tail * rank)))


def tail_norm(model: nn.Module, tail: float) -> torch.Tensor:
    """sum over LoRA layers of ||s B[:, r-t:] A[r-t:]||_F with t = :func:`tail_size` (HetLoRA)."""
    total = torch.zeros(())
    for m in lora_modules(model).values():
        t = tail_size(m.rank, tail)
        if t == 0:
            continue
        A, B = m.lora_A.weight[m.rank - t:], m.lora_B.weight[:, m.rank - t:]
        total = total + m.scaling * lowrank_norm(B, A)
    return total


def hetlora(model: nn.Module, batch: Batch, config: dict[str, Any]) -> float:
    """HetLoRA's local objective: CE + lambda * tail norm (rank self-pruning regulariser)."""
    loss = batch.loss(model)
    reg = float(config.get("hetlora_reg", 0.0))
    total = loss + reg * tail_norm(model, float(config.get("hetlora_tail", 0.25))) if reg > 0 else loss
    total.backward()
    return loss.item()


def prox(model: nn.Module, batch: Batch, config: dict[str, Any]) -> float:
    """FedProx's local objective (Li et al., "Federated Optimization in Heterogeneous Networks",
    MLSys 2020, eq. 2): CE + mu/2 * sum ||theta - theta_global||^2 over the trained parameters.

    config["fedprox_mu"]: mu (>= 0); config["_anchor"]: [(parameter, its received global value)],
    set on the client (federation/client_state.py). Returns the CE alone (nats per token).
    Raises KeyError without ``_anchor``.
    """
    loss = batch.loss(model)
    mu = float(config.get("fedprox_mu", 0.0))
    total = loss
    if mu > 0:
        total = loss + 0.5 * mu * sum(((p - a) ** 2).sum() for p, a in config["_anchor"])
    total.backward()
    return loss.item()


def ssi(model: nn.Module, batch: Batch, config: dict[str, Any]) -> float:
    """FedSSI's local objective (Li et al., ICML 2025, eq. 2): CE + c * sum_i Omega_i
    (theta_i - theta_global,i)^2, Omega the importance from the client's personalised surrogate
    (federation/client_state.py, :func:`surrogate_importance`).

    config["fedssi_c"]: c (>= 0); ``_anchor`` as for :func:`prox`; ``_importance``: [Omega per
    parameter] aligned with ``_anchor``. Returns the CE alone. Raises KeyError without them.
    """
    loss = batch.loss(model)
    c = float(config.get("fedssi_c", 0.0))
    total = loss
    if c > 0:
        total = loss + c * sum((w * (p - a) ** 2).sum() for (p, a), w in zip(config["_anchor"], config["_importance"]))
    total.backward()
    return loss.item()


OBJECTIVES: dict[str, Callable[[nn.Module, Batch, dict[str, Any]], float]] = {
    "plain": plain, "nested": nested, "hetlora": hetlora, "prox": prox, "ssi": ssi,
}
