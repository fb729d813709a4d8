"""Prompt formats: the chat template's tokens exactly (against apply_chat_template), the loss on
the assistant turn only, FlowerTune's text, long inputs cut inside the frame, clear refusals."""

from pathlib import Path

import pytest

from nestfed.data.tasks import IGNORE_INDEX
from nestfed.data.templates import FLOWERTUNE_PREAMBLE, check_template, example_row, instruction_examples, prompt_ids
from nestfed.nn.backbone import byte_tokenizer

SMOLLM2 = Path.home() / ".cache" / "nestfed" / "smollm2-135m-instruct" / "tokenizer.json"


def tokenizers():
    out = [byte_tokenizer()]
    if SMOLLM2.is_file():
        from transformers import AutoTokenizer

        out.append(AutoTokenizer.from_pretrained(SMOLLM2.parent))
    return out


@pytest.mark.parametrize("tok", tokenizers(), ids=lambda t: type(t).__name__ + str(len(t)))
@pytest.mark.parametrize("input", ["", "The article text."])
def test_chat_rows_are_the_chat_templates_tokens(tok, input):
    user = "Write a headline." + ("\n\n" + input if input else "")
    ids, labels = example_row(tok, "chat", "Write a headline.", input, "Markets rally", 512)
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": "Markets rally"}]
    assert ids == list(tok.apply_chat_template(messages, tokenize=True)["input_ids"])  # token by token
    prompt = prompt_ids(tok, "chat", "Write a headline.", input)
    assert prompt == list(tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True)["input_ids"])
    assert ids[: len(prompt)] == prompt and labels[: len(prompt)] == [IGNORE_INDEX] * len(prompt)
    answer = tok.decode(ids[len(prompt) :], skip_special_tokens=True)
    assert labels[len(prompt) :] == ids[len(prompt) :] and answer.strip() == "Markets rally"


def test_flowertune_rows_are_flowertunes_text():
    tok = byte_tokenizer()
    ids, labels = example_row(tok, "flowertune", "Name the topic.", "An article.", "sport", 512)
    text = f"{FLOWERTUNE_PREAMBLE}\n### Instruction:\nName the topic. An article.\n### Response: sport<eos>"
    assert tok.decode(ids) == text
    assert tok.decode([x for x in labels if x != IGNORE_INDEX]) == " sport<eos>"


def test_alpaca_rows_are_the_default_and_unchanged():
    tok = byte_tokenizer()
    items = [{"instruction": "Add.", "input": "2 and 3", "output": "5"}]
    assert (
        instruction_examples(items, tok, 256).input_ids.tolist()
        == instruction_examples(items, tok, 256, "alpaca").input_ids.tolist()
    )
    ids, _ = example_row(tok, "alpaca", "Add.", "2 and 3", "5", 256)
    assert tok.decode(ids).endswith("### Input:\n2 and 3\n\n### Response:\n5<eos>")


def test_a_long_input_is_cut_inside_the_chat_frame():
    tok = byte_tokenizer()
    ids, labels = example_row(tok, "chat", "Summarise.", "word " * 200, "Short.", 120)
    text = tok.decode(ids)
    assert len(ids) <= 120 and text.startswith("<|im_start|>user\nSummarise.\n\nword word")
    assert "<eos>\n<|im_start|>assistant\n" in text
    assert sum(x != IGNORE_INDEX for x in labels) >= 1


def test_unknown_templates_and_chat_without_one_are_refused():
    tok = byte_tokenizer()
    with pytest.raises(ValueError, match="data.template: unknown template 'vicuna'"):
        check_template(tok, "vicuna")
    tok.chat_template = None
    with pytest.raises(ValueError, match="'chat' needs a tokenizer with a chat template"):
        example_row(tok, "chat", "a", "", "b", 64)


def test_rows_cut_past_their_response_are_counted_and_warned(caplog):
    """Byte tokenizer: one token per character, EOS added. Alpaca's prompt for "Say." with no input
    is P tokens; responses of 3, 20 and 60 characters at max_length P + 10 keep 4 (whole: 3 + EOS),
    10 and 10 labelled tokens: two rows lost their end, none is down to one token."""
    tok = byte_tokenizer()
    p = len(prompt_ids(tok, "alpaca", "Say.", ""))
    items = [{"instruction": "Say.", "input": "", "output": "x" * n} for n in (3, 20, 60)]
    with caplog.at_level("WARNING", logger="nestfed.data.templates"):
        ds = instruction_examples(items, tok, p + 10)
    assert [int((row != IGNORE_INDEX).sum()) for row in ds.labels] == [4, 10, 10]
    assert caplog.messages == [
        f"data.block_size = {p + 10}: 2 of 3 instruction rows lost the end of their response (EOS included), "
        f"0 of them keep one labelled token; the longest row has {p + 61} tokens (raise data.block_size)"
    ]
    caplog.clear()
    with caplog.at_level("WARNING", logger="nestfed.data.templates"):
        instruction_examples(items, tok, p + 1)  # every response down to its first token
        instruction_examples(items[:1], tok, p + 4)  # nothing cut: no warning
    assert len(caplog.messages) == 1 and "3 of 3 instruction rows" in caplog.messages[0]
    assert "3 of them keep one labelled token" in caplog.messages[0]
