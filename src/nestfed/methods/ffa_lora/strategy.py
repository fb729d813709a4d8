"""ffa_lora: the server strategy and the client hooks (the method is declared in nestfed.methods.ffa_lora)."""

from __future__ import annotations

from nestfed.config import ExperimentConfig
from nestfed.federation.aggregation import pad_rank, weighted_mean
from nestfed.federation.hooks import ClientHooks
from nestfed.federation.messages import Arrays, GlobalState, Reply
from nestfed.federation.strategy import LoraStrategy, copy_state, examples
from nestfed.methods.implementation import lora_implementation, lora_settings


class FFALoRA(LoraStrategy):
    """Clients receive A and B, train and send only B; the server averages B with n_k weights."""

    name = "ffa_lora"

    def reply_keys(self, sent: Arrays) -> list[str]:
        """Only B comes back."""
        return [k for k in sent if k.endswith("lora_B.weight")]

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """B the n_k-weighted mean of the clients' B, zero-padded to r_max; A unchanged."""
        new = copy_state(state)
        n = examples(replies)
        cids = sorted(replies)
        for key in sorted(k for k in state.arrays if k.endswith("lora_B.weight")):
            padded = [pad_rank(replies[c].arrays[key], 1, self.s.r_max) for c in cids]
            new.arrays[key] = weighted_mean(padded, [n[c] for c in cids])
        return new


class FFALoRAHooks(ClientHooks):
    """A stays frozen: only B trains and travels back."""

    train_a = False


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> FFALoRA:
    return FFALoRA(lora_settings(cfg))


IMPLEMENTATION = lora_implementation(_strategy, hooks=lambda cfg: FFALoRAHooks())
