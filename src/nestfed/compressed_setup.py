"""What FedSLM and FedMKT share on top of a prepared LoRA experiment: the SVD of the backbone
(computed once, cached on disk), one compressed model per compression ratio, each client's data
as its group's model sees it, and the unlabeled server text (methods.md section 2).

Frozen-prefix reuse (nestfed/frozen_prefix.py): cores train only in ``compression.train_layers``;
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

from nestfed import config as C
from nestfed.adapters.svd import (SVDFactors, compute_bases, derive_compressed, layer_index, load_bases, save_bases,
                                  select_layers)
from nestfed.backbone import default_cache_dir
from nestfed.data.held_out import load_server_text
from nestfed.data.tasks import TokenDataset
from nestfed.elicitation import CachedText
from nestfed.errors import ConfigError
from nestfed.federation.client import ClientData
from nestfed.federation.messages import Arrays
from nestfed.frozen_prefix import prefix_features
from nestfed.strategies.fedslm import core_key, fuse_cores


@dataclass
class CompressedSetup:
    """The compressed side of an experiment.

    ratios: the distinct compression ratios, sorted (group g has ratios[g]); client_group:
    {cid: g}; bases: {module: SVDFactors} at the largest rank; trained: module paths whose cores
    train and travel; models: {g: compressed model}; data: {g: {cid: ClientData}} for the group's
    clients, prefix cached from layer ``start``; server_text: [N, T] blocks held out from every
    client; public: {g: CachedText} the server text as group g's model sees it, plus "strong" (the
    backbone); initial: {g: {core key: diag(S[:r])}}; bytes: {"full": backbone bytes, g: group
    model bytes} (parameters and buffers, LoRA excluded, shared tensors once).
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

    def ranks(self, g: int) -> dict[str, int]:
        """{module: r_gl} of the trained layers of group g."""
        return {n: self.models[g].get_submodule(n).rank for n in self.trained}

    def group_examples(self) -> dict[int, float]:
        """N_g: training examples of every group (all its clients)."""
        out = {g: 0.0 for g in range(len(self.ratios))}
        for g, d in self.data.items():
            out[g] += float(sum(x.num_examples for x in d.values()))
        return out


def model_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters and buffers, LoRA matrices excluded, each storage counted once."""
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if ".lora_" in name:
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def client_ratios(cfg: C.ExperimentConfig) -> list[float]:
    """rho of every client: ``compression.client_ratios`` broadcast to data.num_clients."""
    r = list(cfg.compression.client_ratios)
    return r * cfg.data.num_clients if len(r) == 1 else r


def cached_bases(model: nn.Module, cfg: C.ExperimentConfig, source: str, say) -> dict[str, SVDFactors]:
    """The SVD bases at the largest ratio, read from the cache when a real model was computed before.

    Cache: <model cache dir>/svd/<hash of model, target, ratio, dtype>.safetensors (only for models
    loaded from a directory; tiny random models are recomputed: milliseconds).
    Raises ConfigError for a bad target regex or ratio.
    """
    c = cfg.compression
    top = max(client_ratios(cfg))
    path = None
    if source:
        key = hashlib.sha256(f"{source}|{c.target}|{top}|{cfg.model.dtype}".encode()).hexdigest()[:16]
        path = (Path(cfg.model.cache_dir) if cfg.model.cache_dir else default_cache_dir()) / "svd" / f"{key}.safetensors"
        if path.is_file():
            return load_bases(path)[0]
    say("computing the SVD of the compressed layers (once)")
    try:
        bases = compute_bases(model, [top], c.target)
    except ValueError as exc:
        raise ConfigError(f"compression.target: {exc}") from None
    if path is not None:
        save_bases(bases, path, {"source": source, "target": c.target, "ratio": str(top)})
    return bases


def prepare_compressed(prep, cfg: C.ExperimentConfig, say=None) -> CompressedSetup:
    """Build (once per preparation; memoised on ``prep``) the compressed side of an experiment.

    prep: experiment.Prepared (the backbone with LoRA, every client's data). Raises ConfigError
    (target, train_layers) or DataError (too little held-out server text).
    """
    memo = prep.__dict__.setdefault("_compressed", {})
    key = (tuple(client_ratios(cfg)), cfg.compression.target, tuple(cfg.compression.train_layers),
           cfg.compression.server_blocks)
    if key in memo:
        return memo[key]
    say = say or (lambda s: None)
    t0 = time.perf_counter()
    model = prep.backbone.model
    per_client = client_ratios(cfg)
    ratios = sorted(set(per_client))
    client_group = {cid: ratios.index(per_client[cid]) for cid in prep.data}
    bases = cached_bases(model, cfg, prep.backbone.source, say)
    num_layers = model.config.num_hidden_layers
    try:
        trained = select_layers(sorted(bases), cfg.compression.train_layers, num_layers)
    except ValueError as exc:
        raise ConfigError(f"compression.train_layers: {exc}") from None
    if not trained:
        raise ConfigError(f"compression.train_layers {list(cfg.compression.train_layers)}: no compressed layer "
                          "lies there (check compression.target)")
    say("deriving the compressed client models")
    models = {g: derive_compressed(model, bases, rho) for g, rho in enumerate(ratios)}
    prep_start = next(iter(prep.data.values())).start if prep.data else 0
    start = min(layer_index(n) or 0 for n in trained) if cfg.train.cache_frozen_prefix else 0
    shared = start == prep_start and all((layer_index(n) or 0) >= start for n in bases)
    say("caching the server text and the compressed models' frozen layers")
    server = load_server_text(cfg, prep.backbone.tokenizer, cfg.compression.server_blocks)
    bs = cfg.train.eval_batch_size
    strong_hidden = prefix_features(model, server.input_ids, prep_start, bs) if prep_start else None
    public: dict[str | int, CachedText] = {"strong": CachedText(server.input_ids, strong_hidden, prep_start)}
    data: dict[int, dict[int, ClientData]] = {}
    for g, m in models.items():
        if shared or not start:
            public[g] = public["strong"] if shared else CachedText(server.input_ids)
        else:
            public[g] = CachedText(server.input_ids, prefix_features(m, server.input_ids, start, bs), start)
        data[g] = {}
        for cid, d in prep.data.items():
            if client_group[cid] != g:
                continue
            if shared:
                nd = ClientData(d.train_ids, d.train_labels, d.test_ids, d.test_labels, d.train_hidden,
                                d.test_hidden, d.start, d.letter_ids, d.label)
            else:
                nd = ClientData(d.train_ids, d.train_labels, d.test_ids, d.test_labels, letter_ids=d.letter_ids,
                                label=d.label)
                nd.cache_prefix(m, start, bs)
            data[g][cid] = nd
    initial = {g: {core_key(n): m.get_submodule(n).sigma.detach().clone() for n in trained} for g, m in models.items()}
    sizes: dict[str | int, int] = {"full": model_bytes(model)}
    sizes.update({g: model_bytes(m) for g, m in models.items()})
    setup = CompressedSetup(ratios, client_group, bases, trained, models, data, server, public, initial, sizes,
                            start, shared, time.perf_counter() - t0)
    memo[key] = setup
    return setup


def weak_model(setup: CompressedSetup, prep, fused: Arrays, fusion: str) -> nn.Module:
    """The weak global model f_w: the backbone with every compressed layer at the largest rank R,
    holding W_g = U M V^T. Trained layers take M from ``fused`` ({core key: [R, R]}); the other
    compressed layers take the fusion of the groups' fixed cores diag(S[:r_g]) weighted by N_g
    (``coverage``: diag(S[:R]); ``average``: the shrunken average, strategies/fedslm.py).
    """
    from nestfed.adapters.svd import layer_ranks
    from nestfed.federation.client import apply_arrays

    top = max(setup.ratios)
    sizes = setup.group_examples()
    groups = [g for g in range(len(setup.ratios)) if sizes[g] > 0]
    ranks = {g: layer_ranks(setup.bases, setup.ratios[g]) for g in groups}
    cores = {}
    for name, f in setup.bases.items():
        if name in setup.trained:
            continue
        R = layer_ranks({name: f}, top)[name]
        init = torch.diag(f.S[:R])
        cores[name] = fuse_cores(init, [torch.diag(f.S[:ranks[g][name]]) for g in groups],
                                 [sizes[g] for g in groups], fusion)
    weak = derive_compressed(prep.backbone.model, setup.bases, top, cores)
    apply_arrays(weak, fused, 1.0)
    return weak
