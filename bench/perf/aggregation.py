"""Server aggregation time for 100 clients over SmolLM2-135M's q, k, v, o shapes, for every rule.

Prints one JSON object. Shapes (30 layers): q, o [576, 576]; k, v [192, 576] (3 KV heads x 64).
Two settings: every client at rank 16 (every rule of :data:`EQUAL`), and heterogeneous ranks
2/4/8/16 cycling over the clients (the rules of :data:`HETEROGENEOUS`). Client updates are random tensors: aggregation
cost does not depend on their values. Times are the median of ``--repeats`` runs, in seconds.

    python bench/perf/aggregation.py [--clients 100] [--rank 16] [--layers 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rule_inputs import smollm2_shapes, strategy

from nestfed.federation.messages import ClientInfo, Reply


def bench(name: str, ranks: list[int], layers: int, repeats: int) -> dict:
    st = strategy(name, ranks, 2.0 * max(ranks), "hetlora.pruning=false")
    clients = [ClientInfo(i, r, 10 + i) for i, r in enumerate(ranks)]
    state = st.initialize(smollm2_shapes(range(layers)), clients)
    ins = st.configure(1, state, clients)
    g = torch.Generator().manual_seed(0)
    replies = {
        c.cid: Reply({k: torch.randn(s, generator=g) * 0.01 for k, s in ins[c.cid].expect.items()}, c.num_examples)
        for c in clients
    }
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        st.aggregate(1, state, replies)
        times.append(time.perf_counter() - t0)
    params = sum(v.numel() for r in replies.values() for v in r.arrays.values())
    return {"seconds": statistics.median(times), "all_seconds": times, "uplink_params_total": params}


#: the rules timed with every client at one rank, and those that take ranks 2/4/8/16 (Fed-SB takes
#: one rank; RAVAN's heads of rank 4 leave out a client of rank 2)
EQUAL = (
    "fedavg",
    "zeropad",
    "hetlora",
    "prelort",
    "ffa_lora",
    "flora",
    "flexlora",
    "fedex_lora",
    "fedsvd",
    "lora_fair",
    "fed_sb",
    "ravan",
    "raflora",
    "fed_plora",
)
HETEROGENEOUS = (
    "zeropad",
    "hetlora",
    "prelort",
    "flora",
    "flexlora",
    "fedex_lora",
    "fedsvd",
    "lora_fair",
    "raflora",
    "fed_plora",
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    homogeneous = [a.rank] * a.clients
    cycle = [2, 4, 8, 16]
    heterogeneous = [cycle[i % 4] for i in range(a.clients)]
    result = {
        "clients": a.clients,
        "layers": a.layers,
        "modules": 4 * a.layers,
        "threads": a.threads,
        "equal_rank": {},
        "heterogeneous_ranks_2_4_8_16": {},
    }
    for name in EQUAL:
        result["equal_rank"][name] = bench(name, homogeneous, a.layers, a.repeats)
    for name in HETEROGENEOUS:
        result["heterogeneous_ranks_2_4_8_16"][name] = bench(name, heterogeneous, a.layers, a.repeats)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
