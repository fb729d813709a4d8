"""The recipe of the compressed-client methods, FedSLM and its baseline FedMKT, and the comparison
with the LoRA baselines whose clients host the full model (methods.md section 2).

A FedSLM or FedMKT run directory is a LoRA run directory (config.toml, metrics.jsonl with the
client models' held-out metrics per round, checkpoints/, plots/, summary.json) plus:

    adapter/                  the server model's LoRA in PEFT's format (FedSLM: after elicitation
                              with elicitation.alpha; FedMKT: after the last round)
    weak_model_cores.safetensors   FedSLM: the fused cores M of W_g = U M V^T (trained layers)
    summary.json              also ``server_eval`` / ``server_mean_ppl`` (the full server model on
                              every client's test set), ``client_memory`` and, for FedSLM,
                              ``weak_eval`` and ``elicitation`` (one entry per variant: none,
                              alpha = 0, alpha = a)

:func:`compare` runs FedSLM, FedMKT, FedAvg+LoRA and HetLoRA on one preparation and writes
``comparison.md`` / ``comparison.json``: client-model and server-model perplexity, client memory
relative to the full model, and bytes per client per round.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nestfed import config as C
from nestfed.adapters.lora import init_adapter_state
from nestfed.adapters.peft_export import export_peft_adapter
from nestfed.compressed_setup import CompressedSetup, prepare_compressed, weak_model
from nestfed.elicitation import CachedText, elicit
from nestfed.errors import ConfigError
from nestfed.federation.client import ClientData, ClientTrainer, apply_arrays
from nestfed.federation.knowledge_transfer import MutualClientTrainer, ServerDistiller
from nestfed.federation.messages import Arrays, ClientInfo
from nestfed.federation.model_groups import GroupedTrainer
from nestfed.federation.runner import RoundLoop
from nestfed.frozen_prefix import prefix_features
from nestfed.strategies.fedmkt import FedMKT
from nestfed.strategies.fedslm import FedSLM, SLMGroups

COMPRESSED = ("fedslm", "fedmkt")


def evaluate_server(prep, cfg: C.ExperimentConfig, arrays: Arrays, scaling: float) -> dict[str, dict[str, float]]:
    """The full server model (backbone + LoRA ``arrays`` at scale s) on every client's test set."""
    trainer = ClientTrainer(prep.backbone.model, prep.data, cfg.train)
    return {str(cid): trainer.evaluate(cid, arrays, scaling) for cid in sorted(prep.data)}


def mean_ppl(evals: dict[str, dict[str, float]]) -> float:
    """Mean over clients of the held-out perplexity."""
    return sum(v["ppl"] for v in evals.values()) / max(len(evals), 1)


def _clients(setup: CompressedSetup, prep) -> list[ClientInfo]:
    return [ClientInfo(cid, 0, d.num_examples) for cid, d in sorted(prep.data.items())]


def _core_train(cfg: C.ExperimentConfig) -> C.TrainConfig:
    return dataclasses.replace(cfg.train, lr=cfg.compression.core_lr)


def client_memory(setup: CompressedSetup) -> dict[str, Any]:
    """Bytes of every group's client model against the full backbone (parameters + buffers)."""
    full = setup.bytes["full"]
    return {"full_model_bytes": full,
            "groups": {str(g): {"ratio": rho, "bytes": setup.bytes[g], "ratio_to_full": setup.bytes[g] / full}
                       for g, rho in enumerate(setup.ratios)},
            "mean_ratio_to_full": sum(setup.bytes[setup.client_group[c]] for c in setup.client_group)
            / (full * len(setup.client_group))}


def _finish(prep, cfg: C.ExperimentConfig, run_dir: Path, loop: RoundLoop, extra: dict[str, Any], t0: float) -> dict:
    from nestfed import report
    from nestfed.experiment import write_text_atomic

    if cfg.output.plots:
        report.plot_run(run_dir)
    summary = report.summarise(report.read_metrics(run_dir), cfg)
    summary.update({"run_dir": str(run_dir), "wall_time_s": time.perf_counter() - t0,
                    "prepare_time_s": prep.prepare_time_s,
                    "client_labels": {str(c): d.label for c, d in prep.data.items()}, "rejections": loop.log})
    summary.update(extra)
    write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def run_fedslm(prep, cfg: C.ExperimentConfig, run_dir: Path, resume: bool = False,
               on_event: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """FedSLM: federated rounds over the compressed groups (strategies/fedslm.py), then the weak model
    W_g, then weak-to-strong elicitation for "none", every ``compare_alphas`` and ``alpha``."""
    from nestfed.experiment import write_text_atomic

    t0 = time.perf_counter()
    setup = prepare_compressed(prep, cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        write_text_atomic(run_dir / "config.toml", C.dumps_toml(cfg))
    groups = SLMGroups(setup.ratios, [setup.ranks(g) for g in range(len(setup.ratios))], setup.client_group,
                       {n: setup.bases[n].S for n in setup.trained})
    strategy = FedSLM(groups, cfg.compression.fusion, cfg.federation.seed)
    trainers = {g: ClientTrainer(m, setup.data[g], _core_train(cfg)) for g, m in setup.models.items()}
    grouped = GroupedTrainer(trainers, setup.client_group, setup.initial)
    fed = cfg.federation
    loop = RoundLoop(strategy, grouped, _clients(setup, prep), fed.rounds, run_dir, fed.fraction, fed.min_clients,
                     fed.seed, on_event=on_event)
    state = loop.run({}, resume=resume)
    for g, m in setup.models.items():  # leave the group models at their initial cores
        apply_arrays(m, setup.initial[g], 1.0)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.arrays.items()}, str(run_dir / "weak_model_cores.safetensors"))
    weak = weak_model(setup, prep, state.arrays, cfg.compression.fusion)
    weak_text, weak_data = _weak_views(setup, prep, weak, cfg)
    weak_eval = {str(cid): ClientTrainer(weak, weak_data, cfg.train).evaluate(cid, {}, 1.0) for cid in sorted(weak_data)}
    extra = _elicitation(prep, cfg, setup, weak, weak_text, run_dir)
    extra.update({"weak_eval": weak_eval, "weak_mean_ppl": mean_ppl(weak_eval), "client_memory": client_memory(setup),
                  "fusion": cfg.compression.fusion, "ratios": setup.ratios,
                  "client_ratio": {str(c): setup.ratios[g] for c, g in setup.client_group.items()},
                  "trained_layers": len(setup.trained), "server_text_blocks": int(setup.server_text.input_ids.shape[0]),
                  "prefix_shared_with_backbone": setup.shared_prefix, "frozen_prefix_layers": setup.start})
    return _finish(prep, cfg, run_dir, loop, extra, t0)


def _weak_views(setup: CompressedSetup, prep, weak, cfg: C.ExperimentConfig) -> tuple[CachedText, dict[int, ClientData]]:
    """The server text and the clients' test data as the weak model sees them (its frozen prefix)."""
    if setup.shared_prefix or not setup.start:
        data = {cid: d for g in setup.data for cid, d in setup.data[g].items()}
        return setup.public["strong" if setup.shared_prefix else 0], data
    bs = cfg.train.eval_batch_size
    text = CachedText(setup.server_text.input_ids, prefix_features(weak, setup.server_text.input_ids, setup.start, bs),
                      setup.start)
    data = {}
    for cid, d in prep.data.items():
        nd = ClientData(d.train_ids[:0], d.train_labels[:0], d.test_ids, d.test_labels, letter_ids=d.letter_ids,
                        label=d.label)
        nd.start = setup.start
        nd.test_hidden = prefix_features(weak, d.test_ids, setup.start, bs)
        data[cid] = nd
    return text, data


def _elicitation(prep, cfg: C.ExperimentConfig, setup: CompressedSetup, weak, weak_text: CachedText,
                 run_dir: Path) -> dict[str, Any]:
    """Step 4 for every variant; the variant ``alpha = elicitation.alpha`` is the reported server model."""
    e = cfg.elicitation
    scale = cfg.lora.lora_alpha / e.rank
    init = init_adapter_state(prep.shapes, e.rank, cfg.lora.init_seed)
    student = prep.backbone.model
    variants: list[tuple[str, float | None]] = [("none", None)]
    for a in list(e.compare_alphas) + [e.alpha]:
        name = f"alpha={a:g}"
        if all(v[0] != name for v in variants):
            variants.append((name, a))
    results, evals, chosen = {}, {}, None
    for name, a in variants:
        apply_arrays(student, init, scale)
        info: dict[str, float] = {}
        if a is not None:
            from nestfed.adapters.lora import lora_modules

            params = [p for m in lora_modules(student).values() for p in (m.lora_A.weight, m.lora_B.weight)]
            info = elicit(student, params, weak, setup.public["strong"], weak_text, a, e.steps, e.batch_size, e.lr,
                          e.seed)
        adapter = {k: v for k, v in _current_adapter(student).items()}
        evals[name] = evaluate_server(prep, cfg, adapter, scale)
        results[name] = {**info, "mean_ppl": mean_ppl(evals[name])}
        if a == e.alpha:
            chosen = adapter
    export_peft_adapter(chosen, scale, run_dir / "adapter", prep.backbone.source)
    key = f"alpha={e.alpha:g}"
    return {"elicitation": results, "server_eval_variants": evals, "server_eval": evals[key],
            "server_mean_ppl": results[key]["mean_ppl"], "server_variant": key}


def _current_adapter(model) -> Arrays:
    from nestfed.adapters.lora import get_adapter_state

    return get_adapter_state(model)


def run_fedmkt(prep, cfg: C.ExperimentConfig, run_dir: Path, resume: bool = False,
               on_event: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """FedMKT with the server's LoRA (rank lora.r_max) on the full model and the FedSLM groups'
    compressed models as the clients' small models. Raises ConfigError on resume: the clients'
    own models live on the clients and are not in the server's checkpoints."""
    from nestfed.experiment import write_text_atomic

    if resume:
        raise ConfigError("fedmkt runs cannot be resumed: the clients' own models are not checkpointed")
    t0 = time.perf_counter()
    setup = prepare_compressed(prep, cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / "config.toml", C.dumps_toml(cfg))
    m = cfg.fedmkt
    r = C.r_max(cfg)
    scale = cfg.lora.lora_alpha / r
    labels = setup.server_text.labels
    server = ServerDistiller(prep.backbone.model, setup.public["strong"], labels, scale, m.topk, m.lm_weight,
                             m.server_steps, m.batch_size, m.server_lr, cfg.federation.seed)
    trainers = {g: MutualClientTrainer(ClientTrainer(model, setup.data[g], _core_train(cfg)), setup.public[g], labels,
                                       setup.initial[g], m.topk, m.lm_weight, m.client_steps, m.batch_size,
                                       cfg.compression.core_lr)
                for g, model in setup.models.items()}
    strategy = FedMKT(server, init_adapter_state(prep.shapes, r, cfg.lora.init_seed), setup.client_group,
                      setup.ratios, cfg.federation.seed)
    fed = cfg.federation
    loop = RoundLoop(strategy, GroupedTrainer(trainers, setup.client_group), _clients(setup, prep), fed.rounds, run_dir,
                     fed.fraction, fed.min_clients, fed.seed, on_event=on_event)
    state = loop.run({}, resume=False)
    for g, model in setup.models.items():
        apply_arrays(model, setup.initial[g], 1.0)
    adapter, s = strategy.export(state)
    export_peft_adapter(adapter, s, run_dir / "adapter", prep.backbone.source)
    ev = evaluate_server(prep, cfg, adapter, s)
    extra = {"server_eval": ev, "server_mean_ppl": mean_ppl(ev), "client_memory": client_memory(setup),
             "ratios": setup.ratios, "client_ratio": {str(c): setup.ratios[g] for c, g in setup.client_group.items()},
             "public_blocks": int(labels.shape[0]), "server_last_round": state.meta.get("server", {})}
    return _finish(prep, cfg, run_dir, loop, extra, t0)


def run_compressed(prep, cfg: C.ExperimentConfig, run_dir: Path, resume: bool = False,
                   on_event: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Dispatch ``strategy.name`` fedslm / fedmkt (experiment.run_experiment calls this)."""
    run = run_fedslm if cfg.strategy.name == "fedslm" else run_fedmkt
    return run(prep, cfg, run_dir, resume, on_event)
