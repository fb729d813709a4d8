"""Multi-query associative recall past the attention window, with a key and value vocabulary of its
own per client and a held-out vocabulary no client trains on.

The task is Zoology's MQAR (Arora et al. 2024, "Zoology: Measuring and Improving Recall in
Efficient Language Models", section 3): a row states ``pairs`` key-value pairs, then asks
``queries`` of the keys again, each answered by its value, the only labelled tokens. Between the
pairs and the queries lie ``gap`` filler tokens, so that with a softmax window no longer than the
gap divided by the layers a query cannot see its pair through attention alone (a model whose every
layer sees W tokens reaches back layers x (W - 1) tokens at most); a memory can. A row is

    [BOS] k_1 v_1 k_2 v_2 ... k_P v_P | f_1 ... f_gap | k_a v_a k_b v_b ...   (queries: distinct keys)

Vocabularies (FedNL's claim in miniature: clients share the rule that writes and reads a memory,
not what it holds): the candidate tokens (`single_tokens`: single-token words, else single
characters) are cut into ``pools`` disjoint vocabularies of ``vocab`` keys and ``vocab`` values,
one per client and the last held out, plus a shared filler vocabulary. Client i trains on its own
vocabulary and is tested on it (group ``own``) and on the held-out one (``held_out``): recalling a
held-out vocabulary is zero-shot. Accuracy is the argmax over every pool's values at each queried
position (a guess of the right pool scores 1 / vocab).

`mqar_batch` draws rows as tensors for training loops outside the federation (the capability
tests, the pretraining of ``tiny-llama-mqar``).
"""

from __future__ import annotations

import random
import string
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nestfed.config import ConfigError, ExperimentConfig
from nestfed.data.clients import ClientData, generated_client_data
from nestfed.data.tasks import IGNORE_INDEX, TokenDataset, _bos, _pad, _pad_id, concat_rows

#: common English words, tried first as one-token candidates (with a leading space)
WORDS = (
    "apple river stone cloud garden window silver market doctor forest castle bridge mountain island "
    "letter paper pencil engine rocket planet violin guitar dragon tiger rabbit spider turtle falcon "
    "orange lemon cherry melon carrot potato onion butter cheese bread honey sugar coffee salad pepper "
    "winter summer autumn spring morning evening summer night moon star storm rain snow wind fire "
    "iron copper bronze marble glass wood cotton wool silk leather north south east west king queen "
    "prince knight bishop tower temple church school house street road train boat plane truck horse "
    "sheep goat camel zebra eagle raven owl fox wolf bear lion mouse snake frog fish whale shark crab "
    "red blue green yellow black white brown purple pink grey gold ruby pearl coral amber ivory jade"
).split()


@dataclass(frozen=True)
class Vocab:
    """One vocabulary of keys and values.

    Attributes:
        keys: the key token ids.
        values: the value token ids (disjoint from the keys).
    """

    keys: tuple[int, ...]
    values: tuple[int, ...]


def single_tokens(tokenizer) -> list[int]:
    """Candidate token ids, each one token on its own, distinct and in a fixed order.

    First the words of `WORDS` with a leading space, then single printable characters, then
    the other ASCII characters (a byte-level tokenizer's only one-token strings); special tokens are
    left out.

    Args:
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.

    Returns:
        The token ids.
    """
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    out, seen = [], set()
    chars = string.ascii_letters + string.digits + string.punctuation
    chars += "".join(chr(i) for i in range(1, 128) if chr(i) not in chars)
    for text in [" " + w for w in WORDS] + list(chars):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and ids[0] not in seen and ids[0] not in special:
            out.append(ids[0])
            seen.add(ids[0])
    return out


def vocabularies(tokenizer, pools: int, vocab: int, fillers: int) -> tuple[list[Vocab], tuple[int, ...]]:
    """Disjoint vocabularies and filler tokens from `single_tokens`, in order.

    Keys and values are interleaved, so that every pool draws alike from the list.

    Args:
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        pools: how many vocabularies.
        vocab: keys (and values) per vocabulary.
        fillers: how many filler tokens.

    Returns:
        The vocabularies and the filler token ids.

    Raises:
        ValueError: when the tokenizer has too few one-token candidates.
    """
    cand = single_tokens(tokenizer)
    need = 2 * pools * vocab + fillers
    if len(cand) < need:
        raise ValueError(
            f"the tokenizer has {len(cand)} one-token candidates, {pools} vocabularies of {vocab} keys and "
            f"values and {fillers} fillers need {need}"
        )
    out = []
    for p in range(pools):
        block = cand[2 * p * vocab : 2 * (p + 1) * vocab]
        out.append(Vocab(tuple(block[0::2]), tuple(block[1::2])))
    return out, tuple(cand[2 * pools * vocab : need])


def mqar_row(
    vocab: Vocab,
    fillers: Sequence[int],
    pairs: int,
    queries: int,
    gap: int,
    rng: random.Random,
    bos: Sequence[int] = (),
) -> tuple[list[int], list[int]]:
    """One row (module docstring): its ids and labels.

    Keys are distinct within a row, values drawn with replacement, the queries a random order of
    ``queries`` distinct keys.

    Args:
        vocab: the vocabulary the pairs come from.
        fillers: the filler tokens.
        pairs: key-value pairs stated.
        queries: keys asked again (at most ``pairs``).
        gap: filler tokens between the pairs and the queries.
        rng: the random stream.
        bos: tokens the row starts with (a BOS token or none).

    Returns:
        The ids and the labels (the queried values; IGNORE_INDEX elsewhere), of equal length.
    """
    keys = rng.sample(vocab.keys, pairs)
    values = [rng.choice(vocab.values) for _ in range(pairs)]
    ids = list(bos)
    for k, v in zip(keys, values):
        ids += [k, v]
    ids += [rng.choice(fillers) for _ in range(gap)]
    labels = [IGNORE_INDEX] * len(ids)
    for j in rng.sample(range(pairs), queries):
        ids += [keys[j], values[j]]
        labels += [IGNORE_INDEX, values[j]]
    return ids, labels


def mqar_batch(
    vocab: Vocab, fillers: Sequence[int], n: int, pairs: int, queries: int, gap: int, rng: random.Random
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of one shape as tensors, for training loops outside the federation.

    Args:
        vocab: the vocabulary the pairs come from.
        fillers: the filler tokens.
        n: rows.
        pairs: key-value pairs per row.
        queries: keys asked again per row.
        gap: filler tokens between the pairs and the queries.
        rng: the random stream.

    Returns:
        input_ids and labels, each [n, 2 (pairs + queries) + gap].
    """
    rows = [mqar_row(vocab, fillers, pairs, queries, gap, rng) for _ in range(n)]
    return torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])


def union(vocabs: Sequence[Vocab]) -> Vocab:
    """One vocabulary holding every key and every value of ``vocabs``.

    Args:
        vocabs: the vocabularies, in order.

    Returns:
        Their union (keys and values concatenated in order).
    """
    return Vocab(tuple(k for v in vocabs for k in v.keys), tuple(x for v in vocabs for x in v.values))


def _dataset(vocab, fillers, n, o, rng, tokenizer) -> TokenDataset:
    rows = [mqar_row(vocab, fillers, o.pairs, o.queries, o.gap, rng, _bos(tokenizer)) for _ in range(n)]
    return _pad(rows, _pad_id(tokenizer))


def mqar_clients(cfg: ExperimentConfig, tokenizer) -> tuple[list[dict], list[int]]:
    """Every client's rows: client i trains on vocabulary i.

    Client i trains on ``data.max_train`` rows of vocabulary i and is tested on ``data.max_test``
    rows of its own (group ``own``) and of the held-out vocabulary (group ``held_out``, when
    ``[mqar] held_out``).

    Args:
        cfg: the experiment (``[data]`` and ``[mqar]``).
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.

    Returns:
        The clients (dicts of ``train``, ``test``, ``groups``, ``label``) and every pool's values
            (the candidates accuracy takes its argmax over).

    Raises:
        ValueError: when the tokenizer has too few one-token candidates.
    """
    d, o = cfg.data, cfg.section("mqar")
    pools = d.num_clients + (1 if o.held_out else 0)
    vocabs, fillers = vocabularies(tokenizer, pools, o.vocab, o.fillers)
    pad, out = _pad_id(tokenizer), []
    for cid in range(d.num_clients):
        rng = random.Random(f"mqar/{d.seed}/{cid}")
        train = _dataset(vocabs[cid], fillers, d.max_train, o, rng, tokenizer)
        parts = [_dataset(vocabs[cid], fillers, d.max_test, o, rng, tokenizer)]
        groups = {"own": torch.arange(d.max_test)}
        if o.held_out:
            parts.append(_dataset(vocabs[-1], fillers, d.max_test, o, rng, tokenizer))
            groups["held_out"] = torch.arange(d.max_test, 2 * d.max_test)
        out.append({"train": train, "test": concat_rows(parts, pad), "groups": groups, "label": f"vocabulary {cid}"})
    return out, [x for v in vocabs for x in v.values]


def mqar_client_data(cfg: ExperimentConfig, tokenizer) -> tuple[dict[int, ClientData], list[list[str]]]:
    """The mqar source's reader (nestfed.config.sources).

    Args:
        cfg: the experiment.
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.

    Returns:
        {cid: ClientData} scored over every pool's values, and each client's labels.

    Raises:
        ConfigError: when the tokenizer has too few one-token candidates for the vocabularies asked.
    """
    try:
        clients, candidates = mqar_clients(cfg, tokenizer)
    except ValueError as exc:
        raise ConfigError(f"mqar: {exc}") from None
    return generated_client_data(clients, candidates)
