"""FedSLM against its baselines on one preparation (methods.md section 2, "Baselines"):
FedAvg+LoRA (every client hosts the full model, rank lora.r_max), HetLoRA (the full model at the
heterogeneous ranks lora.ranks), FedMKT and FedSLM (compressed clients, compression.client_ratios).

Every method reports the same four figures: the clients' models' held-out perplexity (each
client's own test set), the server model's held-out perplexity on the same test sets, the client
model's memory relative to the full model (parameters and buffers), and the bytes per client per
round (serialised payloads, both directions). ``comparison.md`` / ``comparison.json`` hold them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nestfed import config as C
from nestfed.federation.messages import ClientInfo

METHODS = ("fedslm", "fedmkt", "fedavg", "hetlora")


def baseline_config(cfg: C.ExperimentConfig, method: str) -> C.ExperimentConfig:
    """The config of one method: FedAvg at rank lora.r_max for every client; others as given."""
    if method == "fedavg":
        return C.replace(cfg, strategy={"name": method}, lora={"ranks": (C.r_max(cfg),), "r_max": C.r_max(cfg)})
    return C.replace(cfg, strategy={"name": method})


def lora_client_memory(prep, cfg: C.ExperimentConfig) -> dict[str, Any]:
    """Client model bytes of a LoRA method: the full backbone plus an fp32 LoRA of rank r_k."""
    from nestfed.compressed_setup import model_bytes

    full = model_bytes(prep.backbone.model)
    ranks = C.client_ranks(cfg)
    per = {str(c): (full + 4 * ranks[c] * sum(o + i for o, i in prep.shapes.values())) / full
           for c in range(len(ranks))}
    return {"full_model_bytes": full, "clients": per, "mean_ratio_to_full": sum(per.values()) / len(per)}


def run_lora_baseline(prep, cfg: C.ExperimentConfig, run_dir: Path, on_event=None) -> dict[str, Any]:
    """run_experiment for a LoRA method, then its global adapter on the full model (the server
    model) on every client's test set; both added to summary.json."""
    from nestfed.experiment import run_experiment, write_text_atomic
    from nestfed.fedslm_experiment import evaluate_server, mean_ppl
    from nestfed.federation.runner import latest_checkpoint, load_checkpoint
    from nestfed.strategies import make_strategy

    ranks = C.client_ranks(cfg)
    bprep = dataclasses.replace(prep, clients=[ClientInfo(c.cid, ranks[c.cid], c.num_examples) for c in prep.clients])
    summary = run_experiment(bprep, cfg, run_dir, on_event=on_event)
    state = load_checkpoint(latest_checkpoint(run_dir))[1]
    arrays, scale = make_strategy(cfg).deploy(state, None)
    ev = evaluate_server(prep, cfg, arrays, scale)
    summary.update({"server_eval": ev, "server_mean_ppl": mean_ppl(ev), "client_memory": lora_client_memory(prep, cfg)})
    write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def rows_of(summaries: dict[str, dict[str, Any]], backbone_ppl: float) -> list[dict[str, Any]]:
    """One comparison row per method (and per elicitation variant of FedSLM). backbone_ppl: the
    pretrained full model's mean held-out perplexity."""
    rows = []
    for method, s in summaries.items():
        base = {"method": method, "client_mean_ppl": s["mean_ppl"], "client_round0_mean_ppl": s["initial_mean_ppl"],
                "backbone_mean_ppl": backbone_ppl,
                "server_mean_ppl": s.get("server_mean_ppl"),
                "client_memory_ratio": s["client_memory"]["mean_ratio_to_full"],
                "kb_per_client_round": (s["bytes_down_per_client_round"] + s["bytes_up_per_client_round"]) / 1024,
                "wall_time_s": s.get("wall_time_s", 0.0)}
        if method == "fedslm":
            for variant, info in s["elicitation"].items():
                rows.append({**base, "method": f"fedslm ({variant})", "server_mean_ppl": info["mean_ppl"],
                             "weak_mean_ppl": s["weak_mean_ppl"]})
        else:
            rows.append(base)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table."""
    head = ["method", "client ppl (round 0)", "client ppl", "server ppl", "weak W_g ppl", "client memory / full",
            "KB/client/round", "time s"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if rows:
        b = rows[0]["backbone_mean_ppl"]
        out.append(f"| backbone (no training) | {b:.2f} | {b:.2f} | {b:.2f} | - | 1.000 | - | - |")
    for r in rows:
        weak = f"{r['weak_mean_ppl']:.2f}" if r.get("weak_mean_ppl") is not None else "-"
        out.append(f"| {r['method']} | {r['client_round0_mean_ppl']:.2f} | {r['client_mean_ppl']:.2f} | "
                   f"{r['server_mean_ppl']:.2f} | {weak} | "
                   f"{r['client_memory_ratio']:.3f} | {r['kb_per_client_round']:.1f} | {r['wall_time_s']:.0f} |")
    return "\n".join(out) + "\n"


def compare(cfg: C.ExperimentConfig, methods: list[str] | tuple[str, ...] = METHODS,
            on_status: Callable[[str], None] | None = None,
            on_event: Callable[[str, dict[str, Any]], None] | None = None) -> Path:
    """Prepare once, run every method into ``<output.dir>/<name>-<time>/<method>``, write the
    comparison there; return that directory. Raises ConfigError for an unknown method."""
    from nestfed.compressed_setup import prepare_compressed
    from nestfed.experiment import new_run_dir, prepare, write_text_atomic
    from nestfed.fedslm_experiment import evaluate_server, mean_ppl, run_compressed

    for m in methods:
        if m not in METHODS:
            raise C.ConfigError(f"--methods: unknown method '{m}' (known here: {', '.join(METHODS)})")
    cfgs = {m: baseline_config(cfg, m) for m in methods}  # validates every method before any work
    say = on_status or (lambda s: None)
    prep = prepare(cfg, on_status=say)
    if any(m in ("fedslm", "fedmkt") for m in methods):
        prepare_compressed(prep, cfg, say)
    parent = new_run_dir(C.replace(cfg, output={"name": cfg.output.name or "fedslm_compare"}))
    backbone = mean_ppl(evaluate_server(prep, cfg, {}, 1.0))
    summaries = {}
    for m in methods:
        say(f"running {m}")
        run_dir = parent / m
        if m in ("fedslm", "fedmkt"):
            summaries[m] = run_compressed(prep, cfgs[m], run_dir, on_event=on_event)
        else:
            summaries[m] = run_lora_baseline(prep, cfgs[m], run_dir, on_event=on_event)
    rows = rows_of(summaries, backbone)
    write_text_atomic(parent / "comparison.md", markdown(rows))
    write_text_atomic(parent / "comparison.json", json.dumps(rows, indent=2))
    return parent
