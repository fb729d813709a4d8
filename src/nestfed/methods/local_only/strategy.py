"""local_only: the server strategy and the client hooks (the method is declared in nestfed.methods.local_only)."""

from __future__ import annotations

from dataclasses import replace

from nestfed.config import ExperimentConfig
from nestfed.federation.aggregation import merge_prefix, truncate_rank
from nestfed.federation.hooks import ClientHooks, FitContext
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState, Instruction, Reply
from nestfed.federation.strategy import LoraStrategy, copy_state
from nestfed.methods.implementation import lora_implementation, lora_settings
from nestfed.nn.keys import rank_dim


class LocalOnly(LoraStrategy):
    """The server of local-only training: the global state stays the initial adapter."""

    name = "local_only"

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """The unchanged state (a copy): nothing is aggregated."""
        return copy_state(state)

    def aggregate_secure(self, rnd: int, state: GlobalState, secure) -> GlobalState:
        """The unchanged state (a copy): nothing is aggregated."""
        return copy_state(state)

    def configure(self, rnd: int, state: GlobalState, clients: list[ClientInfo]) -> dict[int, Instruction]:
        """Send every client its own rank's prefix, what it keeps and replies.

        A client at an elastic rank this round trains that prefix of it (``train_rank``).
        """
        out = super().configure(rnd, state, [replace(c, round_rank=0) for c in clients])
        for c in clients:
            if c.round_rank and c.round_rank < c.rank:
                out[c.cid].config["train_rank"] = c.round_rank
        return out


def _clone(arrays: Arrays) -> Arrays:
    return {k: v.detach().clone() for k, v in arrays.items()}


class LocalOnlyHooks(ClientHooks):
    """The client trains from its own kept adapter and is evaluated under it.

    In its first round it starts from the received initial prefix.
    """

    keeps_state = True

    def arrays_to_load(self, ctx: FitContext, arrays: Arrays) -> Arrays:
        """The client's kept adapter ({key: [r_k, in] / [out, r_k]}), or the received one at first.

        At an elastic rank this round (``train_rank``), its prefix of that rank.
        """
        ctx.scratch["own"] = _clone(ctx.state.get("adapter", arrays))
        return truncate_rank(ctx.scratch["own"], int(ctx.config.get("train_rank", ctx.config["rank"])))

    def reply_arrays(self, ctx: FitContext, out: Arrays) -> Arrays:
        """Keep the trained adapter on the client and send it (the server ignores it).

        Trained at an elastic rank, its prefix is replaced and the rest kept as it was.
        """
        own = ctx.scratch["own"]
        ctx.state["adapter"] = {
            k: merge_prefix(own.get(k), v, rank_dim(k)) if rank_dim(k) is not None else v.detach().clone()
            for k, v in out.items()
        }
        return _clone(ctx.state["adapter"])

    def evaluation_arrays(self, state: dict[str, Arrays], arrays: Arrays) -> Arrays:
        """The client's own adapter; the deployed (initial) one before its first round."""
        return _clone(state.get("adapter", arrays))


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> LocalOnly:
    return LocalOnly(lora_settings(cfg))


IMPLEMENTATION = lora_implementation(_strategy, hooks=lambda cfg: LocalOnlyHooks())
