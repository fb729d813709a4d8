"""One PreLort local step relative to one plain LoRA step at the same rank on the same batch.

Prints one JSON object. A client of rank 16 trains with R_k = {16}, {8, 16}, {4, 8, 16} or
{2, 4, 8, 16} (|R_k| = 1..4); a plain LoRA step at rank 16 is timed beside the nested step (every
sub-rank, |R_k| passes) and the sampled step (one sub-rank drawn per step by the seed rule, one
pass; ``prelort.objective = "sampled"``), interleaved, on the same batch, and the ratios of medians
are reported (these machines are noisy: compare within one
run). Two models (SmolLM2-135M and a tiny random Llama) and two placements: LoRA on q, k, v, o of
every layer with the whole model in the graph, and the main job's top-4 layers with the frozen
prefix cached (nestfed/frozen_prefix.py). The paper reports about 1.4x (arXiv 2606.15963, sec. 4).

    python bench/perf/prelort_step.py [--quick] [--repeats 5] [--batch 4] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from nestfed.config import ModelConfig
from nestfed.federation.training import Batch
from nestfed.methods.prelort.strategy import nested_loss, sampled_subrank
from nestfed.nn.backbone import load_backbone
from nestfed.nn.frozen_prefix import first_adapted_layer, prefix_features
from nestfed.nn.lora import get_adapter_state, inject_lora, set_adapter_state


def plain(model, batch, cfg) -> float:
    """A plain LoRA step's loss at the full rank (what the default client hooks compute)."""
    loss = batch.loss(model)
    loss.backward()
    return loss.item()


def nested(model, batch, cfg) -> float:
    """PreLort's nested objective over ``cfg["subranks"]``."""
    return nested_loss(model, batch, cfg["subranks"])


def sampled(model, batch, cfg) -> float:
    """PreLort's sampled objective: one sub-rank of ``cfg["subranks"]`` drawn for step ``cfg["step"]``."""
    r = sampled_subrank(cfg["subranks"], 0, 1, 1, cfg["step"])
    return nested_loss(model, batch, [r])


SUBRANKS = {1: [16], 2: [8, 16], 3: [4, 8, 16], 4: [2, 4, 8, 16]}


def step(model, params, opt, fn, batch, cfg) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    fn(model, batch, cfg)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return time.perf_counter() - t0


def measure(model_name: str, layers: tuple[int, ...], cached: bool, batch_size: int, T: int, repeats: int) -> dict:
    bb = load_backbone(ModelConfig(name=model_name))
    model = bb.model
    inject_lora(model, ("q_proj", "k_proj", "v_proj", "o_proj"), 16, 1.0, layers)
    set_adapter_state(model, {k: torch.randn_like(v) * 0.01 for k, v in get_adapter_state(model).items()})
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch_size, T), generator=torch.Generator().manual_seed(0))
    start = first_adapted_layer(model) if cached else 0
    batch = (
        Batch(ids.clone(), hidden=prefix_features(model, ids, start), start=start)
        if start
        else Batch(ids.clone(), input_ids=ids)
    )
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=1e-5)
    model.train()
    step(model, params, opt, plain, batch, {})  # warm-up
    out = {
        "model": model_name,
        "lora_layers": "all" if not layers else list(layers),
        "frozen_prefix_cached": bool(start),
        "batch": [batch_size, T],
        "threads": torch.get_num_threads(),
        "by_num_subranks": {},
    }
    for n, ranks in SUBRANKS.items():
        t_plain, t_nested, t_sampled = [], [], []
        for i in range(repeats):  # interleaved
            t_plain.append(step(model, params, opt, plain, batch, {}))
            t_nested.append(step(model, params, opt, nested, batch, {"subranks": ranks}))
            t_sampled.append(step(model, params, opt, sampled, batch, {"subranks": ranks, "step": i}))
        p = statistics.median(t_plain)
        out["by_num_subranks"][str(n)] = {
            "subranks": ranks,
            "plain_step_s": p,
            "prelort_step_s": statistics.median(t_nested),
            "ratio": statistics.median(t_nested) / p,
            "sampled_step_s": statistics.median(t_sampled),
            "sampled_ratio": statistics.median(t_sampled) / p,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny model only")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    runs = [measure("tiny-llama", (), False, a.batch, a.tokens, a.repeats)]
    if not a.quick:
        runs.append(measure("smollm2-135m", (), False, a.batch, a.tokens, max(2, a.repeats // 2)))
        runs.append(measure("smollm2-135m", (-4, -3, -2, -1), True, a.batch, a.tokens, a.repeats))
    print(json.dumps({"paper_reported_ratio": 1.4, "goal_sampled_ratio_at_most": 1.4, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
