"""The data-source registry (nestfed.config.sources): every source declared once, its reader
resolved on use, its checks and its own section at config load, and a new source added by a
registry line alone."""

import importlib

import pytest

from nestfed import methods
from nestfed.config import ConfigError
from nestfed.config import sources as S
from nestfed.config.schema import SOURCES
from nestfed.data.clients import load_partitions
from nestfed.data.corpora import Document


@pytest.mark.parametrize("name", list(S.REGISTRY))
def test_every_source_names_a_reader_that_exists(name):
    src = S.REGISTRY[name]
    module, _, function = src.reader.partition(":")
    assert callable(getattr(importlib.import_module(module), function))
    assert src.tasks and set(src.tasks) <= {"causal_lm", "instruction", "multiple_choice"}


def test_the_config_knows_exactly_the_registered_sources():
    assert SOURCES == tuple(S.REGISTRY)
    with pytest.raises(ConfigError, match="data.source: unknown source 'bbc' \\(known: bbc_news, newsgroups"):
        methods.config_from_dict({"data": {"source": "bbc"}}, "exp.toml")


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"source": "niah", "task": "causal_lm"},
            "data.task: the source 'niah' serves 'multiple_choice', not 'causal_lm'",
        ),
        (
            {"source": "bbc_news", "task": "multiple_choice"},
            "the source 'bbc_news' serves 'causal_lm' or 'instruction'",
        ),
        ({"source": "mmlu", "task": "multiple_choice"}, "data.path: the source 'mmlu' needs a local path"),
        ({"source": "file", "path": "x.jsonl", "text_column": ""}, "data.text_column: the source 'file' needs"),
        ({"source": "mmlu", "path": "m", "unit": "block"}, "data.unit: 'block' deals out blocks of a text corpus"),
        (
            {"source": "niah", "task": "multiple_choice", "niah_train_length": 64},
            "unknown key 'data.niah_train_length'",
        ),
    ],
)
def test_a_source_checks_its_data_settings_at_load(data, message):
    with pytest.raises(ConfigError) as exc:
        methods.config_from_dict({"data": data}, "exp.toml")
    assert message in str(exc.value) and str(exc.value).startswith("exp.toml")


def test_the_niah_settings_are_the_niah_sources_section():
    cfg = methods.config_from_dict(
        {
            "data": {"source": "niah", "task": "multiple_choice", "num_clients": 7},
            "niah": {"train_length": 128, "depths": [0.5]},
        }
    )
    assert cfg.section("niah") == S.NiahOptions(train_length=128, depths=(0.5,))
    with pytest.raises(ConfigError, match="niah.haystack must be wikipedia, austen or all"):
        methods.config_from_dict({"niah": {"haystack": "web"}})
    with pytest.raises(ConfigError, match=r"\[niah\] train_length"):  # a former data.niah_* key points to [niah]
        methods.config_from_dict({"data": {"niah_train_length": 128}})


def test_a_new_source_is_a_reader_and_a_registry_line(monkeypatch):
    docs = [Document(text=f"text {i}", label=f"L{i % 2}") for i in range(8)]
    reader = type("M", (), {"read": staticmethod(lambda d: (docs, [x.label for x in docs]))})
    monkeypatch.setitem(importlib.sys.modules, "my_corpus", reader)
    monkeypatch.setitem(S.REGISTRY, "my_corpus", S.Source("my_corpus", "a test corpus", "my_corpus:read"))
    cfg = methods.config_from_dict({"data": {"source": "my_corpus", "partition": "label", "num_clients": 2}})
    records, labels, parts = load_partitions(cfg.data)
    assert records == docs and sorted(len(p) for p in parts) == [4, 4]
    assert {labels[i] for i in parts[0]} != {labels[i] for i in parts[1]}


def test_niah_templates_are_checked_at_load():
    base = {"data": {"source": "niah", "task": "multiple_choice", "num_clients": 2}}
    with pytest.raises(ConfigError, match="niah.templates: unknown template 'nope'"):
        methods.config_from_dict({**base, "niah": {"templates": ["passkey", "nope"]}}, "exp.toml")
    with pytest.raises(ConfigError, match="niah.templates: 7 templates for data.num_clients = 2"):
        methods.config_from_dict(base, "exp.toml")
    assert methods.config_from_dict({**base, "niah": {"templates": ["passkey", "mk_niah"]}}).data.num_clients == 2
