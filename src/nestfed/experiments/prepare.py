"""Prepare an experiment once for every method it compares: load the backbone, inject LoRA, build
and cache every client's data (nestfed.data.clients), and, for a streamed evaluation, give every
attention layer a (disabled) memory module."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from nestfed.config import ConfigError, ExperimentConfig, client_ranks, r_max
from nestfed.config.trust import DATA_ATTACKS
from nestfed.data import client_cache as client_cache_io
from nestfed.data.clients import ClientData, build_client_data, load_partitions
from nestfed.data.poisoning import poison_client
from nestfed.federation.messages import ClientInfo
from nestfed.federation.prepared import Prepared
from nestfed.nn.backbone import load_backbone
from nestfed.nn.checkpointing import enable_activation_checkpointing
from nestfed.nn.frozen_prefix import first_adapted_layer
from nestfed.nn.lora import inject_lora, module_shapes, target_module_names
from nestfed.nn.memory import MemorySettings, install_memory
from nestfed.seeds import stream_seed


def prepare(cfg: ExperimentConfig, on_status: Callable[[str], None] | None = None,
            only_clients: list[int] | None = None, client_cache: str | Path | None = None) -> Prepared:
    """Load the backbone, inject LoRA (rank r_max), build and cache every client's data.

    only_clients: keep (and cache the frozen prefix for) these client ids only, e.g. the one
    partition a Flower SuperNode serves; None = every client. client_cache: with only_clients, a
    directory where each of their prepared data is kept (nestfed.data.client_cache): loaded when
    there, written after building otherwise (a Flower node's next ClientApp process then skips
    partitioning, tokenising and the frozen prefix).

    Raises ConfigError / DataError on bad input (a rank above an adapted layer's min(out, in)
    among them); creates no files except the model cache and ``client_cache``'s files.
    """
    t0 = time.perf_counter()
    say = on_status or (lambda s: None)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    ranks = client_ranks(cfg)
    cached: dict[int, ClientData | None] = {}
    if client_cache is not None and only_clients is not None:
        cached = {cid: client_cache_io.load(client_cache_io.path_for(client_cache, cfg, cid)) for cid in only_clients}
    if cached and all(d is not None for d in cached.values()):
        say("loading the backbone")
        backbone = load_backbone(cfg.model)
        data = {cid: d for cid, d in cached.items() if d is not None}
    else:
        say("loading data")
        loaded = load_partitions(cfg.data)
        say("loading the backbone")
        backbone = load_backbone(cfg.model)
        say("tokenising")
        data, _ = build_client_data(cfg, backbone.tokenizer, loaded)
        if only_clients is not None:
            data = {cid: data[cid] for cid in only_clients}
        if cfg.attack.kind in DATA_ATTACKS:  # an attacking client trains on its poisoned text (docs/trust.md)
            for cid in cfg.attack.clients:
                if cid in data:
                    poison_client(data[cid], cfg.attack.kind, backbone.model.config.vocab_size,
                                  stream_seed(cfg.federation.seed, 0, cid, "poison"))
    try:
        names = target_module_names(backbone.model, cfg.lora.target_modules, cfg.lora.layers)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None  # names lora.layers or lora.target_modules
    smallest = min(min(backbone.model.get_submodule(n).weight.shape) for n in names)
    if r_max(cfg) > smallest:  # checked before any [r, in] matrix is allocated
        raise ConfigError(f"lora.ranks: rank {r_max(cfg)} exceeds {smallest}, the smallest adapted layer's min(out, in) "
                          "(a LoRA update of a [out, in] layer has rank at most min(out, in))")
    inject_lora(backbone.model, cfg.lora.target_modules, r_max(cfg), cfg.lora.lora_alpha / r_max(cfg), cfg.lora.layers)
    if cfg.train.gradient_checkpointing:
        enable_activation_checkpointing(backbone.model)
    shapes = module_shapes(backbone.model)
    start = first_adapted_layer(backbone.model) if cfg.train.cache_frozen_prefix else 0
    if start > 0:
        say(f"caching the frozen layers 0..{start - 1}")
    for cid, d in data.items():
        if cached.get(cid) is not None:
            if d.start != start:  # cannot happen (the key covers what fixes start); never trust it blindly
                raise ConfigError(f"client {cid}: cached data start at layer {d.start}, the model at {start}")
            continue
        d.cache_prefix(backbone.model, start, cfg.train.eval_batch_size)
        if client_cache is not None and only_clients is not None:
            client_cache_io.save(client_cache_io.path_for(client_cache, cfg, cid), d)
    clients = [ClientInfo(cid, ranks[cid], d.num_examples) for cid, d in data.items()]
    return Prepared(cfg, backbone, data, clients, shapes, time.perf_counter() - t0)


def install_stream_modules(prep: Prepared, cfg: ExperimentConfig) -> None:
    """For a streamed evaluation (``train.eval_stream_chunk > 0``) every attention layer needs a
    memory module to carry its stream state: add a disabled one (it computes exactly the backbone's
    attention) where a method installed none. Called after the method's setup, on the server's
    model and on every Flower node alike."""
    if cfg.train.eval_stream_chunk > 0:
        install_memory(prep.backbone.model, MemorySettings(gate=cfg.memory.gate, window=cfg.memory.window,
                                                           sink=cfg.memory.sink_tokens))
