"""Scores of generated answers against references: ROUGE-L, exact match and a verbaliser's
accuracy, per answer, then their means.

- ROUGE-L F-measure (Lin 2004): Google's ``rouge-score`` package (``RougeScorer(["rougeL"],
  use_stemmer=True)``, Porter stemming, its own tokenisation), as PreLort's and most instruction-
  tuning papers report it on Dolly and Alpaca; in [0, 1].
- Exact match: the answer and the reference equal after SQuAD's normalisation (Rajpurkar et al.
  2016, its evaluation script: lower case, punctuation and the articles a / an / the dropped,
  whitespace collapsed); 0 or 1.
- Verbaliser accuracy (classification as instruction): the label the answer names -- the
  verbaliser word that occurs first in it (whole word, case-insensitive), None when it names
  none -- equal to the reference's; 0 or 1. A record whose reference is a verbaliser label is
  scored by accuracy only, any other by ROUGE-L and exact match, so one run may hold both kinds.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from functools import lru_cache

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalise(text: str) -> str:
    """SQuAD's answer normalisation (module docstring).

    Args:
        text: an answer or reference.

    Returns:
        The normalised text.
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


@lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(answer: str, reference: str) -> float:
    """ROUGE-L F-measure of an answer against its reference (module docstring).

    Args:
        answer: the generated answer.
        reference: the reference answer.

    Returns:
        The F-measure in [0, 1].
    """
    return float(_scorer().score(reference, answer)["rougeL"].fmeasure)


def exact_match(answer: str, reference: str) -> float:
    """Whether the answer equals the reference after `normalise`.

    Args:
        answer: the generated answer.
        reference: the reference answer.

    Returns:
        1.0 or 0.0.
    """
    return float(normalise(answer) == normalise(reference))


def verbalised(answer: str, verbaliser: Sequence[str]) -> str | None:
    """The verbaliser label the answer names first (whole word, case-insensitive).

    Args:
        answer: the text to read.
        verbaliser: the labels.

    Returns:
        The label, or None when it names none.
    """
    best, at = None, len(answer) + 1
    for label in verbaliser:
        m = re.search(rf"\b{re.escape(label)}\b", answer, flags=re.IGNORECASE)
        if m is not None and m.start() < at:
            best, at = label, m.start()
    return best


def answer_scores(answer: str, reference: str, verbaliser: Sequence[str] = ()) -> dict[str, float]:
    """The scores of one answer.

    Args:
        answer: the generated answer.
        reference: the reference answer.
        verbaliser: the labels of classification records; empty for none.

    Returns:
        ``accuracy`` when the reference is one of the verbaliser's labels (a classification record),
            else ``rouge_l`` and ``exact_match`` (a generation record).
    """
    if verbaliser and normalise(reference) in {normalise(v) for v in verbaliser}:
        return {"accuracy": float(verbalised(answer, verbaliser) == verbalised(reference, verbaliser))}
    return {"rouge_l": rouge_l(answer, reference), "exact_match": exact_match(answer, reference)}


def mean_scores(scores: Sequence[dict[str, float]]) -> dict[str, float]:
    """The mean of each score over the answers that have it.

    Args:
        scores: one dict per answer (`answer_scores`).

    Returns:
        Each score's mean, ``answers`` (all of them) and, per score, ``answers:<score>`` (how many
            had it).
    """
    out: dict[str, float] = {"answers": float(len(scores))}
    for k in sorted({k for s in scores for k in s}):
        vals = [s[k] for s in scores if k in s]
        out[k] = sum(vals) / len(vals)
        out[f"answers:{k}"] = float(len(vals))
    return out
