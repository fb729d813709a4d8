"""What FedSLM and FedMKT share on top of a prepared LoRA experiment: the SVD of the backbone
(computed once, cached on disk), one compressed model per compression ratio, each client's data
as its group's model sees it, and the unlabeled server text (docs/methods.md section 2).

Calibration (``compression.whitening = "activation"``, nn/whitening.py): the whitened SVD
needs the input second moment of every compressed layer, collected by running the backbone over
the server text, the unlabeled blocks held out from every client (data/held_out.py). It uses
only that server text: no client data leave the clients, and no client's train or test record is
part of the calibration.

Frozen-prefix reuse (nestfed.nn.frozen_prefix): cores train only in ``compression.train_layers``;
everything below the lowest of those layers is frozen in every group model. When no layer below
it is compressed either, each group's prefix equals the backbone's, so the backbone's cached
outputs are shared instead of being recomputed per group.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from nestfed.config import ConfigError, ExperimentConfig
from nestfed.data.clients import ClientData
from nestfed.data.held_out import load_server_text
from nestfed.data.tasks import TokenDataset
from nestfed.federation.messages import Arrays
from nestfed.federation.prepared import Prepared
from nestfed.methods.compressed.options import DEFAULT_RATIO
from nestfed.methods.compressed.ratio_choice import budget_ratios
from nestfed.nn.backbone import default_cache_dir
from nestfed.nn.footprint import TrainedFootprint, weight_bytes
from nestfed.nn.frozen_prefix import CachedText, prefix_features
from nestfed.nn.keys import layer_of
from nestfed.nn.placement import resolve_device, resolve_dtype
from nestfed.nn.svd import (
    SVDFactors,
    base_linear,
    compute_bases,
    core_key,
    derive_compressed,
    load_bases,
    save_bases,
    select_layers,
    target_linear_names,
)
from nestfed.nn.whitening import DAMPING, second_moments, token_hash


@dataclass
class CompressedSetup:
    """The compressed side of an experiment.

    Attributes:
        ratios: the distinct compression ratios, sorted (group g has ratios[g]).
        client_group: {cid: g}.
        bases: {module: SVDFactors} at the largest rank.
        trained: module paths whose cores train and travel.
        models: {g: compressed model}.
        data: {g: {cid: ClientData}} for the group's clients, prefix cached from layer ``start``.
        server_text: [N, T] blocks held out from every client.
        public: {g: CachedText} the server text as group g's model sees it, plus "strong" (the
            backbone).
        initial: {g: {core key: diag(S[:r])}}.
        bytes: {"full": backbone bytes, g: group model bytes} (parameters and buffers, LoRA
            excluded, shared tensors once).
        start: the first layer the group models' cached prefixes enter.
        shared_prefix: whether every group's prefix equals the backbone's (the backbone's cached
            outputs are shared).
        prepare_time_s: seconds the preparation took.
        extra: what a method adds (e.g. measurements of its own).
        budgets: {cid: memory budget, MiB} when the budgets chose the ratios
            (``compression.ratio_choices``); None otherwise.
        footprints: {rho: training footprint of its compressed client model} of every ratio choice
            (nestfed.methods.compressed.ratio_choice), chosen or not; {} without budgets.
    """

    ratios: list[float]
    client_group: dict[int, int]
    bases: dict[str, SVDFactors]
    trained: list[str]
    models: dict[int, nn.Module]
    data: dict[int, dict[int, ClientData]]
    server_text: TokenDataset
    public: dict[str | int, CachedText]
    initial: dict[int, Arrays]
    bytes: dict[str | int, int]
    start: int
    shared_prefix: bool
    prepare_time_s: float = 0.0
    extra: dict = field(default_factory=dict)
    budgets: dict[int, int] | None = None
    footprints: dict[float, TrainedFootprint] = field(default_factory=dict)

    def ranks(self, g: int) -> dict[str, int]:
        """The ranks r_gl of group g's trained layers.

        Args:
            g: the group.

        Returns:
            {module: r_gl}.
        """
        return {n: self.models[g].get_submodule(n).rank for n in self.trained}

    def group_examples(self) -> dict[int, float]:
        """N_g: training examples of every group (all its clients).

        Returns:
            {g: N_g}.
        """
        out = {g: 0.0 for g in range(len(self.ratios))}
        for g, d in self.data.items():
            out[g] += float(sum(x.num_examples for x in d.values()))
        return out


def client_ratios(cfg: ExperimentConfig) -> list[float]:
    """rho of every client: ``compression.client_ratios`` broadcast to data.num_clients.

    Args:
        cfg: the experiment.

    Returns:
        One ratio per client (`DEFAULT_RATIO` for every client when ``client_ratios`` is empty).
    """
    r = list(cfg.section("compression").client_ratios) or [DEFAULT_RATIO]
    return r * cfg.data.num_clients if len(r) == 1 else r


def largest_ratio(cfg: ExperimentConfig) -> float:
    """The largest rho any client may hold, the rank the bases are computed at.

    Args:
        cfg: the experiment.

    Returns:
        The largest of ``compression.ratio_choices``, else of `client_ratios`.
    """
    return max(cfg.section("compression").ratio_choices or client_ratios(cfg))


def bases_cache_key(source: str, cfg: ExperimentConfig, calibration: torch.Tensor | None = None) -> str:
    """16 hex digits naming a model's cached bases.

    Covers the source, target, largest ratio, the resolved dtype of the frozen weights (``auto``
    keys as what it resolves to) and, for ``compression.whitening = "activation"``, the mode, the
    damping and a hash of the calibration token ids (another server text gives other bases). Plain
    SVD keeps the key of earlier versions, so existing caches stay valid.

    Args:
        source: where the backbone was loaded from.
        cfg: the experiment.
        calibration: the calibration token ids [B, T]; needed for whitening.

    Returns:
        The key.

    Raises:
        ValueError: when whitening needs calibration ids and gets none.
    """
    c = cfg.section("compression")
    dtype = str(resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device))).removeprefix("torch.")
    text = f"{source}|{c.target}|{largest_ratio(cfg)}|{dtype}"
    if c.whitening != "none":
        if calibration is None:
            raise ValueError(f"compression.whitening = '{c.whitening}' needs the calibration token ids")
        text += f"|{c.whitening}|{DAMPING}|{token_hash(calibration)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_calibration(model: nn.Module, cfg: ExperimentConfig, calibration: torch.Tensor) -> None:
    """Check that the calibration text has as many tokens as the widest compressed layer has inputs.

    Else C = X^T X / N is rank deficient and the damping alone decides the directions the server
    text never shows.

    Args:
        model: the backbone.
        cfg: the experiment (``compression.target``).
        calibration: [B, T] server text ids.

    Raises:
        ConfigError: naming ``compression.server_blocks`` (and ``compression.target`` for a regex
            matching nothing).
    """
    try:
        names = target_linear_names(model, cfg.section("compression").target)
    except ValueError as exc:
        raise ConfigError(f"compression.target: {exc}") from None
    need = max(base_linear(model.get_submodule(n)).in_features for n in names)
    have = calibration.numel()
    if have < need:
        T = calibration.shape[-1]
        raise ConfigError(
            f"compression.server_blocks: compression.whitening = 'activation' calibrates on the server "
            f"text, {calibration.shape[0]} blocks = {have} tokens, fewer than the {need} inputs of the "
            f"widest compressed layer; set compression.server_blocks >= {-(-need // T)} or "
            "compression.whitening = 'none'"
        )


def cached_bases(
    model: nn.Module, cfg: ExperimentConfig, source: str, say, calibration: torch.Tensor | None = None
) -> dict[str, SVDFactors]:
    """The SVD bases at the largest ratio, read from the cache when a real model was computed before.

    With ``compression.whitening = "activation"`` the input second moment of every compressed layer
    is collected on the calibration text (`nestfed.nn.whitening.second_moments`) and the bases
    are SVD-LLM's whitened SVD. Cache: <model cache dir>/svd/<`bases_cache_key`>.safetensors
    (only for models loaded from a directory; tiny random models are recomputed: milliseconds).

    Args:
        model: the backbone.
        cfg: the experiment.
        source: where the backbone was loaded from ("" = not from a directory: no cache).
        say (Callable[[str], None]): progress lines.
        calibration: the server text's token ids [B, T] (data/held_out.py; held out from every
            client); needed for whitening.

    Returns:
        {module: SVDFactors}.

    Raises:
        ConfigError: for a bad target regex or ratio, too little calibration text or a missing one.
    """
    c = cfg.section("compression")
    top = largest_ratio(cfg)
    whiten = c.whitening == "activation"
    if whiten:
        if calibration is None:
            raise ConfigError("compression.whitening: 'activation' needs the server text (compression.server_blocks)")
        check_calibration(model, cfg, calibration)
    path = None
    if source:
        key = bases_cache_key(source, cfg, calibration if whiten else None)
        path = (
            (Path(cfg.model.cache_dir) if cfg.model.cache_dir else default_cache_dir()) / "svd" / f"{key}.safetensors"
        )
        if path.is_file():
            return load_bases(path)[0]
    moments = None
    field = "compression.whitening" if whiten else "compression.target"  # the target was checked above
    try:
        if whiten:
            say(f"collecting the compressed layers' input statistics on {calibration.numel()} server-text tokens")
            moments = second_moments(model, calibration, pattern=c.target, batch_size=cfg.train.eval_batch_size)
        say(f"computing the {'whitened ' if whiten else ''}SVD of the compressed layers (once)")
        bases = compute_bases(model, [top], c.target, whitening=moments)
    except ValueError as exc:
        raise ConfigError(f"{field}: {exc}") from None
    if path is not None:
        meta = {"source": source, "target": c.target, "ratio": str(top), "whitening": c.whitening}
        if whiten:
            meta.update(
                {
                    "damping": str(DAMPING),
                    "calibration": token_hash(calibration),
                    "calibration_tokens": str(calibration.numel()),
                }
            )
        save_bases(bases, path, meta)
    return bases


def prepare_compressed(prep: Prepared, cfg: ExperimentConfig, say=None) -> CompressedSetup:
    """Build the compressed side of an experiment, once per preparation (memoised in ``prep.cache``).

    The server text is loaded first: with ``compression.whitening = "activation"`` it is the
    calibration text of the SVD (only server text, held out from every client; no client data leave
    the clients).

    Args:
        prep: the prepared experiment (the backbone with LoRA, every client's data).
        cfg: the experiment.
        say (Callable[[str], None] | None): progress lines; None for silence.

    Returns:
        The compressed setup.

    Raises:
        ConfigError: for the target, train_layers, whitening, or too little calibration text.
        DataError: for too little held-out server text.
    """
    c = cfg.section("compression")
    budgets = prep.budgets if c.ratio_choices else None
    memo = prep.cache.setdefault("compressed", {})
    key = (
        tuple(client_ratios(cfg)),
        tuple(c.ratio_choices),
        None if budgets is None else tuple(sorted(budgets.items())),
    )
    key += (c.target, tuple(c.train_layers), c.server_blocks, c.whitening)
    if key in memo:
        return memo[key]
    say = say or (lambda s: None)
    t0 = time.perf_counter()
    model = prep.backbone.model
    say("loading the server text (held out from every client)")
    server = load_server_text(cfg, prep.backbone.tokenizer, c.server_blocks)
    bases = cached_bases(model, cfg, prep.backbone.source, say, server.input_ids)
    trained = _trained_layers(cfg, sorted(bases), model.config.num_hidden_layers)
    start = min(layer_of(n) or 0 for n in trained) if cfg.train.cache_frozen_prefix else 0
    per_client, derived, footprints = _client_models(prep, cfg, bases, trained, start, say)
    ratios = sorted(set(per_client.values()))
    client_group = {cid: ratios.index(per_client[cid]) for cid in prep.data}
    models = {g: derived[rho] for g, rho in enumerate(ratios)}  # a choice no client holds is let go
    prep_start = prep.frozen_prefix_layers
    shared = start == prep_start and all((layer_of(n) or 0) >= start for n in bases)
    say("caching the server text and the compressed models' frozen layers")
    bs = cfg.train.eval_batch_size
    strong_hidden = prefix_features(model, server.input_ids, prep_start, bs) if prep_start else None
    public: dict[str | int, CachedText] = {"strong": CachedText(server.input_ids, strong_hidden, prep_start)}
    data: dict[int, dict[int, ClientData]] = {}
    for g, m in models.items():
        if shared or not start:
            public[g] = public["strong"] if shared else CachedText(server.input_ids)
        else:
            public[g] = CachedText(server.input_ids, prefix_features(m, server.input_ids, start, bs), start)
        data[g] = {
            cid: _group_client(d, m, shared, start, bs) for cid, d in prep.data.items() if client_group[cid] == g
        }
    initial = {g: {core_key(n): m.get_submodule(n).sigma.detach().clone() for n in trained} for g, m in models.items()}
    sizes: dict[str | int, int] = {"full": weight_bytes(model)}
    sizes.update({g: weight_bytes(m) for g, m in models.items()})
    setup = CompressedSetup(
        ratios,
        client_group,
        bases,
        trained,
        models,
        data,
        server,
        public,
        initial,
        sizes,
        start,
        shared,
        time.perf_counter() - t0,
        budgets=None if budgets is None else dict(budgets),
        footprints=footprints,
    )
    memo[key] = setup
    return setup


def _client_models(
    prep: Prepared, cfg: ExperimentConfig, bases: dict[str, SVDFactors], trained: list[str], start: int, say
) -> tuple[dict[int, float], dict[float, nn.Module], dict[float, TrainedFootprint]]:
    """({cid: rho}, {rho: compressed model}, {rho: footprint}): the models derived at every ratio
    a client may hold; with ``compression.ratio_choices`` each client's budget chooses among them
    (ratio_choice.py; footprints measured on the group models entering layer ``start``), else
    ``compression.client_ratios`` (no footprints). Raises ConfigError for a budget that holds no choice."""
    c = cfg.section("compression")
    say("deriving the compressed client models")
    model = prep.backbone.model
    derived = {rho: derive_compressed(model, bases, rho) for rho in c.ratio_choices or set(client_ratios(cfg))}
    if not c.ratio_choices:
        return dict(enumerate(client_ratios(cfg))), derived, {}
    say(f"measuring the training footprint of compression ratios {sorted(c.ratio_choices)}")
    per_client, footprints = budget_ratios(prep.budgets, derived, trained, cfg, start)
    return per_client, derived, footprints


def _trained_layers(cfg: ExperimentConfig, compressed: list[str], num_layers: int) -> list[str]:
    """The compressed modules whose cores train (``compression.train_layers`` among ``compressed``).
    Raises ConfigError for bad train_layers or when no compressed layer lies there."""
    try:
        trained = select_layers(compressed, cfg.section("compression").train_layers, num_layers)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None  # names compression.train_layers
    if not trained:
        raise ConfigError(
            f"compression.train_layers {list(cfg.section('compression').train_layers)}: no compressed layer "
            "lies there (check compression.target)"
        )
    return trained


def _group_client(d: ClientData, model: nn.Module, shared: bool, start: int, bs: int) -> ClientData:
    """A client's data as its group's compressed ``model`` sees it: the backbone's cached prefix
    when the prefix is ``shared``, else the prefix cached again from layer ``start`` through
    ``model`` (batches of ``bs``)."""
    if shared:
        return ClientData(
            d.train_ids,
            d.train_labels,
            d.test_ids,
            d.test_labels,
            d.train_hidden,
            d.test_hidden,
            d.start,
            d.letter_ids,
            d.label,
        )
    nd = ClientData(d.train_ids, d.train_labels, d.test_ids, d.test_labels, letter_ids=d.letter_ids, label=d.label)
    nd.cache_prefix(model, start, bs)
    return nd
