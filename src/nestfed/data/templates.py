"""Prompt formats for instruction records: how an (instruction, input, output) record becomes tokens
to train on (the loss on the response only) and a prompt to generate from, the same at training
and at evaluation (``data.template``, recorded with the run's config).

- ``alpaca``: Stanford Alpaca's prompt (``### Instruction:`` / ``### Input:`` / ``### Response:``;
  nestfed.data.tasks.alpaca_prompt), then the response and EOS.
- ``chat``: the tokenizer's own chat template (``tokenizer.apply_chat_template``): a user turn
  holding the instruction (and the input after a blank line), then the assistant turn holding the
  response; the labels are the assistant turn's tokens as the template writes them (its end-of-turn
  marker included), so the ids are exactly the template's (tested against apply_chat_template).
  A chat model (SmolLM2-135M-Instruct) is trained and asked as it was tuned.
- ``flowertune``: FlowerTune's (Flower's ``flwr new`` FlowerTune template, ``dataset.py``):
  ``<preamble>\\n### Instruction:\\n<instruction>\\n### Response: <response>``, the input appended
  to the instruction after a space, then EOS.

Long rows: for ``alpaca`` and ``flowertune`` the response loses its end first (keeping at least one
token) and a prompt that alone is too long is cut from the left after the BOS; for ``chat`` the
user content is cut (from its end) until the response keeps its whole turn or half the row, so
the template's frame stays whole.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from nestfed.config.schema import TEMPLATES
from nestfed.data.tasks import IGNORE_INDEX, TokenDataset, _bos, _encode, _eos_id, _field, _pad, _pad_id, alpaca_prompt

log = logging.getLogger(__name__)

FLOWERTUNE_PREAMBLE = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."
)


def flowertune_prompt(instruction: str, input: str = "") -> str:
    """FlowerTune's prompt up to ``### Response:`` (its response follows after a space).

    Args:
        instruction: the record's instruction.
        input: its context (may be empty).

    Returns:
        The prompt text.
    """
    text = instruction + (" " + input if input.strip() else "")
    return f"{FLOWERTUNE_PREAMBLE}\n### Instruction:\n{text}\n### Response:"


def _user(instruction: str, input: str) -> str:
    return instruction + ("\n\n" + input if input.strip() else "")


def _chat(tokenizer, user: str, output: str | None) -> list[int]:
    """The chat template's tokens: the user turn and the generation prompt (output None), or the
    whole exchange."""
    messages = [{"role": "user", "content": user}]
    if output is None:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": output}], tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_template(tokenizer, template: str) -> None:
    """Check that a template is known and the tokenizer can render it.

    Args:
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        template: ``alpaca``, ``chat`` or ``flowertune`` (``data.template``).

    Raises:
        ValueError: naming ``data.template`` when the template is unknown or the tokenizer cannot
            render it (``chat`` without a chat template).
    """
    if template not in TEMPLATES:
        raise ValueError(f"data.template: unknown template '{template}' (known: {', '.join(TEMPLATES)})")
    if template == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ValueError("data.template: 'chat' needs a tokenizer with a chat template; this model's has none")


def prompt_ids(tokenizer, template: str, instruction: str, input: str = "") -> list[int]:
    """The prompt a model answers.

    It starts with BOS where the tokenizer puts one; for ``chat`` it is the template's generation
    prompt.

    Args:
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        template: ``alpaca``, ``chat`` or ``flowertune`` (``data.template``).
        instruction: the record's instruction.
        input: its context (may be empty).

    Returns:
        The prompt's token ids.

    Raises:
        ValueError: as `check_template` raises it.
    """
    check_template(tokenizer, template)
    if template == "chat":
        return _chat(tokenizer, _user(instruction, input), None)
    text = alpaca_prompt(instruction, input) if template == "alpaca" else flowertune_prompt(instruction, input)
    return _bos(tokenizer) + _encode(tokenizer, [text])[0]


def example_text(tokenizer, template: str, instruction: str, input: str, output: str) -> str:
    """One record's whole exchange as text in ``template``.

    The prompt, then the response (the chat template's turns with their markers), for text that is
    read rather than trained on response-only: FedSLM's server text (nestfed.data.held_out).

    Args:
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        template: ``alpaca``, ``chat`` or ``flowertune`` (``data.template``).
        instruction: the record's instruction.
        input: its context (may be empty).
        output: its response.

    Returns:
        The text.

    Raises:
        ValueError: as `check_template` raises it.
    """
    check_template(tokenizer, template)
    if template == "chat":
        messages = [{"role": "user", "content": _user(instruction, input)}, {"role": "assistant", "content": output}]
        return tokenizer.apply_chat_template(messages, tokenize=False)
    if template == "alpaca":
        return alpaca_prompt(instruction, input) + output
    return flowertune_prompt(instruction, input) + " " + output


def example_row(
    tokenizer, template: str, instruction: str, input: str, output: str, max_length: int
) -> tuple[list[int], list[int]]:
    """The ids and labels of one record, at most ``max_length`` tokens (module docstring).

    Args:
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        template: ``alpaca``, ``chat`` or ``flowertune`` (``data.template``).
        instruction: the record's instruction.
        input: its context (may be empty).
        output: its response.
        max_length: the most tokens in the row.

    Returns:
        The ids and the labels (IGNORE_INDEX on the prompt).

    Raises:
        ValueError: as `check_template` raises it, or when the chat template does not render
            the prompt as the exchange's prefix.
    """
    check_template(tokenizer, template)
    if template == "chat":
        return _chat_row(tokenizer, _user(instruction, input), output, max_length)
    prompt = prompt_ids(tokenizer, template, instruction, input)
    bos = len(_bos(tokenizer))
    response = _encode(tokenizer, [output if template == "alpaca" else " " + output])[0] + [_eos_id(tokenizer)]
    if len(prompt) > max_length - 1:
        prompt = prompt[:bos] + prompt[len(prompt) - max(max_length - 1 - bos, 0) :]
    response = response[: max(1, max_length - len(prompt))]
    return prompt + response, [IGNORE_INDEX] * len(prompt) + response


def _chat_row(tokenizer, user: str, output: str, max_length: int) -> tuple[list[int], list[int]]:
    prompt = _chat(tokenizer, user, None)
    answer = len(_chat(tokenizer, user, output)) - len(prompt)  # the assistant turn's tokens
    room = max(1, min(answer, max_length // 2))  # what the response keeps when the row is too long
    content = _encode(tokenizer, [user])[0]
    for _ in range(4):  # cut the user content until the prompt leaves the response its room
        over = len(prompt) + room - max_length
        if over <= 0 or not content:
            break
        content = content[: max(len(content) - over - 2, 0)]
        user = tokenizer.decode(content)
        prompt = _chat(tokenizer, user, None)
    full = _chat(tokenizer, user, output)
    if full[: len(prompt)] != prompt:
        raise ValueError("data.template: the chat template does not write the prompt as the exchange's beginning")
    response = full[len(prompt) :][: max(1, max_length - len(prompt))]
    return prompt + response, [IGNORE_INDEX] * len(prompt) + response


def instruction_examples(items: Sequence, tokenizer, max_length: int, template: str = "alpaca") -> TokenDataset:
    """Tokenise instruction records in ``template`` for supervised fine-tuning.

    The loss is on the response only. Rows are `example_row`'s; one warning says how many
    responses ``max_length`` cut (`warn_truncated`).

    Args:
        items: nestfed.data.corpora.InstructionExample records, or mappings with ``instruction``,
            ``input``, ``output``.
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        max_length: the most tokens per row.
        template: ``alpaca``, ``chat`` or ``flowertune`` (``data.template``).

    Returns:
        input_ids and labels [N, T], T the longest row (<= max_length), right-padded.

    Raises:
        ValueError: for max_length < 2, a record lacking a field, a tokenizer without eos, or as
            `check_template` raises it.
    """
    if max_length < 2:
        raise ValueError(f"instruction_examples: max_length must be >= 2, got {max_length}")
    fields = [(_field(it, "instruction"), _field(it, "input", ""), _field(it, "output")) for it in items]
    rows = [example_row(tokenizer, template, *f, max_length) for f in fields]
    warn_truncated(rows, [example_row(tokenizer, template, *f, 1 << 30) for f in fields], max_length)
    return _pad(rows, _pad_id(tokenizer))


def truncation_counts(
    rows: Sequence[tuple[list[int], list[int]]], whole: Sequence[tuple[list[int], list[int]]]
) -> dict[str, int]:
    """How ``max_length`` cut instruction rows, against the same records untruncated.

    Args:
        rows: the (ids, labels) rows as cut.
        whole: the same records' rows uncut.

    Returns:
        ``rows``; ``cut``: rows whose response lost its end, its EOS with it (the model never learns
            to stop there); ``one_token``: rows left with a single labelled token; ``longest``:
            tokens of the longest whole row.
    """
    labelled = [sum(t != IGNORE_INDEX for t in labels) for _, labels in rows]
    full = [sum(t != IGNORE_INDEX for t in labels) for _, labels in whole]
    return {
        "rows": len(rows),
        "cut": sum(a < b for a, b in zip(labelled, full)),
        "one_token": sum(a <= 1 < b for a, b in zip(labelled, full)),
        "longest": max((len(ids) for ids, _ in whole), default=0),
    }


def warn_truncated(rows, whole, max_length: int) -> None:
    """Log one warning with `truncation_counts` when ``max_length`` cut any response.

    Args:
        rows (Sequence[tuple[list[int], list[int]]]): the (ids, labels) rows as cut.
        whole (Sequence[tuple[list[int], list[int]]]): the same records' rows uncut.
        max_length: the length they were cut to (``data.block_size``).
    """
    n = truncation_counts(rows, whole)
    if n["cut"]:
        log.warning(
            "data.block_size = %d: %d of %d instruction rows lost the end of their response (EOS included), "
            "%d of them keep one labelled token; the longest row has %d tokens (raise data.block_size)",
            max_length,
            n["cut"],
            n["rows"],
            n["one_token"],
            n["longest"],
        )
