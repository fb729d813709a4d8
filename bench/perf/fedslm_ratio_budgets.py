"""Which memory budget holds which FedSLM client model: the training footprint of every compression
ratio choice on the main job's FedSLM config, against the mixed-tier budgets (docs/scale.md).

The config is configs/fedslm_bbc_news.toml (SmolLM2-135M-Instruct, float32 on the CPU, the top four
decoder layers' projections compressed and their cores trained, the frozen prefix cached below
them), with ``compression.ratio_choices`` and the budgets of configs/tiers/bbc_news_tiers.toml
(``population.memory_mib``, drawn for the same 5 clients as the LoRA tiers). Each choice's
compressed client model is derived from the whitened bases (computed once at the largest choice)
and its footprint measured as FedSLM's setup measures it (nestfed.methods.compressed.ratio_choice,
nestfed.nn.footprint.TrainedFootprint: W the weights, P the trained core entries at 16 bytes, S the
tensors autograd saves for one batch): at the FedSLM config's step (batch 2) and at the tiers
config's step (batch 4), beside the full model's LoRA footprint at the same step.

    python bench/perf/fedslm_ratio_budgets.py [--ratios 0.3 0.5 0.7 0.9] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from pathlib import Path

from nestfed import methods
from nestfed.data.held_out import load_server_text
from nestfed.experiments.prepare import prepare
from nestfed.io.markdown import markdown_table
from nestfed.methods.compressed.ratio_choice import choose_ratio, ratio_footprints
from nestfed.methods.compressed.setup import cached_bases
from nestfed.nn.footprint import Footprint, weight_bytes
from nestfed.nn.keys import layer_of
from nestfed.nn.svd import derive_compressed, select_layers

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "fedslm_bbc_news.toml"
TIERS = ROOT / "configs" / "tiers" / "bbc_news_tiers.toml"
MIB = 2**20


def tier_budgets() -> dict[int, float]:
    """The tiers config's ``population.memory_mib`` ({MiB: share})."""
    table = tomllib.loads(TIERS.read_text())["population"]["memory_mib"]
    return {int(k): float(v) for k, v in table.items()}


def measure(ratios: list[float], batches: dict[str, int]) -> dict:
    """Footprints of every ratio at every step shape, and which budget holds which ratio."""
    shares = ",".join(f"{k}={v}" for k, v in tier_budgets().items())
    sets = [
        "model.device=cpu",
        "compression.client_ratios=[]",
        f"compression.ratio_choices=[{','.join(map(str, ratios))}]",
        f"population.memory_mib={{{shares}}}",
        "lora.ranks=[16]",
        "lora.r_max=16",
    ]
    cfg = methods.load_config(CONFIG, sets)
    t0 = time.perf_counter()
    prep = prepare(cfg)
    model = prep.backbone.model
    c = cfg.section("compression")
    server = load_server_text(cfg, prep.backbone.tokenizer, c.server_blocks)
    bases = cached_bases(model, cfg, prep.backbone.source, print, server.input_ids)
    trained = select_layers(sorted(bases), c.train_layers, model.config.num_hidden_layers)
    start = min(layer_of(n) or 0 for n in trained)
    derived = {rho: derive_compressed(model, bases, rho) for rho in ratios}
    full = weight_bytes(model)
    steps = []
    for name, batch in batches.items():
        step_cfg = methods.replace_config(cfg, train={"batch_size": batch})
        fps = ratio_footprints(derived, trained, step_cfg, start)
        lora = Footprint.measure(model, step_cfg.train, cfg.data.block_size, prep.frozen_prefix_layers)
        rows = [
            {"ratio": rho, "weights": f.weights, "trainable": f.trainable, "saved": f.saved, "bytes": f.bytes}
            for rho, f in sorted(fps.items())
        ]
        holds = {str(b): choose_ratio(b, {r["ratio"]: r["bytes"] for r in rows}) for b in tier_budgets()}
        steps.append(
            {
                "step": name,
                "batch_size": batch,
                "rows": rows,
                "lora_full": {str(r): lora.bytes(r) for r in (2, 4, 8, 16)},
                "lora_weights": lora.weights,
                "holds": holds,
            }
        )
    return {
        "bench": "fedslm_ratio_budgets",
        "model": "SmolLM2-135M-Instruct fp32 (CPU)",
        "config": str(CONFIG.relative_to(ROOT)),
        "compressed": f"{len(bases)} projections of the top 4 decoder layers, {len(trained)} cores trained",
        "block_size": cfg.data.block_size,
        "frozen_prefix_layers": start,
        "full_weights": full,
        "budgets": {str(cid): b for cid, b in sorted(prep.budgets.items())},
        "steps": steps,
        "seconds": time.perf_counter() - t0,
    }


def table(res: dict) -> str:
    """Markdown: one row per (step, ratio), MiB, and whether each budget holds it (bench/tools/tables.py)."""
    budgets = sorted({int(b) for s in res["steps"] for b in s["holds"]})
    head = ["step", "model", "W (MiB)", "trained P", "S (MiB)", "footprint (MiB)"]
    head += [f"{b} MiB holds" for b in budgets]
    body = []
    for s in res["steps"]:
        step = f"batch {s['batch_size']} x {res['block_size']}"
        for r in s["rows"]:
            fits = ["yes" if r["bytes"] <= b * MIB else "no" for b in budgets]
            mib = [f"{r[k] / MIB:.1f}" for k in ("weights", "saved", "bytes")]
            body.append([step, f"FedSLM rho = {r['ratio']:g}", mib[0], f"{r['trainable']:,}", mib[1], mib[2], *fits])
        for rank in ("2", "16"):
            b = s["lora_full"][rank]
            fits = ["yes" if b <= m * MIB else "no" for m in budgets]
            body.append([step, f"full model + LoRA r = {rank}", f"{s['lora_weights'] / MIB:.1f}", "-", "-"])
            body[-1] += [f"{b / MIB:.1f}", *fits]
    return "\n".join(markdown_table(head, body)) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ratios", nargs="+", type=float, default=[0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "fedslm_ratio_budgets.json")
    args = ap.parse_args()
    res = measure(args.ratios, {"FedSLM config": 2, "tiers config": 4})
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(table(res))


if __name__ == "__main__":
    main()
