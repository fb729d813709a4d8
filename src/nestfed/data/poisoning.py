"""Data poisoning for robustness experiments (config ``[attack]``, kinds ``shuffle`` and
``random_text``): an attacking client's training text is corrupted before it is cached or
trained on, so the client trainer produces the poisoned update itself."""

from __future__ import annotations

import torch

from nestfed.data.clients import ClientData


def poison_tokens(
    ids: torch.Tensor, labels: torch.Tensor, kind: str, vocab_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Poisoned copies of ids [N, T] and labels [N, T] (-100 = no loss).

    shuffle: within each row the labelled positions' tokens are permuted (same words, no order);
    random_text: every labelled position gets a uniformly random token id in [0, vocab_size).
    Unlabelled positions (prompts, padding) are kept. Raises ValueError for another kind.
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
    """Poison ``data``'s training split in place (before its frozen prefix is cached); the test
    split is untouched, so held-out metrics measure the damage. ``seed``: the seed rule's."""
    g = torch.Generator().manual_seed(seed)
    data.train_ids, data.train_labels = poison_tokens(data.train_ids, data.train_labels, kind, vocab_size, g)
