"""The recipe: config -> backbone + data -> partitions -> client datasets -> rounds -> run directory.

A run directory is self-describing::

    config.toml        the resolved config (re-run or resume from it)
    metrics.jsonl      one line per round (round 0 = the backbone alone)
    checkpoints/       round_NNN.safetensors: the global state after each round (atomic writes)
    adapter/           the final global adapter in PEFT's format
    plots/             eval_ppl.png, bytes.png
    summary.json       written last: its presence marks a finished run

Everything that can fail on bad input (config, data paths, malformed files, ranks) is checked in
:func:`prepare`, before any directory is created.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nestfed import config as C
from nestfed.adapters.lora import inject_lora, module_shapes
from nestfed.adapters.peft_export import export_peft_adapter
from nestfed.backbone import Backbone, load_backbone
from nestfed.data import partition, sources, tasks
from nestfed.errors import ConfigError, DataError
from nestfed.federation.client import ClientData, ClientTrainer
from nestfed.federation.messages import ClientInfo
from nestfed.federation.runner import RoundLoop, save_tensors_atomic
from nestfed.frozen_prefix import first_adapted_layer
from nestfed.strategies import make_strategy


@dataclass
class Prepared:
    """What every method of one experiment shares: the backbone with LoRA layers, the clients' data."""

    cfg: C.ExperimentConfig
    backbone: Backbone
    data: dict[int, ClientData]
    clients: list[ClientInfo]
    shapes: dict[str, tuple[int, int]]
    prepare_time_s: float


def _records(d: C.DataConfig) -> tuple[list[Any], list[str]]:
    """Load the data source; return (records, one label per record)."""
    if d.source == "bbc_news":
        docs = sources.bbc_news(d.path or None)
        return docs, [x.label for x in docs]
    if d.source == "newsgroups":
        docs = sources.newsgroups(d.path or None)
        return docs, [x.label for x in docs]
    if d.source == "long_texts":  # Wikipedia articles and Austen's novels (haystacks, streaming)
        docs = sources.long_texts("all")
        return docs, [x.source for x in docs]
    if not d.path:
        raise ConfigError(f"data.path: the source '{d.source}' needs a local path")
    if not Path(d.path).exists():
        raise DataError(f"data.path: {d.path} does not exist")
    if d.source == "mmlu":
        items = sources.mmlu(d.path, "test")
        return items, [x.subject for x in items]
    if d.source == "mmlu_domains":  # FedNL's five MMLU domains (data/mmlu_domains.py)
        from nestfed.data.mmlu_domains import domain_items

        return domain_items(d.path, "test", d.seed)
    items = sources.instructions(d.path)
    return items, [x.category or "all" for x in items]


def _partition(labels: list[str], d: C.DataConfig) -> list[list[int]]:
    if d.partition == "iid":
        return partition.iid(len(labels), d.num_clients, d.seed)
    if d.partition == "dirichlet":
        return partition.dirichlet(labels, d.num_clients, d.dirichlet_alpha, d.seed)
    client_labels = [list(x) for x in d.client_labels]
    if not client_labels:
        distinct = sorted(set(labels))
        if len(distinct) < d.num_clients:
            raise ConfigError(f"data.client_labels: {d.num_clients} clients but only {len(distinct)} labels "
                              f"({', '.join(distinct)}); list the labels of each client")
        client_labels = [[lab] for lab in distinct[: d.num_clients]]
    if len(client_labels) != d.num_clients:
        raise ConfigError(f"data.client_labels: {len(client_labels)} entries for data.num_clients = {d.num_clients}")
    known = set(labels)
    for i, labs in enumerate(client_labels):
        for lab in labs:
            if lab not in known:
                raise ConfigError(f"data.client_labels: client {i} names label '{lab}', which the data does not have")
    return partition.by_label(labels, client_labels, d.seed)


def _tokenise(records: list[Any], idx: list[int], d: C.DataConfig, tokenizer, cap: int) -> tasks.TokenDataset:
    items = [records[i] for i in idx]
    if d.task == "causal_lm":
        texts = [getattr(x, "text", None) or _as_text(x) for x in items]
        return tasks.pack_causal_lm(texts, tokenizer, d.block_size, max_blocks=cap)
    if d.task == "instruction":
        return tasks.instruction_examples(items[:cap], tokenizer, d.block_size)
    return tasks.multiple_choice_examples(items[:cap], tokenizer, d.block_size)


def _as_text(x: Any) -> str:
    if isinstance(x, sources.InstructionExample):
        return tasks.alpaca_prompt(x.instruction, x.input) + x.output
    if isinstance(x, sources.MultipleChoice):
        return tasks.mc_prompt(x.question, x.choices)
    return str(x)


def load_partitions(d: C.DataConfig) -> tuple[list[Any], list[str], list[list[int]]]:
    """Read the data source and partition it: (records, labels, record indices per client).

    Raises DataError (missing or malformed data) or ConfigError (bad partition settings).
    """
    if d.source == "niah":  # generated per client (data/niah.py), no shared records
        return [], [], []
    records, labels = _records(d)
    if d.task == "multiple_choice" and d.source != "mmlu":
        if d.source not in ("mmlu_domains", "niah"):
            raise ConfigError("data.task: multiple_choice needs data.source = 'mmlu', 'mmlu_domains' or 'niah'")
    try:
        parts = _partition(labels, d)
    except ValueError as exc:
        raise ConfigError(f"data.partition: {exc}") from None
    return records, labels, parts


def build_client_data(cfg: C.ExperimentConfig, tokenizer, loaded=None) -> tuple[dict[int, ClientData], list[list[str]]]:
    """Tokenised train/test data for every client, from the config's source, partition and task.

    loaded: the result of :func:`load_partitions` (read here when None).
    Raises DataError (missing or malformed data, a client left without examples) or ConfigError.
    """
    d = cfg.data
    if d.source == "niah":
        return _niah_client_data(cfg, tokenizer)
    records, labels, parts = loaded or load_partitions(d)
    letter_ids = tasks.letter_token_ids(tokenizer) if d.task == "multiple_choice" else None
    out = {}
    client_labels = []
    for cid, idx in enumerate(parts):
        train_idx, test_idx = partition.train_test_split(idx, d.test_fraction, d.seed + cid)
        train = _tokenise(records, train_idx, d, tokenizer, d.max_train)
        test = _tokenise(records, test_idx, d, tokenizer, d.max_test)
        if len(train) == 0 or len(test) == 0:
            raise DataError(f"client {cid}: no {'training' if len(train) == 0 else 'test'} examples after "
                            f"partitioning ({len(idx)} records); lower data.block_size or add data")
        names = sorted({labels[i] for i in idx})
        client_labels.append(names)
        out[cid] = ClientData(train.input_ids, train.labels, test.input_ids, test.labels,
                              letter_ids=letter_ids, label="+".join(names) if len(names) <= 3 else f"{len(names)} labels")
    return out, client_labels


def _niah_client_data(cfg: C.ExperimentConfig, tokenizer) -> tuple[dict[int, ClientData], list[list[str]]]:
    """NIAH clients (one template each) as ClientData with test groups per length and depth."""
    from nestfed.data.niah import niah_clients

    try:
        clients = niah_clients(cfg.data, tokenizer)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    letter_ids = tasks.letter_token_ids(tokenizer)
    out = {cid: ClientData(c["train"].input_ids, c["train"].labels, c["test"].input_ids, c["test"].labels,
                           letter_ids=letter_ids, label=c["label"], test_groups=c["groups"])
           for cid, c in enumerate(clients)}
    return out, [[c["label"]] for c in clients]


def install_fednl_memory(prep: Prepared, cfg: C.ExperimentConfig) -> dict[str, torch.Tensor]:
    """Give the prepared backbone FedNL's memory layers (``[memory]``; default the LoRA layers)
    if it has none yet, and return fresh initial memory rules for them (payload-keyed).

    The memory layers must lie at or above the frozen prefix whose outputs were cached (a
    disabled memory layer computes exactly the backbone, so installing it later is safe).
    Raises ConfigError for a memory layer below the cached prefix or out of range.
    """
    from nestfed.adapters.memory import MemorySettings, fresh_rule_arrays, install_memory, resolve_layers

    m = cfg.memory
    model = prep.backbone.model
    settings = MemorySettings(gate=m.gate, alpha_init=m.alpha_start if m.gate == "constant" else m.alpha_init,
                              window=m.window, beta_window=m.beta_window, dynamic_kernel=m.dynamic_kernel,
                              chunk_size=m.chunk_size, sink=m.sink_tokens)
    try:
        layers = resolve_layers(model, m.layers or cfg.lora.layers)
    except ValueError as exc:
        raise ConfigError(f"memory.layers: {exc}") from None
    start = next(iter(prep.data.values())).start if prep.data else 0
    if layers and min(layers) < start:
        raise ConfigError(f"memory.layers: layer {min(layers)} lies in the frozen prefix cached up to layer {start}; "
                          "put the memory on LoRA layers or set train.cache_frozen_prefix = false")
    install_memory(model, settings, layers)
    return fresh_rule_arrays(model, layers)


def install_method_modules(prep: Prepared, cfg: C.ExperimentConfig) -> dict[str, torch.Tensor]:
    """What a method adds to the prepared backbone before its first round, on the server's side
    (embedded runner) and on every Flower node alike: FedNL's memory layers (returns their fresh
    rules, payload-keyed; {} for other methods), and for a streamed evaluation
    (``train.eval_stream_chunk > 0``) a disabled memory module on every layer.
    Raises ConfigError as :func:`install_fednl_memory` does."""
    memory_init = install_fednl_memory(prep, cfg) if cfg.strategy.name == "fednl" else {}
    if cfg.train.eval_stream_chunk > 0:  # streamed evaluation: every layer needs a (disabled) memory module
        from nestfed.adapters.memory import MemorySettings, install_memory

        install_memory(prep.backbone.model, MemorySettings(gate=cfg.memory.gate, window=cfg.memory.window,
                                                           sink=cfg.memory.sink_tokens))
    return memory_init


def prepare(cfg: C.ExperimentConfig, on_status: Callable[[str], None] | None = None,
            only_clients: list[int] | None = None) -> Prepared:
    """Load the backbone, inject LoRA (rank r_max), build and cache every client's data.

    only_clients: keep (and cache the frozen prefix for) these client ids only, e.g. the one
    partition a Flower SuperNode serves; None = every client.

    Raises ConfigError / DataError on bad input; creates no files except the model cache.
    """
    t0 = time.perf_counter()
    say = on_status or (lambda s: None)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    ranks = C.client_ranks(cfg)
    say("loading data")
    loaded = load_partitions(cfg.data)
    say("loading the backbone")
    backbone = load_backbone(cfg.model)
    say("tokenising")
    data, _ = build_client_data(cfg, backbone.tokenizer, loaded)
    if only_clients is not None:
        data = {cid: data[cid] for cid in only_clients}
    s = cfg.lora.lora_alpha / C.r_max(cfg)
    try:
        inject_lora(backbone.model, cfg.lora.target_modules, C.r_max(cfg), s, cfg.lora.layers)
    except ValueError as exc:
        raise ConfigError(f"lora: {exc}") from None
    start = first_adapted_layer(backbone.model) if cfg.train.cache_frozen_prefix else 0
    if start > 0:
        say(f"caching the frozen layers 0..{start - 1}")
    for d in data.values():
        d.cache_prefix(backbone.model, start, cfg.train.eval_batch_size)
    clients = [ClientInfo(cid, ranks[cid], d.num_examples) for cid, d in data.items()]
    return Prepared(cfg, backbone, data, clients, module_shapes(backbone.model), time.perf_counter() - t0)


def write_text_atomic(path: Path, text: str) -> None:
    """Write a text file via a temporary file and a rename (never half-written)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def new_run_dir(cfg: C.ExperimentConfig, parent: Path | None = None) -> Path:
    """A fresh, not yet existing directory ``<output.dir>/<name>-<UTC time>``, or ``parent/<method>``
    for one method of a multi-method run."""
    if parent is not None:
        return parent / cfg.strategy.name
    name = cfg.output.name or cfg.strategy.name
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = Path(cfg.output.dir) / f"{name}-{stamp}"
    i = 1
    while path.exists():
        path = Path(cfg.output.dir) / f"{name}-{stamp}-{i}"
        i += 1
    return path


def run_experiment(prep: Prepared, cfg: C.ExperimentConfig, run_dir: Path, resume: bool = False,
                   on_event: Callable[[str, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run one method over the prepared clients into ``run_dir``; return the summary.

    ``cfg`` may differ from ``prep.cfg`` only in the strategy, federation, train and output
    sections (several methods share one preparation).
    """
    if cfg.strategy.name in ("fedslm", "fedmkt"):  # compressed clients: their own recipe
        from nestfed.fedslm_experiment import run_compressed

        return run_compressed(prep, cfg, run_dir, resume, on_event)
    t0 = time.perf_counter()
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        write_text_atomic(run_dir / "config.toml", C.dumps_toml(cfg))
    strategy = make_strategy(cfg)
    memory_init = install_method_modules(prep, cfg)
    if cfg.strategy.name == "fednl":
        strategy.options["memory_init"] = memory_init
    for c in prep.clients:
        if c.rank > C.r_max(cfg):
            raise ConfigError(f"lora.ranks: client {c.cid} rank {c.rank} is above lora.r_max = {C.r_max(cfg)}")
    trainer = ClientTrainer(prep.backbone.model, prep.data, cfg.train)
    fed = cfg.federation
    loop = RoundLoop(strategy, trainer, prep.clients, fed.rounds, run_dir, fed.fraction, fed.min_clients,
                     fed.seed, on_event=on_event)
    state = loop.run(prep.shapes, resume=resume)
    arrays, scale = strategy.export(state)
    if arrays:  # FedNL with fednl_travel = "rules" has no global LoRA: each client keeps its own
        export_peft_adapter(arrays, scale, run_dir / "adapter", prep.backbone.source)
    if hasattr(strategy, "export_rules"):
        save_tensors_atomic(strategy.export_rules(state), run_dir / "memory_rules.safetensors")
    from nestfed import report

    if cfg.output.plots:
        report.plot_run(run_dir)
    lines = report.read_metrics(run_dir)
    summary = report.summarise(lines, cfg)
    summary.update({"run_dir": str(run_dir), "wall_time_s": time.perf_counter() - t0,
                    "prepare_time_s": prep.prepare_time_s, "client_labels": {str(c): d.label for c, d in prep.data.items()},
                    "rejections": loop.log, "frozen_prefix_layers": next(iter(prep.data.values())).start})
    write_text_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary
