"""GPU check and timing of the delta-rule dispatcher: flash-linear-attention's Triton kernel
(bf16) against nestfed's pure-PyTorch chunkwise WY form (fp32).

To be run on a CUDA machine where ``fla-core`` is installed (``pip install fla-core``, or the
carried wheel):

    python bench/perf/gpu_delta_rule.py                 # checks at T = 100, 2048; timings at
                                                        # T = 2048, 8192, 16384; B = 4, H = 9, K = 64
    python bench/perf/gpu_delta_rule.py --cpu-dry-run   # the same code path at tiny sizes on CPU
                                                        # (the "fla" side is then the CPU dispatcher)

Check: both sides get the same inputs, rounded to bf16 (the reference computes in fp32 on the
rounded values, so only the kernel's own precision is measured). For o, the final state and
the gradients of q, k, v, beta and initial_state it reports the relative RMS error
||x - ref|| / ||ref|| (flash-linear-attention's own test metric) against a bf16 tolerance.

Prints one JSON object. Exit status: 0 when every check passes, 1 on a mismatch (or a
non-finite value), 3 when CUDA is present but fla is not importable (nothing to check).
Importing this module runs nothing and needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from nestfed.ops import delta_rule as dr

NAMES = ["o", "final_state", "dq", "dk", "dv", "dbeta", "dh0"]


def make_inputs(B, T, H, K, V, device, seed=0):
    """fp32 inputs already rounded to bf16 (so both sides see the same values)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    q = r(B, T, H, K)
    k = F.normalize(r(B, T, H, K), dim=-1)
    v = r(B, T, H, V)
    beta = r(B, T, H).sigmoid()
    h0 = 0.1 * r(B, H, K, V)
    out = [x.bfloat16().float().to(device) for x in (q, k, v, beta)]
    return out + [h0.to(device)]


def run(fn, q, k, v, beta, h0, scale, do, dht, **kw):
    """o, final state and the five gradients, all returned in fp32."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, beta, h0)]
    o, ht = fn(*leaves[:4], scale=scale, initial_state=leaves[4], output_final_state=True, **kw)
    ((o.float() * do).sum() + (ht.float() * dht).sum()).backward()
    return [o.detach().float(), ht.detach().float()] + [x.grad.float() for x in leaves]


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    den = ref.double().pow(2).mean().sqrt().item()
    num = (x.double() - ref.double()).pow(2).mean().sqrt().item()
    return num / den if den > 0 else num


def check(T, B, H, K, V, device, tol_out, tol_grad, chunk_size):
    q, k, v, beta, h0 = make_inputs(B, T, H, K, V, device, seed=T)
    scale = K**-0.5
    g = torch.Generator(device="cpu").manual_seed(T + 1)
    do = torch.randn(B, T, H, V, generator=g).to(device)
    dht = torch.randn(B, H, K, V, generator=g).to(device)
    ref = run(dr.delta_rule_chunkwise, q, k, v, beta, h0, scale, do, dht, chunk_size=chunk_size)
    half = [x.bfloat16() for x in (q, k, v, beta)]
    fast = run(dr.delta_rule, *half, h0, scale, do, dht)
    errors, ok = {}, True
    for name, x, r in zip(NAMES, fast, ref):
        e = rel_rms(x, r)
        tol = tol_out if name in ("o", "final_state") else tol_grad
        finite = bool(torch.isfinite(x).all())
        errors[name] = {"rel_rms": round(e, 6), "tol": tol, "finite": finite}
        ok = ok and finite and e <= tol
    return {"T": T, "B": B, "H": H, "K": K, "V": V, "ok": ok, "errors": errors}


def timeit(fn, ins, scale, device, repeats, warmup=2, **kw):
    """Median seconds of one forward + backward; peak memory allocated during one (CUDA)."""
    leaves = [x.detach().clone().requires_grad_() for x in ins]

    def once():
        for x in leaves:
            x.grad = None
        o, ht = fn(*leaves[:4], scale=scale, initial_state=leaves[4], output_final_state=True, **kw)
        (o.float().sum() + ht.float().sum()).backward()

    for _ in range(warmup):
        once()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    ts = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        once()
        if cuda:
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    out = {"median_ms": round(1e3 * ts[len(ts) // 2], 3), "min_ms": round(1e3 * ts[0], 3), "repeats": repeats}
    if cuda:
        out["peak_extra_GiB"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on CPU; exercises the code path, not fla")
    ap.add_argument(
        "--tol-out", type=float, default=0.02, help="relative RMS tolerance for o and the final state (bf16)"
    )
    ap.add_argument("--tol-grad", type=float, default=0.04, help="relative RMS tolerance for the gradients (bf16)")
    ap.add_argument("--chunk-size", type=int, default=64, help="chunk size of the fp32 side")
    args = ap.parse_args(argv)

    if args.cpu_dry_run:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # tiny ops; two threads crawl on a shared 2-core machine
        B, H, K, V = 1, 2, 16, 16
        check_T, time_T, reps = [20, 70], [64, 128], 2
    else:
        if not torch.cuda.is_available():
            print(json.dumps({"error": "no CUDA device; use --cpu-dry-run"}))
            return 2
        device = torch.device("cuda")
        B, H, K, V = 4, 9, 64, 64
        check_T, time_T, reps = [100, 2048], [2048, 8192, 16384], 10

    fla_fn = dr._fla_chunk_delta_rule()
    probe = torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16, device=device)
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "fla_importable": fla_fn is not None,
        "fla_version": getattr(sys.modules.get("fla"), "__version__", None),
        "dispatches_to_fla_for_bf16": dr._use_fla(probe),
        "shape": {"B": B, "H": H, "K": K, "V": V},
        "scale": K**-0.5,
        "fp32_side": f"delta_rule_chunkwise, fp32, chunk_size={args.chunk_size}",
        "bf16_side": "delta_rule (dispatcher) on bf16 inputs",
        "metric": "relative RMS error ||x - ref|| / ||ref||, ref = fp32 chunkwise on the same bf16-rounded inputs",
    }
    if device.type == "cuda" and fla_fn is None:
        report["error"] = "fla (fla-core) is not importable: nothing to check"
        print(json.dumps(report, indent=1))
        return 3

    report["checks"] = [check(T, B, H, K, V, device, args.tol_out, args.tol_grad, args.chunk_size) for T in check_T]
    timings = []
    for T in time_T:
        ins = make_inputs(B, T, H, K, V, device, seed=T)
        half = [x.bfloat16() for x in ins[:4]] + [ins[4]]
        chunk_reps = reps if T <= 8192 else max(2, reps // 3)
        row = {
            "T": T,
            "bf16_dispatcher": timeit(dr.delta_rule, half, K**-0.5, device, reps),
            "fp32_chunkwise": timeit(
                dr.delta_rule_chunkwise, ins, K**-0.5, device, chunk_reps, chunk_size=args.chunk_size
            ),
        }
        row["speedup"] = round(row["fp32_chunkwise"]["median_ms"] / max(row["bf16_dispatcher"]["median_ms"], 1e-9), 2)
        timings.append(row)
        del ins, half
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["timings_fwd_bwd"] = timings
    report["ok"] = all(c["ok"] for c in report["checks"])
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
