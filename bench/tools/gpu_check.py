"""The prepared GPU check of issue 13: one script, about 8 minutes on one H200, one JSON file.

    python bench/tools/gpu_check.py --out bench/results/gpu_check_h200.json   # on a CUDA machine
    python bench/tools/gpu_check.py --dry-run                                 # every part at tiny sizes on the CPU

Parts (each timed and guarded: a part that fails records its error and the others still run):

- ``cuda_tests``: the CUDA-marked tests (``pytest -m cuda``).
- ``lora_vs_peft``: tokens per second and peak memory of one local step (forward, backward, AdamW)
  of plain LoRA (r = 8 on q, k, v, o) through nestfed (nestfed.nn.lora, its training loss) against
  PEFT's own LoRA on the same random-initialised model, batch and dtype (bf16 weights, fp32
  adapters, autocast), at two real shapes: SmolLM2-135M's and TinyLlama-1.1B's. Criterion: nestfed
  >= 0.9x PEFT's tokens per second.
- ``qlora``: a QLoRA step (issue 34): nestfed's LoRA over an nf4 backbone (``model.quantization``)
  against PEFT's LoRA over the same nf4 layers, tokens per second interleaved (criterion >= 0.9x),
  and the nf4 step's peak memory over the same model's bf16 LoRA step. Needs bitsandbytes
  (``bench/tools/gpu_bundle.sh`` carries its wheel).
- ``prelort``: one PreLort step with |R_k| = 1..4 nested sub-ranks (R_k = the top |R_k| of 1, 2, 4,
  8): a step costs about |R_k| passes (arXiv 2606.15963 section 2.2), ``objective = "sampled"`` one.
- ``fednl``: a FedNL step (the delta-rule memory on every layer, through flash-linear-attention's
  fused kernel when it imports: nestfed.ops.delta_rule) against plain LoRA. Criterion: >= 0.7x.
- ``fedslm``: a FedSLM client at compression ratio 0.5 (every projection factorised, cores
  trained) against the full-model LoRA client, both with activation checkpointing: peak memory
  (criterion <= 0.6x) and tokens per second.
- ``two_rounds``: two federated rounds of the main job's protocol (configs/bbc_news.toml, four
  methods) through ``nestfed run`` on the GPU. The real SmolLM2 cannot travel (its GGUF is 98 MB,
  a call carries 64 MiB): the run uses a random-initialised model of SmolLM2-135M's shape with
  SmolLM2's real tokenizer and the real BBC News text, from ``--bundle`` (made here by
  ``bench/tools/gpu_bundle.sh``); the point is that the protocol runs end to end on CUDA, not its
  perplexities.

The GPU machine is bare (PyTorch, transformers, peft; no network): ``bench/tools/gpu_bundle.sh`` puts the
wheels nestfed needs beyond those (and flash-linear-attention's) into ``.whl`` and the tokenizer and
data into ``.gpu_bundle``; the device command installs the wheels to /tmp/site first. Exit status 0
when every part ran and every criterion held, 1 otherwise. --dry-run runs the same code on CPU in
float32 at tiny shapes and sizes (tests/test_gpu_check.py runs it in CI): it catches typos, not speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {  # real shapes of the two models the issue names (random weights)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=258, tie_word_embeddings=False),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class Setting:
    """Where and how big: the device, dtype, batch [rows, tokens], timed steps, model shapes."""

    def __init__(self, dry: bool):
        self.dry = dry
        self.device = torch.device("cpu" if dry else "cuda")
        self.dtype = torch.float32 if dry else torch.bfloat16
        self.steps = 2 if dry else 8
        self.shapes = ["tiny"] if dry else ["smollm2-135m", "tinyllama-1.1b"]

    def batch(self, shape: str) -> tuple[int, int]:
        if self.dry:
            return 2, 32
        return (8, 1024) if shape == "smollm2-135m" else (4, 1024)


def model_of(shape: str, s: Setting, seed: int = 0):
    """A random-initialised Llama-family causal LM of ``shape``, frozen, on the device in s.dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(max_position_embeddings=4096, attn_implementation="sdpa", **SHAPES[shape])
    with torch.device(s.device):
        model = LlamaForCausalLM(cfg).to(s.dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def sync(s: Setting) -> None:
    if s.device.type == "cuda":
        torch.cuda.synchronize()


def stepper(step, params):
    """One local step (zero_grad, ``step()`` = forward + backward, AdamW) as a function."""
    opt = torch.optim.AdamW(params, lr=1e-4)

    def one():
        opt.zero_grad(set_to_none=True)
        step()
        opt.step()

    return one


def timed_steps(step, params, s: Setting, tokens: int) -> dict:
    """Median tokens/s of ``s.steps`` AdamW steps after one warm-up; peak CUDA memory (bytes) of
    the timed steps (None on the CPU)."""
    one = stepper(step, params)
    one()
    sync(s)
    if s.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(s.steps):
        t0 = time.perf_counter()
        one()
        sync(s)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if s.device.type == "cuda" else None
    return {"tokens_per_s": tokens / statistics.median(times), "step_s_median": statistics.median(times),
            "peak_memory_bytes": peak}


def interleaved(steps: dict, s: Setting, tokens: int) -> dict:
    """{name: median tokens/s} of the given step functions timed in alternation (``s.steps``
    rounds after a warm-up round), so a machine's drift hits all of them alike."""
    times = {name: [] for name in steps}
    for name, one in steps.items():
        one()
    for _ in range(s.steps):
        for name, one in steps.items():
            sync(s)
            t0 = time.perf_counter()
            one()
            sync(s)
            times[name].append(time.perf_counter() - t0)
    return {name: tokens / statistics.median(t) for name, t in times.items()}


def free(s: Setting) -> None:
    """The CUDA cache released between parts (nestfed.nn.placement.release; nothing on the CPU)."""
    from nestfed.nn.placement import release

    release(s.device)


def nestfed_lora(shape: str, s: Setting, rank: int = 8):
    from nestfed.nn.lora import inject_lora, lora_modules

    model = model_of(shape, s)
    inject_lora(model, TARGETS, rank, 16.0 / rank)
    params = [p for m in lora_modules(model).values() for p in (m.lora_A.weight, m.lora_B.weight)]
    for p in params:
        p.requires_grad_(True)
    return model, params


def batch_of(shape: str, s: Setting):
    from nestfed.federation.training import Batch

    B, T = s.batch(shape)
    ids = torch.randint(0, SHAPES[shape]["vocab_size"], (B, T), generator=torch.Generator().manual_seed(1))
    return Batch(ids.clone(), input_ids=ids), B * T


def peft_lora(model, ids, s: Setting):
    """PEFT's LoRA (r = 8 on q, k, v, o) over ``model`` in training mode: (model, trainable
    parameters, one forward + backward on ``ids`` under autocast in s.dtype)."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGETS)))
    peft_model.train()
    autocast = torch.autocast(s.device.type, dtype=s.dtype, enabled=s.dtype != torch.float32)

    def step():
        with autocast:
            loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()

    return peft_model, [p for p in peft_model.parameters() if p.requires_grad], step


def part_lora_vs_peft(s: Setting) -> dict:
    """Peak memory of each side alone (the other deleted), then tokens/s of both timed in alternation."""
    out = {}
    for shape in s.shapes:
        batch, tokens = batch_of(shape, s)
        ids = batch.input_ids.to(s.device)

        def build_ours():
            model, params = nestfed_lora(shape, s)
            model.train()
            return model, params, lambda: batch.loss(model).backward()

        def build_peft():
            return peft_lora(model_of(shape, s), ids, s)

        alone = {}
        for name, build in (("nestfed", build_ours), ("peft", build_peft)):
            model, params, step = build()
            alone[name] = timed_steps(step, params, s, tokens)
            del model, params, step
            free(s)
        ours, peft = build_ours(), build_peft()
        speed = interleaved({"nestfed": stepper(ours[2], ours[1]), "peft": stepper(peft[2], peft[1])}, s, tokens)
        del ours, peft
        free(s)
        out[shape] = {"batch": list(s.batch(shape)), "alone": alone, "tokens_per_s_interleaved": speed,
                      "tokens_per_s_ratio": speed["nestfed"] / speed["peft"],
                      "peak_memory_ratio": None if alone["peft"]["peak_memory_bytes"] is None
                      else alone["nestfed"]["peak_memory_bytes"] / alone["peft"]["peak_memory_bytes"],
                      "adapter_dtype": "float32", "frozen_dtype": str(s.dtype).removeprefix("torch.")}
    return out


def quantised_model(shape: str, s: Setting):
    """``model_of`` with its linear layers in nf4 (nestfed.nn.quantization, QLoRA's double
    quantisation, computing in s.dtype), as ``model.quantization = "nf4"`` holds a backbone."""
    from nestfed.nn.quantization import quantize_linears

    model = model_of(shape, s)
    quantize_linears(model, "nf4", s.dtype, double_quant=True)
    return model


def part_qlora(s: Setting) -> dict:
    """A QLoRA step (issue 34): nestfed's LoRA over an nf4 backbone against PEFT's LoRA over the
    same nf4 layers (the same random model, batch and adapter init), tokens per second interleaved,
    and the nf4 step's peak memory against the same model's plain LoRA step in s.dtype. Criterion:
    nestfed >= 0.9x PEFT's tokens per second."""
    from nestfed.nn.lora import inject_lora, lora_modules

    shape = s.shapes[0]
    batch, tokens = batch_of(shape, s)
    ids = batch.input_ids.to(s.device)

    def ours(model, params):
        model.train()
        return model, params, lambda: batch.loss(model).backward()

    def build_nf4():
        model = quantised_model(shape, s)
        inject_lora(model, TARGETS, 8, 16.0 / 8)
        params = [p for m in lora_modules(model).values() for p in (m.lora_A.weight, m.lora_B.weight)]
        for p in params:
            p.requires_grad_(True)
        return ours(model, params)

    builds = {"nestfed_nf4": build_nf4, "peft_nf4": lambda: peft_lora(quantised_model(shape, s), ids, s),
              "nestfed_dense": lambda: ours(*nestfed_lora(shape, s))}
    alone = {}
    for name, build in builds.items():
        model, params, step = build()
        alone[name] = timed_steps(step, params, s, tokens)
        del model, params, step
        free(s)
    a, b = builds["nestfed_nf4"](), builds["peft_nf4"]()
    speed = interleaved({"nestfed": stepper(a[2], a[1]), "peft": stepper(b[2], b[1])}, s, tokens)
    del a, b
    free(s)
    peaks = {k: v["peak_memory_bytes"] for k, v in alone.items()}
    return {"shape": shape, "batch": list(s.batch(shape)), "alone": alone, "tokens_per_s_interleaved": speed,
            "tokens_per_s_ratio": speed["nestfed"] / speed["peft"],
            "nf4_over_dense_peak_memory": None if peaks["nestfed_dense"] is None
            else peaks["nestfed_nf4"] / peaks["nestfed_dense"]}


def lora_setup(s: Setting):
    """The first shape's LoRA model (training mode), its trainable parameters, a batch and its tokens."""
    shape = s.shapes[0]
    batch, tokens = batch_of(shape, s)
    model, params = nestfed_lora(shape, s)
    model.train()
    return shape, model, params, batch, tokens


def part_prelort(s: Setting) -> dict:
    from nestfed.methods.prelort.strategy import nested_loss

    _, model, params, batch, tokens = lora_setup(s)
    out = {}
    for n in (1, 2, 3, 4):
        subranks = [1, 2, 4, 8][-n:]
        out[f"R_k={n}"] = timed_steps(lambda: nested_loss(model, batch, subranks), params, s, tokens)
    base = out["R_k=1"]["tokens_per_s"]
    for n in (1, 2, 3, 4):
        out[f"R_k={n}"]["cost_vs_one_pass"] = base / out[f"R_k={n}"]["tokens_per_s"]
    del model, params
    free(s)
    return out


def part_fednl(s: Setting) -> dict:
    from nestfed.nn.memory import MemorySettings, install_memory, memory_rules, set_memory_enabled
    from nestfed.ops import delta_rule as dr

    shape, model, params, batch, tokens = lora_setup(s)
    plain = timed_steps(lambda: batch.loss(model).backward(), params, s, tokens)
    mem_model, mem_params = nestfed_lora(shape, s)
    install_memory(mem_model, MemorySettings(gate="learned", chunk_size=64))
    set_memory_enabled(mem_model, True)
    rules = [p for r in memory_rules(mem_model).values() for p in r.parameters()]
    for p in rules:
        p.requires_grad_(True)
    mem_model.train()
    fednl = timed_steps(lambda: batch.loss(mem_model).backward(), mem_params + rules, s, tokens)
    speed = interleaved({"plain_lora": stepper(lambda: batch.loss(model).backward(), params),
                         "fednl": stepper(lambda: batch.loss(mem_model).backward(), mem_params + rules)}, s, tokens)
    fused = s.device.type == "cuda" and dr._fla_chunk_delta_rule() is not None
    del model, params, mem_model, mem_params, rules
    free(s)
    return {"alone": {"plain_lora": plain, "fednl": fednl}, "tokens_per_s_interleaved": speed, "fused_kernel": fused,
            "tokens_per_s_ratio": speed["fednl"] / speed["plain_lora"]}


def part_fedslm(s: Setting) -> dict:
    from nestfed.nn.checkpointing import enable_activation_checkpointing
    from nestfed.nn.svd import compute_bases, derive_compressed, svd_modules

    shape = s.shapes[0]
    batch, tokens = batch_of(shape, s)
    B, T = s.batch(shape)
    batch.labels, batch.input_ids = batch.labels[:, : T // 2], batch.input_ids[:, : T // 2]
    tokens //= 2
    model, params = nestfed_lora(shape, s)
    enable_activation_checkpointing(model)
    model.train()
    full = timed_steps(lambda: batch.loss(model).backward(), params, s, tokens)
    del model, params
    free(s)
    base = model_of(shape, s)
    bases = compute_bases(base, [0.5])
    compressed = derive_compressed(base, bases, 0.5)
    del base, bases
    free(s)
    enable_activation_checkpointing(compressed)
    cores = [m.sigma for m in svd_modules(compressed).values()]
    for p in cores:
        p.requires_grad_(True)
    compressed.train()
    slm = timed_steps(lambda: batch.loss(compressed).backward(), cores, s, tokens)
    del compressed, cores
    free(s)
    ratio = None if full["peak_memory_bytes"] is None else slm["peak_memory_bytes"] / full["peak_memory_bytes"]
    return {"full_lora": full, "fedslm_rho_0.5": slm, "peak_memory_ratio": ratio,
            "tokens_per_s_ratio": slm["tokens_per_s"] / full["tokens_per_s"], "levers": "activation checkpointing"}


def part_two_rounds(s: Setting, bundle: Path) -> dict:
    out_dir = Path(tempfile.mkdtemp(prefix="gpu-check-run-"))
    if s.dry:
        config, extra = ROOT / "configs" / "tiny.toml", ["--set", "model.device=cpu"]
    else:
        model_dir = bundle / "smollm2-135m-random"
        if not (bundle / "tokenizer" / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{bundle}/tokenizer: run bench/tools/gpu_bundle.sh here and carry .gpu_bundle")
        if not (model_dir / "config.json").is_file():
            from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

            torch.manual_seed(0)
            LlamaForCausalLM(LlamaConfig(max_position_embeddings=8192, **SHAPES["smollm2-135m"])).save_pretrained(model_dir)
            AutoTokenizer.from_pretrained(bundle / "tokenizer").save_pretrained(model_dir)
        config, extra = ROOT / "configs" / "bbc_news.toml", ["--set", f"model.name={model_dir}",
                                                            "--set", "model.device=cuda"]
    cmd = [sys.executable, "-m", "nestfed.cli", "run", str(config), "--methods", "prelort,zeropad,hetlora,flora",
           "--set", "federation.rounds=2", "--set", f"output.dir={out_dir}", "--set", "output.plots=false", *extra]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    summaries = sorted(out_dir.rglob("summary.json"))
    return {"returncode": p.returncode, "seconds": time.perf_counter() - t0, "finished_runs": len(summaries),
            "finished": p.returncode == 0 and len(summaries) == 4,
            "summaries": [json.loads(x.read_text()) for x in summaries][:4],
            "stderr_tail": p.stderr[-2000:]}


def part_cuda_tests(s: Setting) -> dict:
    files = [str(f.relative_to(ROOT)) for f in sorted((ROOT / "tests").rglob("test_*.py"))
             if "mark.cuda" in f.read_text()]
    # -n 0: one process (the suite's addopts start two pytest-xdist workers, each importing everything)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "cuda", "-p", "no:cacheprovider", *files],
                       capture_output=True, text=True, cwd=ROOT)
    return {"returncode": p.returncode, "files": files, "summary": p.stdout.strip().splitlines()[-1:]}


def criteria(results: dict, dry: bool) -> dict:
    """The issue's pass marks, read from the parts' results (None where a part did not run)."""
    def get(*keys):
        r = results
        for k in keys:
            if not isinstance(r, dict) or k not in r:
                return None
            r = r[k]
        return r

    lora = [get("lora_vs_peft", "result", shape, "tokens_per_s_ratio") for shape in Setting(dry).shapes]
    out = {"lora_tokens_per_s_vs_peft>=0.9": None if None in lora else all(x >= 0.9 for x in lora),
           "fednl_fused_vs_lora>=0.7": None if get("fednl", "result", "tokens_per_s_ratio") is None
           else get("fednl", "result", "tokens_per_s_ratio") >= 0.7,
           "fedslm_peak_memory<=0.6": None if get("fedslm", "result", "peak_memory_ratio") is None
           else get("fedslm", "result", "peak_memory_ratio") <= 0.6,
           "qlora_tokens_per_s_vs_peft>=0.9": None if get("qlora", "result", "tokens_per_s_ratio") is None
           else get("qlora", "result", "tokens_per_s_ratio") >= 0.9,
           "two_rounds_finished": get("two_rounds", "result", "finished"),
           "cuda_tests_passed": None if get("cuda_tests", "result", "returncode") is None
           else get("cuda_tests", "result", "returncode") == 0}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="every part on the CPU at tiny sizes (no GPU needed)")
    ap.add_argument("--out", type=Path, help="write the JSON here too")
    ap.add_argument("--bundle", type=Path, default=ROOT / ".gpu_bundle", help="tokenizer and data (gpu_bundle.sh)")
    ap.add_argument("--parts", nargs="+", default=["cuda_tests", "lora_vs_peft", "qlora", "prelort", "fednl",
                                                   "fedslm", "two_rounds"])
    a = ap.parse_args()
    if not a.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run for the CPU check", file=sys.stderr)
        return 2
    s = Setting(a.dry_run)
    parts = {"cuda_tests": part_cuda_tests, "lora_vs_peft": part_lora_vs_peft, "qlora": part_qlora, "prelort": part_prelort,
             "fednl": part_fednl, "fedslm": part_fedslm, "two_rounds": lambda s: part_two_rounds(s, a.bundle)}
    import transformers

    results: dict = {"bench": "gpu_check", "dry_run": a.dry_run, "torch": torch.__version__,
                     "transformers": transformers.__version__,
                     "device": torch.cuda.get_device_name(0) if s.device.type == "cuda" else "cpu",
                     "dtype": str(s.dtype).removeprefix("torch.")}
    for name in a.parts:
        t0 = time.perf_counter()
        try:
            results[name] = {"result": parts[name](s)}
        except Exception as exc:  # a failed part is recorded; the others still run
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        results[name]["seconds"] = time.perf_counter() - t0
        print(f"{name}: {'error' if 'error' in results[name] else 'done'} in {results[name]['seconds']:.1f} s",
              file=sys.stderr, flush=True)
    results["criteria"] = criteria(results, a.dry_run)
    text = json.dumps(results, indent=2, default=str)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(text)
    ran = all("error" not in results[n] for n in a.parts)
    held = all(v is not False for v in results["criteria"].values())
    return 0 if ran and (held or a.dry_run) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
