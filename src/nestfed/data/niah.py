"""Non-IID needle-in-a-haystack: a seeded generator of FedNL's seven retrieval templates.

Source: FedNL (arXiv 2605.16350), section 5.2 and docs/methods.md section 3: seven clients, one
template each; haystacks cut from real long text (gensim's Wikipedia articles, Austen's novels);
a 4-option multiple-choice question whose wrong options are hard negatives drawn from the same
haystack; controlled needle depths and context lengths.

The templates, their four events and their hard negatives are nestfed.data.niah_templates'; this
module cuts the haystacks and renders the examples. Decisions where the sources are silent:

- An event sits at the first sentence boundary (a token ending in . ! ? or a newline) at or after
  its depth fraction of the haystack, so it never splits a sentence when one ends nearby.
- The prompt ends with ``tasks.mc_prompt`` ("Question: ...\\nA. ...\\nAnswer:"); the label is the
  gold letter token only (as for MMLU), so accuracy comes from the 4 letter logits.
- Training and test haystacks come from disjoint halves of each document's tokens.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from nestfed.config import ConfigError, ExperimentConfig
from nestfed.config.sources import NiahOptions
from nestfed.data.clients import ClientData, generated_client_data
from nestfed.data.corpora import long_texts
from nestfed.data.niah_templates import TEMPLATES, NiahItem, make_item
from nestfed.data.tasks import (
    IGNORE_INDEX,
    TokenDataset,
    _answer_tokens,
    _bos,
    _encode,
    _pad,
    _pad_id,
    concat_rows,
    letter_token_ids,
    mc_prompt,
)


class Haystack:
    """Tokenised long documents to cut haystacks from, with the sentence boundaries marked.

    Args:
        texts: the documents (e.g. ``[t.text for t in sources.long_texts()]``).
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        half: ``train``: each document's first half of tokens, ``test``: the second, ``all``: all; a document
            under 64 tokens is dropped.

    Raises:
        ValueError: when no document is left or ``half`` is unknown.
    """

    def __init__(self, texts: Sequence[str], tokenizer, half: str = "all"):
        if half not in ("train", "test", "all"):
            raise ValueError(f"Haystack half must be train, test or all, got '{half}'")
        self.docs: list[list[int]] = []
        for ids in _encode(tokenizer, list(texts)):
            mid = len(ids) // 2
            part = ids[:mid] if half == "train" else ids[mid:] if half == "test" else ids
            if len(part) >= 64:
                self.docs.append(part)
        if not self.docs:
            raise ValueError("Haystack: no document has 64 tokens or more")
        vocab = {t for d in self.docs for t in d}
        self._boundary = {t: _ends_sentence(tokenizer.decode([t])) for t in vocab}

    @property
    def max_tokens(self) -> int:
        """The longest document (tokens)."""
        return max(len(d) for d in self.docs)

    def span(self, rng: random.Random, n: int) -> list[int]:
        """Consecutive haystack tokens from a random document long enough (else all, concatenated).

        Args:
            rng: the random stream.
            n: tokens wanted.

        Returns:
            ``n`` token ids.

        Raises:
            ValueError: for n < 1.
        """
        if n < 1:
            raise ValueError(f"haystack span must be >= 1 token, got {n}")
        fits = [d for d in self.docs if len(d) >= n]
        if fits:
            d = rng.choice(fits)
            s = rng.randint(0, len(d) - n)
            return d[s : s + n]
        joined = [t for d in self.docs for t in d]
        while len(joined) < n:
            joined += joined
        s = rng.randint(0, len(joined) - n)
        return joined[s : s + n]

    def insertion_point(self, hay: list[int], depth: float, lo: int) -> int:
        """The first sentence boundary at or after ``depth * len(hay)`` and after ``lo``.

        Args:
            hay: the haystack's token ids.
            depth: the depth fraction in [0, 1].
            lo: the earliest position (the previous event's).

        Returns:
            The position (the depth's own when no boundary follows within 128 tokens).
        """
        p = max(int(round(depth * len(hay))), lo)
        for j in range(p, min(p + 128, len(hay))):
            if j > 0 and self._boundary.get(hay[j - 1], False):
                return j
        return min(p, len(hay))


def _ends_sentence(text: str) -> bool:
    t = text.rstrip(" ")
    return "\n" in text or t.endswith((".", "!", "?", '."', ".'"))


def render(
    item: NiahItem, tokenizer, haystack: Haystack, length: int, rng: random.Random
) -> tuple[list[int], list[int], float]:
    """One example of exactly ``length`` tokens: BOS, the haystack with the needles, question, answer.

    Args:
        item: the needle task.
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        haystack: where the haystack tokens come from.
        length: the example's tokens.
        rng: the random stream.

    Returns:
        The input ids, the labels (the gold letter only), and the gold event's actual depth as a fraction of the
            haystack.

    Raises:
        ValueError: when ``length`` leaves fewer than 32 haystack tokens.
    """
    bridge, letters = _answer_tokens(tokenizer)
    question = _encode(tokenizer, ["\n\n" + mc_prompt(item.question, item.options)])[0] + bridge
    needles = _encode(tokenizer, [" " + n + " " for n in item.needles])
    ids: list[int] = _bos(tokenizer)
    n_hay = length - 1 - len(ids) - len(question) - sum(len(x) for x in needles)
    if n_hay < 32:
        raise ValueError(
            f"NIAH length {length} leaves {n_hay} haystack tokens for template {item.template} "
            "(need >= 32); use longer contexts"
        )
    hay = haystack.span(rng, n_hay)
    prev = 0
    gold_at = 0.0
    for needle, depth in zip(needles, item.depths):
        p = haystack.insertion_point(hay, depth, prev)
        ids += hay[prev:p]
        if depth == item.gold_depth:
            gold_at = p / len(hay)
        ids += needle
        prev = p
    ids += hay[prev:] + question
    ids.append(letters[item.answer])
    labels = [IGNORE_INDEX] * (len(ids) - 1) + [letters[item.answer]]
    return ids, labels, gold_at


def niah_dataset(
    template: str, n: int, length: int, depths: Sequence[float], tokenizer, haystack: Haystack, seed: int
) -> tuple[TokenDataset, list[dict]]:
    """Seeded examples of one template at one context length, gold depths cycling through ``depths``.

    Args:
        template: the template's name.
        n: examples.
        length: tokens per example.
        depths: the requested gold depths.
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        haystack: where the haystack tokens come from.
        seed: the seed of the examples.

    Returns:
        The dataset ([n, length] ids, labels), and per row ``depth``, ``actual_depth``, ``answer``, ``length``.

    Raises:
        ValueError: for n < 1 or no depths, and as ``make_item`` and ``render`` raise it.
    """
    if n < 1 or not depths:
        raise ValueError(f"niah_dataset: need n >= 1 and at least one depth, got n={n}, depths={list(depths)}")
    rng = random.Random(f"{template}/{length}/{seed}")
    rows, meta = [], []
    for i in range(n):
        depth = float(depths[i % len(depths)])
        item = make_item(template, rng, depth)
        ids, labels, actual = render(item, tokenizer, haystack, length, rng)
        rows.append((ids, labels))
        meta.append({"depth": depth, "actual_depth": actual, "answer": item.answer, "length": length})
    return _pad(rows, _pad_id(tokenizer)), meta


def group_rows(meta: Sequence[dict]) -> dict[str, torch.Tensor]:
    """Disjoint row groups for per-length and per-depth accuracy (ClientData.test_groups).

    Args:
        meta: one record per row, as ``niah_dataset`` returns them.

    Returns:
        {"<length>@<depth>": row indices}.
    """
    groups: dict[str, list[int]] = {}
    for i, m in enumerate(meta):
        groups.setdefault(f"{m['length']}@{m['depth']:g}", []).append(i)
    return {k: torch.tensor(v, dtype=torch.long) for k, v in groups.items()}


def niah_clients(d, tokenizer, o: NiahOptions | None = None) -> list[dict]:
    """The NIAH federation of a data config: client i holds template i.

    Client i gets ``d.max_train`` training examples of ``o.train_length`` tokens and ``d.max_test`` test
    examples per length in ``o.test_lengths``, from disjoint halves of ``sources.long_texts(o.haystack)``,
    depths cycling through ``o.depths``.

    Args:
        d (DataConfig): the data config (source ``niah``).
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        o: the generator's options (``[niah]``; defaults when None); templates: ``o.templates`` or all seven.

    Returns:
        One dict per client: ``train``, ``test`` (TokenDataset), ``groups`` (``group_rows``), ``label``.

    Raises:
        ValueError: for an unknown template, or not one template per client.
        DataError: when a corpus is missing.
    """
    o = o or NiahOptions()
    templates = list(o.templates) or list(TEMPLATES)
    if len(templates) != d.num_clients:
        raise ValueError(
            f"niah.templates: {len(templates)} templates for data.num_clients = {d.num_clients} "
            "(one template per client)"
        )
    for t in templates:
        if t not in TEMPLATES:
            raise ValueError(f"niah.templates: unknown template '{t}' (known: {', '.join(TEMPLATES)})")
    texts = [x.text for x in long_texts(o.haystack)]
    train_hay, test_hay = Haystack(texts, tokenizer, "train"), Haystack(texts, tokenizer, "test")
    out = []
    for cid, t in enumerate(templates):
        train, _ = niah_dataset(
            t, d.max_train, o.train_length, o.depths, tokenizer, train_hay, seed=d.seed * 1000 + cid
        )
        parts, meta = [], []
        for length in o.test_lengths:
            ds, m = niah_dataset(t, d.max_test, length, o.depths, tokenizer, test_hay, seed=d.seed * 1000 + 500 + cid)
            parts.append(ds)
            meta += m
        test = concat_rows(parts, _pad_id(tokenizer))
        out.append({"train": train, "test": test, "groups": group_rows(meta), "label": t})
    return out


def niah_client_data(cfg: ExperimentConfig, tokenizer) -> tuple[dict[int, ClientData], list[list[str]]]:
    """The NIAH source's reader (nestfed.config.sources).

    Args:
        cfg: the experiment (``[data]`` and ``[niah]``).
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.

    Returns:
        {cid: ClientData} with test groups per length and depth, and each client's labels.

    Raises:
        ConfigError: for the templates.
        DataError: when a corpus is missing.
    """
    try:
        clients = niah_clients(cfg.data, tokenizer, cfg.section("niah"))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return generated_client_data(clients, letter_token_ids(tokenizer))
