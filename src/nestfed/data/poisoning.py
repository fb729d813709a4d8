"""Data poisoning for robustness experiments (config ``[attack]``, kinds ``shuffle`` and
``random_text``): an attacking client's training text is corrupted before it is cached or
trained on, so the client trainer produces the poisoned update itself."""

from __future__ import annotations

import torch

from nestfed.data.clients import ClientData


def poison_tokens(
    ids: torch.Tensor, labels: torch.Tensor, kind: str, vocab_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Poisoned copies of a batch of token ids and their labels.

    Unlabelled positions (prompts, padding) are kept.

    Args:
        ids: [N, T] token ids.
        labels: [N, T] labels (-100 = no loss).
        kind: ``shuffle`` (each row's labelled tokens permuted: same words, no order) or
            ``random_text`` (each labelled position a uniformly random token id in [0, vocab_size)).
        vocab_size: the tokenizer's vocabulary size.
        generator: the random stream.

    Returns:
        The poisoned ids [N, T] and labels [N, T].

    Raises:
        ValueError: when ``kind`` is another kind.
    """
    if kind not in ("shuffle", "random_text"):
        raise ValueError(f"attack.kind: '{kind}' does not poison data")
    ids, labels = ids.clone(), labels.clone()
    for i in range(ids.shape[0]):
        pos = (labels[i] != -100).nonzero().flatten()
        if pos.numel() == 0:
            continue
        if kind == "shuffle":
            new = ids[i, pos][torch.randperm(pos.numel(), generator=generator)]
        else:
            new = torch.randint(0, vocab_size, (pos.numel(),), generator=generator, dtype=ids.dtype)
        ids[i, pos] = new
        labels[i, pos] = new
    return ids, labels


def poison_client(data: ClientData, kind: str, vocab_size: int, seed: int) -> None:
    """Poison a client's training split in place, before its frozen prefix is cached.

    The test split is untouched, so held-out metrics measure the damage.

    Args:
        data: the client's data; its train_ids and train_labels are replaced.
        kind: ``shuffle`` or ``random_text`` (`poison_tokens`).
        vocab_size: the tokenizer's vocabulary size.
        seed: the seed rule's seed for this client.
    """
    g = torch.Generator().manual_seed(seed)
    data.train_ids, data.train_labels = poison_tokens(data.train_ids, data.train_labels, kind, vocab_size, g)
