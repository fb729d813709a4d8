"""FedNL's memory warm-up: before round 1 the server fits the memory rules to full attention on
public long text, so the federation starts from a memory that reads.

The fit is attention transfer (LoLCATs' first stage, nestfed.nn.attention_transfer): each memory
layer, with its window and its memory, learns to output what the same layer outputs with full
attention, on ``[fednl] warmup_rows`` rows of ``warmup_length`` tokens cut from the corpora that
ship with nestfed (Wikipedia from gensim, Austen; the first half of each document, the half the
recall source's training filler comes from), the LoRA at zero. Clients never see this text and
the server never sees theirs.

The result is kept beside the model cache (``<model cache>/fednl_warmup/<key>.safetensors``, written
atomically, with its facts in the file's metadata), keyed by everything that determines it (the
model, its window, the memory layers and settings, the warm-up options, the LoRA seed): a second
run, a resumed run or a Flower node with the same cache finds it instead of fitting again, and the
fit is deterministic (seeded), so one recomputed after the cache was removed is the same on the
same machine. Its cost (steps, tokens, seconds) and its fit per layer go into the run's summary
(``fednl_warmup``); the warmed rules are the run's round-0 state and ``memory_warmup.safetensors``.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from nestfed.config import ExperimentConfig
from nestfed.data.corpora import long_texts
from nestfed.data.niah import Haystack
from nestfed.data.tasks import _bos
from nestfed.federation.messages import Arrays
from nestfed.federation.prepared import Prepared
from nestfed.io import atomic
from nestfed.nn.arrays import apply_arrays
from nestfed.nn.attention_transfer import record_layers, transfer_memory
from nestfed.nn.backbone import default_cache_dir
from nestfed.nn.memory import memory_arrays
from nestfed.seeds import stream_seed

VERSION = "fednl-warmup/1"
REPORT = "fednl_warmup"  # the Prepared.cache key and the summary field


def warmup_key(cfg: ExperimentConfig, layers: list[int]) -> str:
    """The sha256 (hex, 16 characters) of everything the warm-up's result depends on.

    Args:
        cfg: the experiment (model, [fednl], LoRA seed).
        layers: the memory layers.

    Returns:
        The key.
    """
    m = cfg.model
    what = {
        "version": VERSION,
        "model": [m.name, m.seed, m.dtype, m.attention_window, m.attention_sinks],
        "layers": layers,
        "fednl": asdict(cfg.section("fednl")) | {"travel": None, "rule_lr": None, "window_dropout": None},
        "lora_seed": cfg.lora.init_seed,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_path(cfg: ExperimentConfig, layers: list[int]) -> Path:
    """Where the warm-up of ``cfg`` is kept: ``<model cache>/fednl_warmup/<key>.safetensors``.

    Args:
        cfg: the experiment.
        layers: the memory layers.

    Returns:
        The file's path.
    """
    root = Path(cfg.model.cache_dir) if cfg.model.cache_dir else default_cache_dir()
    return root / "fednl_warmup" / f"{warmup_key(cfg, layers)}.safetensors"


def public_rows(cfg: ExperimentConfig, tokenizer) -> torch.Tensor:
    """``warmup_rows`` rows of public text (module docstring), seeded by ``lora.init_seed``.

    Each row starts with the tokenizer's BOS where it has one.

    Args:
        cfg: the experiment (``[fednl] warmup_*``).
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.

    Returns:
        [N, warmup_length] token ids.

    Raises:
        DataError: when a corpus is missing.
    """
    o = cfg.section("fednl")
    hay = Haystack([t.text for t in long_texts(o.warmup_corpus)], tokenizer, "train")
    rng = random.Random(stream_seed(cfg.lora.init_seed, 0, 0, "fednl_warmup/rows"))
    bos = _bos(tokenizer)
    return torch.tensor([bos + hay.span(rng, o.warmup_length - len(bos)) for _ in range(o.warmup_rows)])


def _load(path: Path) -> tuple[Arrays, dict[str, Any]] | None:
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            facts = json.loads((f.metadata() or {})["facts"])
        return load_file(str(path)), facts
    except (SafetensorError, OSError, KeyError, ValueError):
        return None  # unreadable: fitted again and written over


def warm_rules(prep: Prepared, cfg: ExperimentConfig, layers: list[int], fresh: Arrays) -> Arrays:
    """The memory rules the federation starts from, fitted to full attention when ``[fednl] warmup_steps`` > 0.

    ``fresh`` fitted by ``warmup_steps`` steps of attention transfer, or ``fresh`` itself when that
    is 0. Found in the cache when there; the facts go to ``prep.cache[REPORT]`` (`report`).
    Leaves the model with a zero LoRA and the warmed rules loaded.

    Args:
        prep: the prepared experiment.
        cfg: the experiment.
        layers: the memory layers.
        fresh: the fresh rules, payload-keyed (from nestfed.nn.memory.fresh_rule_arrays).

    Returns:
        The starting rules, payload-keyed.

    Raises:
        DataError: when a corpus is missing.
    """
    o = cfg.section("fednl")
    if o.warmup_steps == 0:
        return fresh
    path = cache_path(cfg, layers)
    found = _load(path)
    if found is None:
        model = prep.backbone.model
        apply_arrays(model, fresh, 1.0)  # zero LoRA, fresh rules, their memories enabled
        records = record_layers(model, layers, public_rows(cfg, prep.backbone.tokenizer), o.warmup_batch)
        facts = transfer_memory(
            model, records, o.warmup_steps, o.warmup_lr, o.warmup_batch, stream_seed(cfg.lora.init_seed, 0, 0, REPORT)
        )
        warmed = {k: v for k, v in memory_arrays(model).items() if k in fresh}
        summary = asdict(facts) | {"lr": o.warmup_lr, "cache": str(path)}
        summary["rel_mse"] = {str(i): v for i, v in facts.rel_mse.items()}
        atomic.write_tensors(path, {k: v.contiguous() for k, v in warmed.items()}, {"facts": json.dumps(summary)})
        found = warmed, summary | {"found_in_cache": False}
    else:
        found = found[0], found[1] | {"found_in_cache": True}
    arrays, facts = found
    apply_arrays(prep.backbone.model, arrays, 1.0)
    prep.cache[REPORT] = facts
    return {k: arrays[k].clone() for k in fresh}


def report(prep: Prepared, cfg: ExperimentConfig) -> dict[str, Any]:
    """The run summary's ``fednl_warmup`` field: the warm-up's cost and fit.

    Steps, rows, tokens, seconds when it was fitted, rel_mse per layer for the window alone, the
    memory at the start and after.

    Args:
        prep: the prepared experiment (its cache holds the facts).
        cfg: the experiment.

    Returns:
        {``fednl_warmup``: facts}, or {} without a warm-up.
    """
    facts = prep.cache.get(REPORT)
    return {REPORT: facts} if facts is not None and cfg.section("fednl").warmup_steps else {}
