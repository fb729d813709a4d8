"""The frozen-prefix cache on real multiple-choice prompts: every row computed to the full block
(the old way) against each longest-first batch only to its longest labelled row
(``prefix_features(..., lengths=labelled_length(labels))``), side by side in one run, with the
largest difference between the two where anything reads them.

The prompts are one MMLU domain client's training questions as configs/fednl/mmlu.toml builds them
(SmolLM2-135M, prompts cut to 256 tokens from the left, the frozen 26 of 30 layers). Prints JSON:
seconds for each way, their ratio, the positions computed, the max |difference| and the max |value|
of the hidden states.

    .venv/bin/python bench/perf/prefix_cache.py [--client 3] [--rows 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "fednl" / "mmlu.toml")
    ap.add_argument("--client", type=int, default=3)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "prefix_cache.json")
    a = ap.parse_args()
    from nestfed import methods
    from nestfed.experiments.prepare import prepare
    from nestfed.nn.frozen_prefix import first_adapted_layer, labelled_length, prefix_features

    cfg = methods.replace_config(
        methods.load_config(a.config), train={"cache_frozen_prefix": False, "threads": a.threads}
    )
    prep = prepare(cfg, only_clients=[a.client])
    torch.set_num_threads(a.threads)
    d, model = prep.data[a.client], prep.backbone.model
    ids, labels = d.train_ids[: a.rows], d.train_labels[: a.rows]
    start, bs = first_adapted_layer(model), cfg.train.eval_batch_size
    lengths = labelled_length(labels)
    t0 = time.perf_counter()
    full = prefix_features(model, ids, start, bs)
    t_full = time.perf_counter() - t0
    seen = []  # [rows, positions] of every batch the first layer runs
    hook = model.model.layers[0].register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[:2]))
    t0 = time.perf_counter()
    trimmed = prefix_features(model, ids, start, bs, lengths)
    t_trim = time.perf_counter() - t0
    hook.remove()
    diff = max(float((trimmed[r, :n] - full[r, :n]).abs().max()) for r, n in enumerate(lengths.tolist()) if n)
    computed = sum(int(b) * int(t) for b, t in seen)
    res = {
        "bench": "prefix_cache",
        "config": str(a.config.relative_to(ROOT)),
        "client": d.label,
        "rows": int(ids.shape[0]),
        "block": int(ids.shape[1]),
        "frozen_layers": start,
        "batch_size": bs,
        "threads": a.threads,
        "mean_labelled_length": round(float(lengths.float().mean()), 1),
        "positions_full": int(ids.numel()),
        "positions_trimmed": computed,
        "full_s": round(t_full, 2),
        "trimmed_s": round(t_trim, 2),
        "speedup": round(t_full / t_trim, 2),
        "max_abs_diff": diff,
        "max_abs_value": float(full.abs().max()),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
