"""fed_plora: the server strategy (the method is declared in nestfed.methods.fed_plora, whose
docstring gives the paper's rule and every decision).

The clients run the default client hooks: the payload already holds the fold (the trainable LoRA
is the client's selected modules, the frozen residual the others), so a client trains plain LoRA
of rank r_k on top of a residual and replies with its r_k modules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from nestfed.config import ExperimentConfig, check_rank
from nestfed.federation.aggregation import weighted_mean
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState, Instruction, Reply
from nestfed.federation.robust import Block, BlockRule
from nestfed.federation.strategy import LoraSettings, LoraStrategy, copy_state, examples, lora_keys, reply_rank
from nestfed.methods.fed_plora import FedPLoRAOptions
from nestfed.methods.implementation import lora_implementation, lora_settings
from nestfed.nn.keys import merged_key, module_of, peft_key, rank_dim
from nestfed.seeds import stream_seed

#: the instruction config key carrying the modules a client trains (sorted module indices)
MODULES = "fed_plora_modules"
#: the seed rule's stream the random selection draws from
STREAM = "fed_plora_select"


class ModuleGroup(NamedTuple):
    """Modules trained by the same clients in one round.

    Attributes:
        members: those clients (indices into the round's sorted replies).
        modules: the module indices j (ascending).
        rows: for each member, the positions of ``modules`` in its reply (its selection's order).
    """

    members: list[int]
    modules: list[int]
    rows: list[list[int]]


def selection(seed: int, rnd: int, cid: int, r_max: int, rank: int, rule: str = "random") -> list[int]:
    """Select the rank-1 modules a client trains in a round.

    ``rank == r_max`` gives every module under both rules.

    Args:
        seed: the federation's seed.
        rnd: the round.
        cid: the client.
        r_max: R, the number of modules.
        rank: r_k, how many it trains.
        rule: ``random`` (the paper's): a uniform draw without replacement from the seed rule's
            stream ``fed_plora_select`` of (seed, rnd, cid), the first ``rank`` of a permutation;
            ``prefix``: range(rank).

    Returns:
        The sorted indices K (``rank`` of range(r_max)).

    Raises:
        ValueError: for a rank outside [1, r_max] or an unknown rule.
    """
    check_rank(rank, r_max)
    if rule not in ("random", "prefix"):
        raise ValueError(f"unknown selection rule '{rule}'")
    if rule == "prefix" or rank == r_max:
        return list(range(rank))
    rng = np.random.default_rng(stream_seed(seed, rnd, cid, STREAM))
    return sorted(int(j) for j in rng.permutation(r_max)[:rank])


def _rows(t: torch.Tensor, dim: int, idx: Sequence[int]) -> torch.Tensor:
    """``t``'s rows ``idx`` along ``dim``: a view when idx is range(len(idx)), else a copy."""
    if list(idx) == list(range(len(idx))):
        return t.narrow(dim, 0, len(idx))
    return t.index_select(dim, torch.tensor(list(idx), dtype=torch.long))


def fold_payload(arrays: Arrays, modules: Sequence[int], scale: float) -> Arrays:
    """Build Select-N-Fold's payload for a client from the global adapter.

    W^0 + merged_B merged_A + s B[:, K] A[K] is then the global W^0 + s B A.

    Args:
        arrays: the global adapter (A [R, in], B [out, R] per layer).
        modules: K, the client's modules (sorted, in [0, R)).
        scale: the global scale s.

    Returns:
        The trainable LoRA A[K] [r, in], B[:, K] [out, r] and, when r < R, the other modules as
        the layer's frozen residual ``merged_A`` = A[not K] [R - r, in], ``merged_B`` =
        s B[:, not K] [out, R - r]. Arrays without a rank dimension pass through.

    Raises:
        KeyError: for a layer with A and no B.
    """
    out: Arrays = {k: v for k, v in arrays.items() if rank_dim(k) is None}
    for a_key in sorted(k for k in arrays if k.endswith("lora_A.weight")):
        module = module_of(a_key)[0]
        b_key = peft_key(module, "lora_B")
        A, B = arrays[a_key], arrays[b_key]
        kept = set(modules)
        rest = [j for j in range(A.shape[0]) if j not in kept]
        out[a_key], out[b_key] = _rows(A, 0, modules), _rows(B, 1, modules)
        if rest:
            out[merged_key(module, "A")] = _rows(A, 0, rest)
            out[merged_key(module, "B")] = _rows(B, 1, rest) * scale
    return out


def module_groups(selections: Sequence[Sequence[int]], r_max: int) -> list[ModuleGroup]:
    """Group every module j < r_max some client trained by Q_j, the clients whose selection holds j.

    ``module_groups([[0, 2], [2]], 3)`` is [([0], [0], [[0]]), ([0, 1], [2], [[1], [0]])]: module 1
    has no client, module 2 is row 1 of the first reply and row 0 of the second.

    Args:
        selections: each client's sorted modules.
        r_max: R, the number of modules.

    Returns:
        The groups (members index ``selections``), in order of each group's first module.
    """
    holders: dict[int, list[int]] = {}
    for k, sel in enumerate(selections):
        for j in sel:
            holders.setdefault(int(j), []).append(k)
    grouped: dict[tuple[int, ...], list[int]] = {}
    for j in range(r_max):
        if j in holders:
            grouped.setdefault(tuple(holders[j]), []).append(j)
    out = []
    for members, modules in grouped.items():
        pos = [{j: i for i, j in enumerate(selections[k])} for k in members]
        out.append(ModuleGroup(list(members), modules, [[p[j] for j in modules] for p in pos]))
    return out


class ModuleMean:
    """Fed-PLoRA's aggregation for one round, built once (the selections serve every layer).

    Module j (row j of A, column j of B) becomes sum_{k in Q_j} w_k X_k[pos_k(j)] / sum_{k in Q_j}
    w_k, Q_j the clients whose selection holds j and pos_k(j) its position in client k's sorted
    selection (reply k holds its modules in that order); a module no client trained keeps the
    global value. With one group of clients holding every module they hold (every client at r_max,
    or equal prefixes) each matrix is one `weighted_mean` of the replies, FedAvg's bit for bit;
    otherwise one mixing matrix M [R, sum_k r_k] (float64, row j the normalised weights of module
    j's rows among the stacked replies) per round, and each matrix is M times the stacked replies
    (one matmul however many clients).

    Args:
        selections: selections[k] is client k's sorted modules.
        weights: weights[k] is w_k (> 0).
        r_max: R, the number of modules.
    """

    def __init__(self, selections: Sequence[Sequence[int]], weights: Sequence[float], r_max: int):
        self.groups = module_groups(selections, r_max)
        self.weights = [float(w) for w in weights]
        self.r_max = r_max
        self.mixing: torch.Tensor | None = None
        if len(self.groups) > 1:
            offsets = np.cumsum([0] + [len(sel) for sel in selections]).tolist()
            self.mixing = torch.zeros(r_max, int(offsets[-1]), dtype=torch.float64)
            for g in self.groups:
                total = sum(self.weights[k] for k in g.members)
                for k, rows in zip(g.members, g.rows):
                    for j, p in zip(g.modules, rows):
                        self.mixing[j, offsets[k] + p] = self.weights[k] / total
        self.held = torch.tensor(sorted(j for g in self.groups for j in g.modules), dtype=torch.long)

    def __call__(self, global_t: torch.Tensor, replies: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        """The new global matrix (global_t's shape and dtype) from global_t [R, in] (dim 0) or
        [out, R] (dim 1) and replies[k] [r_k, in] or [out, r_k]; global_t is not modified."""
        out = global_t.clone()
        if self.mixing is None:
            for g in self.groups:
                parts = [_rows(replies[k], dim, rows) for k, rows in zip(g.members, g.rows)]
                mean = weighted_mean(parts, [self.weights[k] for k in g.members])
                out.index_copy_(dim, torch.tensor(g.modules, dtype=torch.long), mean)
            return out
        stacked = torch.cat(list(replies), dim).double()
        mixed = self.mixing @ stacked if dim == 0 else stacked @ self.mixing.T
        out.index_copy_(dim, self.held, mixed.index_select(dim, self.held).to(global_t.dtype))
        return out


class FedPLoRA(LoraStrategy):
    """Fed-PLoRA's strategy: the global adapter read as R = r_max rank-1 modules at the global scale s.

    Global state: one LoRA adapter of rank R (A [R, in], B [out, R] per layer); the rule is the
    module docstring of nestfed.methods.fed_plora.

    Args:
        settings: r_max, lora_alpha, scaling and seeds.
        options: ``[fed_plora]`` (None: the defaults).
    """

    name = "fed_plora"

    def __init__(self, settings: LoraSettings, options: FedPLoRAOptions | None = None):
        self.o = options if options is not None else FedPLoRAOptions()
        super().__init__(settings, self.o)

    @property
    def global_scale(self) -> float:
        """s = scale(r_max), the scale every client runs its modules and its fold at."""
        return self.s.scale(self.s.r_max)

    def modules(self, rnd: int, cid: int, rank: int) -> list[int]:
        """Give the modules a client trains in a round (`selection` under the options' rule).

        Args:
            rnd: the round.
            cid: the client.
            rank: the rank it trains.

        Returns:
            The sorted module indices.
        """
        return selection(self.s.seed, rnd, cid, self.s.r_max, rank, self.o.selection)

    def client_config(self, rnd: int, state: GlobalState, client: ClientInfo, rank: int) -> dict[str, Any]:
        """The global scale s for every client, and ``fed_plora_modules``: the sorted indices it trains."""
        return {"scaling": self.global_scale, MODULES: self.modules(rnd, client.cid, rank)}

    def configure(self, rnd: int, state: GlobalState, clients: list[ClientInfo]) -> dict[int, Instruction]:
        """Replace each base instruction's payload by the `fold_payload` of the client's modules.

        The expected reply shapes, [r_k, in] and [out, r_k], are the prefix's.
        """
        out = super().configure(rnd, state, clients)
        for ins in out.values():
            ins.arrays = fold_payload(state.arrays, ins.config[MODULES], self.global_scale)
        return out

    def weights(self, replies: dict[int, Reply]) -> dict[int, float]:
        """Give the unnormalised client weights.

        Args:
            replies: {cid: reply}.

        Returns:
            {cid: n_k} (``examples``) or {cid: 1} (``uniform``).
        """
        return {c: 1.0 for c in replies} if self.o.weighting == "uniform" else examples(replies)

    def selections(self, rnd: int, cids: Sequence[int], replies: dict[int, Reply]) -> list[list[int]]:
        """Recompute each replying client's modules from the seed and the rank it trained.

        Args:
            rnd: the round.
            cids: the replying clients, in the order wanted.
            replies: {cid: reply}.

        Returns:
            Each client's sorted modules, in the order of ``cids``.
        """
        return [self.modules(rnd, c, reply_rank(replies[c])) for c in cids]

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """Average every A and B module-wise: `ModuleMean` of the replies with `weights`."""
        new = copy_state(state)
        cids = sorted(replies)
        w = self.weights(replies)
        mean = ModuleMean(self.selections(rnd, cids, replies), [w[c] for c in cids], self.s.r_max)
        for key in lora_keys(state.arrays):
            new.arrays[key] = mean(state.arrays[key], [replies[c].arrays[key] for c in cids], rank_dim(key))
        return new

    def expected_holders(self, state: GlobalState, module: int) -> float:
        """Count the clients of the federation that hold a module in a round, in expectation.

        Central DP's fixed denominator, times the sampling rate.

        Args:
            state: the global state (its meta ``ranks``).
            module: the module index j.

        Returns:
            sum_k r_k / R under ``random`` (client k draws j with probability r_k / R), the number
            of clients with r_k > j under ``prefix``.
        """
        ranks = [int(r) for r in state.meta["ranks"].values()]
        if self.o.selection == "prefix":
            return float(sum(r > module for r in ranks))
        return sum(ranks) / self.s.r_max

    def robust_aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply], rule: BlockRule) -> GlobalState:
        """Combine one block per group of modules held by the same replying clients.

        Under ``prefix`` a block's modules also share their expected holders. A block holds the
        members' updates of its modules against the global ones, combined by ``rule`` and written
        back to the modules; a module no client trained keeps its value. Under the mean rule with
        n_k weights this is `aggregate`.
        """
        new = copy_state(state)
        cids = sorted(replies)
        sels = self.selections(rnd, cids, replies)
        w = self.weights(replies)
        keys = lora_keys(state.arrays)
        for g in self._blocks(state, module_groups(sels, self.s.r_max)):
            start = {k: _rows(state.arrays[k], rank_dim(k), g.modules) for k in keys}
            deltas = {
                cids[i]: {k: _rows(replies[cids[i]].arrays[k], rank_dim(k), rows) - start[k] for k in keys}
                for i, rows in zip(g.members, g.rows)
            }
            name = "modules " + ",".join(map(str, g.modules))
            holders = self.expected_holders(state, g.modules[0])
            block = Block(name, deltas, {cids[i]: w[cids[i]] for i in g.members}, holders, start, start)
            idx = torch.tensor(g.modules, dtype=torch.long)
            for k, v in rule(block).items():
                new.arrays[k].index_copy_(rank_dim(k), idx, v)
        return new

    def _blocks(self, state: GlobalState, groups: list[ModuleGroup]) -> list[ModuleGroup]:
        """``groups`` split so that the modules of one have the same `expected_holders`."""
        out = []
        for g in groups:
            by: dict[float, list[int]] = {}
            for i, j in enumerate(g.modules):
                by.setdefault(self.expected_holders(state, j), []).append(i)
            out += [
                ModuleGroup(g.members, [g.modules[i] for i in at], [[rows[i] for i in at] for rows in g.rows])
                for at in by.values()
            ]
        return out

    def deploy(self, state: GlobalState, cid: int | None = None) -> tuple[Arrays, float]:
        """The whole global adapter at s for every client (its fold plus its modules is the global model)."""
        return {k: v.clone() for k, v in state.arrays.items()}, self.global_scale


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> FedPLoRA:
    return FedPLoRA(lora_settings(cfg), cfg.section("fed_plora"))


IMPLEMENTATION = lora_implementation(_strategy)
