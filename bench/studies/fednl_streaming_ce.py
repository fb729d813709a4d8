"""The streaming cross-entropy probe (FedNL, arXiv 2605.16350, section 5.3): next-token CE over a
16K-token stream of real long text in 1K-token bins, each bin relative to the first, for the
federated FedNL model and the federated FedAvg model (and the backbone alone, for reference).

The models are the final global states of two finished runs of configs/fednl/long_text.toml
(``--set strategy.name=fedavg`` for the second), read from their run directories. The stream is
the last N+1 tokens of the longest Austen novel (training packs blocks from the starts of the
clients' documents, so the end of a novel is unseen). Everything streams chunk by chunk through
nestfed.evaluation.streaming:

- ``fednl``: the memory on the layers FedNL trained, every softmax path windowed
  (``fednl.window`` of the run) -- constant memory;
- ``fedavg_window``: FedAvg's LoRA, the same softmax window, no memory;
- ``fedavg_full``: FedAvg's LoRA with plain attention over everything seen (past SmolLM2's
  8,192-token training context after 8K);
- ``backbone_full``: no adapter, plain attention.

The windowed streams keep ``sink`` attention-sink tokens; by default at positions just before the
window (StreamingLLM's cache positions), ``--sink-positions absolute`` keeps them at 0..sink-1.

    .venv/bin/python bench/studies/fednl_streaming_ce.py --fednl runs/fednl_long_text-... --fedavg runs/fedavg_long-...
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from nestfed.io.markdown import markdown_row, markdown_table


def load_run(run_dir: Path):
    """(config, final global arrays) of a finished or interrupted run directory."""
    from nestfed import methods
    from nestfed.federation.run_dir import RunDir

    rd = RunDir.open(run_dir)
    return methods.load_run_config(rd.config_path), rd.latest_checkpoint().state.arrays


def probe_text(tokenizer, n: int) -> tuple[torch.Tensor, str]:
    from nestfed.data import corpora

    novels = corpora.austen_novels()
    longest = max(novels, key=lambda d: len(d.text))
    ids = tokenizer(longest.text, add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise SystemExit(f"{longest.title}: {len(ids)} tokens < {n}")
    return torch.tensor([ids[-n:]]), f"austen:{longest.title}, last {n} tokens"


def table(result: dict) -> str:
    """The markdown rows of docs/fednl.md's streaming-CE table for one result: per stream, the CE
    of each 1K-token bin relative to the first (bins 1-12 as a range, 13-16 each), last / first and
    the mean CE (bench/tools/tables.py regenerates the docs' copy from the JSON)."""
    where = (
        "none"
        if not result["sink"]
        else (
            f"{result['sink']}, at cache positions (default)"
            if result.get("sink_positions") == "cache"
            else f"{result['sink']}, at positions 0-{result['sink'] - 1}"
        )
    )
    label = f" ({result['label']})" if result.get("label") else ""
    names = {"fednl": "FedNL" + label, "fedavg_window": "FedAvg, window" + label}
    out = markdown_table(
        ["sinks", "stream", "bins 1-12 (relative)", "bins 13-16 (relative)", "last / first", "mean CE (nats)"]
    )
    for name, v in result["streams"].items():
        ce = v["ce"]
        rel = [c / ce[0] for c in ce]
        first = f"{min(rel[:12]):.2f} - {max(rel[:12]):.2f}"
        last = " / ".join(f"{r:.2f}" for r in rel[12:16])
        change = f"{100 * (ce[-1] / ce[0] - 1):+.1f}%"
        out.append(markdown_row([where, names.get(name, name), first, last, change, f"{sum(ce) / len(ce):.3f}"]))
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fednl", type=Path, required=True)
    ap.add_argument("--fedavg", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--bin", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--sink", type=int, default=None, help="attention-sink tokens (default: the FedNL run's fednl.sink_tokens)"
    )
    ap.add_argument(
        "--sink-positions",
        choices=["cache", "absolute"],
        default="cache",
        help="the sinks' RoPE positions: just before the window (StreamingLLM) or their own",
    )
    ap.add_argument("--streams", nargs="+", default=["fednl", "fedavg_window", "fedavg_full", "backbone_full"])
    ap.add_argument("--label", default="", help="what the FedNL stream is called in the table (its recipe)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parents[1] / "results" / "fednl_streaming_ce.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from nestfed.config import r_max
    from nestfed.evaluation.streaming import binned_ce, stream_nll
    from nestfed.methods.fednl.setup import memory_settings
    from nestfed.nn.arrays import apply_arrays
    from nestfed.nn.backbone import load_backbone
    from nestfed.nn.lora import inject_lora
    from nestfed.nn.memory import install_memory

    cfg_nl, arrays_nl = load_run(a.fednl)
    cfg_avg, arrays_avg = load_run(a.fedavg)
    if cfg_avg.lora.target_modules != cfg_nl.lora.target_modules or cfg_avg.lora.layers != cfg_nl.lora.layers:
        raise SystemExit("the two runs must share lora.target_modules and lora.layers")
    bb = load_backbone(cfg_nl.model)
    model = bb.model
    inject_lora(
        model, cfg_nl.lora.target_modules, r_max(cfg_nl), cfg_nl.lora.lora_alpha / r_max(cfg_nl), cfg_nl.lora.layers
    )
    m = cfg_nl.section("fednl")
    install_memory(model, memory_settings(cfg_nl))  # the layer the run trained (its [fednl] section)
    ids, source = probe_text(bb.tokenizer, a.tokens + 1)
    window = m.window or 1024
    sink = m.sink_tokens if a.sink is None else a.sink
    plans = {
        "fednl": (arrays_nl, cfg_nl, "memory"),
        "fedavg_window": (arrays_avg, cfg_avg, "window"),
        "fedavg_full": (arrays_avg, cfg_avg, "full"),
        "backbone_full": ({}, cfg_nl, "full"),
    }
    res = {
        "bench": "fednl_streaming_ce",
        "text": source,
        "tokens": a.tokens,
        "bin": a.bin,
        "chunk": a.chunk,
        "window": window,
        "sink": sink,
        "sink_positions": a.sink_positions,
        "label": a.label,
        "fednl_run": str(a.fednl),
        "fedavg_run": str(a.fedavg),
        "streams": {},
    }
    for name in a.streams:
        arrays, cfg, mode = plans[name]
        apply_arrays(model, arrays, cfg.lora.lora_alpha / r_max(cfg))  # enables the memory where FedNL trained it
        t0 = time.perf_counter()
        nll = stream_nll(
            model, ids, chunk=a.chunk, mode=mode, window=window, sink=sink, sink_positions=a.sink_positions
        )
        curve = binned_ce(nll, a.bin)
        curve.update(
            {
                "mode": mode,
                "time_s": round(time.perf_counter() - t0, 1),
                "change_last_over_first_pct": round(100 * (curve["relative"][-1] - 1), 2),
                "mean_relative_after_first_pct": round(
                    100 * (sum(curve["relative"][1:]) / max(len(curve["relative"]) - 1, 1) - 1), 2
                ),
            }
        )
        res["streams"][name] = curve
        print(
            name,
            json.dumps(
                {k: curve[k] for k in ("mode", "time_s", "change_last_over_first_pct", "mean_relative_after_first_pct")}
            ),
            flush=True,
        )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
