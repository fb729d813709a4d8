"""Non-IID needle-in-a-haystack: a seeded generator of FedNL's seven retrieval templates.

Source: FedNL (arXiv 2605.16350), section 5.2 and docs/methods.md section 3: seven clients, one
template each; haystacks cut from real long text (gensim's Wikipedia articles, Austen's novels);
a 4-option multiple-choice question whose wrong options are hard negatives drawn from the same
haystack; controlled needle depths and context lengths.

Templates (the gold answer in brackets):

- ``passkey``: "Officer Hale's passkey is 4829173." [the queried officer's 7-digit passkey]
- ``uuid_code``: "The access code of device KX-27 is 7F3A-91C2-0B4E." [a three-part code]
- ``name_date``: "Officer Hale filed the report on March 14, 1987." [the date]
- ``phrase_code``: "The codeword for mission Aurora is silver falcon." [the codeword]
- ``counter_state``: "The counter starts at 5." then three "The counter is increased/decreased
  by n." events [the final value mod 8]
- ``mk_niah``: four "The secret number for key maple is 4821." [the queried key's number]
- ``mv_niah``: four "Codeword #3 is lantern." (numbers 1-4 in random order) [codeword #k]

Decisions where the sources are silent:

- Every template inserts four events at the depth fractions 0.10/0.30/0.50/0.70 of the
  haystack (docs/methods.md's four-event placement). The single-fact templates (passkey, UUID code,
  name-date, phrase code) put the gold fact at the requested depth and three facts of the same
  form about other entities (officers, devices, missions) at the other three event depths (all
  but the one nearest it): those are the hard negatives, present in the same haystack. For MK- and MV-NIAH the
  queried event is the one nearest the requested depth and the other three are the negatives.
  For the counter every event matters (its depth is that of the last event, 0.70); its
  negatives are the intermediate states mod 8 (base, after one and after two events), padded
  with other residues when they coincide.
- An event sits at the first sentence boundary (a token ending in . ! ? or a newline) at or after
  its depth fraction of the haystack, so it never splits a sentence when one ends nearby.
- The prompt ends with ``tasks.mc_prompt`` ("Question: ...\\nA. ...\\nAnswer:"); the label is the
  gold letter token only (as for MMLU), so accuracy comes from the 4 letter logits.
- Training and test haystacks come from disjoint halves of each document's tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from nestfed.config import ConfigError, ExperimentConfig
from nestfed.config.sources import NIAH_TEMPLATES, NiahOptions
from nestfed.data.clients import ClientData, generated_client_data
from nestfed.data.corpora import long_texts
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

TEMPLATES = NIAH_TEMPLATES  # declared with the source (nestfed.config.sources), checked at config load
EVENT_DEPTHS = (0.10, 0.30, 0.50, 0.70)

SURNAMES = (
    "Hale",
    "Moreno",
    "Quinn",
    "Abbott",
    "Lindqvist",
    "Okafor",
    "Brennan",
    "Castillo",
    "Devereux",
    "Fischer",
    "Gallagher",
    "Haddad",
    "Ivanova",
    "Jansen",
    "Kowalski",
    "Larkin",
    "Mbeki",
    "Nakamura",
    "Oyelaran",
    "Petrov",
    "Rasmussen",
    "Sato",
    "Thorne",
    "Underwood",
    "Varga",
    "Whitaker",
    "Yilmaz",
    "Zielinski",
)
MISSIONS = (
    "Aurora",
    "Bastion",
    "Cinder",
    "Driftwood",
    "Ember",
    "Falconry",
    "Glacier",
    "Harbor",
    "Ironwood",
    "Juniper",
    "Keystone",
    "Lodestar",
    "Meridian",
    "Nightjar",
    "Obsidian",
    "Paragon",
    "Quarry",
    "Redwing",
)
ADJECTIVES = (
    "silver",
    "crimson",
    "quiet",
    "amber",
    "hollow",
    "northern",
    "velvet",
    "broken",
    "golden",
    "pale",
    "restless",
    "frozen",
    "distant",
    "scarlet",
    "iron",
    "hidden",
)
NOUNS = (
    "falcon",
    "lantern",
    "harbor",
    "compass",
    "orchard",
    "meadow",
    "anchor",
    "beacon",
    "willow",
    "canyon",
    "sparrow",
    "citadel",
    "glacier",
    "thistle",
    "comet",
    "ember",
)
KEYWORDS = (
    "maple",
    "cobalt",
    "saffron",
    "granite",
    "lagoon",
    "pepper",
    "quartz",
    "tundra",
    "walnut",
    "zephyr",
    "basil",
    "cedar",
    "delta",
    "fjord",
    "garnet",
    "hazel",
)
MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)


@dataclass(frozen=True)
class NiahItem:
    """One needle task before it meets a haystack.

    Attributes:
        template: the template's name (:data:`TEMPLATES`).
        needles: the event sentences, in haystack order.
        depths: the depth fraction of each event (same order, increasing).
        question: the question asked after the haystack.
        options: the 4 answer strings (A-D).
        answer: the gold index, 0-3.
        gold_depth: the depth fraction of the event that holds the answer.
    """

    template: str
    needles: tuple[str, ...]
    depths: tuple[float, ...]
    question: str
    options: tuple[str, str, str, str]
    answer: int
    gold_depth: float


def _distinct(rng: random.Random, make, n: int) -> list:
    out: list = []
    while len(out) < n:
        x = make()
        if x not in out:
            out.append(x)
    return out


def _slots(depth: float) -> tuple[int, list[int]]:
    """(the event slot nearest ``depth``, the other three slots)."""
    gold = min(range(4), key=lambda i: (abs(EVENT_DEPTHS[i] - depth), i))
    return gold, [i for i in range(4) if i != gold]


def _facts(
    rng: random.Random,
    depth: float,
    subjects: list[str],
    values: list[str],
    sentence: str,
    question: str,
    template: str,
) -> NiahItem:
    """Four facts "subject -> value": the gold (subjects[0]) at ``depth``, three decoys at the
    event depths other than the one nearest it; options = the four values, shuffled."""
    gold_slot, others = _slots(depth)
    placed = [(depth, sentence.format(s=subjects[0], v=values[0]))]
    for j, slot in enumerate(others, start=1):
        placed.append((EVENT_DEPTHS[slot], sentence.format(s=subjects[j], v=values[j])))
    placed.sort()
    order = list(range(4))
    rng.shuffle(order)
    options = tuple(values[i] for i in order)
    return NiahItem(
        template,
        tuple(p[1] for p in placed),
        tuple(p[0] for p in placed),
        question.format(s=subjects[0]),
        options,
        order.index(0),
        depth,
    )  # type: ignore[arg-type]


@dataclass(frozen=True)
class FactTemplate:
    """A single-fact template: ``draw(rng)`` gives the four (subjects, values) in the order the
    seeded draws are made, the gold pair first; ``sentence`` and ``question`` format them
    (``{s}``, ``{v}``)."""

    sentence: str
    question: str
    draw: Callable[[random.Random], tuple[list[str], list[str]]]

    def item(self, template: str, rng: random.Random, depth: float) -> NiahItem:
        subjects, values = self.draw(rng)
        return _facts(rng, depth, subjects, values, self.sentence, self.question, template)


def _passkeys(rng: random.Random) -> tuple[list[str], list[str]]:
    officers = rng.sample(SURNAMES, 4)
    return officers, _distinct(rng, lambda: str(rng.randint(10**6, 10**7 - 1)), 4)


def _access_codes(rng: random.Random) -> tuple[list[str], list[str]]:
    hexes = "0123456789ABCDEF"
    devices = _distinct(rng, lambda: f"{rng.choice('BCDKMRTX')}{rng.choice('BCDKMRTX')}-{rng.randint(10, 99)}", 4)
    codes = _distinct(rng, lambda: "-".join("".join(rng.choice(hexes) for _ in range(4)) for _ in range(3)), 4)
    return devices, codes


def _report_dates(rng: random.Random) -> tuple[list[str], list[str]]:
    dates = _distinct(rng, lambda: f"{rng.choice(MONTHS)} {rng.randint(1, 28)}, {rng.randint(1950, 2020)}", 4)
    return rng.sample(SURNAMES, 4), dates


def _codewords(rng: random.Random) -> tuple[list[str], list[str]]:
    phrases = _distinct(rng, lambda: f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}", 4)
    return rng.sample(MISSIONS, 4), phrases


def _counter_state(template: str, rng: random.Random, depth: float) -> NiahItem:
    """Four events (a base, three signed steps) at every event depth; the gold is the final value
    mod 8, the negatives the intermediate states mod 8 padded with other residues."""
    base = rng.randint(0, 20)
    deltas = [rng.choice([-1, 1]) * rng.randint(1, 9) for _ in range(3)]
    needles = [f"The counter starts at {base}."]
    needles += [f"The counter is {'increased' if d > 0 else 'decreased'} by {abs(d)}." for d in deltas]
    states = [base, base + deltas[0], base + deltas[0] + deltas[1], base + sum(deltas)]
    gold = states[-1] % 8
    values = [gold]
    for s in states[:-1]:
        if s % 8 not in values:
            values.append(s % 8)
    values += [r for r in rng.sample(range(8), 8) if r not in values][: 4 - len(values)]
    order = list(range(4))
    rng.shuffle(order)
    return NiahItem(
        template,
        tuple(needles),
        EVENT_DEPTHS,
        "After all the changes, what is the counter's value modulo 8?",
        tuple(str(values[i]) for i in order),
        order.index(0),
        EVENT_DEPTHS[-1],
    )  # type: ignore[arg-type]


def _queried_event(
    template: str, rng: random.Random, gold_slot: int, needles: tuple[str, ...], question: str, values: list[str]
) -> NiahItem:
    """An item of four events at the event depths, the one at ``gold_slot`` queried; options = the
    four events' values, shuffled."""
    order = [gold_slot] + [i for i in range(4) if i != gold_slot]
    rng.shuffle(order)
    return NiahItem(
        template,
        needles,
        EVENT_DEPTHS,
        question,
        tuple(values[i] for i in order),  # type: ignore[arg-type]
        order.index(gold_slot),
        EVENT_DEPTHS[gold_slot],
    )


def _secret_numbers(template: str, rng: random.Random, depth: float) -> NiahItem:
    """MK-NIAH: four keys with a secret number each; the key of the event nearest ``depth`` is queried."""
    gold_slot, _ = _slots(depth)
    keys = rng.sample(KEYWORDS, 4)
    nums = _distinct(rng, lambda: str(rng.randint(1000, 9999)), 4)
    needles = tuple(f"The secret number for key {keys[i]} is {nums[i]}." for i in range(4))
    return _queried_event(
        template, rng, gold_slot, needles, f"What is the secret number for key {keys[gold_slot]}?", nums
    )


def _numbered_codewords(template: str, rng: random.Random, depth: float) -> NiahItem:
    """MV-NIAH: four codewords numbered 1-4 in random order; the number of the event nearest
    ``depth`` is queried."""
    gold_slot, _ = _slots(depth)
    words = _distinct(rng, lambda: rng.choice(NOUNS + KEYWORDS), 4)
    numbers = [1, 2, 3, 4]
    rng.shuffle(numbers)
    needles = tuple(f"Codeword #{numbers[i]} is {words[i]}." for i in range(4))
    return _queried_event(template, rng, gold_slot, needles, f"What is codeword #{numbers[gold_slot]}?", words)


# {template: builder(template, rng, depth)}, one per template of TEMPLATES
BUILDERS: dict[str, Callable[[str, random.Random, float], NiahItem]] = {
    "passkey": FactTemplate("Officer {s}'s passkey is {v}.", "What is Officer {s}'s passkey?", _passkeys).item,
    "uuid_code": FactTemplate(
        "The access code of device {s} is {v}.", "What is the access code of device {s}?", _access_codes
    ).item,
    "name_date": FactTemplate(
        "Officer {s} filed the report on {v}.", "On what date did Officer {s} file the report?", _report_dates
    ).item,
    "phrase_code": FactTemplate(
        "The codeword for mission {s} is {v}.", "What is the codeword for mission {s}?", _codewords
    ).item,
    "counter_state": _counter_state,
    "mk_niah": _secret_numbers,
    "mv_niah": _numbered_codewords,
}


def make_item(template: str, rng: random.Random, depth: float = 0.5) -> NiahItem:
    """One seeded :class:`NiahItem` of ``template`` with its gold event at ``depth`` (a fraction
    of the haystack; single-fact templates use it exactly, the others take the nearest event).

    Raises ValueError for an unknown template or a depth outside [0, 1].
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown NIAH template '{template}' (known: {', '.join(TEMPLATES)})")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"NIAH depth must be a fraction in [0, 1], got {depth}")
    return BUILDERS[template](template, rng, depth)


# ----------------------------------------------------------------------------- haystacks


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
        ValueError: for n < 1 or no depths, and as :func:`make_item` and :func:`render` raise it.
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
        meta: one record per row, as :func:`niah_dataset` returns them.

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
        One dict per client: ``train``, ``test`` (TokenDataset), ``groups`` (:func:`group_rows`), ``label``.

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
