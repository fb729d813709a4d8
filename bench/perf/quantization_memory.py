"""A client's memory and step time over a quantised backbone (``model.quantization``: none, int8,
nf4) for SmolLM2-135M and Gemma-3-270M, against the footprint model's estimate
(nestfed.nn.footprint: W + 16 P(r) + S(r), W counting the packed weights and their state).

Prints one JSON object (and writes it with --out). Every (model, precision) runs in its own fresh
subprocess, one after another in one run, so the settings share the machine's state:

- the client: the backbone as ``nestfed run`` loads it (nestfed.nn.backbone.load_backbone), LoRA of
  rank --rank on q, k, v, o of every decoder layer (so every layer's weights are touched and the
  frozen prefix is not cached), AdamW, nestfed's training loss, --batch rows of --tokens tokens;
- ``footprint_bytes``: the footprint model at that rank (what ``population.memory_mib`` compares a
  budget with), and its parts (weights W, trainable, saved activations);
- ``rss``: resident memory after the model is built and the peak sampled every 2 ms over a
  training step (the second; after malloc_trim), minus the bare process's after importing torch,
  transformers and bitsandbytes; ``footprint_error`` = footprint / step peak - 1;
- ``step_s``: the median of --steps training steps (forward, backward, AdamW) after one warm-up.

    python bench/perf/quantization_memory.py [--models smollm2-135m gemma3-270m] [--rank 8] [--batch 4]
        [--tokens 128] [--steps 3] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fedslm_memory import PeakSampler, rss  # noqa: E402

from nestfed.io.markdown import markdown_table  # noqa: E402

PRECISIONS = ("none", "int8", "nf4")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def child(model_name: str, precision: str, rank: int, batch: int, tokens: int, steps: int, threads: int) -> dict:
    """Measure one (model, precision) in this fresh process."""
    import bitsandbytes  # noqa: F401  (imported before the baseline RSS, as torch and transformers)
    import torch
    import transformers  # noqa: F401

    torch.set_num_threads(threads)
    from nestfed.config import ModelConfig, TrainConfig
    from nestfed.federation.training import Batch
    from nestfed.nn.backbone import load_backbone
    from nestfed.nn.footprint import Footprint
    from nestfed.nn.lora import inject_lora, lora_modules

    libc = ctypes.CDLL("libc.so.6")
    base = rss()
    model = load_backbone(ModelConfig(name=model_name, quantization=precision, device="cpu")).model
    inject_lora(model, TARGETS, rank, 16.0 / rank)
    built = rss() - base
    train = TrainConfig(batch_size=batch)
    fp = Footprint.measure(model, train, tokens, 0)
    params = [p for m in lora_modules(model).values() for p in (m.lora_A.weight, m.lora_B.weight)]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=g)
    data = Batch(labels=ids, input_ids=ids)
    model.train()

    def step() -> float:
        t0 = time.perf_counter()
        loss = data.loss(model)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    step()  # warm-up: AdamW's state exists from here on
    libc.malloc_trim(0)
    with PeakSampler() as peak:
        times = [step()]
    times += [step() for _ in range(steps - 1)]
    peak_bytes = peak.peak - base
    estimate = fp.bytes(rank)
    return {
        "model": model_name,
        "precision": precision,
        "rank": rank,
        "footprint_bytes": estimate,
        "footprint_weights_bytes": fp.weights,
        "footprint_trainable_bytes": 16 * fp.per_rank * rank,
        "footprint_saved_bytes": int(fp.saved_at_1 + fp.saved_slope * (rank - 1)),
        "rss_built_bytes": built,
        "rss_step_peak_bytes": peak_bytes,
        "footprint_error": estimate / peak_bytes - 1,
        "step_s": statistics.median(times),
        "step_times_s": times,
    }


def table(res: dict) -> str:
    """Markdown: one row per (model, precision), MiB and seconds (bench/tools/tables.py renders it)."""
    head = [
        "model",
        "precision",
        "weights W (MiB)",
        "footprint (MiB)",
        "RSS built (MiB)",
        "RSS step peak (MiB)",
        "footprint / peak",
        "step (s)",
    ]
    mib = 2**20
    keys = ("footprint_weights_bytes", "footprint_bytes", "rss_built_bytes", "rss_step_peak_bytes")
    rows = [
        [r["model"], r["precision"], *(f"{r[k] / mib:.0f}" for k in keys)]
        + [f"{r['footprint_bytes'] / r['rss_step_peak_bytes']:.2f}", f"{r['step_s']:.2f}"]
        for r in res["rows"]
    ]
    return "\n".join(markdown_table(head, rows)) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--precisions", nargs="+", default=list(PRECISIONS))
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "PRECISION"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*a.child, a.rank, a.batch, a.tokens, a.steps, a.threads)))
        return
    rows = []
    for model in a.models:
        for precision in a.precisions:
            args = [*map(str, ("--rank", a.rank, "--batch", a.batch, "--tokens", a.tokens))]
            args += [*map(str, ("--steps", a.steps, "--threads", a.threads))]
            res = subprocess.run(
                [sys.executable, __file__, "--child", model, precision, *args], capture_output=True, text=True
            )
            if res.returncode != 0:
                raise SystemExit(f"{model} {precision}: {res.stderr[-2000:]}")
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr)
    out = {
        "bench": "quantization_memory",
        "settings": {k: getattr(a, k) for k in ("rank", "batch", "tokens", "steps", "threads")},
        "rows": rows,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
