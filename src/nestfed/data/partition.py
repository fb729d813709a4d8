"""Split a data set among federated clients. Everything here returns index lists, never data.

Common contract: deterministic for a given ``seed`` (``numpy.random.default_rng``), each
client's list sorted ascending, clients disjoint, and their union covering every assigned item
(:func:`by_label` leaves items of labels no client asked for unassigned; the others assign all).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


def _label_groups(labels: Sequence[Hashable]) -> dict[Hashable, np.ndarray]:
    """label -> indices carrying it, labels in sorted order (by ``str`` when not comparable)."""
    groups: dict[Hashable, list[int]] = {}
    for i, lab in enumerate(labels):
        groups.setdefault(lab, []).append(i)
    try:
        keys = sorted(groups)
    except TypeError:
        keys = sorted(groups, key=str)
    return {k: np.asarray(groups[k], dtype=np.int64) for k in keys}


def by_label(labels: Sequence[str], client_labels: Sequence[Sequence[str]], seed: int = 0) -> list[list[int]]:
    """Natural non-IID split: client ``i`` gets the items whose label is in ``client_labels[i]``.

    labels: one label per item (length N). client_labels: per client, the labels it holds.
    A label listed by several clients has its items shuffled (seeded) and split among them as
    evenly as possible (sizes differ by at most 1). Items of labels no client lists stay
    unassigned. Returns one sorted index list per client.
    Raises ValueError when a client lists a label absent from ``labels`` (naming label and
    client) or when there are no clients.
    """
    if len(client_labels) == 0:
        raise ValueError("by_label: client_labels is empty (no clients)")
    groups = _label_groups(labels)
    owners: dict[Hashable, list[int]] = {}
    for c, labs in enumerate(client_labels):
        if isinstance(labs, str):
            labs = [labs]
        for lab in dict.fromkeys(labs):  # dedupe, keep order
            if lab not in groups:
                raise ValueError(f"by_label: client {c} lists label '{lab}', which no item has "
                                 f"(labels present: {', '.join(map(str, groups))})")
            owners.setdefault(lab, []).append(c)
    rng = np.random.default_rng(seed)
    clients: list[list[int]] = [[] for _ in client_labels]
    for lab, idx in groups.items():
        if lab not in owners:
            continue
        perm = rng.permutation(idx)
        for c, part in zip(owners[lab], np.array_split(perm, len(owners[lab]))):
            clients[c].extend(part.tolist())
    return [sorted(c) for c in clients]


def dirichlet(labels: Sequence[Hashable], num_clients: int, alpha: float, seed: int = 0,
              min_size: int = 1, max_tries: int = 1000) -> list[list[int]]:
    """Label-Dirichlet non-IID split (Hsu et al. 2019; the NIID-Bench / FedML variant).

    For each label, client proportions p ~ Dir(alpha * 1); clients already holding at least
    N / num_clients items get no more (p_j set to 0, p renormalised); the label's shuffled items
    are cut at the cumulative proportions. The whole draw is repeated (up to ``max_tries``
    times) until every client holds at least ``min_size`` items. Small alpha (e.g. 0.1) gives
    few labels per client; large alpha (e.g. 100) approaches IID. Every item is assigned.
    Returns one sorted index list per client.
    Raises ValueError for num_clients < 1, alpha <= 0, min_size < 0, num_clients * min_size > N,
    or when no draw within max_tries meets min_size.
    """
    n = len(labels)
    if num_clients < 1:
        raise ValueError(f"dirichlet: num_clients must be >= 1, got {num_clients}")
    if not alpha > 0:
        raise ValueError(f"dirichlet: alpha must be > 0, got {alpha}")
    if min_size < 0:
        raise ValueError(f"dirichlet: min_size must be >= 0, got {min_size}")
    if num_clients * min_size > n:
        raise ValueError(f"dirichlet: {num_clients} clients x min_size {min_size} exceeds the {n} items")
    groups = _label_groups(labels)
    rng = np.random.default_rng(seed)
    cap = n / num_clients
    for _ in range(max(1, max_tries)):
        clients: list[list[int]] = [[] for _ in range(num_clients)]
        for idx in groups.values():
            perm = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_clients, float(alpha)))
            p = p * np.array([len(c) < cap for c in clients], dtype=float)
            total = p.sum()
            p = p / total if total > 0 else np.full(num_clients, 1.0 / num_clients)
            cuts = (np.cumsum(p) * len(perm)).astype(int)[:-1]
            for c, part in enumerate(np.split(perm, cuts)):
                clients[c].extend(part.tolist())
        if min(len(c) for c in clients) >= min_size:
            return [sorted(c) for c in clients]
    raise ValueError(f"dirichlet: no draw in {max_tries} tries gave every one of {num_clients} "
                     f"clients >= {min_size} items (alpha={alpha}, N={n}); raise alpha or lower min_size")


def iid(n: int, num_clients: int, seed: int = 0) -> list[list[int]]:
    """IID split of items ``0..n-1``: a seeded permutation cut into ``num_clients`` parts whose
    sizes differ by at most 1. Returns one sorted index list per client.
    Raises ValueError when num_clients < 1 or n < num_clients (a client would get nothing)."""
    if num_clients < 1:
        raise ValueError(f"iid: num_clients must be >= 1, got {num_clients}")
    if n < num_clients:
        raise ValueError(f"iid: {n} items cannot give each of {num_clients} clients one")
    perm = np.random.default_rng(seed).permutation(n)
    return [sorted(p.tolist()) for p in np.array_split(perm, num_clients)]


def train_test_split(indices: Sequence[int], test_fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """Split ``indices`` (the item ids themselves, e.g. one client's list) into (train, test).

    The test part has round(len * test_fraction) items, but at least 1 when len >= 2 and
    test_fraction > 0, and never all of them (at least 1 stays in train); test_fraction 0 gives
    an empty test part. Both lists sorted. Deterministic by seed.
    Raises ValueError unless 0 <= test_fraction < 1.
    """
    if not 0 <= test_fraction < 1:
        raise ValueError(f"train_test_split: test_fraction must be in [0, 1), got {test_fraction}")
    items = np.asarray(list(indices), dtype=np.int64)
    n = len(items)
    if n < 2 or test_fraction == 0:
        return sorted(items.tolist()), []
    n_test = min(max(1, int(round(n * test_fraction))), n - 1)
    perm = np.random.default_rng(seed).permutation(items)
    return sorted(perm[n_test:].tolist()), sorted(perm[:n_test].tolist())
