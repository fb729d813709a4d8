"""The recall generator: the answer is the queried fact's value, exactly ``distance`` tokens after
it; the facts of a row are distinct; the held-out kind and the groups partition the test rows;
rows are seeded; training and test filler come from disjoint halves."""

import random
import re

import pytest
import torch

from nestfed.config import ConfigError
from nestfed.config.sources import RecallOptions
from nestfed.data import recall
from nestfed.data.niah import Haystack
from nestfed.data.tasks import IGNORE_INDEX
from nestfed.methods import load_config
from nestfed.nn.backbone import byte_tokenizer

TEXT = " ".join(f"Sentence {i} is about the river near town{i % 9}." for i in range(600))


class WordTokenizer:
    """Whitespace-word tokens, each with its leading space (as BPE's 'Ġword'); '.', "'s" and
    newlines apart. Grows its vocabulary as it meets words."""

    bos_token_id = None
    pad_token_id = 0
    eos_token_id = 0

    def __init__(self):
        self.vocab, self.words = {"<pad>": 0}, ["<pad>"]

    def _id(self, w):
        if w not in self.vocab:
            self.vocab[w] = len(self.words)
            self.words.append(w)
        return self.vocab[w]

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[self._id(w) for w in re.findall(r"\n|'s|\.| ?[^\s.']+", t)] for t in texts]}

    def decode(self, ids):
        return "".join(self.words[i] for i in ids)


@pytest.fixture
def tok():
    return WordTokenizer()


@pytest.fixture
def hay(tok):
    return Haystack([TEXT], tok, "all")


@pytest.mark.parametrize("kind", recall.KINDS)
@pytest.mark.parametrize("distance", [64, 97, 300])
def test_the_answer_is_the_asked_facts_value_exactly_distance_tokens_back(tok, hay, kind, distance):
    rng = random.Random(3)
    k = recall.KINDS[kind]
    for _ in range(10):
        row = recall.make_row(kind, tok, hay, rng, distance, facts=4, lead=16)
        ids, labels = row.ids, row.labels
        answer = ids[-1]
        assert labels[-1] == answer and all(x == IGNORE_INDEX for x in labels[:-1])
        assert ids[-1 - distance] == answer  # the stored value, distance tokens before the answer
        assert row.values_at[row.asked] == len(ids) - 1 - distance
        assert [tok.decode([ids[p]]).strip() for p in row.values_at] == [
            v
            for _, v in re.findall(
                re.escape(k.template).replace(r"\{k\}", r"(\S+?)").replace(r"\{v\}", r"(\w+)"), tok.decode(ids)
            )
        ]
        text = tok.decode(ids)
        question = text.rsplit(recall.QUESTION, 1)[1]
        facts = re.findall(re.escape(k.template).replace(r"\{k\}", r"(\S+?)").replace(r"\{v\}", r"(\w+)"), text)
        assert len(facts) == 4 and len({f[0] for f in facts}) == 4 and len({f[1] for f in facts}) == 4
        stated = dict(facts)
        key = next(f for f in stated if question == k.prefix(f) + " " + stated[f])
        assert tok.decode([answer]) == " " + stated[key]
        assert text.index(k.prefix(next(iter(stated)))) > len(tok.decode(ids[:16]))  # the lead comes first


def test_a_distance_too_short_for_the_question_is_refused(tok, hay):
    with pytest.raises(ValueError, match="shorter than"):
        recall.make_row("city", tok, hay, random.Random(0), 8)


def test_rows_are_seeded(tok, hay):
    a, da = recall.recall_dataset("colour", 3, [64, 128], tok, hay, "s", 4, 8)
    b, db = recall.recall_dataset("colour", 3, [64, 128], tok, hay, "s", 4, 8)
    c, _ = recall.recall_dataset("colour", 3, [64, 128], tok, hay, "t", 4, 8)
    assert torch.equal(a.input_ids, b.input_ids) and da == db == [64] * 3 + [128] * 3
    assert not torch.equal(a.input_ids, c.input_ids)


def test_a_value_that_is_not_one_token_is_refused():
    with pytest.raises(ValueError, match="not one token"):
        recall.value_ids(byte_tokenizer(), ["city"])


def test_the_kinds_declared_with_the_source_are_the_generators():
    from nestfed.config.sources import RECALL_KINDS

    assert tuple(recall.KINDS) == RECALL_KINDS
    values = [v for k in recall.KINDS.values() for v in k.values]
    assert len(values) == len(set(values)) == 8 * len(recall.KINDS)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kinds": ("city", "moon")}, "kinds: unknown kind 'moon'"),
        ({"held_out": "sun"}, "held_out: unknown kind 'sun'"),
        ({"held_out": "city"}, "also a training kind"),
        ({"kinds": ("city", "city")}, "distinct"),
        ({"facts": 9}, "facts"),
        ({"test_distances": (16,)}, "test_distances"),
    ],
)
def test_bad_options_name_the_key(options, message):
    with pytest.raises(ValueError, match=message):
        RecallOptions(**options)


def test_a_config_needs_one_kind_per_client(tmp_path):
    p = tmp_path / "r.toml"
    p.write_text('[data]\nsource = "recall"\ntask = "multiple_choice"\nnum_clients = 3\n')
    with pytest.raises(ConfigError, match=r"recall.kinds: 4 kinds for data.num_clients = 3"):
        load_config(p)


def test_clients_hold_their_kind_and_the_held_out_kind_in_groups(tok, monkeypatch, tmp_path):
    monkeypatch.setattr(recall, "long_texts", lambda which: [type("T", (), {"text": TEXT})()])
    p = tmp_path / "r.toml"
    p.write_text(
        '[model]\nname = "tiny-llama"\n[data]\nsource = "recall"\ntask = "multiple_choice"\nnum_clients = 2\n'
        "max_train = 3\nmax_test = 2\n"
        '[recall]\nkinds = ["city", "fruit"]\nheld_out = "number"\ntrain_distances = [64]\n'
        "test_distances = [48, 96]\n"
    )
    cfg = load_config(p)
    clients, labels = recall.recall_client_data(cfg, tok)
    assert labels == [["city"], ["fruit"]]
    candidates = recall.candidate_ids(tok, ["city", "fruit", "number"])
    for c in clients.values():
        assert c.num_examples == 3 and c.letter_ids == candidates
        rows = sorted(int(i) for g in c.test_groups.values() for i in g)
        assert rows == list(range(c.test_ids.shape[0])) == list(range(8))
        assert set(c.test_groups) == {"own@48", "own@96", "held_out@48", "held_out@96"}
        for name, idx in c.test_groups.items():
            kind = c.label if name.startswith("own") else "number"
            values = set(recall.value_ids(tok, [kind])[kind])
            for i in idx:
                lab = c.test_labels[i]
                assert int(lab[lab != IGNORE_INDEX][0]) in values

    def sentences(ids):  # the filler's sentence numbers
        return {int(n) for row in ids for n in re.findall(r"Sentence (\d+)", tok.decode(row.tolist()))}

    train = set().union(*(sentences(c.train_ids) for c in clients.values()))
    test = set().union(*(sentences(c.test_ids) for c in clients.values()))
    assert train and test and max(train) < min(test)  # disjoint halves of the text


def test_past_window_labels_every_token_from_the_window_on(tok, monkeypatch, tmp_path):
    """``recall.loss = "past_window"``: a training row's labels are its own tokens from position
    ``model.attention_window`` on (the filler and the answer), -100 before; test rows keep the
    answer only; without a window the option is refused, naming it."""
    monkeypatch.setattr(recall, "long_texts", lambda which: [type("T", (), {"text": TEXT})()])
    base = (
        '[data]\nsource = "recall"\ntask = "multiple_choice"\nnum_clients = 1\nmax_train = 2\nmax_test = 1\n'
        '[recall]\nkinds = ["city"]\nheld_out = ""\ntrain_distances = [64]\ntest_distances = [48]\n'
        'loss = "past_window"\n'
    )
    p = tmp_path / "r.toml"
    p.write_text('[model]\nname = "tiny-llama"\nattention_window = 20\n' + base)
    (c,) = recall.recall_client_data(load_config(p), tok)[0].values()
    for ids, lab in zip(c.train_ids, c.train_labels):
        real = int((ids != tok.pad_token_id).sum())
        assert (lab[:20] == IGNORE_INDEX).all() and torch.equal(lab[20:real], ids[20:real])
    assert ((c.test_labels != IGNORE_INDEX).sum(1) == 1).all()
    p.write_text('[model]\nname = "tiny-llama"\n' + base)
    with pytest.raises(ConfigError, match="recall.loss: 'past_window' labels the tokens past model.attention_window"):
        load_config(p)
