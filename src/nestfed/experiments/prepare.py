"""Prepare an experiment once for every method it compares: load the backbone, inject LoRA, register
every client (n_k, label) and give the methods a pool that builds a client's data when it is first
needed (nestfed.data.client_pool), and, for a streamed evaluation, give every attention layer
bounded attention (nestfed.nn.bounded_attention)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from nestfed import methods
from nestfed.config import ConfigError, ExperimentConfig, client_ranks, r_max
from nestfed.config.population import assign_tiers
from nestfed.config.trust import DATA_ATTACKS
from nestfed.data import client_cache as client_cache_io
from nestfed.data.client_pool import ClientPool
from nestfed.data.clients import ClientData, ClientSource
from nestfed.data.poisoning import poison_client
from nestfed.experiments.pretrained_tiny import ensure_pretrained
from nestfed.federation.messages import ClientInfo
from nestfed.federation.population import trace_has_budgets
from nestfed.federation.prepared import Prepared, tier_config
from nestfed.nn.backbone import Backbone, default_cache_dir, load_backbone
from nestfed.nn.bounded_attention import install_bounded_attention
from nestfed.nn.checkpointing import enable_activation_checkpointing
from nestfed.nn.footprint import Footprint
from nestfed.nn.frozen_prefix import first_adapted_layer
from nestfed.nn.lora import inject_lora, module_shapes, target_module_names
from nestfed.seeds import stream_seed


def client_cache_of(cfg: ExperimentConfig, override: str | Path | None = None) -> client_cache_io.ClientCache | None:
    """The on-disk client cache of an experiment.

    Args:
        cfg: the experiment's config (``train.client_cache``: "" = <model cache dir>/clients,
            "off" = none; ``train.client_cache_mb``: its bound).
        override: a directory in its place (a Flower node's ``client-cache``; "off" = none); None
            keeps the config's.

    Returns:
        The cache; None when it is off.
    """
    where = str(override) if override is not None else cfg.train.client_cache
    if where == "off":
        return None
    if not where:
        where = str((Path(cfg.model.cache_dir) if cfg.model.cache_dir else default_cache_dir()) / "clients")
    return client_cache_io.ClientCache(Path(where), cfg.train.client_cache_mb * 2**20)


def prepare(
    cfg: ExperimentConfig,
    on_status: Callable[[str], None] | None = None,
    only_clients: list[int] | None = None,
    client_cache: str | Path | None = None,
) -> Prepared:
    """Load the backbone, inject LoRA (rank r_max), register the clients.

    Their data are built when first read from ``Prepared.data`` (a
    ``nestfed.data.client_pool.ClientPool``). It creates no files except the model cache and the
    client cache's.

    Memory budgets (``population.memory_mib``) are drawn for every method alike; they choose each
    client's LoRA tier (backbone precision and rank) unless the method's own setup chooses what a
    budget holds (``Method.chooses_memory``: the budgets are then only recorded, ``Prepared.budgets``).

    Args:
        cfg: the experiment's config.
        on_status: called with what it is doing; None for silence.
        only_clients: register these client ids only (``Prepared.clients``), e.g. the one partition
            a Flower SuperNode serves; the pool still serves any client, registering it when first
            asked for; None = every client.
        client_cache: a directory replacing ``train.client_cache`` ("off" = none), where built
            clients are kept and found again (a Flower node's next process then skips
            partitioning, tokenising and the frozen prefix); None keeps the config's.

    Returns:
        The preparation.

    Raises:
        ConfigError: on a bad setting (a rank above an adapted layer's min(out, in), a memory
            budget that holds no rank, among them).
        DataError: on bad data (a client without data, among them).
    """
    t0 = time.perf_counter()
    say = on_status or (lambda s: None)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    ensure_pretrained(cfg.model, say)
    say("loading the backbone")
    backbone = load_backbone(cfg.model)
    _adapt(backbone.model, cfg)
    shapes = module_shapes(backbone.model)
    start = first_adapted_layer(backbone.model) if cfg.train.cache_frozen_prefix else 0
    own = cfg.model.quantization
    backbones = {own: backbone}
    lora_tiers = not methods.get(cfg.strategy.name).chooses_memory  # else the method's setup chooses
    footprints = _footprints(backbones, cfg, start, say, lora_tiers)
    sizes = None if footprints is None else {q: f.bytes for q, f in footprints.items()}
    try:
        p, lo = cfg.population, cfg.lora
        ranks, budgets, precisions = assign_tiers(
            p, lo.ranks, lo.r_max, cfg.data.num_clients, cfg.data.seed, sizes, own, lora_tiers
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for q in [q for q in backbones if q != own and q not in precisions]:
        del backbones[q]  # measured for the choice, held by no client
    pool = _client_pool(cfg, backbones, precisions, start, client_cache)
    cids = list(range(cfg.data.num_clients)) if only_clients is None else list(only_clients)
    say(f"registering {len(cids)} clients")
    clients = [ClientInfo(cid, ranks[cid], pool.num_examples(cid)) for cid in cids]
    return Prepared(
        cfg,
        backbone,
        pool,
        clients,
        shapes,
        time.perf_counter() - t0,
        start=start,
        ranks=ranks,
        budgets=None if budgets is None else {cid: budgets[cid] for cid in cids},
        footprint=None if footprints is None else footprints[own],
        backbones=backbones,
        precisions=precisions,
        footprints=footprints,
    )


def _adapt(model: torch.nn.Module, cfg: ExperimentConfig) -> None:
    """Inject LoRA at rank r_max (scale lora_alpha / r_max) into the adapted layers, and activation
    checkpointing when ``train.gradient_checkpointing``. Raises ConfigError for bad
    ``lora.layers`` / ``lora.target_modules`` or a rank above the smallest adapted layer's
    min(out, in), checked before any [r, in] matrix is allocated."""
    try:
        names = target_module_names(model, cfg.lora.target_modules, cfg.lora.layers)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None  # names lora.layers or lora.target_modules
    smallest = min(min(m.in_features, m.out_features) for m in map(model.get_submodule, names))
    if r_max(cfg) > smallest:
        raise ConfigError(
            f"lora.ranks: rank {r_max(cfg)} exceeds {smallest}, the smallest adapted layer's min(out, in) "
            "(a LoRA update of a [out, in] layer has rank at most min(out, in))"
        )
    inject_lora(
        model,
        cfg.lora.target_modules,
        r_max(cfg),
        cfg.lora.lora_alpha / r_max(cfg),
        cfg.lora.layers,
        cfg.lora.lora_dropout,
    )
    if cfg.train.gradient_checkpointing:
        enable_activation_checkpointing(model)


def _footprints(
    backbones: dict[str, Backbone], cfg: ExperimentConfig, start: int, say: Callable[[str], None], lora_tiers: bool
) -> dict[str, Footprint] | None:
    """The training footprint per rank (nestfed.nn.footprint) of every precision a budget chooses
    from (``population.precisions``), measured only when memory budgets draw the ranks
    (``population.memory_mib``, or an elastic trace with budgets) and choose LoRA tiers
    (``lora_tiers``: not a method that chooses what a budget holds itself); else None. Each other
    precision's backbone is loaded once, LoRA injected, into ``backbones``."""
    p = cfg.population
    budgets_trace = p.elastic == "trace" and trace_has_budgets(p.elastic_trace)
    if not lora_tiers or not (p.memory_mib or budgets_trace):
        return None
    out = {}
    for q in p.tiers(cfg.model.quantization):
        if q not in backbones:
            say(f"loading the backbone at {q}")
            backbones[q] = load_backbone(tier_config(cfg, q).model)
            _adapt(backbones[q].model, cfg)
        out[q] = Footprint.measure(backbones[q].model, cfg.train, cfg.data.block_size, start)
    return out


def _client_pool(
    cfg: ExperimentConfig,
    backbones: dict[str, Backbone],
    precisions: list[str],
    start: int,
    client_cache: str | Path | None,
) -> ClientPool:
    """The pool that builds a client's data when first read: an attacking client's text poisoned
    (``attack.kind`` a data attack, docs/trust.md), its frozen prefix cached from layer ``start``
    by its own tier's backbone (``precisions[cid]``); kept in the client cache (``client_cache_of``)
    under its tier's config."""
    attackers = set(cfg.attack.clients) if cfg.attack.kind in DATA_ATTACKS else set()
    backbone = backbones[cfg.model.quantization]
    vocab = backbone.model.config.vocab_size
    bs = cfg.train.eval_batch_size

    def finish(cid: int, d: ClientData) -> None:
        if cid in attackers:  # an attacking client trains on its poisoned text (docs/trust.md)
            poison_client(d, cfg.attack.kind, vocab, stream_seed(cfg.federation.seed, 0, cid, "poison"))
        d.cache_prefix(backbones[precisions[cid]].model, start, bs)

    return ClientPool(
        ClientSource(cfg, backbone.tokenizer),
        range(cfg.data.num_clients),
        finish,
        lambda cid: client_cache_io.key(tier_config(cfg, precisions[cid]), cid),
        client_cache_of(cfg, client_cache),
        cfg.train.client_memory_mb * 2**20,
    )


def install_stream_modules(prep: Prepared, cfg: ExperimentConfig) -> None:
    """Give every attention layer bounded attention for a streamed evaluation.

    With ``train.eval_stream_chunk > 0`` every attention layer needs bounded attention to carry its
    stream state (nestfed.nn.bounded_attention: with no stream it computes exactly the backbone's
    attention): add it, with ``train.eval_stream_window`` and ``train.eval_stream_sinks``, where a
    method's setup bounded none. Called after the method's setup, on the server's model and on
    every Flower node alike.

    Args:
        prep: the preparation (its backbone's model is changed in place).
        cfg: the run's config.
    """
    t = cfg.train
    if t.eval_stream_chunk > 0:
        install_bounded_attention(prep.backbone.model, None, t.eval_stream_window, t.eval_stream_sinks)


__all__ = ["client_cache_of", "client_ranks", "install_stream_modules", "prepare"]
