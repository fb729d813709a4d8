"""Benchmark the delta-rule operator on CPU: chunkwise WY form against the per-token recurrence.

Forward + backward wall time of ``delta_rule_chunkwise`` and ``delta_rule_recurrent`` at
T = 512, 2048 and 8192 (B = 1, H = 4, K = V = 64, fp32), measured side by side in one process:
the implementations are interleaved within each repeat and the median of the repeats is
reported (the recurrence at the largest T runs once). Also the memory each keeps for backward,
counted with ``torch.autograd.graph.saved_tensors_hooks``. Prints one JSON object.

    .venv/bin/python bench/perf/delta_rule.py            # about a minute on 2 quiet cores
    .venv/bin/python bench/perf/delta_rule.py --quick    # T = 256, 1024, a few seconds

Acceptance target (the FedNL operator issue): chunkwise at least 20x faster than the
recurrence at T = 2048 on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import time

import torch
import torch.nn.functional as F

from nestfed.ops.delta_rule import delta_rule_chunkwise, delta_rule_recurrent

B, H, K, V = 1, 4, 64, 64
TARGET_T, TARGET_SPEEDUP = 2048, 20.0


def make_inputs(T: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = 0.5 * torch.randn(B, T, H, K, generator=g)
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g) * K**-0.5
    beta = torch.randn(B, T, H, generator=g).sigmoid()
    return [x.requires_grad_() for x in (q, k, v, beta)]


def fwd_bwd(fn, ins, chunk_size: int) -> tuple[float, torch.Tensor]:
    """Seconds for one forward + backward (loss: sum of o plus sum of the final state)."""
    for x in ins:
        x.grad = None
    t0 = time.perf_counter()
    o, s = fn(*ins, chunk_size=chunk_size)
    (o.sum() + s.sum()).backward()
    dt = time.perf_counter() - t0
    return dt, o.detach()


def saved_bytes(fn, ins, chunk_size: int) -> dict[str, int]:
    """Bytes of the tensors autograd keeps for backward after one forward pass.

    ``sum``: every saved tensor's own bytes (numel x element size), views counted separately;
    ``unique_storage``: the distinct storages behind them, each counted once at full size (what
    the saved tensors actually keep alive; the better measure of the memory held for backward).
    """
    total = 0
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        nonlocal total
        total += t.numel() * t.element_size()
        st = t.untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, s = fn(*ins, chunk_size=chunk_size)
    del o, s
    return {"sum": total, "unique_storage": sum(storages.values())}


def _dumps(obj) -> str:
    """JSON with one key per line but lists and small dicts of numbers kept on one line."""
    text = json.dumps(obj, indent=1)
    return re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="T = 256, 1024, one recurrent run each")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a shared 2-core machine two "
        "OpenMP threads collapse when another process holds a core)",
    )
    ap.add_argument("--chunk-sizes", default="32,64", help="chunkwise chunk sizes to time")
    ap.add_argument("--repeats", type=int, default=5, help="chunkwise repeats per T")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    chunk_sizes = [int(c) for c in args.chunk_sizes.split(",")]
    if args.quick:
        plan = [(256, 1), (1024, 1)]  # (T, recurrent repeats)
    else:
        plan = [(512, 3), (2048, 3), (8192, 1)]
    load_before = os.getloadavg()
    t_start = time.perf_counter()

    # warm-up (first-call allocations and kernel selection), not timed
    warm = make_inputs(256, seed=99)
    for c in chunk_sizes:
        fwd_bwd(delta_rule_chunkwise, warm, c)
    fwd_bwd(delta_rule_recurrent, warm, 64)

    results = []
    for T, rec_repeats in plan:
        ins = make_inputs(T, seed=T)
        times: dict[str, list[float]] = {f"chunkwise_C{c}": [] for c in chunk_sizes}
        times["recurrent"] = []
        outs: dict[str, torch.Tensor] = {}
        for r in range(max(args.repeats, rec_repeats)):
            for c in chunk_sizes:
                dt, outs[f"chunkwise_C{c}"] = fwd_bwd(delta_rule_chunkwise, ins, c)
                times[f"chunkwise_C{c}"].append(dt)
            if r < rec_repeats:
                dt, outs["recurrent"] = fwd_bwd(delta_rule_recurrent, ins, 64)
                times["recurrent"].append(dt)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        ref = outs["recurrent"]
        mem = {f"chunkwise_C{c}": saved_bytes(delta_rule_chunkwise, ins, c) for c in chunk_sizes}
        mem["recurrent"] = saved_bytes(delta_rule_recurrent, ins, 64)
        results.append(
            {
                "T": T,
                "fwd_bwd_s_median": {n: round(t, 5) for n, t in med.items()},
                "fwd_bwd_s_all": {n: [round(t, 5) for t in ts] for n, ts in times.items()},
                "speedup_vs_recurrent": {n: round(med["recurrent"] / t, 2) for n, t in med.items() if n != "recurrent"},
                "speedup_vs_recurrent_of_min_times": {
                    n: round(min(times["recurrent"]) / min(ts), 2) for n, ts in times.items() if n != "recurrent"
                },
                "max_abs_diff_o_vs_recurrent": {
                    n: float((o - ref).abs().max()) for n, o in outs.items() if n != "recurrent"
                },
                "saved_for_backward_MiB": {
                    n: {kind: round(b / 2**20, 2) for kind, b in m.items()} for n, m in mem.items()
                },
                "saved_for_backward_bytes_per_token_per_head": {
                    n: round(m["unique_storage"] / (T * B * H), 1) for n, m in mem.items()
                },
                "saved_ratio_chunkwise_over_recurrent": {
                    n: round(m["unique_storage"] / mem["recurrent"]["unique_storage"], 3)
                    for n, m in mem.items()
                    if n != "recurrent"
                },
            }
        )

    target = next((r for r in results if r["T"] == TARGET_T), None)
    best = None
    if target is not None:
        best_name, best_speed = max(target["speedup_vs_recurrent"].items(), key=lambda kv: kv[1])
        best = {
            "T": TARGET_T,
            "required": TARGET_SPEEDUP,
            "best": best_name,
            "speedup": best_speed,
            "met": best_speed >= TARGET_SPEEDUP,
        }
    print(
        _dumps(
            {
                "benchmark": "delta rule forward+backward, CPU, fp32",
                "shape": {"B": B, "H": H, "K": K, "V": V},
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "cpu": platform.processor() or platform.machine(),
                "cpu_count": os.cpu_count(),
                "load_avg_1_5_15_before": [round(x, 2) for x in load_before],
                "load_avg_1_5_15_after": [round(x, 2) for x in os.getloadavg()],
                "method": "implementations interleaved within each repeat; median of repeats; "
                "recurrence repeats: " + ", ".join(f"T={T}: {n}" for T, n in plan),
                "memory_method": "torch.autograd.graph.saved_tensors_hooks over one forward pass: "
                "'sum' adds every tensor saved for backward (views counted separately), "
                "'unique_storage' counts each distinct storage they keep alive once at "
                "full size (the memory held for backward; excludes the gradient "
                "temporaries of backward itself)",
                "results": results,
                "target": best,
                "wall_s": round(time.perf_counter() - t_start, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
