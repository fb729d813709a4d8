"""Token datasets: packing, instruction masking, multiple-choice answer scoring."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nestfed.data.corpora import InstructionExample, MultipleChoice
from nestfed.data.tasks import (
    IGNORE_INDEX,
    TokenDataset,
    alpaca_prompt,
    answer_positions,
    bos_id,
    choice_logits,
    letter_token_ids,
    mc_prompt,
    multiple_choice_examples,
    pack_causal_lm,
)
from nestfed.data.templates import instruction_examples
from nestfed.nn.backbone import byte_tokenizer

SMOLLM2_TOKENIZER = Path.home() / ".cache" / "nestfed" / "smollm2-135m-instruct" / "tokenizer.json"


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


class CountingTokenizer:
    """Delegates to a real tokenizer and records every text it was asked to encode."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __call__(self, texts, **kw):
        self.seen.extend(texts)
        return self.inner(texts, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


# ----------------------------------------------------------------------------- TokenDataset


def test_token_dataset_validation_and_subset():
    ds = TokenDataset(torch.arange(12).reshape(4, 3), torch.arange(12).reshape(4, 3) + 100)
    assert len(ds) == 4
    sub = ds.subset([3, 1])
    assert sub.input_ids.tolist() == [[9, 10, 11], [3, 4, 5]]
    assert sub.labels.tolist() == [[109, 110, 111], [103, 104, 105]]
    assert ds[2]["labels"].tolist() == [106, 107, 108]
    with pytest.raises(ValueError, match="differ in shape"):
        TokenDataset(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="int64"):
        TokenDataset(torch.zeros(2, 3), torch.zeros(2, 3))


# ----------------------------------------------------------------------------- causal LM


def test_pack_causal_lm_blocks(tok):
    eos = tok.eos_token_id
    ds = pack_causal_lm(["abc", "de"], tok, block_size=3)
    stream = _ids(tok, "abc") + [eos] + _ids(tok, "de") + [eos]  # 7 tokens -> 2 blocks
    assert ds.input_ids.shape == (2, 3)
    assert ds.input_ids.flatten().tolist() == stream[:6]
    assert torch.equal(ds.labels, ds.input_ids)
    assert pack_causal_lm(["abc", "de"], tok, block_size=3, max_blocks=1).input_ids.tolist() == [stream[:3]]
    assert pack_causal_lm(["ab"], tok, block_size=8).input_ids.shape == (0, 8)
    with pytest.raises(ValueError):
        pack_causal_lm(["ab"], tok, block_size=0)


def test_pack_causal_lm_stops_tokenizing_early(tok):
    counting = CountingTokenizer(tok)
    texts = ["x" * 50] * 10
    ds = pack_causal_lm(texts, counting, block_size=16, max_blocks=2, batch_size=1)
    assert ds.input_ids.shape == (2, 16)
    assert len(counting.seen) == 1  # 51 tokens from the first text already fill 2 blocks


def test_blocks_and_rows_start_with_the_bos_the_tokenizer_adds(tok):
    """A tokenizer that puts BOS before every text (Gemma's; here the byte tokenizer with <bos>):
    every packed block starts with it, then block_size - 1 tokens of the same stream; instruction
    and multiple-choice rows start with it too, unlabelled. A tokenizer that only defines a BOS
    (SmolLM2's <|im_start|>) or has none gets exactly the rows it got before."""
    gemma_like = byte_tokenizer(bos=True)
    bos = gemma_like.bos_token_id
    assert bos_id(gemma_like) == bos == 258 and gemma_like("ab")["input_ids"] == [bos, *_ids(tok, "ab")]
    eos = tok.eos_token_id
    stream = _ids(tok, "abc") + [eos] + _ids(tok, "de") + [eos]  # 7 tokens -> 3 blocks of BOS + 2
    ds = pack_causal_lm(["abc", "de"], gemma_like, block_size=3)
    assert ds.input_ids.tolist() == [[bos, *stream[0:2]], [bos, *stream[2:4]], [bos, *stream[4:6]]]
    assert torch.equal(ds.labels, ds.input_ids)
    with pytest.raises(ValueError, match=">= 2"):
        pack_causal_lm(["ab"], gemma_like, block_size=1)
    item = InstructionExample("Hi.", "", "abcdefghij", "")
    plain, with_bos = instruction_examples([item], tok, 20), instruction_examples([item], gemma_like, 20)
    assert with_bos.input_ids[0].tolist() == [bos, *plain.input_ids[0, 1:].tolist()]  # the prompt cut after BOS
    assert with_bos.labels[0, 0] == IGNORE_INDEX and _labelled_text(tok, with_bos, 0) == "a"
    mc = multiple_choice_examples(ITEMS, gemma_like, max_length=256)
    assert mc.input_ids[:, 0].tolist() == [bos, bos]
    assert torch.equal(mc.input_ids[:, 1:], multiple_choice_examples(ITEMS, tok, 256).input_ids)
    defines_only = byte_tokenizer()
    defines_only.bos_token = "<eos>"  # a BOS id the tokenizer never puts before a text
    assert defines_only.bos_token_id is not None and bos_id(defines_only) is None and bos_id(tok) is None
    assert torch.equal(
        pack_causal_lm(["abc", "de"], defines_only, 3).input_ids, pack_causal_lm(["abc", "de"], tok, 3).input_ids
    )


@pytest.mark.skipif(not SMOLLM2_TOKENIZER.is_file(), reason="converted SmolLM2 tokenizer not cached")
def test_smollm2_defines_a_bos_it_never_adds():
    from transformers import AutoTokenizer

    st = AutoTokenizer.from_pretrained(SMOLLM2_TOKENIZER.parent)
    assert st.bos_token_id == 1 and st("Hello world")["input_ids"] == _ids(st, "Hello world")
    assert bos_id(st) is None  # so SmolLM2's blocks, and the adapters pinned on them, are unchanged


# ----------------------------------------------------------------------------- instructions


def _labelled_text(tok, ds, row):
    return tok.decode(ds.input_ids[row][ds.labels[row] != IGNORE_INDEX])


def test_instruction_examples_mask_exactly_the_response(tok):
    items = [
        InstructionExample("Add the numbers.", "2 and 3", "5", ""),
        InstructionExample("Say hello politely.", "", "Hello, nice to meet you.", ""),
    ]
    ds = instruction_examples(items, tok, max_length=512)
    lengths = []
    for r, it in enumerate(items):
        prompt = alpaca_prompt(it.instruction, it.input)
        n_prompt = len(_ids(tok, prompt))
        n_resp = len(_ids(tok, it.output)) + 1
        lengths.append(n_prompt + n_resp)
        assert _labelled_text(tok, ds, r) == it.output + "<eos>"
        assert (ds.labels[r, :n_prompt] == IGNORE_INDEX).all()
        assert tok.decode(ds.input_ids[r, :n_prompt]) == prompt
        assert (ds.labels[r, n_prompt : n_prompt + n_resp] == ds.input_ids[r, n_prompt : n_prompt + n_resp]).all()
        assert (ds.input_ids[r, lengths[-1] :] == tok.pad_token_id).all()
        assert (ds.labels[r, lengths[-1] :] == IGNORE_INDEX).all()
    assert ds.input_ids.shape == (2, max(lengths))
    assert "### Input:\n2 and 3\n\n### Response:\n" in alpaca_prompt("x", "2 and 3")
    assert "### Input" not in alpaca_prompt("Say hello politely.", "")
    assert alpaca_prompt("Q", "").endswith("### Instruction:\nQ\n\n### Response:\n")


def test_instruction_examples_truncation(tok):
    item = InstructionExample("Hi.", "", "abcdefghij", "")
    n_prompt = len(_ids(tok, alpaca_prompt("Hi.")))
    ds = instruction_examples([item], tok, max_length=n_prompt + 4)
    assert ds.input_ids.shape == (1, n_prompt + 4)
    assert _labelled_text(tok, ds, 0) == "abcd"  # response end (and eos) cut first
    tiny = instruction_examples([item], tok, max_length=20)
    assert tiny.input_ids.shape == (1, 20)
    assert _labelled_text(tok, tiny, 0) == "a"  # one response token kept
    assert tok.decode(tiny.input_ids[0, :19]) == alpaca_prompt("Hi.")[-19:]  # prompt cut from the left


# ----------------------------------------------------------------------------- multiple choice


ITEMS = [
    MultipleChoice("What is 2+2?", ("3", "4", "5", "6"), 1, "math"),
    MultipleChoice("Largest planet?", ("Mars", "Venus", "Jupiter", "Earth"), 2, "astronomy"),
]


def test_letter_token_ids_byte_tokenizer(tok):
    ids = letter_token_ids(tok)
    assert [tok.decode([i]) for i in ids] == ["A", "B", "C", "D"]


@pytest.mark.skipif(not SMOLLM2_TOKENIZER.is_file(), reason="converted SmolLM2 tokenizer not cached")
def test_letter_token_ids_smollm2():
    from transformers import PreTrainedTokenizerFast

    st = PreTrainedTokenizerFast(tokenizer_file=str(SMOLLM2_TOKENIZER))
    ids = letter_token_ids(st)
    assert [st.decode([i]) for i in ids] == [" A", " B", " C", " D"]


class SplitATokenizer:
    """Character tokenizer that spells the letter 'A' with two tokens."""

    eos_token_id = pad_token_id = 0

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[t for ch in s for t in ((65, 65) if ch == "A" else (ord(ch),))] for s in texts]}


def test_letter_token_ids_rejects_multi_token_letters():
    with pytest.raises(ValueError, match="'A'.*not a single token"):
        letter_token_ids(SplitATokenizer())


def test_multiple_choice_examples(tok):
    ds = multiple_choice_examples(ITEMS, tok, max_length=256)
    pos = answer_positions(ds.labels)
    letters = letter_token_ids(tok)
    for r, it in enumerate(ITEMS):
        labelled = (ds.labels[r] != IGNORE_INDEX).nonzero().flatten().tolist()
        assert labelled == [int(pos[r]) + 1]
        assert int(ds.labels[r, labelled[0]]) == letters[it.answer]
        assert (
            tok.decode(ds.input_ids[r, : labelled[0] + 1])
            == mc_prompt(it.question, it.choices) + " " + "ABCD"[it.answer]
        )
    assert mc_prompt("q", ("a", "b", "c", "d")) == "Question: q\nA. a\nB. b\nC. c\nD. d\nAnswer:"
    short = multiple_choice_examples(ITEMS[:1], tok, max_length=12)
    assert short.input_ids.shape == (1, 12)
    assert tok.decode(short.input_ids[0]) == " 6\nAnswer: B"  # prompt cut from the left
    assert answer_positions(short.labels).tolist() == [10]


def test_answer_positions_and_choice_logits():
    letters = [5, 6, 7, 8]
    labels = torch.full((2, 5), IGNORE_INDEX)
    labels[0, 3] = 6  # gold B, predicted from logits[0, 2]
    labels[1, 4] = 8  # gold D, predicted from logits[1, 3]
    assert answer_positions(labels).tolist() == [2, 3]
    logits = torch.randn(2, 5, 10, generator=torch.Generator().manual_seed(0)) * 100
    logits[0, 2, letters] = torch.tensor([0.0, 5.0, 1.0, 2.0])
    logits[1, 3, letters] = torch.tensor([-1.0, -2.0, -3.0, 4.0])
    out = choice_logits(logits, labels, letters)
    assert out.tolist() == [[0.0, 5.0, 1.0, 2.0], [-1.0, -2.0, -3.0, 4.0]]
    assert out.argmax(-1).tolist() == [1, 3]
    with pytest.raises(ValueError, match="must be"):
        choice_logits(logits[:, :4], labels, letters)


def test_answer_positions_errors():
    none = torch.full((2, 4), IGNORE_INDEX)
    none[0, 2] = 1
    with pytest.raises(ValueError, match="row 1 has 0 labelled"):
        answer_positions(none)
    two = torch.full((1, 4), IGNORE_INDEX)
    two[0, 1] = two[0, 2] = 1
    with pytest.raises(ValueError, match="row 0 has 2 labelled"):
        answer_positions(two)
    first = torch.full((1, 4), IGNORE_INDEX)
    first[0, 0] = 1
    with pytest.raises(ValueError, match="position 0"):
        answer_positions(first)
