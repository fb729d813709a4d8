"""hetlora: the server strategy and the client hooks (the method is declared in nestfed.methods.hetlora)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from nestfed.config import ExperimentConfig
from nestfed.federation.aggregation import lowrank_norm, pad_rank, weighted_mean
from nestfed.federation.hooks import ClientHooks, FitContext
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState, Reply
from nestfed.federation.robust import BlockRule
from nestfed.federation.strategy import LoraSettings, LoraStrategy, copy_state, examples, lora_keys, reply_rank
from nestfed.federation.training import Batch
from nestfed.methods.hetlora import HetLoRAOptions
from nestfed.methods.implementation import lora_implementation, lora_settings
from nestfed.nn.keys import rank_dim
from nestfed.nn.lora import lora_modules


def tail_size(rank: int, tail: float) -> int:
    """HetLoRA's number of regularised tail dimensions: ceil(tail * rank), 0 when rank is 1.

    Args:
        rank: the client's rank r_k.
        tail: the regularised fraction (``hetlora.tail``).

    Returns:
        The tail's dimensions, at most rank - 1.
    """
    return 0 if rank <= 1 else min(rank - 1, max(1, math.ceil(tail * rank)))


def tail_norm(model: nn.Module, tail: float) -> torch.Tensor:
    """sum over LoRA layers of ||s B[:, r-t:] A[r-t:]||_F with t = `tail_size`.

    Args:
        model: the backbone with its LoRA layers.
        tail: the regularised fraction (``hetlora.tail``).

    Returns:
        The norm, a 0-dim differentiable tensor.
    """
    modules = lora_modules(model)
    total = torch.zeros((), device=next(iter(modules.values())).lora_A.weight.device if modules else None)
    for m in modules.values():
        t = tail_size(m.rank, tail)
        if t == 0:
            continue
        A, B = m.lora_A.weight[m.rank - t :], m.lora_B.weight[:, m.rank - t :]
        total = total + m.scaling * lowrank_norm(B, A)
    return total


class HetLoRA(LoraStrategy):
    """Zero-padded, norm-weighted aggregation; remembers each client's pruned rank and tail norm.

    Args:
        settings: the LoRA numbers.
        options: ``[hetlora]``.
    """

    name = "hetlora"

    def __init__(self, settings: LoraSettings, options: HetLoRAOptions = HetLoRAOptions()):
        super().__init__(settings, options)
        self.o = options
        self.sent_rank: dict[int, int] = {}  # the rank each client was sent in the round being configured

    @property
    def may_shrink_rank(self) -> bool:  # type: ignore[override]
        """Whether replies may come back at a lower rank: when clients prune (``hetlora.pruning``)."""
        return self.o.pruning

    def client_config(self, rnd: int, state: GlobalState, client: ClientInfo, rank: int) -> dict[str, Any]:
        """``hetlora_prev_tail``: the client's tail norm after its last round.

        It is -1 (no pruning) before its first round, when that round trained another rank, and in a
        round at an elastic rank below its own (pruning decides the client's own rank, which a round
        of less memory says nothing of).
        """
        prev = state.meta.get("tail_norms", {}).get(str(client.cid))
        prev_rank = state.meta.get("tail_ranks", {}).get(str(client.cid), rank)
        own = self.rank_of(state, client.cid)
        self.sent_rank[client.cid] = rank
        comparable = prev is not None and prev_rank == rank and rank == own
        return {"hetlora_prev_tail": float(prev) if comparable else -1.0}

    def remember(self, new: GlobalState, replies: dict[int, Reply]) -> None:
        """Keep each replying client's pruned rank and its tail norm in the state's meta.

        A reply below the rank it was sent, which was its own, is a pruned rank (clients prune only
        at their own rank); the tail norm is kept with the rank it was measured at.

        Args:
            new: the state being aggregated (its meta is updated in place).
            replies: {cid: reply} of this round.
        """
        for c in sorted(replies):
            r = reply_rank(replies[c])
            own = int(new.meta["ranks"][str(c)])
            if r < self.sent_rank.get(c, own) == own:
                new.meta["ranks"][str(c)] = r
            if "tail_norm" in replies[c].metrics:
                new.meta.setdefault("tail_norms", {})[str(c)] = float(replies[c].metrics["tail_norm"])
                new.meta.setdefault("tail_ranks", {})[str(c)] = r

    def robust_aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply], rule: BlockRule) -> GlobalState:
        """LoraStrategy's padded block (norm weights replaced by the rule), pruned ranks remembered."""
        new = super().robust_aggregate(rnd, state, replies, rule)
        self.remember(new, replies)
        return new

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """Zero-pad every reply to r_max, average with norm (or n_k) weights per layer, remember pruned ranks."""
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
                    norm = float(lowrank_norm(B, A))
                    if not math.isfinite(norm):  # overflowed in float32: float64 cannot (entries < 3.4e38 give < 1e160)
                        norm = float(lowrank_norm(B.double(), A.double()))
                    norms.append(self.s.scale(A.shape[0]) * norm)
                if sum(norms) > 0:
                    weights = norms
            for k in (key, b_key):
                d = rank_dim(k)
                padded = [pad_rank(replies[c].arrays[k], d, self.s.r_max) for c in cids]
                new.arrays[k] = weighted_mean(padded, weights)
        return new


class HetLoRAHooks(ClientHooks):
    """CE + lambda * tail norm; after the local steps, prune the rank when the tail norm fell.

    The rank is pruned when the tail norm fell below its value in the client's previous round
    (``hetlora_prev_tail``, sent by the strategy).

    Args:
        options: ``[hetlora]``.
    """

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


IMPLEMENTATION = lora_implementation(_strategy, hooks=lambda cfg: HetLoRAHooks(cfg.section("hetlora")))
