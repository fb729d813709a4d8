"""fedavg: the server strategy and the client hooks (the method is declared in nestfed.methods.fedavg)."""

from __future__ import annotations

from nestfed.config import ExperimentConfig
from nestfed.federation.aggregation import weighted_mean
from nestfed.federation.messages import Arrays, GlobalState, Reply
from nestfed.federation.secure_sum import SecureSum, padded_mean
from nestfed.federation.strategy import LoraStrategy, copy_state, examples, lora_keys
from nestfed.methods.implementation import lora_implementation, lora_settings
from nestfed.nn.keys import rank_dim


class FedAvg(LoraStrategy):
    """Homogeneous-rank LoRA averaged with weights n_k / N; requires equal client ranks."""

    name = "fedavg"

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        """Every LoRA matrix the n_k-weighted mean of the clients'."""
        new = copy_state(state)
        n = examples(replies)
        cids = sorted(replies)
        for key in lora_keys(next(iter(replies.values())).arrays):
            new.arrays[key] = weighted_mean([replies[c].arrays[key] for c in cids], [n[c] for c in cids])
        return new

    def aggregate_secure(self, rnd: int, state: GlobalState, secure: SecureSum) -> GlobalState:
        """`aggregate` from secure sums alone: at one rank, G + S / N.

        The rebuild is nestfed.federation.secure_sum's.
        """
        new = copy_state(state)
        for key, s in secure.sums.items():
            new.arrays[key] = padded_mean(state.arrays[key], s, secure.counts, rank_dim(key))
        return new


def _strategy(cfg: ExperimentConfig, initial: Arrays) -> FedAvg:
    return FedAvg(lora_settings(cfg))


IMPLEMENTATION = lora_implementation(_strategy)
