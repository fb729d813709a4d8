"""Associative recall beyond the attention window: key-value facts stated early in a stream of real
text, asked about after more than the window of filler.

The job the delta rule does (FedNL, arXiv 2605.16350, section 3: write k -> v, read with q), on a
task where a model whose softmax attention is bounded (``model.attention_window``) cannot see the
answer: the fact lies ``distance`` tokens before the answer, more than the window. A row is

    [BOS] lead filler | n facts of one kind | filler | "\\n\\nRecall the facts above. " prefix -> value

with the filler cut from real long text (gensim's Wikipedia, Austen; training and test from
disjoint halves of each document) and the answer the single value token of the queried fact, the
only labelled token. Accuracy is the argmax over every kind's value tokens (``letter_ids``), so a
model that knows the kind but not the fact scores 1 / (values per kind), one that has read the
row's facts but not which is which 1 / ``facts``.

Kinds (non-IID: one per client, plus a held-out kind no client trains on, for the zero-shot
claim), each a sentence ``prefix + " " + value + "."`` with its own keys and eight values, every
value one token with a leading space (checked against the tokenizer; values differ across kinds):

- ``city``: "Mr Hale lives in Paris."
- ``colour``: "The Aurora door is painted red."
- ``animal``: "The mascot of team Bastion is the wolf."
- ``fruit``: "Moreno's favourite fruit is the mango."
- ``metal``: "The maple statue is made of copper."
- ``number``: "Locker cobalt holds seven coins." (the value is not the sentence's last word)

Decisions where nothing says otherwise: the facts of a row are distinct in key and value and
follow ``lead`` filler tokens (so that attention sinks, the first tokens a windowed query keeps
seeing, hold filler and no fact); the queried fact is drawn uniformly among the row's facts and
the filler before the question is cut so that its value lies exactly ``distance`` tokens before
the answer token (the predicting position sees it iff distance <= window).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nestfed.config import ConfigError, ExperimentConfig
from nestfed.data.clients import ClientData, generated_client_data
from nestfed.data.corpora import long_texts
from nestfed.data.niah import Haystack
from nestfed.data.niah_templates import KEYWORDS, MISSIONS, SURNAMES
from nestfed.data.tasks import IGNORE_INDEX, TokenDataset, _bos, _encode, _pad, _pad_id, concat_rows


@dataclass(frozen=True)
class Kind:
    """One kind of fact; the question is the template up to ``{v}``.

    Attributes:
        template: the sentence with ``{k}`` (the key) and ``{v}`` (the value, one token).
        keys: the keys a fact may name.
        values: the eight values.
    """

    template: str
    keys: tuple[str, ...]
    values: tuple[str, ...]

    def prefix(self, key: str) -> str:
        """The sentence up to the value (also the question).

        Args:
            key: the fact's key.

        Returns:
            The prefix, without trailing space.
        """
        return self.template.split("{v}")[0].rstrip().format(k=key)

    def suffix(self) -> str:
        """What follows the value (``"."``, ``" coins."``).

        Returns:
            The suffix.
        """
        return self.template.split("{v}")[1]


KINDS: dict[str, Kind] = {
    "city": Kind(
        "Mr {k} lives in {v}.",
        SURNAMES,
        ("Paris", "London", "Berlin", "Rome", "Tokyo", "Madrid", "Cairo", "Dublin"),
    ),
    "colour": Kind(
        "The {k} door is painted {v}.",
        MISSIONS,
        ("red", "blue", "green", "yellow", "black", "white", "brown", "purple"),
    ),
    "animal": Kind(
        "The mascot of team {k} is the {v}.",
        MISSIONS,
        ("cat", "dog", "horse", "wolf", "bear", "fox", "owl", "lion"),
    ),
    "fruit": Kind(
        "{k}'s favourite fruit is the {v}.",
        SURNAMES,
        ("apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "pear"),
    ),
    "metal": Kind(
        "The {k} statue is made of {v}.",
        KEYWORDS,
        ("gold", "silver", "copper", "iron", "steel", "tin", "zinc", "bronze"),
    ),
    "number": Kind(
        "Locker {k} holds {v} coins.",
        KEYWORDS,
        ("one", "two", "three", "four", "five", "six", "seven", "eight"),
    ),
}
QUESTION = "\n\nRecall the facts above. "


def value_ids(tokenizer, kinds: Sequence[str] = tuple(KINDS)) -> dict[str, list[int]]:
    """The token id of each value of each kind, with a leading space.

    Args:
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        kinds: the kinds (default every kind).

    Returns:
        {kind: value token ids}.

    Raises:
        ValueError: when a value is not one token for this tokenizer (the answer must be one
            labelled token).
    """
    out = {}
    for name in kinds:
        ids = _encode(tokenizer, [" " + v for v in KINDS[name].values])
        bad = [v for v, x in zip(KINDS[name].values, ids) if len(x) != 1]
        if bad:
            raise ValueError(f"recall kind '{name}': value(s) {bad} are not one token for this tokenizer")
        out[name] = [x[0] for x in ids]
    return out


def candidate_ids(tokenizer, kinds: Sequence[str] = tuple(KINDS)) -> list[int]:
    """The value tokens of ``kinds``, in order: the ids accuracy takes its argmax over.

    Args:
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        kinds: the kinds (default every kind).

    Returns:
        The token ids.

    Raises:
        ValueError: as `value_ids` raises it.
    """
    return [i for ids in value_ids(tokenizer, kinds).values() for i in ids]


@dataclass(frozen=True)
class Row:
    """One recall row.

    Attributes:
        ids: the token ids.
        labels: IGNORE_INDEX except the last token (the answer).
        values_at: the position of each fact's value token, in order.
        asked: the index of the fact the question asks about.
    """

    ids: list[int]
    labels: list[int]
    values_at: tuple[int, ...]
    asked: int


def make_row(
    kind: str, tokenizer, haystack: Haystack, rng: random.Random, distance: int, facts: int = 4, lead: int = 16
) -> Row:
    """One row: lead filler, the facts, filler, the question about one of them.

    The asked fact's value token sits exactly ``distance`` tokens before the answer (the last token,
    the only labelled one).

    Args:
        kind: the kind of the facts (`KINDS`).
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        haystack: where the filler comes from.
        rng: the random stream.
        distance: tokens from the asked value to the answer.
        facts: facts stated, distinct in key and value.
        lead: filler tokens before the first fact.

    Returns:
        The row.

    Raises:
        ValueError: when ``distance`` is too short to hold the facts after the asked one and the
            question.
    """
    k = KINDS[kind]
    ids_of = dict(zip(k.values, value_ids(tokenizer, [kind])[kind]))
    keys, values = rng.sample(k.keys, facts), rng.sample(k.values, facts)
    asked = rng.randrange(facts)
    row: list[int] = _bos(tokenizer) + haystack.span(rng, lead)
    at = []
    for i in range(facts):
        row += _encode(tokenizer, [" " + k.prefix(keys[i])])[0]
        at.append(len(row))
        row += [ids_of[values[i]]] + _encode(tokenizer, [k.suffix()])[0]
    question = _encode(tokenizer, [QUESTION + k.prefix(keys[asked])])[0]
    filler = distance - (len(row) - at[asked]) - len(question)
    if filler < 0:
        raise ValueError(f"recall distance {distance} is shorter than the facts after the asked one and the question")
    row += (haystack.span(rng, filler) if filler else []) + question
    row.append(ids_of[values[asked]])
    return Row(row, [IGNORE_INDEX] * (len(row) - 1) + [row[-1]], tuple(at), asked)


def recall_dataset(
    kind: str,
    n: int,
    distances: Sequence[int],
    tokenizer,
    haystack: Haystack,
    seed: str,
    facts: int,
    lead: int,
    past: int = 0,
) -> tuple[TokenDataset, list[int]]:
    """Seeded rows of one kind, ``n`` per distance, right-padded.

    Args:
        kind: the kind of the facts.
        n: rows per distance.
        distances: the distances (`make_row`).
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        haystack: where the filler comes from.
        seed: the seed string of the rows.
        facts: facts per row.
        lead: filler tokens before the first fact.
        past: when > 0, every token from position ``past`` on is labelled (next-token prediction
            past a window of ``past`` tokens), not only the answer.

    Returns:
        The dataset (input_ids and labels [n * len(distances), T]) and each row's distance.
    """
    rng = random.Random(f"recall/{kind}/{seed}")
    rows, dist = [], []
    for d in distances:
        for _ in range(n):
            r = make_row(kind, tokenizer, haystack, rng, int(d), facts, lead)
            labels = r.labels if not past else [IGNORE_INDEX] * past + r.ids[past:]
            rows.append((r.ids, labels))
            dist.append(int(d))
    return _pad(rows, _pad_id(tokenizer)), dist


def recall_clients(cfg: ExperimentConfig, tokenizer) -> list[dict]:
    """Every client's rows: client i trains on kind ``recall.kinds[i]``.

    Client i trains on ``data.max_train`` rows at each of ``recall.train_distances``, labelled as
    ``recall.loss`` says, and is tested on ``data.max_test`` rows per test distance of its own kind
    (groups ``own@<d>``) and of ``recall.held_out`` (``held_out@<d>``), scored on the answer.

    Args:
        cfg: the experiment (``[data]``, ``[recall]``, ``model.attention_window``).
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.

    Returns:
        One dict per client: ``train``, ``test`` (TokenDataset), ``groups``, ``label``.

    Raises:
        ValueError: when a value is not one token, or a distance is too short.
        DataError: when a corpus is missing.
    """
    d, o = cfg.data, cfg.section("recall")
    texts = [x.text for x in long_texts(o.haystack)]
    train_hay, test_hay = Haystack(texts, tokenizer, "train"), Haystack(texts, tokenizer, "test")
    pad = _pad_id(tokenizer)
    out = []
    for cid, kind in enumerate(o.kinds):
        common = dict(tokenizer=tokenizer, facts=o.facts, lead=o.lead)
        past = cfg.model.attention_window if o.loss == "past_window" else 0
        train, _ = recall_dataset(
            kind, d.max_train, o.train_distances, haystack=train_hay, seed=f"{d.seed}/{cid}/train", past=past, **common
        )
        parts = [("own", kind)] + ([("held_out", o.held_out)] if o.held_out else [])
        sets, groups, row = [], {}, 0
        for tag, k in parts:
            ds, dist = recall_dataset(
                k, d.max_test, o.test_distances, haystack=test_hay, seed=f"{d.seed}/{cid}/{tag}", **common
            )
            sets.append(ds)
            for i, x in enumerate(dist):
                groups.setdefault(f"{tag}@{x}", []).append(row + i)
            row += len(dist)
        out.append(
            {
                "train": train,
                "test": concat_rows(sets, pad),
                "groups": {g: torch.tensor(v, dtype=torch.long) for g, v in groups.items()},
                "label": kind,
            }
        )
    return out


def recall_client_data(cfg: ExperimentConfig, tokenizer) -> tuple[dict[int, ClientData], list[list[str]]]:
    """The recall source's reader (nestfed.config.sources).

    Args:
        cfg: the experiment.
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.

    Returns:
        {cid: ClientData} scored over `candidate_ids`, with test groups per own / held-out
            kind and distance, and each client's labels.

    Raises:
        ConfigError: for a value that is not one token.
        DataError: when a corpus is missing.
    """
    try:
        clients = recall_clients(cfg, tokenizer)
        o = cfg.section("recall")
        candidates = candidate_ids(tokenizer, [*o.kinds, *([o.held_out] if o.held_out else [])])
    except ValueError as exc:
        raise ConfigError(f"recall: {exc}") from None
    return generated_client_data(clients, candidates)
