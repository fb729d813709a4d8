"""Each client's tokenised partition: read the source, partition it, split train/test, tokenise.

:func:`load_partitions` reads the configured source and assigns record indices to clients
(natural label, Dirichlet over labels, or IID); :func:`build_client_data` splits every client's
records into train and test (seeded by ``data.seed + cid``), tokenises them for the task and
returns one :class:`ClientData` per client. Nothing here knows which federated method runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nestfed.config import ConfigError, DataConfig, ExperimentConfig
from nestfed.data import partition, sources, tasks
from nestfed.data.local_file import local_file
from nestfed.data.mmlu_domains import domain_items
from nestfed.data.niah import niah_clients
from nestfed.errors import DataError
from nestfed.nn.frozen_prefix import labelled_length, prefix_features


log = logging.getLogger(__name__)

@dataclass
class ClientData:
    """One client's tokenised partition.

    train_ids / test_ids: [N, T] token ids; train_labels / test_labels: [N, T] (-100 = no loss).
    train_hidden / test_hidden: the frozen prefix's outputs [N, T, d] entering layer ``start``
    (None = run the whole model). letter_ids: the 4 answer-letter token ids for multiple choice.
    """

    train_ids: torch.Tensor
    train_labels: torch.Tensor
    test_ids: torch.Tensor
    test_labels: torch.Tensor
    train_hidden: torch.Tensor | None = None
    test_hidden: torch.Tensor | None = None
    start: int = 0
    letter_ids: list[int] | None = None
    label: str = ""
    # optional named groups of test rows ({name: row indices [n]}, e.g. NIAH's context lengths):
    # evaluation adds accuracy@<name> / loss@<name> per group
    test_groups: dict[str, torch.Tensor] | None = None

    @property
    def num_examples(self) -> int:
        """n_k: training examples (blocks or prompts)."""
        return int(self.train_ids.shape[0])

    def cache_prefix(self, model: nn.Module, start: int, batch_size: int = 8) -> None:
        """Compute and keep the frozen layers' outputs for train and test (see frozen_prefix),
        each row only up to its last labelled token (what every loss and metric here reads)."""
        self.start = start
        if start > 0:
            self.train_hidden = prefix_features(model, self.train_ids, start, batch_size,
                                                labelled_length(self.train_labels))
            self.test_hidden = prefix_features(model, self.test_ids, start, batch_size,
                                               labelled_length(self.test_labels))


def _records(d: DataConfig) -> tuple[list[Any], list[str]]:
    """Load the data source; return (records, one label per record)."""
    if d.source == "bbc_news":
        docs = sources.bbc_news(d.path or None)
        return docs, [x.label for x in docs]
    if d.source == "newsgroups":
        docs = sources.newsgroups(d.path or None)
        return docs, [x.label for x in docs]
    if d.source == "file":  # a user's JSON lines / CSV / parquet file (data/local_file.py)
        docs = local_file(d.path, d.text_column, d.label_column)
        return docs, [x.label for x in docs]
    if d.source == "long_texts":  # Wikipedia articles and Austen's novels (haystacks, streaming)
        docs = sources.long_texts("all")
        return docs, [x.source for x in docs]
    if not d.path:
        raise ConfigError(f"data.path: the source '{d.source}' needs a local path")
    if not Path(d.path).exists():
        raise DataError(f"data.path: {d.path} does not exist")
    if d.source == "mmlu":
        items = sources.mmlu(d.path, "test")
        return items, [x.subject for x in items]
    if d.source == "mmlu_domains":  # the five MMLU domains of arXiv 2605.16350 (data/mmlu_domains.py)
        return domain_items(d.path, "test", d.seed)
    items = sources.instructions(d.path)
    return items, [x.category or "all" for x in items]


def _partition(labels: list[str], d: DataConfig) -> list[list[int]]:
    if d.partition == "iid":
        return partition.iid(len(labels), d.num_clients, d.seed)
    if d.partition == "dirichlet":
        return partition.dirichlet(labels, d.num_clients, d.dirichlet_alpha, d.seed)
    if d.partition == "pathological":
        return partition.pathological(labels, d.num_clients, d.classes_per_client, d.seed)
    client_labels = [list(x) for x in d.client_labels]
    if not client_labels:  # one natural id per client: the first num_clients labels, sorted
        distinct = sorted(set(labels))
        if len(distinct) < d.num_clients:
            raise ConfigError(f"data.client_labels: {d.num_clients} clients but only {len(distinct)} labels "
                              f"({', '.join(distinct)}); list the labels of each client")
        if len(distinct) > d.num_clients:  # said, never silent: these records train no one
            log.warning("data.partition: label gives the %d clients the first %d of %d labels; %s go unused "
                        "(set data.client_labels to choose)", d.num_clients, d.num_clients, len(distinct),
                        ", ".join(distinct[d.num_clients:]))
        return partition.natural_id(labels, distinct[: d.num_clients])
    if len(client_labels) != d.num_clients:
        raise ConfigError(f"data.client_labels: {len(client_labels)} entries for data.num_clients = {d.num_clients}")
    known = set(labels)
    for i, labs in enumerate(client_labels):
        for lab in labs:
            if lab not in known:
                raise ConfigError(f"data.client_labels: client {i} names label '{lab}', which the data does not have")
    return partition.by_label(labels, client_labels, d.seed)


def _tokenise(records: list[Any], idx: list[int], d: DataConfig, tokenizer, cap: int) -> tasks.TokenDataset:
    items = [records[i] for i in idx]
    if d.task == "causal_lm":
        texts = [getattr(x, "text", None) or _as_text(x) for x in items]
        return tasks.pack_causal_lm(texts, tokenizer, d.block_size, max_blocks=cap)
    if d.task == "instruction":
        return tasks.instruction_examples(items[:cap], tokenizer, d.block_size)
    return tasks.multiple_choice_examples(items[:cap], tokenizer, d.block_size)


def _as_text(x: Any) -> str:
    if isinstance(x, sources.InstructionExample):
        return tasks.alpaca_prompt(x.instruction, x.input) + x.output
    if isinstance(x, sources.MultipleChoice):
        return tasks.mc_prompt(x.question, x.choices)
    return str(x)


def load_partitions(d: DataConfig) -> tuple[list[Any], list[str], list[list[int]]]:
    """Read the data source and partition it: (records, labels, record indices per client).

    Raises DataError (missing or malformed data, a client whose partition is empty) or
    ConfigError (bad partition settings), each one line.
    """
    if d.source == "niah":  # generated per client (data/niah.py), no shared records
        return [], [], []
    records, labels = _records(d)
    if d.task == "multiple_choice" and d.source != "mmlu":
        if d.source not in ("mmlu_domains", "niah"):
            raise ConfigError("data.task: multiple_choice needs data.source = 'mmlu', 'mmlu_domains' or 'niah'")
    try:
        parts = _partition(labels, d)
    except ValueError as exc:
        raise ConfigError(f"data.partition: {exc}") from None
    empty = [cid for cid, idx in enumerate(parts) if not idx]
    if empty:
        raise DataError(f"client {', '.join(map(str, empty))}: empty partition (data.partition = {d.partition} gave "
                        "it no records); change the partition's settings or data.num_clients")
    return records, labels, parts


def build_client_data(cfg: ExperimentConfig, tokenizer, loaded=None) -> tuple[dict[int, ClientData], list[list[str]]]:
    """Tokenised train/test data for every client, from the config's source, partition and task.

    loaded: the result of :func:`load_partitions` (read here when None).
    Raises DataError (missing or malformed data, a client left without examples) or ConfigError.
    """
    d = cfg.data
    if d.source == "niah":
        return _niah_client_data(cfg, tokenizer)
    records, labels, parts = loaded or load_partitions(d)
    letter_ids = tasks.letter_token_ids(tokenizer) if d.task == "multiple_choice" else None
    out = {}
    client_labels = []
    for cid, idx in enumerate(parts):
        train_idx, test_idx = partition.train_test_split(idx, d.test_fraction, d.seed + cid)
        train = _tokenise(records, train_idx, d, tokenizer, d.max_train)
        test = _tokenise(records, test_idx, d, tokenizer, d.max_test)
        if len(train) == 0 or len(test) == 0:
            raise DataError(f"client {cid}: no {'training' if len(train) == 0 else 'test'} examples after "
                            f"partitioning ({len(idx)} records); lower data.block_size or add data")
        names = sorted({labels[i] for i in idx})
        client_labels.append(names)
        out[cid] = ClientData(train.input_ids, train.labels, test.input_ids, test.labels,
                              letter_ids=letter_ids, label="+".join(names) if len(names) <= 3 else f"{len(names)} labels")
    return out, client_labels


def _niah_client_data(cfg: ExperimentConfig, tokenizer) -> tuple[dict[int, ClientData], list[list[str]]]:
    """NIAH clients (one template each) as ClientData with test groups per length and depth."""
    try:
        clients = niah_clients(cfg.data, tokenizer)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    letter_ids = tasks.letter_token_ids(tokenizer)
    out = {cid: ClientData(c["train"].input_ids, c["train"].labels, c["test"].input_ids, c["test"].labels,
                           letter_ids=letter_ids, label=c["label"], test_groups=c["groups"])
           for cid, c in enumerate(clients)}
    return out, [[c["label"]] for c in clients]
