"""Turn text records into tensors for causal-LM training and evaluation.

All builders return a `TokenDataset` whose ``labels`` follow the Hugging Face
convention: aligned with ``input_ids`` (same shape), ``-100`` where no loss is taken, and the
model shifts them itself (the loss at position t compares ``logits[t]`` with ``labels[t+1]``).
Padded rows are right-padded with the tokenizer's pad id (its eos id when it has none), so a
causal model needs no attention mask for the labelled positions. Every row and block starts with
the tokenizer's BOS token where the tokenizer itself puts one before a text (`bos_id`:
Gemma's; SmolLM2's defines ``<|im_start|>`` as BOS but never adds it, so its rows are unchanged).

- `pack_causal_lm`: plain language modelling on concatenated documents.
- instruction records: nestfed.data.templates (Alpaca, the tokenizer's chat template, FlowerTune),
  loss on the response only.
- `multiple_choice_examples`: MMLU-style prompts with one labelled answer-letter token,
  scored by `answer_positions` / `choice_logits` with `letter_token_ids`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

IGNORE_INDEX = -100
LETTERS = "ABCD"

ALPACA_PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)
MC_PROMPT = "Question: {question}\nA. {c0}\nB. {c1}\nC. {c2}\nD. {c3}\nAnswer:"


@dataclass
class TokenDataset:
    """Token ids and loss labels for a causal LM.

    The model shifts the labels itself: position t's logits predict labels[t + 1].

    Attributes:
        input_ids: [N, T] int64 token ids (N examples, T tokens).
        labels: [N, T] int64, aligned with input_ids, ``-100`` where no loss is taken.

    Raises:
        ValueError: when the two are not 2-D int64 tensors of the same shape.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        for name in ("input_ids", "labels"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.long:
                raise ValueError(
                    f"TokenDataset.{name} must be a 2-D int64 tensor, got "
                    f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}"
                )
        if self.input_ids.shape != self.labels.shape:
            raise ValueError(
                f"TokenDataset: input_ids {tuple(self.input_ids.shape)} and labels "
                f"{tuple(self.labels.shape)} differ in shape"
            )

    def __len__(self) -> int:
        """Number of examples N."""
        return int(self.input_ids.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """Example ``i`` as ``{"input_ids": [T], "labels": [T]}`` (DataLoader friendly)."""
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}

    def subset(self, idx: Sequence[int] | torch.Tensor) -> TokenDataset:
        """The examples at ``idx``, in that order, as a new TokenDataset (copied rows).

        Args:
            idx: row indices in 0..N-1.

        Returns:
            The subset.

        Raises:
            IndexError: for an index outside 0..N-1.
        """
        index = torch.as_tensor(list(idx) if not isinstance(idx, torch.Tensor) else idx, dtype=torch.long)
        index = index.reshape(-1)
        return TokenDataset(self.input_ids.index_select(0, index), self.labels.index_select(0, index))


# ----------------------------------------------------------------------------- helpers


def _encode(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


def bos_id(tokenizer) -> int | None:
    """The token every row should start with.

    ``tokenizer.bos_token_id`` when the tokenizer itself puts it before a text it encodes with
    special tokens (Gemma's tokenizer, which the model needs: Gemma-3-270M's perplexity on an
    English paragraph is 6.6 with it and 67 without).

    Args:
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.

    Returns:
        The BOS id, or None for a tokenizer without BOS or one that defines a BOS it never adds
            (SmolLM2's).
    """
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return int(bos) if ids and ids[0] == bos else None


def _bos(tokenizer) -> list[int]:
    """[BOS] where `bos_id` gives one, else []."""
    bos = bos_id(tokenizer)
    return [] if bos is None else [bos]


def _eos_id(tokenizer) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id")
    return int(eos)


def _pad_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither pad_token_id nor eos_token_id")
    return int(pad)


def _field(item, name: str, default: str | None = None) -> str:
    if isinstance(item, Mapping):
        value = item.get(name, default)
    else:
        value = getattr(item, name, default)
    if value is None:
        raise ValueError(f"record lacks the field '{name}'")
    return value


def _pad(rows: list[tuple[list[int], list[int]]], pad_id: int) -> TokenDataset:
    """Right-pad (ids, labels) pairs to the longest row: ids with pad_id, labels with -100."""
    width = max((len(ids) for ids, _ in rows), default=0)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for r, (ids, labs) in enumerate(rows):
        input_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[r, : len(labs)] = torch.tensor(labs, dtype=torch.long)
    return TokenDataset(input_ids, labels)


def concat_rows(parts: Sequence[TokenDataset], pad_id: int) -> TokenDataset:
    """The rows of ``parts`` one after another, right-padded to the widest.

    Args:
        parts: the datasets, in order.
        pad_id: the id ids are padded with (labels are padded with -100).

    Returns:
        The concatenated dataset.
    """
    width = max(p.input_ids.shape[1] for p in parts)
    ids = torch.cat([F.pad(p.input_ids, (0, width - p.input_ids.shape[1]), value=pad_id) for p in parts])
    labels = torch.cat([F.pad(p.labels, (0, width - p.labels.shape[1]), value=IGNORE_INDEX) for p in parts])
    return TokenDataset(ids, labels)


# ----------------------------------------------------------------------------- causal LM


def pack_causal_lm(
    texts: Sequence[str], tokenizer, block_size: int, max_blocks: int | None = None, batch_size: int = 64
) -> TokenDataset:
    """Pack documents into full blocks for language modelling.

    Each text is tokenised without special tokens and followed by eos; the streams are concatenated
    in order and cut into blocks of ``block_size`` tokens (``block_size - 1`` stream tokens after
    the BOS token where `bos_id` gives one: every block starts with it, as the model saw text
    in training); the incomplete last block is dropped. labels = input_ids (every token carries
    loss; a BOS at position 0 is never predicted).

    Args:
        texts: the documents, in order.
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        block_size: tokens per block.
        max_blocks: keep at most this many blocks; tokenising stops as soon as they are filled. None
            = all.
        batch_size: texts tokenised at a time.

    Returns:
        input_ids and labels [B, block_size] (B may be 0).

    Raises:
        ValueError: for block_size < 1 (< 2 with a BOS), max_blocks < 0, or a tokenizer without eos.
    """
    bos = _bos(tokenizer)
    width = block_size - len(bos)  # stream tokens per block
    if width < 1:
        raise ValueError(f"pack_causal_lm: block_size must be >= {1 + len(bos)}, got {block_size}")
    if max_blocks is not None and max_blocks < 0:
        raise ValueError(f"pack_causal_lm: max_blocks must be >= 0, got {max_blocks}")
    eos = _eos_id(tokenizer)
    texts = texts if isinstance(texts, Sequence) else list(texts)
    limit = None if max_blocks is None else max_blocks * width
    stream: list[int] = []
    for start in range(0, len(texts), max(1, batch_size)):
        if limit is not None and len(stream) >= limit:
            break
        for ids in _encode(tokenizer, texts[start : start + batch_size]):
            stream.extend(ids)
            stream.append(eos)
    n_blocks = len(stream) // width
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    ids = torch.tensor(stream[: n_blocks * width], dtype=torch.long).reshape(n_blocks, width)
    if bos:
        ids = torch.cat([torch.full((n_blocks, 1), bos[0], dtype=torch.long), ids], dim=1)
    return TokenDataset(ids, ids.clone())


# ----------------------------------------------------------------------------- instructions


def alpaca_prompt(instruction: str, input: str = "") -> str:
    r"""The Alpaca prompt for an instruction, ending with ``"### Response:\n"``.

    Args:
        instruction: the instruction.
        input: the context; the ``### Input:`` section is written only when it is not blank.

    Returns:
        The prompt text.
    """
    if input.strip():
        return ALPACA_PROMPT_INPUT.format(instruction=instruction, input=input)
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction)


# ----------------------------------------------------------------------------- multiple choice


def mc_prompt(question: str, choices: Sequence[str]) -> str:
    r"""The multiple-choice prompt for a question and its four options.

    ``"Question: {q}\nA. {c0}\nB. {c1}\nC. {c2}\nD. {c3}\nAnswer:"``.

    Args:
        question: the question.
        choices: the four options, A-D.

    Returns:
        The prompt text.

    Raises:
        ValueError: unless there are exactly 4 choices.
    """
    if len(choices) != 4:
        raise ValueError(f"mc_prompt: expected 4 choices, got {len(choices)}")
    return MC_PROMPT.format(question=question, c0=choices[0], c1=choices[1], c2=choices[2], c3=choices[3])


def _answer_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """(bridge, letters): how ``" A"``..``" D"`` tokenise after ``"Answer:"``.

    ``bridge`` is the token run shared by all four continuations (empty for BPE tokenizers with
    ``Ġ``-prefixed letters such as SmolLM2's; the lone space token for a byte-level tokenizer);
    it becomes part of the prompt. ``letters`` holds the one remaining token per letter.
    """
    base = _encode(tokenizer, ["Answer:"])[0]
    conts = []
    for letter, full in zip(LETTERS, _encode(tokenizer, [f"Answer: {c}" for c in LETTERS])):
        if full[: len(base)] != base:
            raise ValueError(f"letter_token_ids: 'Answer: {letter}' does not tokenise as 'Answer:' plus a continuation")
        conts.append(full[len(base) :])
    k = 0
    while all(len(c) > k for c in conts) and len({c[k] for c in conts}) == 1:
        k += 1
    bridge = conts[0][:k]
    letters = []
    for letter, c in zip(LETTERS, conts):
        if len(c) - k != 1:
            raise ValueError(
                f"letter_token_ids: the answer letter '{letter}' after 'Answer:' is "
                f"{len(c) - k} tokens, not a single token"
            )
        letters.append(int(c[k]))
    return [int(t) for t in bridge], letters


def letter_token_ids(tokenizer) -> list[int]:
    """The 4 token ids of the answer letters A-D as tokenised after ``"Answer:"``.

    For SmolLM2's tokenizer these are the tokens of ``" A"``..``" D"``; for a byte-level tokenizer
    that splits off the space, the space becomes part of the prompt and these are ``"A"``..``"D"``.

    Args:
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.

    Returns:
        The four ids.

    Raises:
        ValueError: when a letter is not a single token.
    """
    return _answer_tokens(tokenizer)[1]


def multiple_choice_examples(items: Sequence, tokenizer, max_length: int) -> TokenDataset:
    """Tokenise four-option questions for training or scoring on the gold letter.

    Each row is the BOS token (where `bos_id` gives one) and `mc_prompt` (plus the
    shared space token for tokenizers that split it off, see `letter_token_ids`) followed by
    exactly one labelled token: the gold letter. Everything else is -100. A prompt longer than
    ``max_length - 1`` tokens (less the BOS) is cut from the left after the BOS (the question's
    start is lost, the choices and ``Answer:`` are kept).

    Args:
        items: the questions (`nestfed.data.corpora.MultipleChoice`).
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        max_length: the most tokens per row.

    Returns:
        input_ids and labels [N, T], T = the longest row (<= max_length), right-padded.

    Raises:
        ValueError: for max_length < 2, an answer outside 0-3, or a tokenizer whose letters are not
            single tokens.
    """
    if max_length < 2:
        raise ValueError(f"multiple_choice_examples: max_length must be >= 2, got {max_length}")
    bridge, letters = _answer_tokens(tokenizer)
    pad, bos = _pad_id(tokenizer), _bos(tokenizer)
    room = max_length - len(bos)  # tokens after the BOS
    prompts = [mc_prompt(it.question, it.choices) for it in items]
    rows = []
    for it, p in zip(items, _encode(tokenizer, prompts)):
        if not 0 <= int(it.answer) <= 3:
            raise ValueError(
                f"multiple_choice_examples: answer {it.answer} outside 0-3 (question '{it.question[:60]}')"
            )
        p = p + bridge
        if len(p) > room - 1:
            p = p[len(p) - max(room - 1, 0) :]
        p = bos + p
        gold = letters[int(it.answer)]
        rows.append((p + [gold], [IGNORE_INDEX] * len(p) + [gold]))
    return _pad(rows, pad)


def answer_positions(labels: torch.Tensor) -> torch.Tensor:
    """For multiple-choice rows, the position t whose logits predict the gold letter.

    Args:
        labels: [N, T] with exactly one non-(-100) entry per row, at position s.

    Returns:
        [N] int64 holding s - 1 (the HF shift: logits[t] predict labels[t + 1]).

    Raises:
        ValueError: when a row has no or several labelled tokens, or its label sits at position 0
            (nothing precedes it).
    """
    if labels.dim() != 2:
        raise ValueError(f"answer_positions: labels must be [N, T], got {tuple(labels.shape)}")
    mask = labels != IGNORE_INDEX
    counts = mask.sum(dim=1)
    bad = (counts != 1).nonzero().flatten()
    if bad.numel():
        r = int(bad[0])
        raise ValueError(f"answer_positions: row {r} has {int(counts[r])} labelled tokens, expected exactly 1")
    pos = mask.to(torch.int64).argmax(dim=1) - 1
    if (pos < 0).any():
        r = int((pos < 0).nonzero().flatten()[0])
        raise ValueError(f"answer_positions: row {r} has its labelled token at position 0")
    return pos


def choice_logits(logits: torch.Tensor, labels: torch.Tensor, letter_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """The model's logits for the answer letters at each row's answer position.

    Args:
        logits: [N, T, V] from a causal LM on the multiple-choice input_ids.
        labels: [N, T] as `multiple_choice_examples` makes them.
        letter_ids: the 4 ids from `letter_token_ids`.

    Returns:
        [N, 4] in the dtype of logits; ``argmax(-1)`` is the predicted answer index 0-3.

    Raises:
        ValueError: on mismatched shapes, letter ids outside the vocabulary, or a row without
            exactly one labelled token.
    """
    if logits.dim() != 3 or logits.shape[:2] != labels.shape:
        raise ValueError(
            f"choice_logits: logits {tuple(logits.shape)} must be [N, T, V] with [N, T] = labels {tuple(labels.shape)}"
        )
    ids = torch.as_tensor(letter_ids, dtype=torch.long, device=logits.device)
    if ids.numel() and (ids.min() < 0 or ids.max() >= logits.shape[-1]):
        raise ValueError(f"choice_logits: letter ids {ids.tolist()} outside the vocabulary ({logits.shape[-1]})")
    pos = answer_positions(labels).to(logits.device)
    rows = torch.arange(logits.shape[0], device=logits.device)
    return logits[rows, pos][:, ids]
