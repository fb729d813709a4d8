"""Scores of generated answers on fixed strings: ROUGE-L by hand, SQuAD's exact match, the
verbaliser's reading, and a run holding both kinds of record."""

import pytest

from nestfed.evaluation.text_scores import answer_scores, exact_match, mean_scores, normalise, rouge_l, verbalised

TOPICS = ("business", "entertainment", "politics", "sport", "tech")


def test_rouge_l_by_hand():
    # LCS of "the cat on the mat" in "the cat sat on the mat" is all 5 answer tokens:
    # P = 5/5, R = 5/6, F = 2PR / (P + R) = 10/11
    assert rouge_l("the cat on the mat", "the cat sat on the mat") == pytest.approx(10 / 11)
    assert rouge_l("Markets rally", "Markets rally") == 1.0
    assert rouge_l("", "Markets rally") == 0.0
    assert rouge_l("rallying markets", "markets rally") == pytest.approx(0.5)  # stemmed: LCS 1 of 2 and 2


def test_exact_match_normalises_as_squad():
    assert normalise("  The Markets, rally!  ") == "markets rally"
    assert exact_match("the Markets rally.", "Markets  rally") == 1.0
    assert exact_match("Markets fall", "Markets rally") == 0.0


def test_the_verbaliser_reads_the_first_label_named():
    assert verbalised("It is about Sport, not tech.", TOPICS) == "sport"
    assert verbalised("technology", TOPICS) is None  # whole words only
    assert verbalised("no idea", TOPICS) is None


def test_each_record_is_scored_by_its_kind():
    topic = answer_scores("Politics.", "politics", TOPICS)
    head = answer_scores("Markets rally", "Markets rally again", TOPICS)
    assert topic == {"accuracy": 1.0} and set(head) == {"rouge_l", "exact_match"}
    assert answer_scores("tech", "sport", TOPICS) == {"accuracy": 0.0}
    m = mean_scores([topic, head, answer_scores("sport", "tech", TOPICS)])
    assert m["accuracy"] == 0.5 and m["answers:accuracy"] == 2 and m["answers"] == 3
    assert m["rouge_l"] == head["rouge_l"] and m["answers:rouge_l"] == 1
