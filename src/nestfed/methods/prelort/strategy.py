"""prelort: the server strategy and the client hooks (the method is declared in nestfed.methods.prelort)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from nestfed.config import ExperimentConfig
from nestfed.federation.aggregation import truncate_rank, weighted_mean
from nestfed.federation.hooks import ClientHooks, FitContext
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState, Reply
from nestfed.federation.robust import Block, BlockRule
from nestfed.federation.secure_sum import SecureSum, segment_mean
from nestfed.federation.strategy import LoraStrategy, copy_state, examples, lora_keys, reply_rank
from nestfed.federation.training import Batch, rows_batch
from nestfed.methods.implementation import lora_implementation, lora_settings
from nestfed.methods.zeropad.strategy import ZeroPad
from nestfed.nn.keys import rank_dim
from nestfed.nn.lora import active_rank
from nestfed.seeds import stream_seed


def segments(ranks: Sequence[int]) -> list[tuple[int, int]]:
    """The rank segments [r_{l-1}, r_l) of the sorted distinct ranks, r_0 = 0.

    ``segments([4, 2, 8, 4]) == [(0, 2), (2, 4), (4, 8)]``.

    Args:
        ranks: the ranks (repeats allowed).

    Returns:
        The segments, in order.
    """
    bounds = sorted(set(int(r) for r in ranks))
    return list(zip([0] + bounds[:-1], bounds))


def segment_average(
    global_t: torch.Tensor,
    client_ts: Sequence[torch.Tensor],
    client_ranks: Sequence[int],
    weights: Sequence[float],
    dim: int,
    bounds: Sequence[tuple[int, int]],
    dilution: float = 0.0,
) -> torch.Tensor:
    """Segment-wise aggregation in update space (arXiv 2606.15963, section 2.3), optionally diluted.

    For each segment [lo, hi) the update of the clients with r_k >= hi is averaged with weights n_k,
    scaled by `segment_weight` (1 at the paper's ``dilution = 0``) and added to the global
    segment; a segment no participating client reaches is left unchanged.

    Args:
        global_t: the global matrix, rank r_max along ``dim``.
        client_ts: client k's trained matrix of rank client_ranks[k] along ``dim`` (started from
            global_t's prefix).
        client_ranks: the rank each client trained.
        weights: the n_k.
        dim: the rank dimension (0 for A, 1 for B).
        bounds: the segments (`segments` of the federation's ranks).
        dilution: the exponent of `segment_weight`.

    Returns:
        The new global matrix, global_t's shape.
    """
    out = global_t.clone()
    total = float(sum(weights))
    for lo, hi in bounds:
        members = [k for k, r in enumerate(client_ranks) if r >= hi]
        if not members:
            continue
        g = global_t.narrow(dim, lo, hi - lo)
        deltas = [client_ts[k].narrow(dim, lo, hi - lo) - g for k in members]
        w = segment_weight(float(sum(weights[k] for k in members)), total, dilution)
        out.narrow(dim, lo, hi - lo).copy_(g + w * weighted_mean(deltas, [weights[k] for k in members]))
    return out


def segment_weight(held: float, total: float, dilution: float) -> float:
    """The factor a segment's mean update is scaled by: (N_l / N)^dilution.

    ``dilution`` 0: the paper's segment-wise mean (1); 1: the mean diluted over every client, as
    ZeroPad dilutes the rows few clients hold (in update space: sum over holders of n_k delta_k /
    N); in between, a shrinkage of the segments few clients hold. Equal ranks give 1 for any
    dilution (FedAvg).

    Args:
        held: N_l, the examples of the round's clients that hold the segment.
        total: N, those of every client of the round.
        dilution: the exponent, in [0, 1].

    Returns:
        The factor, in (0, 1].
    """
    if dilution == 0.0 or held >= total:
        return 1.0
    return float((held / total) ** dilution)


def deploy_cap(ranks: dict[str, int], min_holders: int) -> int:
    """The largest rank any client deploys under ``[prelort] min_holders``.

    The top ``hi`` of the federation's segments [lo, hi) held by at least ``min_holders`` clients
    (r_k >= hi). The lowest segment is always kept, and ``min_holders`` <= 1 keeps every segment
    (r_max of the federation). ``deploy_cap({"0": 2, "1": 4, "2": 4, "3": 8, "4": 16}, 2) == 8``:
    [8, 16) has one holder.

    Args:
        ranks: {cid: r_k} of every client.
        min_holders: ``[prelort] min_holders``.

    Returns:
        The rank.
    """
    bounds = sorted({int(r) for r in ranks.values()})
    if min_holders <= 1:
        return bounds[-1]
    held = [hi for hi in bounds if sum(int(r) >= hi for r in ranks.values()) >= min_holders]
    return held[-1] if held else bounds[0]


class PreLort(LoraStrategy):
    """Nested sub-rank training plus segment-wise aggregation over R_fed."""

    name = "prelort"

    def federation_ranks(self, state: GlobalState) -> list[int]:
        """R_fed: the sorted distinct ranks of every client in the federation.

        Read once per ranks table: a round asks for every sampled client, and a federation may hold
        thousands.

        Args:
            state: the global state (its meta's ``ranks``).

        Returns:
            The ranks, ascending.
        """
        table = state.meta["ranks"]
        if getattr(self, "_rfed", (None,))[0] is not table:
            self._rfed = (table, sorted({int(r) for r in table.values()}))
        return list(self._rfed[1])

    def client_config(self, rnd: int, state: GlobalState, client: ClientInfo, rank: int) -> dict[str, Any]:
        """``subranks``: R_k, the federation's ranks up to the rank the client trains this round.

        That rank is its own, or an elastic rank below it (one of the federation's ranks,
        nestfed.federation.population).
        """
        return {"subranks": [r for r in self.federation_ranks(state) if r <= rank]}

    @property
    def zero_padded(self) -> bool:
        """Whether this run aggregates as ZeroPad does (the ablation ``aggregation = "zeropad"``)."""
        return self.options is not None and self.options.aggregation == "zeropad"

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """`segment_average` of every LoRA matrix over R_fed's segments.

        ZeroPad's mean under ``aggregation = "zeropad"``.
        """
        if self.zero_padded:
            return ZeroPad(self.s).aggregate(rnd, state, replies)
        new = copy_state(state)
        n = examples(replies)
        cids = sorted(replies)
        ranks = [reply_rank(replies[c]) for c in cids]  # the rank each trained this round (elastic ranks)
        bounds = segments(self.federation_ranks(state))
        for key in lora_keys(state.arrays):
            new.arrays[key] = segment_average(
                state.arrays[key],
                [replies[c].arrays[key] for c in cids],
                ranks,
                [n[c] for c in cids],
                rank_dim(key),
                bounds,
                self.dilution,
            )
        return new

    @property
    def dilution(self) -> float:
        """``[prelort] dilution`` (`segment_weight`); 0 without options."""
        return 0.0 if self.options is None else float(self.options.dilution)

    @property
    def min_holders(self) -> int:
        """``[prelort] min_holders`` (`deploy_cap`); 0 without options."""
        return 0 if self.options is None else int(self.options.min_holders)

    def deploy(self, state: GlobalState, cid: int | None = None) -> tuple[Arrays, float]:
        """Client ``cid``'s prefix, at most `deploy_cap`'s rank under ``min_holders``, at its scale.

        None: the global adapter at that cap.
        """
        if self.min_holders <= 1:
            return super().deploy(state, cid)
        r = self.s.r_max if cid is None else self.rank_of(state, cid)
        r = min(r, deploy_cap(state.meta["ranks"], self.min_holders))
        return truncate_rank(state.arrays, r), self.s.scale(r)

    def export(self, state: GlobalState) -> tuple[Arrays, float]:
        """The global adapter at r_max, the segments above `deploy_cap`'s rank zeroed under ``min_holders``.

        So every prefix a client exports (``nestfed export --rank``) leaves them out, its function
        that of `deploy` for no client (under ``rank`` scaling the kept B columns carry s(cap)
        / s(r_max)).
        """
        arrays, scale = super().export(state)
        if self.min_holders > 1:
            cap = deploy_cap(state.meta["ranks"], self.min_holders)
            gain = self.s.scale(cap) / scale  # 1 under fixed scaling; under rank scaling s(cap) / s(r_max)
            for k, v in arrays.items():
                d = rank_dim(k)
                if d is not None and v.shape[d] > cap:
                    v.narrow(d, cap, v.shape[d] - cap).zero_()
                    if gain != 1.0 and k.endswith("lora_B.weight"):
                        v.narrow(d, 0, cap).mul_(gain)
        return arrays, scale

    def robust_aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply], rule: BlockRule) -> GlobalState:
        """Rank-aware robust aggregation: one block per rank segment [lo, hi), added to the global segment.

        Its members are the replying clients with r_k >= hi, its holders every client of the
        federation with r_k >= hi (docs/trust.md).
        """
        new = copy_state(state)
        n = examples(replies)
        ranks = {c: reply_rank(replies[c]) for c in replies}
        everyone = [int(r) for r in state.meta["ranks"].values()]
        keys = lora_keys(state.arrays)
        total = float(sum(n.values()))
        for lo, hi in segments(self.federation_ranks(state)):
            members = sorted(c for c in replies if ranks[c] >= hi)
            if not members:
                continue
            start = {k: state.arrays[k].narrow(rank_dim(k), lo, hi - lo) for k in keys}
            deltas = {
                c: {k: replies[c].arrays[k].narrow(rank_dim(k), lo, hi - lo) - start[k] for k in keys} for c in members
            }
            block = Block(
                f"rank {lo}:{hi}", deltas, {c: n[c] for c in members}, sum(r >= hi for r in everyone), start, start
            )
            w = segment_weight(float(sum(n[c] for c in members)), total, self.dilution)
            for k, v in rule(block).items():
                new.arrays[k].narrow(rank_dim(k), lo, hi - lo).copy_(start[k] + w * (v - start[k]) if w != 1.0 else v)
        return new

    def aggregate_secure(self, rnd: int, state: GlobalState, secure: SecureSum) -> GlobalState:
        """`aggregate` from secure sums alone: each rank row's n_k-weighted mean update over its holders.

        That is its segment's mean (nestfed.federation.secure_sum), diluted as
        `segment_weight` says.
        """
        if self.zero_padded:
            return ZeroPad(self.s).aggregate_secure(rnd, state, secure)
        new = copy_state(state)
        for key, s in secure.sums.items():
            new.arrays[key] = segment_mean(state.arrays[key], s, secure.counts, rank_dim(key))
        if self.dilution:  # each rank row's count is its segment's N_l (row 0: every client's N)
            c = secure.counts.to(torch.float64)
            w = [segment_weight(float(c[j]), float(c[0]), self.dilution) for j in range(len(c))]
            for key in secure.sums:
                g, d = state.arrays[key], rank_dim(key)
                rows = torch.ones(g.shape[d], dtype=torch.float64)  # rows past the counts: no holder, unchanged
                rows[: len(w)] = torch.tensor(w, dtype=torch.float64)
                shape = [1] * g.dim()
                shape[d] = -1
                step = new.arrays[key].to(torch.float64) - g.to(torch.float64)
                new.arrays[key] = (g.to(torch.float64) + rows.view(shape) * step).to(g.dtype)
        return new


def nested_loss(model: torch.nn.Module, batch: Batch, subranks: Sequence[int]) -> float:
    """PreLort's local objective (arXiv 2606.15963, section 2.2), backpropagated.

    L_k = 1/|R_k| sum_{r in R_k} CE(f(.; theta, r)), one forward/backward per sub-rank r (each
    pass's graph is freed before the next).

    Args:
        model: the backbone with its LoRA layers.
        batch: one batch.
        subranks: R_k.

    Returns:
        L_k in nats per labelled token.
    """
    ranks = list(subranks)
    total = 0.0
    for r in ranks:
        with active_rank(model, r):
            loss = batch.loss(model) / len(ranks)
            loss.backward()
        total += loss.item()
    return total


def sampled_subrank(subranks: Sequence[int], seed: int, rnd: int, cid: int, step: int) -> int:
    """The sub-rank one step of the ``sampled`` objective trains: uniform over R_k.

    Drawn from the seed rule's stream ``subrank/<step>`` of (seed, round, client), so E_r[CE(f(.;
    theta, r))] is the nested loss L_k (arXiv 2606.15963, section 2.2) and a resumed run draws the
    same sub-ranks.

    Args:
        subranks: R_k.
        seed: the federation's seed.
        rnd: the round.
        cid: the client.
        step: the local step.

    Returns:
        The sub-rank.

    Raises:
        ValueError: for an empty ``subranks``.
    """
    ranks = list(subranks)
    if not ranks:
        raise ValueError("subranks is empty: a client trains at least its own rank")
    rng = np.random.default_rng(stream_seed(seed, rnd, cid, f"subrank/{step}"))
    return int(ranks[int(rng.integers(len(ranks)))])


class PreLortHooks(ClientHooks):
    """The local objective over the sub-ranks R_k the strategy sends (``subranks``).

    Nested (every sub-rank, `nested_loss`), sampled (one drawn sub-rank per step,
    `sampled_subrank`) or the plain loss at the client's rank (``full_rank``).

    With ``validation_rows`` > 0 (``[prelort] deploy_rank = "validated"``) the client holds that
    many of its training rows out of training (the same rows every round: the seed rule's stream
    ``validation`` of (federation seed, client)), measures the received global adapter's loss on
    them at every r in R_k, keeps the best r (ties: the larger) in its state and runs the deployed
    adapter cut to it (`evaluation_arrays`, so evaluation and ``nestfed export --client``
    follow it). The choice never leaves the client.

    Args:
        objective: ``nested``, ``sampled`` or ``full_rank``.
        validation_rows: rows held out to choose the deploy rank; 0 = none (the client runs r_k).
        rank_scaling: lora.scaling = "rank" (s = lora_alpha / r), where a cut to r' rescales B by r
            / r'.
    """

    def __init__(self, objective: str = "nested", validation_rows: int = 0, rank_scaling: bool = False):
        self.objective = objective
        self.validation_rows = validation_rows
        self.rank_scaling = rank_scaling
        self.keeps_state = validation_rows > 0

    def after_load(self, ctx: FitContext, arrays: Arrays) -> dict[str, float]:
        """Hold the validation rows out and choose the deploy rank on them (class docstring).

        Returns ``deploy_rank`` and ``validation_loss@<r>`` (nats per labelled token).
        """
        n = ctx.data.num_examples
        v = min(self.validation_rows, n - 1)
        if v < 1 or "subranks" not in ctx.config:
            return {}
        g = torch.Generator().manual_seed(stream_seed(ctx.seed, 0, ctx.cid, "validation"))
        order = torch.randperm(n, generator=g)
        held, kept = order[:v].sort().values, order[v:].sort().values
        d = ctx.data
        ctx.data = replace(
            d,
            train_ids=d.train_ids[kept],
            train_labels=d.train_labels[kept],
            train_hidden=None if d.train_hidden is None else d.train_hidden[kept],
        )
        batch = rows_batch(d, held)
        ctx.model.eval()
        losses = {}
        with torch.no_grad():
            for r in ctx.config["subranks"]:
                with active_rank(ctx.model, r):
                    losses[int(r)] = float(batch.loss(ctx.model))
        best = self.choose(losses)
        ctx.state["deploy"] = {"rank": torch.tensor([best])}
        return {"deploy_rank": float(best), **{f"validation_loss@{r}": x for r, x in losses.items()}}

    @staticmethod
    def choose(losses: dict[int, float]) -> int:
        """The deploy rank: the lowest validation loss, ties to the larger r.

        Args:
            losses: {r: validation loss}.

        Returns:
            The rank.
        """
        return min(losses, key=lambda r: (losses[r], -r))

    def evaluation_arrays(self, state: dict[str, Arrays], arrays: Arrays) -> Arrays:
        """The deployed arrays cut to the client's chosen rank.

        As deployed when it chose none, or a rank at or above theirs.
        """
        if "deploy" not in state:
            return arrays
        r = int(state["deploy"]["rank"][0])
        have = max((v.shape[rank_dim(k)] for k, v in arrays.items() if rank_dim(k) is not None), default=0)
        if r >= have:
            return arrays
        out = truncate_rank(arrays, r)
        if self.rank_scaling:  # s(r) / s(have) = have / r, carried by B
            out = {k: v * (have / r) if k.endswith("lora_B.weight") else v for k, v in out.items()}
        return out

    def before_step(self, ctx: FitContext, step: int) -> None:
        """Remember the step (the sampled objective's draw depends on it)."""
        ctx.scratch["step"] = step

    def step_loss(self, ctx: FitContext, batch: Batch) -> float:
        """The configured objective on one batch, backpropagated; returns its value (nats/token)."""
        subranks = ctx.config["subranks"]
        if self.objective == "full_rank":
            subranks = [max(subranks)]
        elif self.objective == "sampled":
            subranks = [sampled_subrank(subranks, ctx.seed, ctx.round, ctx.cid, ctx.scratch["step"])]
        return nested_loss(ctx.model, batch, subranks)


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> PreLort:
    return PreLort(lora_settings(cfg), cfg.section("prelort"))


def _hooks(cfg: ExperimentConfig) -> PreLortHooks:
    o = cfg.section("prelort")
    rows = o.validation_rows if o.deploy_rank == "validated" else 0
    return PreLortHooks(o.objective, rows, cfg.lora.scaling == "rank")


IMPLEMENTATION = lora_implementation(_strategy, hooks=_hooks)
