"""zeropad: the server strategy and the client hooks (the method is declared in nestfed.methods.zeropad)."""

from __future__ import annotations

from nestfed.config import ExperimentConfig
from nestfed.federation.aggregation import pad_rank, weighted_mean
from nestfed.federation.messages import Arrays, GlobalState, Reply
from nestfed.federation.secure_sum import SecureSum, padded_mean
from nestfed.federation.strategy import LoraStrategy, copy_state, examples, lora_keys
from nestfed.methods.implementation import lora_implementation, lora_settings
from nestfed.nn.keys import rank_dim


class ZeroPad(LoraStrategy):
    """global[key] = sum_k n_k pad(client_k[key]) / N for every LoRA matrix."""

    name = "zeropad"

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """Every LoRA matrix the n_k-weighted mean of the clients', zero-padded to r_max."""
        new = copy_state(state)
        n = examples(replies)
        cids = sorted(replies)
        for key in lora_keys(state.arrays):
            d = rank_dim(key)
            padded = [pad_rank(replies[c].arrays[key], d, self.s.r_max) for c in cids]
            new.arrays[key] = weighted_mean(padded, [n[c] for c in cids])
        return new

    def aggregate_secure(self, rnd: int, state: GlobalState, secure: SecureSum) -> GlobalState:
        """`aggregate` from secure sums alone: (G C + S) / N per rank row.

        The padded parameter mean (nestfed.federation.secure_sum).
        """
        new = copy_state(state)
        for key, s in secure.sums.items():
            new.arrays[key] = padded_mean(state.arrays[key], s, secure.counts, rank_dim(key))
        return new


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> ZeroPad:
    return ZeroPad(lora_settings(cfg))


IMPLEMENTATION = lora_implementation(_strategy)
