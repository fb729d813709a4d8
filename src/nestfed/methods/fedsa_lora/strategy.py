"""fedsa_lora: the server strategy and the client hooks (the method is declared in nestfed.methods.fedsa_lora)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from nestfed.config import ExperimentConfig
from nestfed.federation.aggregation import merge_prefix, pad_rank, weighted_mean
from nestfed.federation.hooks import ClientHooks, FitContext
from nestfed.federation.messages import Arrays, GlobalState, Reply
from nestfed.federation.prepared import Prepared
from nestfed.federation.robust import Block, BlockRule
from nestfed.federation.run_dir import Exports
from nestfed.federation.secure_sum import SecureSum, segment_mean
from nestfed.federation.strategy import LoraStrategy, copy_state, examples
from nestfed.methods.implementation import MethodRun, lora_implementation, lora_settings
from nestfed.nn.keys import peft_key, rank_dim
from nestfed.nn.lora import module_shapes

#: the client's kept-state group holding its own B matrices {lora_B key: [out, r_k]}
OWN_B = "own_B"

ADAPTER_NOTE = (
    "the exported adapter is the shared global A (rank r_max) with B = 0: FedSA-LoRA has no "
    "global B (each client's B never leaves it), so the adapter computes the backbone's function; "
    "the personalised models are (global A, own B), kept in the checkpoints' client state"
)


def a_keys(arrays: Arrays) -> list[str]:
    """The ``lora_A`` keys of a payload, sorted.

    Args:
        arrays: the payload.

    Returns:
        The keys.
    """
    return sorted(k for k in arrays if k.endswith("lora_A.weight"))


def rank_segments(ranks: Sequence[int]) -> list[tuple[int, int]]:
    """The row ranges [lo, hi) between consecutive distinct ranks (lo of the first = 0).

    Every row of one range is held by the same clients, those with r_k >= hi: ``[4, 2, 4] -> [(0,
    2), (2, 4)]``.

    Args:
        ranks: the clients' ranks.

    Returns:
        The ranges, in order.
    """
    bounds = sorted({int(r) for r in ranks})
    return list(zip([0] + bounds[:-1], bounds))


def holder_mean(global_a: torch.Tensor, client_as: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Row j: the weighted mean of the clients' row j over those that hold it.

    This module's decision for heterogeneous ranks; at one rank it is FedAvg on A, FedSA-LoRA's
    server step. Rows no client holds keep global_a's.

    Args:
        global_a: [r_max, in] the global A.
        client_as: the clients' A, [r_k, in] each, r_k <= r_max.
        weights: the n_k.

    Returns:
        A new [r_max, in].

    Raises:
        ValueError: for an empty list or a client rank above r_max.
    """
    if not client_as:
        raise ValueError("nothing to average")
    ranks = [a.shape[0] for a in client_as]
    if max(ranks) > global_a.shape[0]:
        raise ValueError(f"client rank {max(ranks)} exceeds the global rank {global_a.shape[0]}")
    out = global_a.clone()
    for lo, hi in rank_segments(ranks):
        members = [k for k, r in enumerate(ranks) if r >= hi]
        out[lo:hi] = weighted_mean([client_as[k][lo:hi] for k in members], [weights[k] for k in members])
    return out


class FedSALoRA(LoraStrategy):
    """Only A travels and is averaged (`holder_mean`); there is no global B.

    The state's ``lora_B`` stays the initial zeros [out, r_max].
    """

    name = "fedsa_lora"

    def client_arrays(self, state: GlobalState, rank: int) -> Arrays:
        """The global A's prefix of the client's rank, [r_k, in] per layer (no B is sent)."""
        return {k: state.arrays[k][:rank].clone() for k in a_keys(state.arrays)}

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """The holder mean of A with n_k weights (`holder_mean`); B untouched."""
        new = copy_state(state)
        n = examples(replies)
        cids = sorted(replies)
        for key in a_keys(state.arrays):
            new.arrays[key] = holder_mean(
                state.arrays[key], [replies[c].arrays[key] for c in cids], [n[c] for c in cids]
            )
        return new

    def robust_aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply], rule: BlockRule) -> GlobalState:
        """One block per rank segment [lo, hi) of A, in update space; the rule's values replace the segment's rows.

        Members: the replying clients with r_k >= hi; holders: every client of the federation with
        r_k >= hi (docs/trust.md).
        """
        new = copy_state(state)
        n = examples(replies)
        ranks = {c: replies[c].arrays[a_keys(replies[c].arrays)[0]].shape[0] for c in replies}
        everyone = [int(r) for r in state.meta["ranks"].values()]
        keys = a_keys(state.arrays)
        for lo, hi in rank_segments(everyone):
            members = sorted(c for c in replies if ranks[c] >= hi)
            if not members:
                continue
            start = {k: state.arrays[k][lo:hi] for k in keys}
            deltas = {c: {k: replies[c].arrays[k][lo:hi] - start[k] for k in keys} for c in members}
            block = Block(
                f"rank {lo}:{hi}", deltas, {c: n[c] for c in members}, sum(r >= hi for r in everyone), start, start
            )
            for k, v in rule(block).items():
                new.arrays[k][lo:hi] = v
        return new

    def aggregate_secure(self, rnd: int, state: GlobalState, secure: SecureSum) -> GlobalState:
        """`aggregate` from secure sums alone: each row of A gets G[j] + S[j] / C[j].

        That is the n_k-weighted mean update of the clients holding it, the holder mean
        (nestfed.federation.secure_sum.segment_mean).
        """
        new = copy_state(state)
        for key, s in secure.sums.items():
            new.arrays[key] = segment_mean(state.arrays[key], s, secure.counts, rank_dim(key))
        return new


class FedSAHooks(ClientHooks):
    """The client's own B is loaded beside the received A, kept after training, never sent.

    It is used with the global A for evaluation (FedSA-LoRA's method section).
    """

    keeps_state = True

    def arrays_to_load(self, ctx: FitContext, arrays: Arrays) -> Arrays:
        """The received A [r, in] plus, per layer, the first r columns of the client's kept B [out, r_k].

        Zeros before its first round, and for columns it never trained (B's initialisation); r is
        the instructed rank, r_k or an elastic rank below it.
        """
        own = ctx.state.get(OWN_B, {})
        r = int(ctx.config["rank"])
        for m, (out_f, _) in sorted(module_shapes(ctx.model).items()):
            if peft_key(m, "lora_A") not in arrays:
                continue
            b_key = peft_key(m, "lora_B")
            b = own.get(b_key)
            arrays[b_key] = pad_rank(b[:, :r], 1, r).clone() if b is not None else torch.zeros(out_f, r)
        return arrays

    def reply_arrays(self, ctx: FitContext, out: Arrays) -> Arrays:
        """Keep the trained B's as ``own_B`` and send the A's only.

        Trained at an elastic rank, its first columns are replaced and the rest kept as they were.
        """
        kept = ctx.state.get(OWN_B, {})
        ctx.state[OWN_B] = {k: merge_prefix(kept.get(k), v, 1) for k, v in out.items() if k.endswith("lora_B.weight")}
        return {k: v for k, v in out.items() if not k.endswith("lora_B.weight")}

    def evaluation_arrays(self, state: dict[str, Arrays], arrays: Arrays) -> Arrays:
        """The deployed arrays with every B the client holds in place of the zeros: its personalised model.

        The deployed arrays are the global A prefix [r, in] and B = 0 [out, r]; each kept B gives
        its first r columns (zeros where it never trained one, as after training only an elastic
        rank's prefix). A client that never trained runs B = 0.
        """
        own = state.get(OWN_B)
        if not own or not arrays:
            return arrays
        out = dict(arrays)
        for k, b in own.items():
            if k in out:
                out[k] = pad_rank(b[:, : out[k].shape[1]], 1, out[k].shape[1])
        return out


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> FedSALoRA:
    return FedSALoRA(lora_settings(cfg))


_LORA = lora_implementation(_strategy, hooks=lambda cfg: FedSAHooks())


def _build(prep: Prepared, cfg: ExperimentConfig) -> MethodRun:
    """The home's run, whose ``finish`` adds ``adapter_note`` (what the exported adapter is) to the
    run's summary."""
    run = _LORA.build(prep, cfg)
    finish = run.finish

    def with_note(state: GlobalState) -> Exports:
        exports = finish(state)
        exports.summary["adapter_note"] = ADAPTER_NOTE
        return exports

    run.finish = with_note
    return run


IMPLEMENTATION = dataclasses.replace(_LORA, build=_build)
