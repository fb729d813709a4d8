"""Every client's prepared data, built when a client is first asked for and kept in bounded caches,
so preparing a federation costs what its sampled and evaluated clients cost, not what all of them
would (docs/scale.md).

A client is *registered* when the server learns its n_k and label (what a real client declares when
it joins): from the on-disk cache's header when the client was prepared before, else by
tokenising its records and counting (no frozen prefix). It is *built* when its data are first
read: tokenised (nestfed.data.clients.ClientSource), finished (a data attack's poisoning, the
frozen prefix's outputs: the expensive part) and written to the on-disk cache
(nestfed.data.client_cache.ClientCache). Built clients stay in memory up to ``memory_bytes``, the
least recently used leaving first; a client read again later comes back from the disk cache bit
for bit, or is built again when the cache is off or evicted it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from safetensors import SafetensorError, safe_open

from nestfed.data.client_cache import FORMAT, ClientCache
from nestfed.data.clients import ClientData, ClientSource


def data_bytes(d: ClientData) -> int:
    """Bytes of a client's tensors (token ids, labels, frozen-prefix outputs, test groups).

    Args:
        d: the client's data.

    Returns:
        The total size in bytes.
    """
    tensors = [d.train_ids, d.train_labels, d.test_ids, d.test_labels, d.train_hidden, d.test_hidden]
    tensors += list((d.test_groups or {}).values())
    return int(sum(t.numel() * t.element_size() for t in tensors if t is not None))


def peek(path) -> tuple[int, str] | None:
    """A client-cache file's n_k and label, read from its header alone (no tensor read).

    Args:
        path (str | Path): the cache file.

    Returns:
        (n_k, label), or None when the file is missing, unreadable or of another format.
    """
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            if meta.get("format") != FORMAT:
                return None
            return int(f.get_slice("train_ids").get_shape()[0]), meta.get("label", "")
    except (SafetensorError, OSError, KeyError, ValueError):
        return None


@dataclass
class PoolStats:
    """What a pool did, counted since it was made.

    Attributes:
        registered: clients registered (n_k and label learnt).
        built: clients built from their records.
        loaded: clients loaded from the disk cache.
        hits: reads served from memory.
        evicted: clients evicted from memory.
        memory_bytes: bytes of the clients in memory now.
        peak_memory_bytes: the most bytes in memory at once.
    """

    registered: int = 0
    built: int = 0
    loaded: int = 0
    hits: int = 0
    evicted: int = 0
    memory_bytes: int = 0
    peak_memory_bytes: int = 0


@dataclass
class ClientPool(Mapping):
    """{cid: ClientData} over ``cids``, each client built on first read (module docstring).

    Attributes:
        source: builds a client's tokens.
        cids: the clients of the pool.
        finish: ``finish(cid, data)`` completes a built client in place (poisoning, the frozen
            prefix).
        key: ``key(cid)`` is the client's on-disk cache key (nestfed.data.client_cache.key).
        disk: the on-disk cache; None = off.
        memory_bytes: the in-memory budget in bytes (the client just read is kept whatever its
            size); default 256 MiB.
        stats: what the pool did.
    """

    source: ClientSource
    cids: Sequence[int]
    finish: Callable[[int, ClientData], None]
    key: Callable[[int], str]
    disk: ClientCache | None = None
    memory_bytes: int = 256 * 2**20
    stats: PoolStats = field(default_factory=PoolStats)
    _memory: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _registered: dict[int, tuple[int, str]] = field(default_factory=dict, repr=False)
    _keys: dict[int, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._ids = set(self.cids)

    def __iter__(self) -> Iterator[int]:
        return iter(self.cids)

    def __len__(self) -> int:
        return len(self.cids)

    def __contains__(self, cid: object) -> bool:
        return cid in self._ids

    def _key(self, cid: int) -> str:
        if cid not in self._keys:
            self._keys[cid] = self.key(cid)
        return self._keys[cid]

    def register(self, cid: int) -> tuple[int, str]:
        """A client's n_k and label (module docstring).

        Read from memory, else from the disk cache's header, else by building the client's tokens.

        Args:
            cid: the client id.

        Returns:
            (n_k, label).

        Raises:
            KeyError: for a client outside the pool.
            DataError: as the source raises it.
            ConfigError: as the source raises it.
        """
        if cid not in self._ids:
            raise KeyError(cid)
        if cid not in self._registered:
            if cid in self._memory:
                d = self._memory[cid][0]
                found = (d.num_examples, d.label)
            else:
                found = peek(self.disk.path(self._key(cid))) if self.disk is not None else None
            if found is None:
                d = self.source.build(cid)
                found = (d.num_examples, d.label)
            self._registered[cid] = found
            self.stats.registered += 1
        return self._registered[cid]

    def num_examples(self, cid: int) -> int:
        """n_k of a client (`register`).

        Args:
            cid: the client id.

        Returns:
            The client's training examples.
        """
        return self.register(cid)[0]

    def label(self, cid: int) -> str:
        """The labels of a client (`register`).

        Args:
            cid: the client id.

        Returns:
            The label string.
        """
        return self.register(cid)[1]

    def __getitem__(self, cid: int) -> ClientData:
        if cid not in self._ids:
            raise KeyError(cid)
        if cid in self._memory:
            self._memory.move_to_end(cid)
            self.stats.hits += 1
            return self._memory[cid][0]
        d = self.disk.get(self._key(cid)) if self.disk is not None else None
        if d is not None:
            self.stats.loaded += 1
        else:
            d = self.source.build(cid)
            self.finish(cid, d)
            self.stats.built += 1
            if self.disk is not None:
                self.disk.put(self._key(cid), d)
        self._registered.setdefault(cid, (d.num_examples, d.label))
        self._keep(cid, d)
        return d

    def _keep(self, cid: int, d: ClientData) -> None:
        size = data_bytes(d)
        self._memory[cid] = (d, size)
        self.stats.memory_bytes += size
        while self.stats.memory_bytes > self.memory_bytes and len(self._memory) > 1:
            _, (_, gone) = self._memory.popitem(last=False)
            self.stats.memory_bytes -= gone
            self.stats.evicted += 1
        self.stats.peak_memory_bytes = max(self.stats.peak_memory_bytes, self.stats.memory_bytes)

    def in_memory(self) -> list[int]:
        """The clients held in memory now, least recently used first.

        Returns:
            Their ids.
        """
        return list(self._memory)
