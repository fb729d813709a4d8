"""FedSLM against its baselines on one preparation (docs/methods.md, FedSLM's baselines):
FedAvg+LoRA (every client hosts the full model, rank lora.r_max), HetLoRA (the full model at the
heterogeneous ranks lora.ranks), FedMKT and FedSLM (compressed clients, compression.client_ratios).

Every method reports the same four figures: the clients' models' held-out perplexity (each
client's own test set), the server model's held-out perplexity on the same test sets, the client
model's memory relative to the full model (parameters and buffers), and the bytes per client per
round (serialised payloads, both directions). ``comparison.md`` / ``comparison.json`` hold them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from nestfed import methods
from nestfed.config import ConfigError, ExperimentConfig, client_ranks, r_max
from nestfed.experiments.prepare import prepare
from nestfed.experiments.run import new_run_dir, run_method
from nestfed.federation.loop import OnEvent
from nestfed.federation.messages import GlobalState
from nestfed.federation.prepared import Prepared
from nestfed.io import atomic
from nestfed.io.markdown import markdown_table
from nestfed.methods.compressed.evaluation import evaluate_server, mean_ppl
from nestfed.methods.compressed.setup import prepare_compressed
from nestfed.methods.implementation import MethodRun
from nestfed.nn.footprint import weight_bytes

METHODS = ("fedslm", "fedmkt", "fedavg", "hetlora")
COMPRESSED = ("fedslm", "fedmkt")


def baseline_config(cfg: ExperimentConfig, method: str) -> ExperimentConfig:
    """The config of one method of the comparison.

    Args:
        cfg: the experiment config.
        method: one of `METHODS`.

    Returns:
        FedAvg at rank lora.r_max for every client; the others with ``cfg``'s settings.
    """
    if method == "fedavg":
        return methods.replace_config(
            cfg, strategy={"name": method}, lora={"ranks": (r_max(cfg),), "r_max": r_max(cfg)}
        )
    return methods.with_method(cfg, method)


def lora_client_memory(prep: Prepared, cfg: ExperimentConfig) -> dict[str, Any]:
    """Client model bytes of a LoRA method: the full backbone plus an fp32 LoRA of rank r_k.

    Args:
        prep: the preparation (its backbone and LoRA layer shapes).
        cfg: the experiment config (the clients' ranks).

    Returns:
        ``{"full_model_bytes", "clients" ({cid: ratio to the full model}), "mean_ratio_to_full"}``.
    """
    full = weight_bytes(prep.backbone.model)
    ranks = client_ranks(cfg)
    per = {
        str(c): (full + 4 * ranks[c] * sum(o + i for o, i in prep.shapes.values())) / full for c in range(len(ranks))
    }
    return {"full_model_bytes": full, "clients": per, "mean_ratio_to_full": sum(per.values()) / len(per)}


def run_lora_baseline(
    prep: Prepared, cfg: ExperimentConfig, run_dir: Path, on_event: OnEvent | None = None
) -> dict[str, Any]:
    """A LoRA method's run, its server model evaluated and its clients' memory in summary.json.

    The server model is the global adapter on the full model, evaluated on every client's test set.

    Args:
        prep: the preparation.
        cfg: the method's config (`baseline_config`).
        run_dir: the run directory to write.
        on_event: called with every event of the run; None: none.

    Returns:
        The run's summary, with ``server_eval``, ``server_mean_ppl`` and ``client_memory``.
    """

    def report(mr: MethodRun, state: GlobalState) -> dict[str, Any]:
        arrays, scale = mr.strategy.deploy(state, None)
        ev = evaluate_server(prep, cfg, arrays, scale)
        return {"server_eval": ev, "server_mean_ppl": mean_ppl(ev), "client_memory": lora_client_memory(prep, cfg)}

    return run_method(prep, cfg, run_dir, on_event=on_event, report=report)


def rows_of(summaries: dict[str, dict[str, Any]], backbone_ppl: float) -> list[dict[str, Any]]:
    """One comparison row per method (and per elicitation variant of FedSLM).

    Args:
        summaries: ``{method: its run's summary}``.
        backbone_ppl: the pretrained full model's mean held-out perplexity.

    Returns:
        The rows: perplexities, memory ratio, KB per client per round, wall time.
    """
    rows = []
    for method, s in summaries.items():
        base = {
            "method": method,
            "client_mean_ppl": s["mean_ppl"],
            "client_round0_mean_ppl": s["initial_mean_ppl"],
            "backbone_mean_ppl": backbone_ppl,
            "server_mean_ppl": s.get("server_mean_ppl"),
            "client_memory_ratio": s["client_memory"]["mean_ratio_to_full"],
            "kb_per_client_round": (s["bytes_down_per_client_round"] + s["bytes_up_per_client_round"]) / 1024,
            "wall_time_s": s.get("wall_time_s", 0.0),
        }
        if method == "fedslm":
            for variant, info in s["elicitation"].items():
                rows.append(
                    {
                        **base,
                        "method": f"fedslm ({variant})",
                        "server_mean_ppl": info["mean_ppl"],
                        "weak_mean_ppl": s["weak_mean_ppl"],
                    }
                )
        else:
            rows.append(base)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table.

    Args:
        rows: the rows of `rows_of`.

    Returns:
        The table, a backbone row first (when there are rows).
    """
    head = [
        "method",
        "client ppl (round 0)",
        "client ppl",
        "server ppl",
        "weak W_g ppl",
        "client memory / full",
        "KB/client/round",
        "time s",
    ]
    body = []
    if rows:
        b = f"{rows[0]['backbone_mean_ppl']:.2f}"
        body.append(["backbone (no training)", b, b, b, "-", "1.000", "-", "-"])
    for r in rows:
        weak = f"{r['weak_mean_ppl']:.2f}" if r.get("weak_mean_ppl") is not None else "-"
        ppl = [f"{r[k]:.2f}" for k in ("client_round0_mean_ppl", "client_mean_ppl", "server_mean_ppl")]
        cost = [f"{r['client_memory_ratio']:.3f}", f"{r['kb_per_client_round']:.1f}", f"{r['wall_time_s']:.0f}"]
        body.append([r["method"], *ppl, weak, *cost])
    return "\n".join(markdown_table(head, body)) + "\n"


def compare(
    cfg: ExperimentConfig,
    names: list[str] | tuple[str, ...] = METHODS,
    on_status: Callable[[str], None] | None = None,
    on_event: OnEvent | None = None,
) -> Path:
    """Prepare once, run every method, write the comparison.

    Args:
        cfg: the experiment config.
        names: the methods, from `METHODS`.
        on_status: called with a status line at each step; None: silent.
        on_event: called with every event of the runs; None: none.

    Returns:
        The directory ``<output.dir>/<name>-<time>``: one run directory per method,
        ``comparison.md`` and ``comparison.json``.

    With memory budgets (``population.memory_mib``) the compressed methods choose each client's
    ratio from ``compression.ratio_choices``; the LoRA baselines here run at ``lora.ranks``, not
    at the budgets, so they are refused (run them at the same budgets with ``nestfed run CONFIG
    --methods <a LoRA method>``: the same budgets are drawn).

    Raises:
        ConfigError: for an unknown method, or a LoRA baseline with memory budgets (before any work).
    """
    for m in names:
        if m not in METHODS:
            raise ConfigError(f"--methods: unknown method '{m}' (known here: {', '.join(METHODS)})")
    lora = [m for m in names if m not in COMPRESSED]
    if cfg.population.memory_mib and lora:
        raise ConfigError(
            f"--methods: with population.memory_mib the comparison of compressed clients runs only "
            f"{' and '.join(COMPRESSED)} (their budgets choose compression ratios); run {', '.join(lora)} at the "
            "same budgets on their own (nestfed run CONFIG --methods ...)"
        )
    cfgs = {m: baseline_config(cfg, m) for m in names}  # validates every method before any work
    say = on_status or (lambda s: None)
    first = next((cfgs[m] for m in names if m in COMPRESSED), cfg)
    prep = prepare(first, on_status=say)  # a compressed method's: its setup chooses what a budget holds
    if any(m in COMPRESSED for m in names):
        prepare_compressed(prep, first, say)
    parent = new_run_dir(methods.replace_config(cfg, output={"name": cfg.output.name or "fedslm_compare"}))
    backbone = mean_ppl(evaluate_server(prep, cfg, {}, 1.0))
    summaries = {}
    for m in names:
        say(f"running {m}")
        run_dir = parent / m
        if m in COMPRESSED:
            summaries[m] = run_method(prep, cfgs[m], run_dir, on_event=on_event)
        else:
            summaries[m] = run_lora_baseline(prep, cfgs[m], run_dir, on_event=on_event)
    rows = rows_of(summaries, backbone)
    atomic.write_text(parent / "comparison.md", markdown(rows))
    atomic.write_json(parent / "comparison.json", rows)
    return parent
