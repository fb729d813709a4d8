"""PreLort: prefix-nested LoRA with segment-wise aggregation (arXiv 2606.15963, sections 2.1-2.3).

Local objective (section 2.2): client k minimises the mean over its sub-ranks
R_k = {r in R_fed : r <= r_k} of the causal-LM loss with the adapter truncated to r, where R_fed
is the sorted set of distinct ranks in the federation. Aggregation (section 2.3): for each
segment [r_{l-1}, r_l) the n_k-weighted mean update of the clients with r_k >= r_l is added to
the global segment (:func:`nestfed.federation.aggregation.segment_average`).
"""

from __future__ import annotations

from typing import Any

from nestfed.federation.aggregation import rank_dim, segment_average, segments
from nestfed.federation.messages import ClientInfo, GlobalState, Reply
from nestfed.federation.strategy import LoraStrategy, copy_state, examples, lora_keys


class PreLort(LoraStrategy):
    """Nested sub-rank training plus segment-wise aggregation over R_fed."""

    name = "prelort"
    objective = "nested"

    def federation_ranks(self, state: GlobalState) -> list[int]:
        """R_fed: the sorted distinct ranks of every client in the federation."""
        return sorted({int(r) for r in state.meta["ranks"].values()})

    def client_config(self, rnd: int, state: GlobalState, client: ClientInfo, rank: int) -> dict[str, Any]:
        return {"subranks": [r for r in self.federation_ranks(state) if r <= rank]}

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        new = copy_state(state)
        n = examples(replies)
        cids = sorted(replies)
        ranks = [self.rank_of(state, c) for c in cids]
        bounds = segments(self.federation_ranks(state))
        for key in lora_keys(state.arrays):
            new.arrays[key] = segment_average(state.arrays[key], [replies[c].arrays[key] for c in cids], ranks,
                                              [n[c] for c in cids], rank_dim(key), bounds)
        return new
