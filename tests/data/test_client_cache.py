"""A node's prepared client data on disk: a second process loads exactly what the first built
(token ids, labels, frozen-prefix outputs) without partitioning, tokenising or running the prefix;
any change of input is another file; a damaged file is rebuilt."""

from pathlib import Path

import pytest
import torch

from nestfed import methods
from nestfed.data import client_cache
from nestfed.data import clients as clients_module
from nestfed.experiments import prepare as prepare_module
from nestfed.experiments.prepare import prepare

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


def cfg(*extra):
    return methods.load_config(TINY, ["lora.layers=[-1]", "train.threads=1", *extra])


def same(a, b):
    for name in ("train_ids", "train_labels", "test_ids", "test_labels", "train_hidden", "test_hidden"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or torch.equal(x, y), name
    assert (a.start, a.label, a.letter_ids) == (b.start, b.label, b.letter_ids)


def test_a_second_prepare_loads_the_first_ones_data_bit_for_bit(tmp_path, monkeypatch):
    c = cfg()
    built = prepare(c, only_clients=[2], client_cache=tmp_path)
    assert list(tmp_path.iterdir()) == []  # a client's data are built when first read
    built.data[2]
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == [f"{client_cache.key(c, 2)}.safetensors"]
    assert built.data[2].start == 1 and built.data[2].train_hidden is not None  # the prefix was cached

    def no_rebuild(*a, **kw):
        raise AssertionError("partitioned again")

    monkeypatch.setattr(clients_module, "load_partitions", no_rebuild)
    monkeypatch.setattr(prepare_module.ClientData, "cache_prefix", no_rebuild)
    loaded = prepare(c, only_clients=[2], client_cache=tmp_path)
    same(built.data[2], loaded.data[2])
    assert loaded.clients == built.clients and loaded.shapes == built.shapes


def test_the_key_covers_the_inputs(tmp_path):
    base = client_cache.key(cfg(), 0)
    assert client_cache.key(cfg(), 0) == base
    for other in (
        client_cache.key(cfg(), 1),
        client_cache.key(cfg("data.max_train=4"), 0),
        client_cache.key(cfg("lora.layers=[0]"), 0),
        client_cache.key(cfg("train.eval_batch_size=2"), 0),
    ):
        assert other != base
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if n == 1 else 1)
        assert client_cache.key(cfg(), 0) != base
    finally:
        torch.set_num_threads(n)
    data_file = tmp_path / "notes.jsonl"
    data_file.write_text('{"text": "a b c", "label": "x"}\n')
    f = cfg("data.source=file", f"data.path={data_file}", "data.partition=iid", "data.num_clients=1", "lora.ranks=[2]")
    k1 = client_cache.key(f, 0)
    data_file.write_text('{"text": "a b c d", "label": "x"}\n')
    assert client_cache.key(f, 0) != k1  # an edited data file is another key
    niah = ("data.source=niah", "data.task=multiple_choice", "data.num_clients=7", "lora.ranks=[2]")
    assert client_cache.key(cfg(*niah), 0) != client_cache.key(cfg(*niah, "niah.train_length=256"), 0)
    recall = ("data.source=recall", "data.task=multiple_choice", "data.num_clients=4", "lora.ranks=[2]")
    assert client_cache.key(cfg(*recall), 0) != client_cache.key(cfg(*recall, "recall.lead=8"), 0)
    assert client_cache.key(cfg(*recall), 0) != client_cache.key(cfg(*recall, "model.attention_window=32"), 0)
    assert "nn/bounded_attention.py" in client_cache.PREPARING  # the frozen prefix runs through it


@pytest.mark.slow
@pytest.mark.parametrize("damage", [b"", b"\x00" * 64, b"not safetensors at all"])
def test_a_damaged_file_is_rebuilt(tmp_path, damage):
    c = cfg()
    built = prepare(c, only_clients=[0], client_cache=tmp_path)
    path = client_cache.path_for(tmp_path, c, 0)
    path.write_bytes(damage)
    assert client_cache.load(path) is None
    again = prepare(c, only_clients=[0], client_cache=tmp_path)
    same(built.data[0], again.data[0])
    assert client_cache.load(path) is not None  # written again
