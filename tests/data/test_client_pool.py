"""The client pool: preparing registers every client without building its data; a client is built
once, when first read, and comes back bit for bit from memory, from the disk cache after eviction,
or rebuilt without a cache; the disk cache stays within its bound, the file used longest ago out
first; the global held-out set holds held-out records only."""

import os
import time
from pathlib import Path

import pytest
import torch

from nestfed import methods
from nestfed.data.client_cache import ClientCache
from nestfed.data.clients import ClientData
from nestfed.data.global_eval_set import global_test_set
from nestfed.experiments.prepare import prepare

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
CORPUS: Path


@pytest.fixture(autouse=True, scope="module")
def corpus(tmp_path_factory):
    """120 short documents in three labels (a local JSON lines file: the pool's tests stay fast)."""
    import json

    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    words = "the federation trains small adapters on data that never leaves the clients".split()
    with path.open("w") as f:
        for i in range(120):
            text = " ".join(f"{words[(i + j) % len(words)]}{60 * i + j}" for j in range(40))  # no two blocks alike
            f.write(json.dumps({"text": text, "label": "abc"[i % 3]}) + "\n")
    global CORPUS
    CORPUS = path
    yield path


def cfg(*extra):
    return methods.load_config(
        TINY,
        [
            "lora.layers=[-1]",
            "train.threads=1",
            "data.partition=iid",
            "data.source=file",
            f"data.path={CORPUS}",
            "data.num_clients=40",
            "lora.ranks=[4]",
            *extra,
        ],
    )


def same(a, b):
    for name in ("train_ids", "train_labels", "test_ids", "test_labels", "train_hidden", "test_hidden"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.fixture
def counted(monkeypatch):
    """How many times a client's frozen prefix was computed."""
    calls = []
    real = ClientData.cache_prefix

    def cache_prefix(self, *a, **kw):
        calls.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(ClientData, "cache_prefix", cache_prefix)
    return calls


def test_prepare_registers_every_client_and_builds_none(tmp_path, counted, keep_threads):
    prep = prepare(cfg(f"train.client_cache={tmp_path}"))
    assert len(prep.clients) == 40 and all(c.num_examples > 0 for c in prep.clients)
    assert counted == [] and list(tmp_path.iterdir()) == []
    d = prep.data[7]
    assert counted == [1] and d.train_hidden is not None and d.num_examples == prep.clients[7].num_examples
    assert prep.data[7] is d and counted == [1]  # from memory
    assert prep.data.stats.built == 1 and prep.data.stats.hits == 1 and len(list(tmp_path.iterdir())) == 1


def test_an_evicted_client_comes_back_bit_for_bit_from_disk_or_rebuilt(tmp_path, counted, keep_threads):
    prep = prepare(cfg(f"train.client_cache={tmp_path}", "train.client_memory_mb=1"))
    prep.data.memory_bytes = 1  # keep only the client just read
    first = {c: prep.data[c] for c in (1, 2, 3)}
    assert prep.data.in_memory() == [3] and prep.data.stats.evicted == 2
    again = prep.data[1]
    assert again is not first[1] and prep.data.stats.loaded == 1 and len(counted) == 3
    same(first[1], again)
    off = prepare(cfg("train.client_cache=off"))
    same(first[2], off.data[2])  # rebuilt: the same bits


def test_a_second_preparation_registers_from_the_cache_headers(tmp_path, monkeypatch, keep_threads):
    c = cfg(f"train.client_cache={tmp_path}")
    prep = prepare(c, only_clients=[3])
    prep.data[3]
    from nestfed.data import clients as clients_module

    def no_partition(*a, **kw):
        raise AssertionError("partitioned again")

    monkeypatch.setattr(clients_module, "load_partitions", no_partition)
    again = prepare(c, only_clients=[3])
    assert again.clients == prep.clients and again.label(3) == prep.label(3)


def test_the_disk_cache_keeps_within_its_bound_using_the_oldest_file_first(tmp_path):
    prep = prepare(cfg("train.client_cache=off"))
    size = None
    cache = ClientCache(tmp_path, max_bytes=10**9)
    for c in range(3):
        p = cache.put(f"k{c}", prep.data[c])
        size = p.stat().st_size
        os.utime(p, (time.time() - 100 + c, time.time() - 100 + c))
    assert cache.get("k0") is not None  # a read makes k0 the most recent
    small = ClientCache(tmp_path, max_bytes=int(2.5 * size))
    small.put("k3", prep.data[3])
    assert sorted(p.stem for p in tmp_path.iterdir()) == ["k0", "k3"]  # k1 and k2 (used longest ago) went


def test_the_global_held_out_set_is_drawn_from_the_clients_held_out_records(keep_threads):
    c = cfg("train.client_cache=off", "data.unit=block")
    prep = prepare(c)
    source = prep.data.source
    held_out = {i for cid in range(40) for i in source.records_of(cid)[1]}
    trained = {i for cid in range(40) for i in source.records_of(cid)[0]}
    g = global_test_set(source, 12, 40, seed=0)
    assert g.num_examples == 0 and g.test_ids.shape == (12, c.data.block_size) and g.label == "global"
    blocks = source.loaded[0]
    rows = {tuple(r.tolist()) for r in g.test_ids}
    assert rows <= {tuple(blocks[i].ids.tolist()) for i in held_out}
    assert not rows & {tuple(blocks[i].ids.tolist()) for i in trained - held_out}
    assert torch.equal(global_test_set(source, 12, 40, seed=0).test_ids, g.test_ids)
