"""FedSLM client memory and speed: a compressed SmolLM2 against the full model (arXiv 2607.29071
reports about 50% of the full model's GPU memory and a higher inference throughput).

Prints one JSON object (and writes it with --out). Every setting runs in its own fresh
subprocess, so one setting's allocations never hide another's:

- ``full+lora``: the full SmolLM2-135M (fp32) with LoRA r = 8 on q, k, v, o of every layer
  trainable: a FedAvg+LoRA / HetLoRA client.
- ``svd rho=<r>``: the compressed client, every attention and MLP projection factorised
  (compression.target's default) at ratio rho, every core trainable; built without ever
  materialising the full model (the skeleton on the meta device, the embeddings and norms read
  from the safetensors file, the bases' prefixes read from the server's SVD file).
- ``svd-top4 rho=0.5``: the FedSLM experiment's placement (configs/fedslm_bbc_news.toml), with
  ``full+lora-top4`` (LoRA r = 8 on q, k, v, o of the top four layers) as its full-model match.

Memory, measured two ways (tracemalloc does not see torch's allocations):
- ``accounting``: parameter + buffer bytes (shared storage once), gradient bytes (= trainable),
  AdamW state (2 x trainable), and the bytes of the tensors autograd saves for backward during
  the forward (saved_tensors_hooks; storages deduplicated, parameters and buffers excluded; with
  micro-batches the largest micro-batch's, since each one's backward frees them).
  ``train_peak_est_bytes`` = their sum: a lower bound on a training step's peak (transient
  buffers inside kernels are not counted).
- ``rss``: the process's resident memory after the model is built, and the peak of the resident
  memory sampled every 2 ms during the second training step (forward + backward + AdamW; after a
  malloc_trim, so that freed heap from the first step does not count), both
  minus the resident memory of the bare process after importing torch and transformers.
  The full model is memory-mapped by from_pretrained: its weights become resident only when a
  step touches them, so compare the step peaks, not ``model_built_bytes``.
Speed (``speed``): all models (full and every ratio, every projection factorised) in one process,
timed interleaved so that the load of a shared machine hits them alike: prefill tokens/s (no-grad
forward of 1 x 128 tokens) and greedy decode tokens/s (16 new tokens with the KV cache after a
16-token prompt), medians over ``--repeats`` rounds. ``train_step_s`` of the memory settings is
one step each, in separate processes: indicative only on a loaded machine.

    python bench/perf/fedslm_memory.py [--ratios 0.3 0.5 0.7] [--batch 4] [--tokens 128] [--out FILE]
        [--levers none|nestfed|checkpoint|checkpoint+micro] [--micro 1] [--only SETTING ...] [--no-speed]

--levers (issue 13's memory levers, the same for both sides of a comparison): ``nestfed`` is
nestfed's own training loss (nestfed.federation.training.Batch: the LM head only where a next
token is labelled), ``checkpoint`` adds activation checkpointing of every decoder layer
(nestfed.nn.checkpointing), ``checkpoint+micro`` micro-batches of --micro rows accumulating one step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from nestfed.io.markdown import markdown_table

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
TOP4 = r"(.*\.)?layers\.(26|27|28|29)\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class PeakSampler:
    """Samples the resident memory every ``period`` seconds in a thread; ``peak`` is the maximum."""

    def __init__(self, period: float = 0.002):
        self.period, self.peak, self._stop = period, rss(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.period)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())


def build_compressed(model_dir: Path, bases_path: Path, ratio: float, target: str):
    """The compressed client from files only: no [out, in] weight of a factorised layer is loaded."""
    import re

    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from nestfed.nn.svd import SVDLinear, rank_for_ratio

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    rx = re.compile(target)
    targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and rx.fullmatch(n)]
    with safe_open(str(bases_path), framework="pt") as fb:
        for name in targets:
            lin = model.get_submodule(name)
            r = rank_for_ratio(lin.out_features, lin.in_features, ratio)
            U = fb.get_slice(f"{name}.U")[:, :r]
            V = fb.get_slice(f"{name}.V")[:, :r]
            S = fb.get_slice(f"{name}.S")[:r]
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, SVDLinear(U, V, torch.diag(S)))
    state = {}
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as fm:
        wanted = {n + ".weight" for n in targets}
        for key in fm.keys():
            if key not in wanted:
                state[key] = fm.get_tensor(key)
    model.load_state_dict(state, strict=False, assign=True)
    rot = model.model.rotary_emb
    model.model.rotary_emb = type(rot)(config=config)  # its inv_freq buffer was on meta
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"still on the meta device: {left[:5]}")
    return model.eval(), targets


PASS_STARTS: list = []  # called at the start of every forward pass while accounting() listens


def new_pass() -> None:
    for f in PASS_STARTS:
        f()


def accounting(model, trainable, step_fn) -> dict:
    """Bytes of parameters, buffers, gradients, AdamW state, and tensors saved for backward (the
    largest forward pass's: micro-batches free theirs in their own backward)."""
    import torch

    held = set()
    p_bytes = b_bytes = 0
    for t in model.parameters():
        if t.untyped_storage().data_ptr() not in held:
            held.add(t.untyped_storage().data_ptr())
            p_bytes += t.untyped_storage().nbytes()
    for t in model.buffers():
        if t.untyped_storage().data_ptr() not in held:
            held.add(t.untyped_storage().data_ptr())
            b_bytes += t.untyped_storage().nbytes()
    passes = []  # {storage: bytes} saved by each forward pass (a micro-batch's are freed by its backward)

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in held:
            passes[-1][st.data_ptr()] = st.nbytes()
        return t

    PASS_STARTS.append(lambda: passes.append({}))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step_fn()
    PASS_STARTS.clear()
    tr = sum(p.numel() * p.element_size() for p in trainable)
    out = {
        "parameter_bytes": p_bytes,
        "buffer_bytes": b_bytes,
        "trainable_bytes": tr,
        "gradient_bytes": tr,
        "adamw_state_bytes": 2 * tr,
        "saved_activation_bytes": max(sum(p.values()) for p in passes),
        "forward_passes": len(passes),
    }
    out["train_peak_est_bytes"] = p_bytes + b_bytes + 2 * tr + 2 * tr + out["saved_activation_bytes"]
    return out


def child(
    setting: str,
    ratio: float,
    model_dir: Path,
    bases: Path,
    batch: int,
    tokens: int,
    threads: int,
    levers: str = "none",
    micro: int = 1,
) -> dict:
    """Measure one setting in this (fresh) process. levers: ``none`` (the model's own forward and a
    full [B, T, V] loss, as first measured), ``nestfed`` (nestfed's training loss, LM head on the
    labelled positions), ``checkpoint`` (that, with activation checkpointing of every decoder
    layer) or ``checkpoint+micro`` (that, in micro-batches of ``micro`` rows accumulating one step)."""
    import torch
    import transformers  # noqa: F401  (imported before the baseline RSS on purpose)

    torch.set_num_threads(threads)
    from nestfed.federation.training import Batch
    from nestfed.nn.checkpointing import enable_activation_checkpointing
    from nestfed.nn.frozen_prefix import causal_lm_loss
    from nestfed.nn.lora import inject_lora, lora_modules
    from nestfed.nn.svd import svd_modules

    rss0 = rss()
    if setting.startswith("full+lora"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        inject_lora(model, LORA_TARGETS, 8, 2.0, (-4, -3, -2, -1) if setting.endswith("top4") else ())
        for m in lora_modules(model).values():
            torch.nn.init.normal_(m.lora_B.weight, std=1e-3)
        trainable = [p for m in lora_modules(model).values() for p in (m.lora_A.weight, m.lora_B.weight)]
        factorised = 0
    else:
        target = (
            TOP4
            if setting.startswith("svd-top4")
            else r"(.*\.)?layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
        )
        model, targets = build_compressed(model_dir, bases, ratio, target)
        for p in model.parameters():
            p.requires_grad_(False)
        trainable = [m.sigma for m in svd_modules(model).values()]
        factorised = len(targets)
    rss_built = rss()
    for p in trainable:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(trainable, lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(0))

    if levers.startswith("checkpoint"):
        enable_activation_checkpointing(model)
    whole = Batch(ids.clone(), input_ids=ids)

    def fwd_bwd():
        if levers == "none":
            new_pass()
            causal_lm_loss(model(input_ids=ids).logits, ids).backward()
            return
        for mb in whole.micro_batches(micro if levers.endswith("micro") else 0):
            new_pass()
            mb.loss(model).backward()

    def step():
        opt.zero_grad(set_to_none=True)
        fwd_bwd()
        opt.step()

    model.train()
    acc = accounting(model, trainable, step)  # the first step (allocates AdamW state)
    _malloc_trim()  # give freed heap back, so the sampled peak is the next step's own
    t0 = time.perf_counter()
    with PeakSampler() as s:
        step()
    step_s = time.perf_counter() - t0
    return {
        "setting": setting,
        "ratio": ratio,
        "levers": levers,
        "micro_batch_rows": micro if levers.endswith("micro") else batch,
        "factorised_layers": factorised,
        "accounting": acc,
        "rss": {
            "model_built_bytes": rss_built - rss0,
            "train_step_peak_bytes": s.peak - rss0,
            "lifetime_peak_bytes": _maxrss() - rss0,
        },
        "train_step_s": step_s,
        "train_tokens_per_s": batch * tokens / step_s,
    }


def speed(model_dir: Path, bases: Path, ratios: list[float], threads: int, repeats: int) -> dict:
    """Interleaved prefill and decode timings of the full model and every compressed model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    target = r"(.*\.)?layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
    models = {"full": AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()}
    for r in ratios:
        models[f"svd rho={r:g}"] = build_compressed(model_dir, bases, r, target)[0]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 49152, (1, 128), generator=g)
    times = {n: {"prefill": [], "decode": []} for n in models}
    with torch.no_grad():
        for rep in range(repeats + 1):
            for name, m in models.items():
                t0 = time.perf_counter()
                m(input_ids=prompt)
                t1 = time.perf_counter()
                m.generate(prompt[:, :16], max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
                t2 = time.perf_counter()
                if rep:  # the first round warms up
                    times[name]["prefill"].append(t1 - t0)
                    times[name]["decode"].append(t2 - t1)
    out = {
        n: {
            "prefill_tokens_per_s": 128 / statistics.median(t["prefill"]),
            "decode_tokens_per_s": 16 / statistics.median(t["decode"]),
        }
        for n, t in times.items()
    }
    for n in out:
        out[n]["prefill_vs_full"] = out[n]["prefill_tokens_per_s"] / out["full"]["prefill_tokens_per_s"]
        out[n]["decode_vs_full"] = out[n]["decode_tokens_per_s"] / out["full"]["decode_tokens_per_s"]
    return {"threads": threads, "repeats": repeats, "models": out}


def _malloc_trim() -> None:
    """glibc's malloc_trim(0): return freed heap pages to the OS (resident memory otherwise keeps
    the high-water mark of everything before, the first step's and the model loading's)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _maxrss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


LEVERS = {  # a result's ``levers`` -> its row label in docs/gpus.md's table
    "none": "none (the model's own forward)",
    "nestfed": "none",
    "checkpoint": "activation checkpointing",
    "checkpoint+micro": "checkpointing + micro-batches of {micro} rows",
}


def table(result: dict) -> str:
    """docs/gpus.md's row for one levers file: the compressed client (the first ``svd`` setting)
    against the full client, MiB, as ``full vs compressed``; tables.py stacks the files' rows."""
    full = next(r for r in result["results"] if r["setting"] == "full+lora")
    svd = next(r for r in result["results"] if r["setting"].startswith("svd"))
    mib = 2**20

    def pair(get) -> str:
        return f"{get(full) / mib:.0f} vs {get(svd) / mib:.0f}"

    label = LEVERS.get(svd["levers"], svd["levers"]).format(micro=svd["micro_batch_rows"])
    label = label.replace("of 1 rows", "of 1 row")
    row = [
        label,
        pair(lambda r: r["accounting"]["parameter_bytes"] + r["accounting"]["buffer_bytes"]),
        pair(lambda r: r["accounting"]["saved_activation_bytes"]),
        pair(lambda r: r["accounting"]["train_peak_est_bytes"]),
        pair(lambda r: r["rss"]["train_step_peak_bytes"]),
        f"{svd['vs_full']['train_peak_est_bytes']:.2f} / {svd['vs_full']['rss_train_step_peak']:.2f}",
    ]
    head = [
        "levers (both sides)",
        "params + buffers",
        "saved for backward",
        "estimate (lower bound)",
        "sampled RSS peak",
        "ratio: estimate / RSS",
    ]
    return "\n".join(markdown_table(head, [row])) + "\n"


def main() -> None:  # noqa: PLR0915 (the command line, then one subprocess per setting)
    ap = argparse.ArgumentParser()
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", nargs=2, metavar=("SETTING", "RATIO"))
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--bases", type=Path)
    ap.add_argument("--levers", choices=["none", "nestfed", "checkpoint", "checkpoint+micro"], default="none")
    ap.add_argument("--micro", type=int, default=1, help="rows per micro-batch with --levers checkpoint+micro")
    ap.add_argument("--only", nargs="+", help="measure only these settings (e.g. 'full+lora' 'svd rho=0.5')")
    ap.add_argument("--no-speed", action="store_true", help="skip the interleaved speed measurement")
    a = ap.parse_args()
    if a.child:
        if a.child[0] == "speed":
            ratios = [float(x) for x in a.child[1].split(",")]
            print(json.dumps(speed(a.model_dir, a.bases, ratios, a.threads, a.repeats)))
        else:
            print(
                json.dumps(
                    child(
                        a.child[0],
                        float(a.child[1]),
                        a.model_dir,
                        a.bases,
                        a.batch,
                        a.tokens,
                        a.threads,
                        a.levers,
                        a.micro,
                    )
                )
            )
        return
    import torch

    from nestfed.config import ModelConfig
    from nestfed.nn.backbone import SMOLLM2, convert_builtin, default_cache_dir, load_backbone
    from nestfed.nn.svd import compute_bases, save_bases

    model_dir = convert_builtin(SMOLLM2, default_cache_dir())
    top = max(a.ratios + [0.5])
    bases_path = default_cache_dir() / "svd" / f"bench-all-projections-{top}.safetensors"
    t_svd = None
    if not bases_path.is_file():
        torch.set_num_threads(a.threads)
        model = load_backbone(ModelConfig(name="smollm2-135m")).model
        t0 = time.perf_counter()
        bases = compute_bases(model, [top])
        t_svd = time.perf_counter() - t0
        save_bases(bases, bases_path, {"ratio": str(top)})
        del model, bases
    settings = (
        [("full+lora", 0.0)]
        + [(f"svd rho={r:g}", r) for r in a.ratios]
        + [("full+lora-top4", 0.0), ("svd-top4 rho=0.5", 0.5)]
    )
    settings = [(n, r) for n, r in settings if not a.only or n in a.only]
    partial = (a.out or Path("/tmp/fedslm_memory.json")).with_suffix(".partial.json")
    done = json.loads(partial.read_text()) if partial.is_file() else {}
    args_key = f"{a.batch}x{a.tokens}@{a.threads}|{a.levers}|{a.micro}"
    results = []
    for name, r in settings:
        if f"{name}|{args_key}" in done:  # a rerun resumes after the settings already measured
            results.append(done[f"{name}|{args_key}"])
            continue
        cmd = [
            sys.executable,
            __file__,
            "--child",
            name,
            str(r),
            "--model-dir",
            str(model_dir),
            "--bases",
            str(bases_path),
            "--batch",
            str(a.batch),
            "--tokens",
            str(a.tokens),
            "--threads",
            str(a.threads),
            "--repeats",
            str(a.repeats),
            "--levers",
            a.levers,
            "--micro",
            str(a.micro),
        ]
        p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
        if p.returncode != 0:
            raise SystemExit(f"{name} failed:\n{p.stderr[-3000:]}")
        results.append(json.loads(p.stdout.strip().splitlines()[-1]))
        done[f"{name}|{args_key}"] = results[-1]
        partial.write_text(json.dumps(done))
        print(f"{name}: done", file=sys.stderr, flush=True)
    speed_key = f"speed|{args_key}|{a.repeats}"
    if a.no_speed:
        done[speed_key] = None
    if speed_key not in done:
        cmd = [
            sys.executable,
            __file__,
            "--child",
            "speed",
            ",".join(f"{r:g}" for r in a.ratios),
            "--model-dir",
            str(model_dir),
            "--bases",
            str(bases_path),
            "--threads",
            str(a.threads),
            "--repeats",
            str(a.repeats),
        ]
        p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
        if p.returncode != 0:
            raise SystemExit(f"speed failed:\n{p.stderr[-3000:]}")
        done[speed_key] = json.loads(p.stdout.strip().splitlines()[-1])
        partial.write_text(json.dumps(done))
    by_name = {r["setting"]: r for r in results}
    for r in results:
        full = by_name.get("full+lora-top4" if r["setting"].endswith("top4") or "top4" in r["setting"] else "full+lora")
        if full is None:
            continue
        r["vs_full"] = {
            "compared_with": full["setting"],
            "parameter_and_buffer_bytes": (r["accounting"]["parameter_bytes"] + r["accounting"]["buffer_bytes"])
            / (full["accounting"]["parameter_bytes"] + full["accounting"]["buffer_bytes"]),
            "train_peak_est_bytes": r["accounting"]["train_peak_est_bytes"]
            / full["accounting"]["train_peak_est_bytes"],
            "rss_train_step_peak": r["rss"]["train_step_peak_bytes"] / full["rss"]["train_step_peak_bytes"],
        }
    out = {
        "bench": "fedslm_memory",
        "model": "SmolLM2-135M-Instruct fp32",
        "batch": [a.batch, a.tokens],
        "levers": a.levers,
        "threads": a.threads,
        "svd_seconds": t_svd,
        "method": __doc__.split("Memory, measured")[1].strip(),
        "results": results,
        "speed": done[speed_key],
    }
    text = json.dumps(out, indent=2)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    partial.unlink(missing_ok=True)
    print(text)


if __name__ == "__main__":
    main()
