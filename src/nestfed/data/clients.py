"""Each client's tokenised partition: read the source, partition it, split train/test, tokenise.

`load_partitions` reads the configured source and assigns record indices to clients
(natural label, Dirichlet over labels, or IID); a `ClientSource` splits one client's records
into train and test (seeded by ``data.seed + cid``) and tokenises them for the task when that
client is asked for (`build_client_data` does it for every client). With ``data.unit =
"block"`` the records are the corpus' blocks of ``block_size`` tokens (each label's documents
packed in turn), so a corpus of a few thousand articles still gives thousands of clients data.
Nothing here knows which federated method runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nestfed.config import ConfigError, DataConfig, ExperimentConfig
from nestfed.config.sources import get as source_of
from nestfed.data import corpora, partition, tasks, templates
from nestfed.errors import DataError
from nestfed.nn.frozen_prefix import labelled_length, prefix_features

log = logging.getLogger(__name__)


@dataclass
class ClientData:
    """One client's tokenised partition.

    Attributes:
        train_ids: [N, T] training token ids.
        train_labels: [N, T] training labels (-100 = no loss).
        test_ids: [M, T] held-out token ids.
        test_labels: [M, T] held-out labels (-100 = no loss).
        train_hidden: [N, T, d] the frozen prefix's outputs entering layer ``start`` for the
            training rows; None = run the whole model.
        test_hidden: [M, T, d] the same for the held-out rows.
        start: the first trained layer the hidden states enter (0 = no frozen prefix).
        letter_ids: the 4 answer-letter token ids for multiple choice; None for other tasks.
        label: the client's labels as listings show them.
        test_groups: optional named groups of held-out rows, {name: row indices [n]} (e.g. NIAH's
            context lengths); evaluation adds ``accuracy@<name>`` and ``loss@<name>`` per group.
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
        """Compute and keep the frozen layers' outputs for the train and test rows.

        The outputs are nestfed.nn.frozen_prefix's. Each row runs only up to its last labelled token
        (what every loss and metric here reads), with the model in eval mode.

        Args:
            model: the backbone with its adapters.
            start: the first trained layer; 0 keeps no prefix.
            batch_size: rows per forward pass.
        """
        self.start = start
        if start > 0:
            was = model.training  # the frozen layers' outputs, as evaluation sees them
            model.eval()
            try:
                self.train_hidden = prefix_features(
                    model, self.train_ids, start, batch_size, labelled_length(self.train_labels)
                )
                self.test_hidden = prefix_features(
                    model, self.test_ids, start, batch_size, labelled_length(self.test_labels)
                )
            finally:
                model.train(was)


@dataclass(frozen=True)
class TokenBlock:
    """One block of the corpus' token ids (``data.unit = "block"``).

    Attributes:
        ids: [T] token ids, T = ``data.block_size``.
        label: the label of the documents the block was packed from.
    """

    ids: torch.Tensor
    label: str


def _blocks(docs: list[Any], labels: list[str], d: DataConfig, tokenizer) -> tuple[list[TokenBlock], list[str]]:
    """The corpus as blocks: each label's documents, in order, packed into blocks of
    ``block_size`` tokens (nestfed.data.tasks.pack_causal_lm; a block never mixes labels)."""
    if tokenizer is None:
        raise ValueError("data.unit = 'block' packs the corpus with the model's tokenizer")
    by_label: dict[str, list[str]] = {}
    for x, lab in zip(docs, labels):
        by_label.setdefault(lab, []).append(getattr(x, "text", None) or _as_text(x))
    out: list[TokenBlock] = []
    for lab in sorted(by_label):
        packed = tasks.pack_causal_lm(by_label[lab], tokenizer, d.block_size)
        out += [TokenBlock(row, lab) for row in packed.input_ids]
    return out, [b.label for b in out]


def _records(d: DataConfig, tokenizer=None) -> tuple[list[Any], list[str]]:
    """Load the data source; return (records, one label per record): its documents, or with
    ``data.unit = "block"`` the corpus' blocks (`_blocks`)."""
    if d.unit == "block":
        return _blocks(*_documents(d), d, tokenizer)
    return _documents(d)


def _documents(d: DataConfig) -> tuple[list[Any], list[str]]:
    """Load the data source's records with its reader (nestfed.config.sources); return (records, one
    label per record)."""
    return source_of(d.source).read(d)


def _partition(labels: list[str], d: DataConfig) -> list[list[int]]:
    if d.partition == "iid":
        return partition.iid(len(labels), d.num_clients, d.seed)
    if d.partition == "dirichlet":
        return partition.dirichlet(labels, d.num_clients, d.dirichlet_alpha, d.seed)
    if d.partition == "inner_dirichlet":
        return partition.inner_dirichlet(labels, d.num_clients, d.dirichlet_alpha, d.seed)
    if d.partition == "pathological":
        return partition.pathological(labels, d.num_clients, d.classes_per_client, d.seed)
    client_labels = [list(x) for x in d.client_labels]
    if not client_labels:  # one natural id per client: the first num_clients labels, sorted
        distinct = sorted(set(labels))
        if len(distinct) < d.num_clients:
            raise ConfigError(
                f"data.client_labels: {d.num_clients} clients but only {len(distinct)} labels "
                f"({', '.join(distinct)}); list the labels of each client, or set data.partition = 'iid' "
                "(records without labels, e.g. an Alpaca file)"
            )
        if len(distinct) > d.num_clients:  # said, never silent: these records train no one
            log.warning(
                "data.partition: label gives the %d clients the first %d of %d labels; %s go unused "
                "(set data.client_labels to choose)",
                d.num_clients,
                d.num_clients,
                len(distinct),
                ", ".join(distinct[d.num_clients :]),
            )
        return partition.natural_id(labels, distinct[: d.num_clients])
    if len(client_labels) != d.num_clients:
        raise ConfigError(f"data.client_labels: {len(client_labels)} entries for data.num_clients = {d.num_clients}")
    known = set(labels)
    for i, labs in enumerate(client_labels):
        for lab in labs:
            if lab not in known:
                raise ConfigError(f"data.client_labels: client {i} names label '{lab}', which the data does not have")
    return partition.by_label(labels, client_labels, d.seed)


def tokenise(records: list[Any], idx: list[int], d: DataConfig, tokenizer, cap: int) -> tasks.TokenDataset:
    """The records at ``idx`` tokenised for ``d.task``.

    Args:
        records: the source's records (documents, instruction or multiple-choice items, or blocks).
        idx: the indices of the records to tokenise.
        d: the data config (``task``, ``unit``, ``block_size``, ``template``).
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        cap: the most rows (blocks or examples) to keep.

    Returns:
        The token dataset, at most ``cap`` rows.
    """
    items = [records[i] for i in idx]
    if d.unit == "block":  # already tokenised: the client's first ``cap`` blocks
        ids = torch.stack([b.ids for b in items[:cap]]) if items else torch.zeros(0, d.block_size, dtype=torch.long)
        return tasks.TokenDataset(ids, ids.clone())
    if d.task == "causal_lm":
        texts = [getattr(x, "text", None) or _as_text(x) for x in items]
        return tasks.pack_causal_lm(texts, tokenizer, d.block_size, max_blocks=cap)
    if d.task == "instruction":
        return templates.instruction_examples(items[:cap], tokenizer, d.block_size, d.template)
    return tasks.multiple_choice_examples(items[:cap], tokenizer, d.block_size)


def _as_text(x: Any) -> str:
    if isinstance(x, corpora.InstructionExample):
        return tasks.alpaca_prompt(x.instruction, x.input) + x.output
    if isinstance(x, corpora.MultipleChoice):
        return tasks.mc_prompt(x.question, x.choices)
    return str(x)


def load_partitions(d: DataConfig, tokenizer=None) -> tuple[list[Any], list[str], list[list[int]]]:
    """Read the data source and partition its records among the clients.

    A generated source (e.g. nestfed.data.niah) has no shared records: all three lists are empty.

    Args:
        d: the data config.
        tokenizer (PreTrainedTokenizerBase): needed for ``data.unit = "block"`` (the corpus is
            tokenised into blocks first); None otherwise.

    Returns:
        The records, one label per record, and the record indices of each client.

    Raises:
        DataError: for missing or malformed data, or a client whose partition is empty (one line).
        ConfigError: for bad partition or unit settings (one line).
    """
    if not source_of(d.source).shared:  # generated per client (e.g. data/niah.py), no shared records
        return [], [], []
    try:
        records, labels = _records(d, tokenizer)
    except ValueError as exc:
        raise ConfigError(f"data.unit: {exc}") from None
    try:
        parts = _partition(labels, d)
    except ValueError as exc:
        raise ConfigError(f"data.partition: {exc}") from None
    empty = [cid for cid, idx in enumerate(parts) if not idx]
    if empty:
        raise DataError(
            f"client {', '.join(map(str, empty))}: empty partition (data.partition = {d.partition} gave "
            "it no records); change the partition's settings or data.num_clients"
        )
    return records, labels, parts


class ClientSource:
    """Any one client's tokenised train and test data (no frozen prefix), built when asked for.

    The source is read and partitioned on the first request (`load_partitions`); then each
    client is split (seeded by ``data.seed + cid``) and tokenised on its own. A generated source's
    clients (NIAH's), generated together by its reader, are built all at once on the first request.

    Args:
        cfg: the experiment.
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        loaded (tuple | None): a `load_partitions` result to use; read on first use when None.
    """

    def __init__(self, cfg: ExperimentConfig, tokenizer, loaded=None):
        self.cfg, self.tokenizer, self._loaded = cfg, tokenizer, loaded
        self._generated: dict[int, ClientData] | None = None

    @property
    def loaded(self) -> tuple[list[Any], list[str], list[list[int]]]:
        """The records, labels and record indices per client, read and partitioned once."""
        if self._loaded is None:
            self._loaded = load_partitions(self.cfg.data, self.tokenizer)
        return self._loaded

    def records_of(self, cid: int) -> tuple[list[int], list[int]]:
        """A client's train and test record indices.

        Args:
            cid: the client id.

        Returns:
            The train indices and the test indices.
        """
        idx = self.loaded[2][cid]
        return partition.train_test_split(idx, self.cfg.data.test_fraction, self.cfg.data.seed + cid)

    def label(self, cid: int) -> str:
        """A client's labels, ``"+"``-joined (``"<n> labels"`` beyond three).

        Args:
            cid: the client id.

        Returns:
            The label string.
        """
        if not source_of(self.cfg.data.source).shared:
            return self.build(cid).label
        records, labels, parts = self.loaded
        names = sorted({labels[i] for i in parts[cid]})
        return "+".join(names) if len(names) <= 3 else f"{len(names)} labels"

    def build(self, cid: int) -> ClientData:
        """A client's tokenised data.

        Args:
            cid: the client id.

        Returns:
            A fresh ClientData (a copy for a generated source: what the pool does to it is done in
                place).

        Raises:
            DataError: for missing or malformed data, or a client left without examples (one line).
            ConfigError: for bad data settings (one line).
        """
        d = self.cfg.data
        if not source_of(d.source).shared:
            if self._generated is None:
                self._generated = source_of(d.source).read(self.cfg, self.tokenizer)[0]
            n = self._generated[cid]  # a copy: what the pool builds from it is changed in place (poisoning, prefix)
            return ClientData(
                n.train_ids.clone(),
                n.train_labels.clone(),
                n.test_ids.clone(),
                n.test_labels.clone(),
                letter_ids=n.letter_ids,
                label=n.label,
                test_groups={g: i.clone() for g, i in (n.test_groups or {}).items()} or None,
            )
        records, labels, parts = self.loaded
        train_idx, test_idx = self.records_of(cid)
        train = tokenise(records, train_idx, d, self.tokenizer, d.max_train)
        test = tokenise(records, test_idx, d, self.tokenizer, d.max_test)
        if len(train) == 0 or len(test) == 0:
            raise DataError(
                f"client {cid}: no {'training' if len(train) == 0 else 'test'} examples after "
                f"partitioning ({len(parts[cid])} records); lower data.block_size or add data"
            )
        letter_ids = tasks.letter_token_ids(self.tokenizer) if d.task == "multiple_choice" else None
        return ClientData(
            train.input_ids, train.labels, test.input_ids, test.labels, letter_ids=letter_ids, label=self.label(cid)
        )


def build_client_data(cfg: ExperimentConfig, tokenizer, loaded=None) -> tuple[dict[int, ClientData], list[list[str]]]:
    """Tokenised train and test data for every client, from the config's source, partition and task.

    Each client is built by a `ClientSource`.

    Args:
        cfg: the experiment.
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        loaded (tuple | None): a `load_partitions` result; read here when None.

    Returns:
        {cid: ClientData}, and each client's sorted labels.

    Raises:
        DataError: for missing or malformed data, or a client left without examples.
        ConfigError: for bad data settings.
    """
    if not source_of(cfg.data.source).shared:
        return source_of(cfg.data.source).read(cfg, tokenizer)
    source = ClientSource(cfg, tokenizer, loaded)
    records, labels, parts = source.loaded
    out = {cid: source.build(cid) for cid in range(len(parts))}
    return out, [sorted({labels[i] for i in idx}) for idx in parts]


def generated_client_data(
    clients: list[dict], letter_ids: list[int] | None
) -> tuple[dict[int, ClientData], list[list[str]]]:
    """A generated source's clients as ClientData.

    Args:
        clients: in client order, ``{"train": TokenDataset, "test": TokenDataset, "groups": test
            groups, "label": str}`` each.
        letter_ids: the answer-letter token ids every client gets, or None.

    Returns:
        {cid: ClientData} with those test groups, and each client's labels (one each).
    """
    out = {
        cid: ClientData(
            c["train"].input_ids,
            c["train"].labels,
            c["test"].input_ids,
            c["test"].labels,
            letter_ids=letter_ids,
            label=c["label"],
            test_groups=c["groups"],
        )
        for cid, c in enumerate(clients)
    }
    return out, [[c["label"]] for c in clients]
