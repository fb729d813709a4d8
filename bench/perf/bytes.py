"""Bytes per client per round for each method, against the size of the full model.

Prints one JSON object. Payloads are built by each strategy's own ``configure`` (downlink) and the
reply shapes it expects (uplink), serialised with safetensors exactly as the runner counts them.
SmolLM2-135M's shapes; two placements: the main job's (q, k, v, o on the top 4 layers) and all 30
layers. Ranks 2, 4, 4, 8, 16 as in the main job. FLoRA's downlink (the accumulated stack) grows
every round: its figures are given after rounds 1 and 3.

    python bench/perf/bytes.py
"""

from __future__ import annotations

import json

import torch
from rule_inputs import smollm2_shapes, strategy

from nestfed import methods
from nestfed.config.capabilities import Capability
from nestfed.federation.messages import ClientInfo, Reply
from nestfed.federation.payload import payload_stats

RANKS = [2, 4, 4, 8, 16]
FULL_PARAMS = 134_515_008  # SmolLM2-135M (tied embeddings), counted from the loaded model


# Every rule that exchanges LoRA factors (or their cores), in the docs' order; the methods that take
# one rank only (fedavg, fed_sb) run at rank 8 on every client, RAVAN (whole heads of rank 16 / 4)
# at 4, 4, 4, 8, 16.
METHODS = (
    "fedavg",
    "zeropad",
    "hetlora",
    "prelort",
    "ffa_lora",
    "flora",
    "flexlora",
    "fedsa_lora",
    "fedex_lora",
    "fedsvd",
    "lora_fair",
    "fed_sb",
    "ravan",
    "raflora",
    "fed_plora",
)
OWN_RANKS = {"ravan": [4, 4, 4, 8, 16]}


def method_bytes(name: str, layer_ids: list[int], rounds: int = 3) -> dict:
    heterogeneous = Capability.HETEROGENEOUS_RANKS in methods.get(name).capabilities
    ranks = OWN_RANKS.get(name, RANKS) if heterogeneous else [8] * len(RANKS)
    st = strategy(name, ranks, 16.0, "hetlora.pruning=false")
    clients = [ClientInfo(i, r, 24) for i, r in enumerate(ranks)]
    state = st.initialize(smollm2_shapes(layer_ids), clients)
    per_round = []
    for rnd in range(1, rounds + 1):
        ins = st.configure(rnd, state, clients)
        replies = {c.cid: Reply({k: torch.zeros(s) for k, s in ins[c.cid].expect.items()}, 24) for c in clients}
        down = {c.cid: payload_stats(ins[c.cid].arrays) for c in clients}
        up = {c.cid: payload_stats(replies[c.cid].arrays) for c in clients}
        per_round.append(
            {
                "round": rnd,
                "down_bytes_per_client": {str(c): d["bytes"] for c, d in down.items()},
                "up_bytes_per_client": {str(c): u["bytes"] for c, u in up.items()},
                "mean_bytes_per_client": sum(d["bytes"] + up[c]["bytes"] for c, d in down.items()) / len(clients),
            }
        )
        state = st.aggregate(rnd, state, replies)
    return {"ranks": ranks, "rounds": per_round}


def main() -> None:
    full_fp32 = FULL_PARAMS * 4
    result = {"full_model_params": FULL_PARAMS, "full_model_bytes_fp32": full_fp32, "placements": {}}
    for label, layer_ids in (("top4_layers_qkvo", [26, 27, 28, 29]), ("all30_layers_qkvo", list(range(30)))):
        res = {}
        for name in METHODS:
            r = method_bytes(name, layer_ids)
            r["round1_mean_fraction_of_full_model"] = r["rounds"][0]["mean_bytes_per_client"] / full_fp32
            r["round3_mean_fraction_of_full_model"] = r["rounds"][-1]["mean_bytes_per_client"] / full_fp32
            res[name] = r
        result["placements"][label] = res
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
