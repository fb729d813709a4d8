"""The NIAH generator: each template's gold answer is right and its negatives sit in the
haystack, rendering is exact in length and depth, everything is seeded."""

import importlib.util
import random
import re

import pytest
import torch

from nestfed.data import corpora
from nestfed.data.niah import Haystack, group_rows, niah_dataset, render
from nestfed.data.niah_templates import EVENT_DEPTHS, TEMPLATES, make_item
from nestfed.nn.backbone import byte_tokenizer

SENTENCES = [f"Sentence number {i} talks about the river and the hills near town {i % 7}." for i in range(400)]
TEXT = " ".join(SENTENCES)


def value_of(needle):
    """The value a needle states (after ' is ' / ' on ' / ' at ' / ' by '), without the full stop."""
    return re.split(r" is | on | at | by ", needle)[-1].rstrip(".")


@pytest.mark.parametrize("template", TEMPLATES)
def test_every_template_answers_correctly(template):
    rng = random.Random(7)
    for trial in range(40):
        depth = [0.0, 0.1, 0.25, 0.5, 0.7, 0.95][trial % 6]
        it = make_item(template, rng, depth)
        assert len(it.options) == 4 and len(set(it.options)) == 4, it
        assert 0 <= it.answer < 4 and len(it.needles) == 4 == len(it.depths)
        assert list(it.depths) == sorted(it.depths)
        gold = it.options[it.answer]
        if template == "counter_state":
            base = int(re.search(r"starts at (\d+)", it.needles[0]).group(1))
            total = base
            for n in it.needles[1:]:
                m = re.search(r"(increased|decreased) by (\d+)", n)
                total += int(m.group(2)) * (1 if m.group(1) == "increased" else -1)
            assert gold == str(total % 8)
            assert all(0 <= int(o) < 8 for o in it.options)
            assert it.gold_depth == EVENT_DEPTHS[-1]
            continue
        values = [value_of(n) for n in it.needles]
        assert sorted(values) == sorted(it.options)  # every option is stated in the haystack
        # the needle stating the gold value is the one the question asks about
        subject = re.search(r"(Officer \w+|device [A-Z]{2}-\d{2}|mission \w+|key \w+|#\d)", it.question).group(1)
        holder = [n for n in it.needles if subject + "'" in n or subject + " " in n]
        assert len(holder) == 1 and value_of(holder[0]) == gold, (it.question, it.needles)
        assert it.depths[it.needles.index(holder[0])] == it.gold_depth
        if template in ("passkey", "uuid_code", "name_date", "phrase_code"):
            assert it.gold_depth == depth  # single-fact templates place the gold where asked
        else:
            assert it.gold_depth == min(EVENT_DEPTHS, key=lambda d: (abs(d - depth), d))


def test_value_formats():
    rng = random.Random(0)
    assert re.fullmatch(r"\d{7}", make_item("passkey", rng).options[0])
    assert re.fullmatch(r"[0-9A-F]{4}-[0-9A-F]{4}-[0-9A-F]{4}", make_item("uuid_code", rng).options[0])
    assert re.fullmatch(r"\d{4}", make_item("mk_niah", rng).options[0])
    assert re.fullmatch(r"[A-Z][a-z]+ \d{1,2}, \d{4}", make_item("name_date", rng).options[0])
    with pytest.raises(ValueError, match="unknown NIAH template"):
        make_item("needle", rng)
    with pytest.raises(ValueError, match="depth"):
        make_item("passkey", rng, 1.5)


def test_render_is_exact_in_length_depth_and_label():
    tok = byte_tokenizer()
    hay = Haystack([TEXT], tok)
    rng = random.Random(1)
    for depth in (0.1, 0.5, 0.9):
        it = make_item("passkey", rng, depth)
        ids, labels, actual = render(it, tok, hay, 1500, rng)
        assert len(ids) == len(labels) == 1500
        assert [i for i, x in enumerate(labels) if x != -100] == [1499]
        assert labels[-1] == ids[-1] == tok.encode(" ABCD"[it.answer + 1], add_special_tokens=False)[-1]
        text = tok.decode(ids)
        pos = [text.index(n) for n in it.needles]
        assert pos == sorted(pos)  # needles in depth order
        assert abs(actual - depth) < 0.1  # moved at most to the next sentence end (~80 byte tokens)
        assert text.rstrip().endswith("Answer: " + "ABCD"[it.answer])
        gold_needle = next(n for n in it.needles if it.options[it.answer] in n)
        prior = text[: text.index(gold_needle)]
        assert prior.endswith(". ") or prior.endswith(".  ")  # inserted at a sentence boundary
    with pytest.raises(ValueError, match="leaves"):
        render(make_item("passkey", rng), tok, hay, 100, rng)


def test_dataset_is_seeded_balanced_and_grouped():
    tok = byte_tokenizer()
    hay = Haystack([TEXT], tok, half="train")
    a, meta = niah_dataset("mk_niah", 8, 900, [0.1, 0.7], tok, hay, seed=3)
    b, _ = niah_dataset("mk_niah", 8, 900, [0.1, 0.7], tok, hay, seed=3)
    c, _ = niah_dataset("mk_niah", 8, 900, [0.1, 0.7], tok, hay, seed=4)
    assert a.input_ids.shape == (8, 900)
    assert torch.equal(a.input_ids, b.input_ids) and not torch.equal(a.input_ids, c.input_ids)
    assert [m["depth"] for m in meta] == [0.1, 0.7] * 4
    groups = group_rows(meta)
    assert sorted(groups) == ["900@0.1", "900@0.7"] and groups["900@0.1"].tolist() == [0, 2, 4, 6]
    answers = [m["answer"] for m in meta]
    assert len(set(answers)) > 1  # the gold letter is not always the same


def test_haystack_halves_are_disjoint():
    tok = byte_tokenizer()
    tr, te = Haystack([TEXT], tok, half="train"), Haystack([TEXT], tok, half="test")
    full = tok.encode(TEXT, add_special_tokens=False)
    assert tr.docs[0] + te.docs[0] == full


@pytest.mark.slow
@pytest.mark.skipif(
    not (corpora.AUSTEN_DIR / "Rdata.rdb").is_file() or importlib.util.find_spec("rdata") is None,
    reason="r-cran-janeaustenr or rdata not installed",
)
def test_real_haystacks_from_austen_and_wikipedia():
    novels = corpora.austen_novels()
    assert [n.title for n in novels] == list(corpora.AUSTEN_NOVELS)
    pp = novels[4].text
    assert pp.startswith("PRIDE AND PREJUDICE") and "It is a truth universally acknowledged" in pp
    assert 600_000 < len(pp) < 800_000
    wiki = corpora.wikipedia_articles(min_chars=50_000)
    assert len(wiki) >= 15 and all("[[" not in w.text[:2000] for w in wiki)
    assert wiki[0].title == "Anarchism" and "political philosophy" in wiki[0].text[:300]
