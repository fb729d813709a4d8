"""The needle-in-a-haystack templates (nestfed.data.niah): FedNL's seven, each a seeded builder of
one needle task before it meets a haystack (arXiv 2605.16350, section 5.2).

Templates (the gold answer in brackets):

- ``passkey``: "Officer Hale's passkey is 4829173." [the queried officer's 7-digit passkey]
- ``uuid_code``: "The access code of device KX-27 is 7F3A-91C2-0B4E." [a three-part code]
- ``name_date``: "Officer Hale filed the report on March 14, 1987." [the date]
- ``phrase_code``: "The codeword for mission Aurora is silver falcon." [the codeword]
- ``counter_state``: "The counter starts at 5." then three "The counter is increased/decreased
  by n." events [the final value mod 8]
- ``mk_niah``: four "The secret number for key maple is 4821." [the queried key's number]
- ``mv_niah``: four "Codeword #3 is lantern." (numbers 1-4 in random order) [codeword #k]

Decisions where the sources are silent: every template inserts four events at the depth fractions
0.10/0.30/0.50/0.70 of the haystack (docs/methods.md's four-event placement).

- The single-fact templates (passkey, UUID code, name-date, phrase code) put the gold fact at the
  requested depth and three facts of the same form about other entities (officers, devices,
  missions) at the other three event depths (all but the one nearest it): those are the hard
  negatives, present in the same haystack.
- For MK- and MV-NIAH the queried event is the one nearest the requested depth and the other three
  are the negatives.
- For the counter every event matters (its depth is that of the last event, 0.70); its negatives
  are the intermediate states mod 8 (base, after one and after two events), padded with other
  residues when they coincide.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from nestfed.config.sources import NIAH_TEMPLATES

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
        template: the template's name (``TEMPLATES``).
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
    """A single-fact template: four facts "subject -> value", the gold one queried.

    Attributes:
        sentence: the fact, formatting ``{s}`` (the subject) and ``{v}`` (the value).
        question: the question, formatting ``{s}``.
        draw: called as ``draw(rng)``: the four (subjects, values) in the order the seeded draws
            are made, the gold pair first.
    """

    sentence: str
    question: str
    draw: Callable[[random.Random], tuple[list[str], list[str]]]

    def item(self, template: str, rng: random.Random, depth: float) -> NiahItem:
        """Build one item: the gold fact at ``depth``, three decoys at the other event depths.

        Args:
            template: the template's name.
            rng: the random stream.
            depth: the gold fact's depth fraction, in [0, 1].

        Returns:
            The item; its options are the four values, shuffled.
        """
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
    """One seeded needle task of a template.

    Args:
        template: the template's name (``TEMPLATES``).
        rng: the random stream.
        depth: the gold event's depth, a fraction of the haystack; single-fact templates use it
            exactly, the others take the nearest event.

    Returns:
        The item.

    Raises:
        ValueError: for an unknown template or a depth outside [0, 1].
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown NIAH template '{template}' (known: {', '.join(TEMPLATES)})")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"NIAH depth must be a fraction in [0, 1], got {depth}")
    return BUILDERS[template](template, rng, depth)
