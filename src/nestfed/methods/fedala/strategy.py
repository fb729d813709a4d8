"""fedala: the server strategy and the client hooks (the method is declared in nestfed.methods.fedala)."""

from __future__ import annotations

import torch

from nestfed.config import ExperimentConfig
from nestfed.federation.hooks import ClientHooks, FitContext
from nestfed.federation.messages import Arrays
from nestfed.methods.fedala import FedALAOptions
from nestfed.methods.fedavg.strategy import FedAvg
from nestfed.methods.implementation import lora_implementation, lora_settings
from nestfed.nn.keys import layer_of, module_of, rank_dim
from nestfed.nn.lora import lora_modules

ALA_W, ALA_LOCAL = "ala_weights", "ala_local"


class FedALA(FedAvg):
    """FedAvg on the server; the adaptive local aggregation is the clients' (`ALAHooks`)."""

    name = "fedala"


def ala_keys(arrays: Arrays, layers: int) -> list[str]:
    """LoRA keys of the top ``layers`` decoder layers that hold LoRA (FedALA's mixed part), sorted.

    Args:
        arrays: the payload.
        layers: how many top layers (``fedala.layers``).

    Returns:
        The keys.
    """
    lora = [k for k in arrays if rank_dim(k) is not None and layer_of(k) is not None]
    top = sorted({layer_of(k) for k in lora}, reverse=True)[: max(layers, 0)]
    return sorted(k for k in lora if layer_of(k) in top)


def ala_mix(global_arrays: Arrays, local: Arrays, weights: Arrays) -> Arrays:
    """theta_hat = theta_local + (theta_global - theta_local) * W on the keys of ``weights`` (FedALA eq. 5).

    Args:
        global_arrays: theta_global, {key: tensor}.
        local: theta_local on (at least) the keys of ``weights``.
        weights: W, each of its array's shape, in [0, 1].

    Returns:
        theta_hat on the keys of ``weights``, theta_global elsewhere.
    """
    out = dict(global_arrays)
    for k, w in weights.items():
        out[k] = torch.lerp(local[k], global_arrays[k], w)  # exact at W = 0 and W = 1
    return out


class ALAHooks(ClientHooks):
    """Learn W after the global arrays are loaded, keep the trained LoRA as the local model, evaluate the mix.

    Args:
        options: ``[fedala]``.
    """

    keeps_state = True

    def __init__(self, options: FedALAOptions):
        self.o = options

    def after_load(self, ctx: FitContext, arrays: Arrays) -> dict[str, float]:
        """Learn W over ``steps`` batches (eq. 6), then load theta_hat; returns ``ala_loss``.

        W <- clip(W - eta * dL/dtheta_hat * (theta_global - theta_local), 0, 1) over batches of the
        seed rule's stream ``ala_weights``. The first round a client takes part it has no local
        model yet and starts from the global one. ``ala_loss`` is the mean loss over the ALA steps,
        nats per token (absent when skipped).
        """
        local = ctx.state.get(ALA_LOCAL)
        keys = ala_keys(arrays, self.o.layers)
        if local is None or not keys:
            return {}
        weights = ctx.state.get(ALA_W) or {k: torch.ones_like(arrays[k]) for k in keys}
        modules = lora_modules(ctx.model)
        params = {}
        for k in keys:
            name, kind = module_of(k)
            params[k] = getattr(modules[name], kind).weight
        losses = []
        for p in params.values():
            p.requires_grad_(True)
        for batch in ctx.batches(self.o.steps, "ala_weights"):
            with torch.no_grad():
                for k, p in params.items():
                    p.copy_(torch.lerp(local[k], arrays[k], weights[k]))
                    p.grad = None
            loss = batch.loss(ctx.model)
            loss.backward()
            losses.append(loss.item())
            with torch.no_grad():
                for k, p in params.items():
                    # the weights live in host memory with the arrays (the model may sit on a GPU)
                    weights[k] = (weights[k] - self.o.eta * p.grad.cpu() * (arrays[k] - local[k])).clamp(0.0, 1.0)
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(torch.lerp(local[k], arrays[k], weights[k]))
                p.grad = None
                p.requires_grad_(False)
        ctx.state[ALA_W] = weights
        return {"ala_loss": sum(losses) / len(losses)} if losses else {}

    def reply_arrays(self, ctx: FitContext, out: Arrays) -> Arrays:
        """Remember the trained LoRA as the client's local model for its next round; send it all."""
        ctx.state[ALA_LOCAL] = {k: v.clone() for k, v in out.items() if rank_dim(k) is not None}
        return out

    def evaluation_arrays(self, state: dict[str, Arrays], arrays: Arrays) -> Arrays:
        """The global arrays mixed with the client's local model by its last weights (FedALA eq. 5)."""
        if not arrays or ALA_W not in state or ALA_LOCAL not in state:
            return arrays
        return ala_mix(arrays, state[ALA_LOCAL], state[ALA_W])


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> FedALA:
    return FedALA(lora_settings(cfg), cfg.section("fedala"))


IMPLEMENTATION = lora_implementation(_strategy, hooks=lambda cfg: ALAHooks(cfg.section("fedala")))
