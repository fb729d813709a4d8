"""HetLoRA (Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation
Models", EMNLP 2024): zero-padding plus sparsity-weighted aggregation plus rank self-pruning.

- Local rank self-pruning: the client adds lambda * sum_layers ||s B_tail A_tail||_F to its loss,
  where the tail is the last ceil(tail * r_k) rank dimensions, and after local training prunes its
  rank to max(1, floor(prune_ratio * r_k)) when the tail's norm fell below its value in the
  client's previous round. It then sends the smaller adapter and keeps the smaller rank.
- Server: every reply zero-padded to r_max and averaged with weights proportional to the Frobenius
  norm of the client's update ||s B_k A_k||_F per layer (``weighting = "norm"``; ``"examples"``
  uses n_k, which with equal ranks and no pruning is exactly FedAvg). Each client then receives
  the global adapter truncated to its current rank.

Options: section ``[hetlora]`` (:class:`HetLoRAOptions`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nestfed.config import ExperimentConfig
from nestfed.federation.aggregation import lowrank_norm, pad_rank, weighted_mean
from nestfed.federation.hooks import ClientHooks, FitContext
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState, Reply
from nestfed.federation.robust import BlockRule
from nestfed.federation.strategy import LoraSettings, LoraStrategy, copy_state, examples, lora_keys
from nestfed.federation.training import Batch
from nestfed.methods.method import lora_method, lora_settings
from nestfed.nn.keys import rank_dim
from nestfed.nn.lora import lora_modules

WEIGHTINGS = ("norm", "examples")


@dataclass(frozen=True)
class HetLoRAOptions:
    """reg: lambda, the weight of the rank self-pruning regulariser (>= 0); tail: the fraction of
    the rank it regularises, in (0, 1]; prune_ratio: the rank kept when pruning, in (0, 1];
    weighting: ``norm`` (Frobenius norm of each update) or ``examples`` (n_k); pruning: whether
    clients prune their rank at all."""

    reg: float = 0.01
    tail: float = 0.25
    prune_ratio: float = 0.9
    weighting: str = "norm"
    pruning: bool = True

    def __post_init__(self) -> None:
        if self.reg < 0:
            raise ValueError(f"reg must be >= 0, got {self.reg}")
        if not 0 < self.tail <= 1:
            raise ValueError(f"tail must be in (0, 1], got {self.tail}")
        if not 0 < self.prune_ratio <= 1:
            raise ValueError(f"prune_ratio must be in (0, 1], got {self.prune_ratio}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be 'norm' or 'examples', got '{self.weighting}'")


def tail_size(rank: int, tail: float) -> int:
    """HetLoRA's number of regularised tail dimensions: ceil(tail * rank), 0 when rank is 1."""
    return 0 if rank <= 1 else min(rank - 1, max(1, math.ceil(tail * rank)))


def tail_norm(model: nn.Module, tail: float) -> torch.Tensor:
    """sum over LoRA layers of ||s B[:, r-t:] A[r-t:]||_F with t = :func:`tail_size` (a 0-dim
    tensor, differentiable)."""
    modules = lora_modules(model)
    total = torch.zeros((), device=next(iter(modules.values())).lora_A.weight.device if modules else None)
    for m in modules.values():
        t = tail_size(m.rank, tail)
        if t == 0:
            continue
        A, B = m.lora_A.weight[m.rank - t:], m.lora_B.weight[:, m.rank - t:]
        total = total + m.scaling * lowrank_norm(B, A)
    return total


class HetLoRA(LoraStrategy):
    """Zero-padded, norm-weighted aggregation; remembers each client's pruned rank and tail norm."""

    name = "hetlora"

    def __init__(self, settings: LoraSettings, options: HetLoRAOptions = HetLoRAOptions()):
        super().__init__(settings, options)
        self.o = options

    @property
    def may_shrink_rank(self) -> bool:  # type: ignore[override]
        return self.o.pruning

    def client_config(self, rnd: int, state: GlobalState, client: ClientInfo, rank: int) -> dict[str, Any]:
        """``hetlora_prev_tail``: the client's tail norm after its last round (-1 before its first)."""
        prev = state.meta.get("tail_norms", {}).get(str(client.cid))
        return {"hetlora_prev_tail": -1.0 if prev is None else float(prev)}

    @staticmethod
    def remember(new: GlobalState, replies: dict[int, Reply]) -> None:
        """Keep each replying client's (possibly pruned) rank and tail norm for the next round."""
        for c in sorted(replies):
            a_key = next(k for k in replies[c].arrays if k.endswith("lora_A.weight"))
            new.meta["ranks"][str(c)] = int(replies[c].arrays[a_key].shape[0])
            if "tail_norm" in replies[c].metrics:
                new.meta.setdefault("tail_norms", {})[str(c)] = float(replies[c].metrics["tail_norm"])

    def robust_aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply], rule: BlockRule) -> GlobalState:
        """The padded block of :meth:`LoraStrategy.robust_aggregate` (norm weights replaced by the
        rule), with pruned ranks remembered."""
        new = super().robust_aggregate(rnd, state, replies, rule)
        self.remember(new, replies)
        return new

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        new = copy_state(state)
        n = examples(replies)
        cids = sorted(replies)
        self.remember(new, replies)
        for key in lora_keys(state.arrays):
            if not key.endswith("lora_A.weight"):
                continue
            b_key = key[: -len("lora_A.weight")] + "lora_B.weight"
            weights = [n[c] for c in cids]
            if self.o.weighting == "norm":
                norms = []
                for c in cids:
                    A, B = replies[c].arrays[key], replies[c].arrays[b_key]
                    norms.append(self.s.scale(A.shape[0]) * float(lowrank_norm(B, A)))
                if sum(norms) > 0:
                    weights = norms
            for k in (key, b_key):
                d = rank_dim(k)
                padded = [pad_rank(replies[c].arrays[k], d, self.s.r_max) for c in cids]
                new.arrays[k] = weighted_mean(padded, weights)
        return new


class HetLoRAHooks(ClientHooks):
    """CE + lambda * tail norm; after the local steps, prune the rank when the tail norm fell
    below its value in the client's previous round (``hetlora_prev_tail``, sent by the strategy)."""

    def __init__(self, options: HetLoRAOptions):
        self.o = options

    def step_loss(self, ctx: FitContext, batch: Batch) -> float:
        """Backpropagates CE + lambda * tail norm; returns the CE alone (nats per token)."""
        loss = batch.loss(ctx.model)
        total = loss + batch.share * self.o.reg * tail_norm(ctx.model, self.o.tail) if self.o.reg > 0 else loss
        total.backward()
        return loss.item()

    def after_steps(self, ctx: FitContext) -> dict[str, float]:
        """Metrics ``tail_norm`` (after any pruning) and ``pruned`` (rank dimensions removed)."""
        with torch.no_grad():
            norm = float(tail_norm(ctx.model, self.o.tail))
        prev = float(ctx.config.get("hetlora_prev_tail", -1.0))
        r = int(ctx.config["rank"])
        pruned = 0.0
        if self.o.pruning and prev >= 0 and norm < prev and r > 1:
            new_r = max(1, math.floor(self.o.prune_ratio * r))
            if new_r < r:
                for m in lora_modules(ctx.model).values():
                    m.set_weights(m.lora_A.weight[:new_r], m.lora_B.weight[:, :new_r])
                with torch.no_grad():
                    norm = float(tail_norm(ctx.model, self.o.tail))
                pruned = float(r - new_r)
        return {"tail_norm": norm, "pruned": pruned}


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> HetLoRA:
    return HetLoRA(lora_settings(cfg), cfg.section("hetlora"))


METHOD = lora_method("hetlora", "zero-pad, weights proportional to each update's Frobenius norm, rank "
                     "self-pruning regulariser and pruning on the client (Cho et al. 2024)", _strategy,
                     hooks=lambda cfg: HetLoRAHooks(cfg.section("hetlora")), sections={"hetlora": HetLoRAOptions})
