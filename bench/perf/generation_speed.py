"""Generation speed side by side: nestfed's batched generation (nestfed.evaluation.generation, the
KV-cache path) against transformers' ``generate`` with the same LoRA adapter loaded by PEFT, on the
same model (SmolLM2-135M-Instruct), prompts (BBC headline prompts in the chat template), batch
size and greedy decoding; each side in its own process (its peak RSS its own), the sides
alternating, ``--repeats`` times each. Both sides must produce the same tokens (checked).

    .venv/bin/python bench/perf/generation_speed.py --prompts 100 --new-tokens 32 --batch 8 \
        --json bench/results/generation_speed.json

Reported per side: seconds per repeat, generated tokens, tokens/s (generated tokens / seconds,
prefill included), prompt tokens, peak RSS (MiB); the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nestfed.io.markdown import markdown_table


def setup(prompts: int):
    """The model with a seeded random LoRA adapter (r 16, q/k/v/o of the top 4 layers), the
    adapter's arrays, the prompt ids and the tokenizer."""
    import torch

    from nestfed.config import ModelConfig
    from nestfed.data.readers import bbc_headlines
    from nestfed.data.templates import prompt_ids
    from nestfed.methods import load_config
    from nestfed.nn.arrays import apply_arrays
    from nestfed.nn.backbone import load_backbone
    from nestfed.nn.lora import get_adapter_state, inject_lora

    bb = load_backbone(ModelConfig(name="smollm2-135m"))
    inject_lora(bb.model, ("q_proj", "k_proj", "v_proj", "o_proj"), 16, 1.0, [-4, -3, -2, -1])
    g = torch.Generator().manual_seed(0)
    arrays = {k: 0.02 * torch.randn(v.shape, generator=g) for k, v in get_adapter_state(bb.model).items()}
    apply_arrays(bb.model, arrays, 1.0)
    items, _ = bbc_headlines(load_config(None, ["data.source=bbc_headlines", "data.task=instruction"]).data)
    ids = [prompt_ids(bb.tokenizer, "chat", x.instruction, x.input) for x in items[::7][:prompts]]
    return bb, arrays, ids


def side(name: str, prompts: int, new_tokens: int, batch: int, out: Path) -> None:
    """One side in this process: time the generation, write its tokens and figures to ``out``."""
    import torch

    torch.set_num_threads(2)
    bb, arrays, ids = setup(prompts)
    tok = bb.tokenizer
    stop = [tok.eos_token_id]
    if name == "ours":
        from nestfed.evaluation.generation import Decoding, generate

        t0 = time.perf_counter()
        outs = generate(bb.model, ids, Decoding(max_new_tokens=new_tokens), stop, tok.pad_token_id, batch)
        seconds = time.perf_counter() - t0
    else:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        from nestfed.nn.peft_export import export_peft_adapter

        source = bb.source
        with tempfile.TemporaryDirectory() as d:
            export_peft_adapter(arrays, 1.0, Path(d) / "adapter", source)
            del bb
            base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
            model = PeftModel.from_pretrained(base, Path(d) / "adapter").eval()
        tok.padding_side = "left"
        outs = []
        t0 = time.perf_counter()
        with torch.no_grad():
            for s in range(0, len(ids), batch):
                part = ids[s : s + batch]
                width = max(len(p) for p in part)
                x = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in part])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in part])
                y = model.generate(
                    input_ids=x,
                    attention_mask=mask,
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    eos_token_id=stop,
                    pad_token_id=tok.pad_token_id,
                )
                for row in y[:, width:].tolist():  # HF pads finished rows with pad: cut at the first stop
                    cut = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
                    outs.append(row[:cut])
        seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.write_text(
        json.dumps(
            {
                "side": name,
                "seconds": seconds,
                "generated_tokens": sum(len(o) for o in outs),
                "prompt_tokens": sum(len(p) for p in ids),
                "peak_rss_mib": rss,
                "tokens": outs,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--side", choices=["ours", "hf"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side:
        side(a.side, a.prompts, a.new_tokens, a.batch, a.out)
        return
    runs: dict[str, list[dict]] = {"ours": [], "hf": []}
    with tempfile.TemporaryDirectory() as d:
        for rep in range(a.repeats):
            for name in ("ours", "hf") if rep % 2 == 0 else ("hf", "ours"):
                out = Path(d) / f"{name}{rep}.json"
                cmd = [sys.executable, __file__, "--side", name, "--out", str(out)]
                cmd += ["--prompts", str(a.prompts), "--new-tokens", str(a.new_tokens), "--batch", str(a.batch)]
                subprocess.run(cmd, check=True)
                runs[name].append(json.loads(out.read_text()))
    same = runs["ours"][0]["tokens"] == runs["hf"][0]["tokens"]
    res = {
        "bench": "generation_speed",
        "command": "bench/perf/generation_speed.py " + " ".join(sys.argv[1:]),
        "model": "smollm2-135m",
        "adapter": "LoRA r 16 on q, k, v, o of the top 4 layers (seeded random)",
        "prompts": a.prompts,
        "new_tokens": a.new_tokens,
        "batch": a.batch,
        "same_tokens": same,
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": 2},
        "sides": {},
    }
    for name, rs in runs.items():
        secs = sorted(r["seconds"] for r in rs)
        median = secs[len(secs) // 2]
        res["sides"][name] = {
            "seconds": [round(r["seconds"], 2) for r in rs],
            "generated_tokens": rs[0]["generated_tokens"],
            "prompt_tokens": rs[0]["prompt_tokens"],
            "tokens_per_s": rs[0]["generated_tokens"] / median,
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
        }
    res["speedup_ours_vs_hf"] = res["sides"]["ours"]["tokens_per_s"] / res["sides"]["hf"]["tokens_per_s"]
    print(json.dumps(res, indent=1))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1) + "\n")


def table(res: dict) -> str:
    """Markdown: one row per side."""
    names = {"ours": "nestfed (batched, KV cache)", "hf": "transformers generate + PEFT"}
    rows = [
        [
            names[name],
            " / ".join(f"{x:.1f}" for x in s["seconds"]),
            s["generated_tokens"],
            f"{s['tokens_per_s']:.1f}",
            f"{s['peak_rss_mib']:.0f}",
        ]
        for name, s in res["sides"].items()
    ]
    head = ["side", "s per run", "generated tokens", "tokens/s", "peak RSS MiB"]
    return "\n".join(markdown_table(head, rows)) + "\n"


if __name__ == "__main__":
    main()
