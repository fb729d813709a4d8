"""A client's prepared data kept on disk.

A fresh process (a Flower ClientApp: flwr 1.42 starts one per message) or a client evicted from
memory (nestfed.data.client_pool) loads it instead of partitioning, tokenising and running the
frozen prefix again (the frozen prefix is most of a SmolLM2 client's build).

One safetensors file per (experiment inputs, client) holds the token ids and labels, the frozen
prefix's outputs (train_hidden / test_hidden: [N, T, d]) and the test groups, with the rest as
metadata. The file name is a SHA-256 over everything the prepared data depends on (`key`):

- the model and data sections and the data source's own section ([niah], [recall]);
- the LoRA layers and target modules (they fix the first adapted layer) and the prefix's batch size;
- a data attack's settings;
- the torch thread count (CPU kernels may round differently with another count);
- the torch and transformers versions and the file format;
- the size and modification time of a local data path;
- a digest of nestfed's own code that prepares data (`code_digest`: the data package and the
  modules the frozen prefix runs through), so an edit of tokenisation, packing or the prefix is a
  new file too.

Files are written atomically with the user's umask; an unreadable one is ignored (and rebuilt).
`ClientCache` bounds a directory's size, evicting the files used longest ago.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open

from nestfed.config import ExperimentConfig, sources, to_dict
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


#: the modules whose code decides a client's prepared data (relative to the nestfed package)
PREPARING = (
    "data",
    "nn/frozen_prefix.py",
    "nn/layer_inputs.py",
    "nn/backbone.py",
    "nn/bounded_attention.py",
    "nn/placement.py",
)


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """SHA-256 (hex) over the source of the modules in `PREPARING` (files sorted by path).

    Returns:
        The hex digest (computed once per process).
    """
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for part in PREPARING:
        p = root / part
        for f in sorted(p.rglob("*.py")) if p.is_dir() else [p]:
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def key(cfg: ExperimentConfig, cid: int) -> str:
    """The SHA-256 (hex) naming a client's prepared data under a config (module docstring).

    Args:
        cfg: the experiment.
        cid: the client id.

    Returns:
        The hex digest.
    """
    d = to_dict(cfg)
    inputs = {
        "format": FORMAT,
        "cid": cid,
        "model": d["model"],
        "data": d["data"],
        "lora": {k: d["lora"][k] for k in ("target_modules", "layers")},
        "train": {k: d["train"][k] for k in ("cache_frozen_prefix", "eval_batch_size")},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "path": _path_stamp(cfg.data.path),
        "code": code_digest(),
    }
    for name in sources.get(cfg.data.source).sections:  # a generated source's own options ([niah], [recall])
        inputs[name] = d.get(name)
    if cfg.attack.kind in DATA_ATTACKS and cid in cfg.attack.clients:
        inputs["attack"] = d["attack"]
        inputs["seed"] = cfg.federation.seed
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def path_for(cache_dir: str | Path, cfg: ExperimentConfig, cid: int) -> Path:
    """The cache file of a client: ``<cache_dir>/<key>.safetensors``.

    Args:
        cache_dir: the cache directory.
        cfg: the experiment.
        cid: the client id.

    Returns:
        The file's path.
    """
    return Path(cache_dir) / f"{key(cfg, cid)}.safetensors"


def save(path: str | Path, data: ClientData) -> Path:
    """Write a client's data to ``path`` atomically (module docstring).

    Args:
        path: the file to write.
        data: the client's data.

    Returns:
        The path written.

    Raises:
        OSError: when the file cannot be written.
    """
    tensors = {
        "train_ids": data.train_ids,
        "train_labels": data.train_labels,
        "test_ids": data.test_ids,
        "test_labels": data.test_labels,
    }
    for name in _OPTIONAL:
        if getattr(data, name) is not None:
            tensors[name] = getattr(data, name)
    for name, rows in (data.test_groups or {}).items():
        tensors[f"group/{name}"] = rows
    meta = {
        "format": FORMAT,
        "start": str(data.start),
        "label": data.label,
        "letter_ids": json.dumps(data.letter_ids),
        "groups": json.dumps(sorted(data.test_groups or {})),
    }
    return atomic.write_tensors(path, tensors, meta)


def load(path: str | Path) -> ClientData | None:
    """The ClientData saved at ``path``.

    Args:
        path: the cache file.

    Returns:
        The data, or None when there is no such file or it is unreadable, truncated or of another
            format (the caller then rebuilds it).
    """
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
        return ClientData(
            t["train_ids"],
            t["train_labels"],
            t["test_ids"],
            t["test_labels"],
            train_hidden=t.get("train_hidden"),
            test_hidden=t.get("test_hidden"),
            start=int(meta["start"]),
            letter_ids=json.loads(meta["letter_ids"]),
            label=meta["label"],
            test_groups={g: t[f"group/{g}"] for g in groups} or None,
        )
    except (SafetensorError, OSError, KeyError, ValueError):
        return None


@dataclass
class ClientCache:
    """A directory of prepared client data (one file per `key`) of at most ``max_bytes``.

    After each write the files used longest ago (by modification time, which a read refreshes) are
    removed until the directory fits, never the file just written. Its size is read from the
    directory once and then tracked; another process writing the same directory is seen at the next
    full scan (when the tracked size exceeds the bound).

    Attributes:
        root: the directory.
        max_bytes: the bound on the directory's size in bytes.
    """

    root: Path
    max_bytes: int
    _sizes: dict[str, int] | None = field(default=None, repr=False)

    def path(self, k: str) -> Path:
        """The file of a key: ``<root>/<k>.safetensors``.

        Args:
            k: the key (`key`).

        Returns:
            The file's path.
        """
        return Path(self.root) / f"{k}.safetensors"

    def _scan(self) -> dict[str, int]:
        out = {}
        for f in Path(self.root).glob("*.safetensors") if Path(self.root).is_dir() else []:
            try:
                out[f.name] = f.stat().st_size
            except OSError:
                continue
        return out

    def get(self, k: str) -> ClientData | None:
        """The data saved under a key, its use time refreshed (`load`).

        Args:
            k: the key.

        Returns:
            The data, or None when there is no usable file.
        """
        p = self.path(k)
        data = load(p)
        if data is not None:
            try:
                os.utime(p)
            except OSError:
                pass
        return data

    def put(self, k: str, data: ClientData) -> Path:
        """Save data under a key (`save`), then bound the directory.

        Args:
            k: the key.
            data: the client's data.

        Returns:
            The path written.

        Raises:
            OSError: when the file cannot be written.
        """
        p = save(self.path(k), data)
        if self._sizes is None:
            self._sizes = self._scan()
        self._sizes[p.name] = p.stat().st_size
        if sum(self._sizes.values()) > self.max_bytes:
            self._evict(keep=p.name)
        return p

    def _evict(self, keep: str) -> None:
        self._sizes = self._scan()
        total = sum(self._sizes.values())
        by_age = sorted(self._sizes, key=lambda n: self._mtime(n))
        for name in by_age:
            if total <= self.max_bytes:
                break
            if name == keep:
                continue
            try:
                (Path(self.root) / name).unlink()
            except OSError:
                continue
            total -= self._sizes.pop(name)

    def _mtime(self, name: str) -> float:
        try:
            return (Path(self.root) / name).stat().st_mtime
        except OSError:
            return 0.0
