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
"""

from __future__ import annotations

from typing import Any

from nestfed.federation.aggregation import lowrank_norm, pad_rank, rank_dim, weighted_mean
from nestfed.federation.messages import ClientInfo, GlobalState, Reply
from nestfed.federation.strategy import LoraStrategy, copy_state, examples, lora_keys


class HetLoRA(LoraStrategy):
    """Options: reg (lambda), tail (fraction of the rank regularised), prune_ratio, weighting, pruning."""

    name = "hetlora"
    objective = "hetlora"

    @property
    def may_shrink_rank(self) -> bool:  # type: ignore[override]
        return bool(self.options.get("pruning", True))

    def client_config(self, rnd: int, state: GlobalState, client: ClientInfo, rank: int) -> dict[str, Any]:
        prev = state.meta.get("tail_norms", {}).get(str(client.cid))
        return {"hetlora_reg": float(self.options.get("reg", 0.01)),
                "hetlora_tail": float(self.options.get("tail", 0.25)),
                "hetlora_prune_ratio": float(self.options.get("prune_ratio", 0.9)),
                "hetlora_pruning": bool(self.options.get("pruning", True)),
                "hetlora_prev_tail": -1.0 if prev is None else float(prev)}

    def aggregate(self, rnd: int, state: GlobalState, replies: dict[int, Reply]) -> GlobalState:
        new = copy_state(state)
        n = examples(replies)
        cids = sorted(replies)
        for c in cids:  # remember pruned ranks and tail norms for the next round
            a_key = next(k for k in replies[c].arrays if k.endswith("lora_A.weight"))
            new.meta["ranks"][str(c)] = int(replies[c].arrays[a_key].shape[0])
            if "tail_norm" in replies[c].metrics:
                new.meta.setdefault("tail_norms", {})[str(c)] = float(replies[c].metrics["tail_norm"])
        for key in lora_keys(state.arrays):
            if not key.endswith("lora_A.weight"):
                continue
            b_key = key[: -len("lora_A.weight")] + "lora_B.weight"
            weights = [n[c] for c in cids]
            if self.options.get("weighting", "norm") == "norm":
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
