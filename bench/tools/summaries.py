"""docs/benchmarks.md's tables, one renderer per results file of the smaller benchmarks (each prints
Markdown from the JSON its script wrote; bench/tools/tables.py calls them by a marker's
``renderer=summaries.<name>``, and its --check catches a table that drifted from its file)."""

from __future__ import annotations

from pathlib import Path

from nestfed.federation.run_files import RunFiles
from nestfed.io.markdown import markdown_table


def _table(head: list[str], rows: list[list]) -> str:
    return "\n".join(markdown_table(head, rows)) + "\n"


def aggregation(d: dict) -> str:
    """bench/perf/aggregation.py: server seconds per rule (best of the repeats' medians as stored)."""
    hetero = d.get("heterogeneous_ranks_2_4_8_16", {})
    rows = [
        [m, f"{v['seconds']:.2f}", f"{hetero[m]['seconds']:.2f}" if m in hetero else "-"]
        for m, v in d["equal_rank"].items()
    ]
    head = [f"rule ({d['clients']} clients, {d['modules']} modules)", "s, rank 16 everywhere", "s, ranks 2/4/8/16"]
    return _table(head, rows)


def bytes_per_round(d: dict) -> str:
    """bench/perf/bytes.py: mean bytes per client per round (both directions), KiB, and the share of the
    full fp32 model in round 1."""
    rows = []
    for placement, by_method in d["placements"].items():
        for m, v in by_method.items():
            per_round = [r["mean_bytes_per_client"] / 1024 for r in v["rounds"]]
            kb = " / ".join(f"{x:,.0f}" for x in per_round) if len(set(per_round)) > 1 else f"{per_round[0]:,.0f}"
            rows.append(
                [
                    placement,
                    m,
                    "/".join(map(str, v["ranks"])),
                    kb,
                    f"{100 * per_round[0] * 1024 / d['full_model_bytes_fp32']:.2f}%",
                ]
            )
    return _table(
        ["placement", "method", "ranks", "KiB per client per round (rounds 1 / 2 / 3)", "round 1 vs full model"], rows
    )


def delta_rule(d: dict) -> str:
    """bench/perf/delta_rule.py: the chunkwise form's forward + backward speed-up over the per-token
    recurrence, and the memory kept for backward, per sequence length."""
    rows = []
    for r in d["results"]:
        sp = r["speedup_vs_recurrent"]
        mem = r["saved_for_backward_MiB"]
        best = max(sp, key=sp.get)
        rows.append(
            [
                r["T"],
                d["threads"],
                " / ".join(f"{k.split('_')[-1]} {v:.1f}x" for k, v in sp.items()),
                f"{mem[best]['unique_storage'] / mem['recurrent']['unique_storage']:.2f}x",
            ]
        )
    return _table(
        ["T", "threads", "speed-up vs the recurrence (chunk size C)", "kept for backward vs the recurrence"], rows
    )


def prelort_step(d: dict) -> str:
    """bench/perf/prelort_step.py: a PreLort local step over a plain LoRA step, by the number of nested
    sub-ranks |R_k| (and the sampled objective's, when measured)."""
    rows = []
    for r in d["runs"]:
        steps = r["by_num_subranks"]
        nested = " / ".join(f"{steps[k]['ratio']:.2f}" for k in sorted(steps, key=int))
        sampled = (
            " / ".join(f"{steps[k]['sampled_ratio']:.2f}" for k in sorted(steps, key=int))
            if all("sampled_ratio" in v for v in steps.values())
            else "-"
        )
        layers = "every layer" if r["lora_layers"] == "all" else f"layers {r['lora_layers']}"
        where = f"{r['model']}, {layers}{', frozen prefix cached' if r['frozen_prefix_cached'] else ''}"
        rows.append([where, f"{steps['1']['plain_step_s']:.3f}", nested, sampled])
    return _table(["setting", "plain step s", "nested / plain, \\|R_k\\| = 1 / 2 / 3 / 4", "sampled / plain"], rows)


def figures(d: dict) -> str:
    """Any results file of scalar figures (bench/perf/prefix_cache.py, bench/perf/conversion.py): one row each."""
    rows = [[k, v] for k, v in d.items() if k != "bench" and not isinstance(v, (dict, list))]
    return _table(["figure", "value"], rows)


def gpu_delta_rule(d: dict) -> str:
    """bench/perf/gpu_delta_rule.py: flash-linear-attention's kernel (bf16) against the chunkwise form
    (fp32): the largest relative RMS error per T, and the timings when measured."""
    rows = [
        [c["T"], "yes" if c["ok"] else "no", f"{max(e['rel_rms'] for e in c['errors'].values()):.4f}"]
        for c in d["checks"]
    ]
    return _table(
        [f"T ({d['device']}, fla {d.get('fla_version', '?')})", "within tolerance", "largest relative RMS"], rows
    )


def panel_by_round(d: dict) -> str:
    """Short diagnostic runs side by side: each run's panel perplexity (the mean over the clients
    evaluated that round, ``eval_summary``) after rounds 1..``rounds`` and its global held-out set's
    perplexity after the last of them it committed, read from the runs' own metrics.jsonl (``runs``:
    ``[{"label", "metrics": path from the repository root}]``)."""
    root = Path(__file__).resolve().parents[2]
    rounds = range(1, d["rounds"] + 1)
    rows = []
    for run in d["runs"]:
        lines = {ln["round"]: ln for ln in RunFiles((root / run["metrics"]).parent).read_metrics()}
        cells = [f"{lines[t]['eval_summary']['ppl']['all']['mean']:.2f}" if t in lines else "-" for t in rounds]
        last = max(t for t in rounds if t in lines)
        rows.append([run["label"], *cells, f"{lines[last]['eval_global']['ppl']:.2f} (round {last})"])
    return _table([d["title"], *(f"round {t}" for t in rounds), "global set"], rows)
