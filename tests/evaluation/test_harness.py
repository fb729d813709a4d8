"""FlowerTune's General-NLP protocol through lm-eval (nestfed.evaluation.harness) against a direct
reference: the same prompts through transformers and PEFT by hand, question by question."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nestfed.data.mmlu_domains import DOMAINS
from nestfed.errors import ConfigError
from nestfed.evaluation import harness
from tests.tiny_eval import save_tiny, write_mmlu

pytest.importorskip("lm_eval")


def test_prompt_is_flowertunes_format():
    text = harness.prompt("What is 2 + 2", ("3", "4", "5", "6"))
    assert text == (
        "<|im_start|>question\nAnswer the following multiple choice question.\n"
        "Question: What is 2 + 2?\n\nOptions:\nA. 3\nB. 4\nC. 5\nD. 6\nThe answer is:\n"
        "<|im_end|>\n<|im_start|>answer\n"
    )
    assert "Question: Why?\n" in harness.prompt("Why?", ("a", "b", "c", "d"))
    assert "Question: Pick one.\n" in harness.prompt("Pick one.", ("a", "b", "c", "d"))


@pytest.mark.parametrize(
    "output, expected",
    [
        ("A", "a"),
        (" b.", "b"),
        ("(D)", "d"),
        ("C is right", "c"),
        ("\n## B\nbecause", "b"),
        ("The answer", "the answer"),
        ("", ""),
        ("é", "é"),
        ("42", "42"),
        ("e", "e"),
    ],
)
def test_extract_answer_as_flowertune_does(output, expected):
    assert harness.extract_answer(output) == expected


def test_categories_are_flowertunes_three_groups_of_real_subjects():
    known = {s for subjects in DOMAINS.values() for s in subjects} | {"professional_accounting"}
    sizes = {c: len(s) for c, s in harness.CATEGORIES.items()}
    assert sizes == {"stem": 19, "social_sciences": 12, "humanities": 13}
    every = [s for subjects in harness.CATEGORIES.values() for s in subjects]
    assert len(every) == len(set(every)) and set(every) <= known


def _items(n_per_subject: dict[str, int]):
    from nestfed.data.corpora import MultipleChoice

    return [
        MultipleChoice(f"{s} q{i}", ("w", "x", "y", "z"), i % 4, s) for s, n in n_per_subject.items() for i in range(n)
    ]


def test_sample_keeps_every_subject_in_proportion_and_is_seeded():
    items = _items({"anatomy": 10, "sociology": 5, "philosophy": 1})
    half = harness.sample_subjects(items, 0.5, seed=3)
    counts = {s: sum(x.subject == s for x in half) for s in ("anatomy", "sociology", "philosophy")}
    assert counts == {"anatomy": 5, "sociology": 3, "philosophy": 1}
    assert half == harness.sample_subjects(items, 0.5, seed=3)
    assert half != harness.sample_subjects(items, 0.5, seed=4)
    assert [items.index(x) for x in half] == sorted(items.index(x) for x in half)
    assert harness.sample_subjects(items, 1.0, seed=0) == items
    for bad in (0.0, 1.5, -1):
        with pytest.raises(ConfigError, match="--fraction"):
            harness.sample_subjects(items, bad, seed=0)


def reference(base: Path, adapter: Path | None, items, quantization=None) -> dict[str, list[str]]:
    """Each question's predicted letter by hand: greedy next token decoded and extracted
    (generation), and the letter whose byte token has the highest logit (log-likelihood); on the
    base loaded with ``quantization`` (BitsAndBytesConfig keyword arguments) when given."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    tok = AutoTokenizer.from_pretrained(base)
    quantized = {"quantization_config": BitsAndBytesConfig(**quantization), "device_map": "cpu"} if quantization else {}
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **quantized)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    letters = [tok.convert_tokens_to_ids(c) for c in harness.LETTERS]
    gen, loglik = [], []
    for x in items:
        ids = torch.tensor([tok.encode(harness.prompt(x.question, x.choices))])
        with torch.no_grad():
            last = model(input_ids=ids).logits[0, -1]
        gen.append(harness.extract_answer(tok.decode([int(last.argmax())], skip_special_tokens=True)))
        loglik.append(harness.LETTERS[int(last[letters].argmax())].lower())
    return {"generation": gen, "loglik": loglik}


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    base, adapter = save_tiny(root)
    # gold answers: the adapter's own log-likelihood choice, so the adapter scores 100% there
    items = harness.questions(harness.Protocol(str(write_mmlu(root / "mmlu0", n=1))))
    flat = [x for c in harness.CATEGORIES for x in items[c]]
    preds = reference(base, adapter, flat)["loglik"]
    answers: dict[str, list[int]] = {}
    for x, p in zip(flat, preds):
        answers.setdefault(x.subject, []).append("abcd".index(p))
    mmlu = write_mmlu(root / "mmlu", n=1, answers=answers)
    return base, adapter, mmlu


@pytest.mark.slow
def test_lm_eval_scores_equal_the_reference_with_and_without_the_adapter(tiny_setup):
    base, adapter, mmlu = tiny_setup
    protocol = harness.Protocol(str(mmlu), batch_size=4)
    items = harness.questions(protocol)
    flat = [x for c in harness.CATEGORIES for x in items[c]]
    ref_base, ref_adapter = reference(base, None, flat), reference(base, adapter, flat)
    assert ref_base["loglik"] != ref_adapter["loglik"]  # the adapter changes the answers
    totals = {}
    for adapter_dir, ref in ((None, ref_base), (adapter, ref_adapter)):
        scored = harness.evaluate(base, adapter_dir, protocol, items)
        for scoring in harness.SCORINGS:
            expected = [int(p == harness.LETTERS[x.answer].lower()) for x, p in zip(flat, ref[scoring])]
            got = [v for c in harness.CATEGORIES for v in scored[scoring][c]]
            assert got == expected, (adapter_dir, scoring)
            totals[adapter_dir, scoring] = sum(got)
    assert totals[adapter, "loglik"] == len(flat)  # the adapter's log-likelihood picks are the gold answers
    assert totals[None, "loglik"] < len(flat)


def test_bad_directories_are_one_line_errors(tmp_path, tiny_setup):
    base, adapter, mmlu = tiny_setup
    protocol = harness.Protocol(str(mmlu))
    with pytest.raises(ConfigError, match="not a Hugging Face model directory"):
        harness.evaluate(tmp_path, None, protocol)
    with pytest.raises(ConfigError, match="not a PEFT adapter directory"):
        harness.evaluate(base, tmp_path, protocol)
    with pytest.raises(ConfigError, match="unknown astrology"):
        harness.questions(harness.Protocol(str(mmlu), categories=("astrology",)))


@pytest.mark.slow
def test_lm_eval_on_a_4bit_base_scores_what_that_base_answers(tiny_setup):
    """``nestfed eval --quantization 4``: lm-eval scores the adapter over the nf4 base (transformers'
    BitsAndBytesConfig, as FlowerTune's leaderboard) exactly as the same base answers by hand."""
    pytest.importorskip("bitsandbytes")
    from nestfed.config import ModelConfig
    from nestfed.nn.quantization import bnb_config

    base, adapter, mmlu = tiny_setup
    protocol = harness.Protocol(str(mmlu), batch_size=4, device="cpu", quantization=harness.quantization_name("4"))
    assert protocol.quantization == "nf4"
    lm = harness.lm_model(base, adapter, protocol)
    assert any(type(m).__name__ == "Linear4bit" for m in lm.model.modules())
    items = harness.questions(protocol)
    flat = [x for c in harness.CATEGORIES for x in items[c]]
    ref = reference(base, adapter, flat, bnb_config(ModelConfig(quantization="nf4", device="cpu")))
    scored = harness.evaluate(base, adapter, protocol, items)
    for scoring in harness.SCORINGS:
        expected = [int(p == harness.LETTERS[x.answer].lower()) for x, p in zip(flat, ref[scoring])]
        assert [v for c in harness.CATEGORIES for v in scored[scoring][c]] == expected, scoring
    with pytest.raises(ConfigError, match="--quantization: '3' is not 4, 8 or none"):
        harness.quantization_name("3")
