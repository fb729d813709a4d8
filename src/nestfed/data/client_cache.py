"""A client's prepared data kept on disk, so that a fresh process (a Flower ClientApp: flwr 1.42
starts one per message) loads it instead of partitioning, tokenising and running the frozen
prefix again (nestfed.experiments.prepare; the frozen prefix is most of a SmolLM2 node's rebuild).

One safetensors file per (experiment inputs, client): the token ids and labels, the frozen
prefix's outputs (train_hidden / test_hidden: [N, T, d]) and the test groups, with the rest as
metadata. The file name is a SHA-256 over everything the prepared data depends on (:func:`key`):
the model and data sections, the LoRA layers and target modules (they fix the first adapted
layer), the prefix's batch size, a data attack's settings, the torch thread count (CPU kernels
may round differently with another count), the torch and transformers versions, the format, and
the size and modification time of a local data path. A changed input is a new file. The key
cannot see nestfed's own code: a change to what is prepared (tokenisation, packing, the frozen
prefix) must bump :data:`FORMAT`, or nodes read data prepared the old way. Files are written
atomically with the user's umask; an unreadable one is ignored (and rebuilt).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open

from nestfed.config import ExperimentConfig, to_dict
from nestfed.config.trust import DATA_ATTACKS
from nestfed.data.clients import ClientData
from nestfed.io import atomic

FORMAT = "nestfed-client-data/1"
_OPTIONAL = ("train_hidden", "test_hidden")


def _path_stamp(path: str) -> list[Any]:
    """(size, mtime_ns) of a local data path, [] when there is none (a packaged corpus)."""
    if not path:
        return []
    try:
        st = os.stat(path)
    except OSError:
        return ["missing"]
    return [st.st_size, st.st_mtime_ns]


def key(cfg: ExperimentConfig, cid: int) -> str:
    """The SHA-256 (hex) naming client ``cid``'s prepared data under ``cfg`` (see the module
    docstring for what it covers)."""
    d = to_dict(cfg)
    inputs = {"format": FORMAT, "cid": cid, "model": d["model"], "data": d["data"],
              "lora": {k: d["lora"][k] for k in ("target_modules", "layers")},
              "train": {k: d["train"][k] for k in ("cache_frozen_prefix", "eval_batch_size")},
              "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
              "path": _path_stamp(cfg.data.path)}
    if cfg.attack.kind in DATA_ATTACKS and cid in cfg.attack.clients:
        inputs["attack"] = d["attack"]
        inputs["seed"] = cfg.federation.seed
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def path_for(cache_dir: str | Path, cfg: ExperimentConfig, cid: int) -> Path:
    """``<cache_dir>/<key>.safetensors``."""
    return Path(cache_dir) / f"{key(cfg, cid)}.safetensors"


def save(path: str | Path, data: ClientData) -> Path:
    """Write ``data`` to ``path`` atomically (see the module docstring). Raises OSError."""
    tensors = {"train_ids": data.train_ids, "train_labels": data.train_labels, "test_ids": data.test_ids,
               "test_labels": data.test_labels}
    for name in _OPTIONAL:
        if getattr(data, name) is not None:
            tensors[name] = getattr(data, name)
    for name, rows in (data.test_groups or {}).items():
        tensors[f"group/{name}"] = rows
    meta = {"format": FORMAT, "start": str(data.start), "label": data.label,
            "letter_ids": json.dumps(data.letter_ids), "groups": json.dumps(sorted(data.test_groups or {}))}
    return atomic.write_tensors(path, tensors, meta)


def load(path: str | Path) -> ClientData | None:
    """The ClientData saved at ``path``; None when there is no such file or it is unreadable,
    truncated or of another format (the caller then rebuilds it)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
        if meta.get("format") != FORMAT:
            return None
        t = load_file(str(path))
        groups = json.loads(meta["groups"])
        return ClientData(t["train_ids"], t["train_labels"], t["test_ids"], t["test_labels"],
                          train_hidden=t.get("train_hidden"), test_hidden=t.get("test_hidden"),
                          start=int(meta["start"]), letter_ids=json.loads(meta["letter_ids"]), label=meta["label"],
                          test_groups={g: t[f"group/{g}"] for g in groups} or None)
    except (SafetensorError, OSError, KeyError, ValueError):
        return None
