"""Can the memory recall past the window at all, and with which recipe? Multi-query associative recall
(Zoology's MQAR) on the tiny Llama of tests/nn/test_memory_capability.py (hidden 64, 2 layers, 2
heads; every layer's window 8 tokens; 4 pairs, 16 fillers, 4 queries; 32 keys, 32 values: chance
3.1%), over seeds, the old recipe against the references'.

- ``scratch``: the whole model trained from its random start, 1,000 steps of 32 rows (backbone at
  3e-3): the window alone; the old recipe (gate 0.05 per layer, beta from the keys' average, no
  convolution, no norm weight, the rules at the backbone's rate); the reference layer (conv 4,
  per-head gate at 0.5, norm weight) with beta from the input or from the keys, rules at 1e-1.
- ``frozen``: a backbone pretrained with full attention (600 steps), frozen, windowed; LoRA r = 8 on
  q, k, v (3e-3) and the memory, 300 steps: the old recipe (the rules at the LoRA's rate) and the
  reference layer with its rules at 1e-2 (FedNL's ``rule_lr`` default) and 1e-1, and without its
  convolution.

Reported per variant: recall (%) over 512 fresh rows, mean ± 95% t half width over seeds, each
seed, the recall with the memory knocked out, the mean gate after training and the seconds per run.

    .venv/bin/python bench/studies/fednl_mqar_capability.py --seeds 3 --json bench/results/fednl_mqar_capability.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from nestfed.io.markdown import markdown_row, markdown_table

OLD = dict(gate_scope="layer", alpha_init=0.05, beta_source="keys", conv_size=0, norm_weight=False)
SCRATCH = {  # label: (memory settings or None for none, the rules' lr or None for the backbone's)
    "window only": (None, None),
    "old recipe": (OLD, None),
    "reference, beta from the input": ({}, 1e-1),
    "reference, beta from the keys": ({"beta_source": "keys"}, 1e-1),
}
FROZEN = {
    "old recipe (rules at the LoRA's 3e-3)": (OLD, 3e-3),
    "reference, rules at 1e-2": ({}, 1e-2),
    "reference, rules at 1e-1": ({}, 1e-1),
    "reference without the convolution, rules at 1e-1": ({"conv_size": 0}, 1e-1),
}
WINDOW, ROWS = 8, 512


def _task():
    from nestfed.data.mqar import vocabularies
    from nestfed.experiments.mqar_training import MqarTask
    from nestfed.nn.backbone import byte_tokenizer

    (vocab,), fillers = vocabularies(byte_tokenizer(), 1, 32, 32)
    return MqarTask(vocab, fillers)


def _memory(model, settings: dict):
    from nestfed.nn.memory import MemorySettings, install_memory, memory_rules, set_memory_enabled

    install_memory(model, MemorySettings(**settings))
    set_memory_enabled(model, True)
    rules = [p for r in memory_rules(model).values() for p in r.parameters()]
    for p in rules:
        p.requires_grad_(True)
    return rules


def _score(model, task, seed: int) -> dict:
    from nestfed.experiments.mqar_training import recall_accuracy
    from nestfed.nn.memory import memory_knocked_out, memory_rules

    out = {"recall": recall_accuracy(model, task, ROWS, seed + 1000)}
    rules = memory_rules(model)
    if rules:
        with memory_knocked_out(model):
            out["knocked_out"] = recall_accuracy(model, task, ROWS, seed + 1000)
        out["gates"] = {str(i): r.alphas() for i, r in rules.items()}
    return out


def scratch(label: str, seed: int, steps: int) -> dict:
    import torch

    from nestfed.experiments.mqar_training import train_on_mqar
    from nestfed.experiments.pretrained_tiny import tiny_mqar_model
    from nestfed.nn.bounded_attention import install_bounded_attention

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    task = _task()
    settings, rule_lr = SCRATCH[label]
    model = tiny_mqar_model(258, seed)
    install_bounded_attention(model, None, WINDOW, 0, fixed=True)
    rules = _memory(model, settings) if settings is not None else []
    ids = {id(p) for p in rules}
    backbone = [p for p in model.parameters() if id(p) not in ids]
    groups = [{"params": backbone, "lr": 3e-3}]
    if rules:
        groups.append({"params": rules, "lr": rule_lr or 3e-3})
    train_on_mqar(model, groups, task, steps, 32, seed)
    return {
        "setting": "scratch",
        "label": label,
        "seed": seed,
        **_score(model, task, seed),
        "s": time.perf_counter() - t0,
    }


def frozen(seed: int, steps: int, pretrain: int) -> list[dict]:
    import torch

    from nestfed.experiments.mqar_training import recall_accuracy, train_on_mqar
    from nestfed.experiments.pretrained_tiny import tiny_mqar_model
    from nestfed.nn.backbone import freeze
    from nestfed.nn.bounded_attention import bounded_layers, install_bounded_attention
    from nestfed.nn.lora import inject_lora, lora_modules

    torch.set_num_threads(1)
    task = _task()
    t0 = time.perf_counter()
    base = tiny_mqar_model(258, seed)
    train_on_mqar(base, [{"params": list(base.parameters()), "lr": 3e-3}], task, pretrain, 32, seed)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    out = [
        {
            "setting": "frozen",
            "label": "full attention",
            "seed": seed,
            "recall": recall_accuracy(base, task, ROWS, seed + 1000),
            "s": time.perf_counter() - t0,
        }
    ]
    install_bounded_attention(base, None, WINDOW, 0, fixed=True)
    out.append(
        {
            "setting": "frozen",
            "label": "window only",
            "seed": seed,
            "recall": recall_accuracy(base, task, ROWS, seed + 1000),
            "s": 0.0,
        }
    )
    for label, (settings, rule_lr) in FROZEN.items():
        t0 = time.perf_counter()
        model = tiny_mqar_model(258, seed)
        model.load_state_dict(state)
        model = freeze(model)
        install_bounded_attention(model, None, WINDOW, 0, fixed=True)
        assert all(b.window == WINDOW for b in bounded_layers(model).values())
        inject_lora(model, ("q_proj", "k_proj", "v_proj"), rank=8, scaling=2.0)
        lora = [p for m in lora_modules(model).values() for p in (m.lora_A.weight, m.lora_B.weight)]
        for p in lora:
            p.requires_grad_(True)
        rules = _memory(model, settings)
        train_on_mqar(
            model, [{"params": lora, "lr": 3e-3}, {"params": rules, "lr": rule_lr}], task, steps, 32, seed + 7
        )
        out.append(
            {
                "setting": "frozen",
                "label": label,
                "seed": seed,
                **_score(model, task, seed),
                "s": time.perf_counter() - t0,
            }
        )
    return out


def summarise(runs: list[dict]) -> dict:
    from nestfed.experiments.intervals import mean_interval

    out: dict = {}
    for r in runs:
        out.setdefault(r["setting"], {}).setdefault(r["label"], []).append(r)
    res = {}
    for setting, labels in out.items():
        res[setting] = {}
        for label, rs in labels.items():
            rs = sorted(rs, key=lambda r: r["seed"])
            i = mean_interval([r["recall"] for r in rs])
            row = {
                "recall": i.mean,
                "half": i.half_width,
                "seeds": [r["recall"] for r in rs],
                "s": [r["s"] for r in rs],
            }
            if "knocked_out" in rs[0]:
                row["knocked_out"] = [r["knocked_out"] for r in rs]
                alphas = [a for r in rs for g in r["gates"].values() for a in g]
                row["alpha"] = [min(alphas), max(alphas)]
            res[setting][label] = row
    return res


def table(res: dict) -> str:
    """Markdown: recall per variant (mean ± 95% over seeds, each seed), knocked out, gates, seconds."""
    head = ["setting", "variant", "recall % (mean ± 95%)", "per seed", "memory knocked out", "gate alpha after"]
    lines = markdown_table([*head, "s per run"])
    for setting in ("scratch", "frozen"):
        for label, r in res["results"].get(setting, {}).items():
            ko = "-" if "knocked_out" not in r else " / ".join(f"{100 * x:.1f}" for x in r["knocked_out"])
            alpha = "-" if "alpha" not in r else f"{r['alpha'][0]:.2f}-{r['alpha'][1]:.2f}"
            seeds = " / ".join(f"{100 * x:.1f}" for x in r["seeds"])
            s = sum(r["s"]) / len(r["s"])
            name = "from scratch" if setting == "scratch" else "frozen backbone"
            recall = f"{100 * r['recall']:.1f} ± {100 * r['half']:.1f}"
            lines.append(markdown_row([name, label, recall, seeds, ko, alpha, f"{s:.0f}"]))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--scratch-steps", type=int, default=1000)
    ap.add_argument("--frozen-steps", type=int, default=300)
    ap.add_argument("--pretrain-steps", type=int, default=600)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    t0 = time.perf_counter()
    runs: list[dict] = []
    with ProcessPoolExecutor(a.workers) as ex:
        jobs = [ex.submit(frozen, s, a.frozen_steps, a.pretrain_steps) for s in range(a.seeds)]
        jobs += [ex.submit(scratch, label, s, a.scratch_steps) for label in SCRATCH for s in range(a.seeds)]
        for j in jobs:
            got = j.result()
            runs.extend(got if isinstance(got, list) else [got])
            print(json.dumps(got if isinstance(got, dict) else got[-1])[:300], flush=True)
    res = {
        "bench": "fednl_mqar_capability",
        "command": "bench/studies/fednl_mqar_capability.py --seeds 3",
        "task": {
            "window": WINDOW,
            "layers": 2,
            "pairs": 4,
            "queries": 4,
            "gap": 16,
            "keys": 32,
            "values": 32,
            "chance": 1 / 32,
            "rows_scored": ROWS,
        },
        "steps": {"scratch": a.scratch_steps, "frozen": a.frozen_steps, "pretrain": a.pretrain_steps, "batch": 32},
        "machine": {"cpu": platform.processor() or platform.machine(), "workers": a.workers, "threads": 1},
        "wall_s": time.perf_counter() - t0,
        "results": summarise(runs),
        "runs": runs,
    }
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1) + "\n")
    print(table(res))


if __name__ == "__main__":
    main()
