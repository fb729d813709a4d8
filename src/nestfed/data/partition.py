"""Split a data set among federated clients. Everything here returns index lists, never data.

The partitioners are flwr-datasets' (Flower's maintained ones, run over an in-memory Hugging Face
``datasets.Dataset`` of the labels):

- `iid`: ``IidPartitioner``;
- `dirichlet`: ``DirichletPartitioner``;
- `pathological`: ``PathologicalPartitioner``;
- `natural_id`: ``NaturalIdPartitioner``.

Three are our own:

- `by_label`: each client is given a list of labels, and a label listed by several clients is
  split evenly among them (no flwr-datasets partitioner takes a label list per client);
- `train_test_split`: each client's held-out part, at least one item on each side of the split
  even for a client of two items (``datasets.Dataset.train_test_split`` refuses a split that leaves
  a side empty);
- `inner_dirichlet`: flwr-datasets' ``InnerDirichletPartitioner`` divides by zero once a
  client's labels run out, which many clients at small alpha always reach.

Common contract: deterministic for a given ``seed``, each client's list sorted ascending, clients
disjoint, and their union covering every assigned item (`by_label`, `natural_id` and
`pathological` leave items of labels no client holds unassigned; the others assign all).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Hashable, Sequence
from typing import Any

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

    A label listed by several clients has its items shuffled (seeded) and split among them as evenly
    as possible (sizes differ by at most 1). Items of labels no client lists stay unassigned.

    Args:
        labels: one label per item (length N).
        client_labels: per client, the labels it holds.
        seed: the seed of the shuffles.

    Returns:
        One sorted index list per client.

    Raises:
        ValueError: when a client lists a label absent from ``labels`` (naming label and client), or
            there are no clients.
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
                raise ValueError(
                    f"by_label: client {c} lists label '{lab}', which no item has "
                    f"(labels present: {', '.join(map(str, groups))})"
                )
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


def _flwr_partitions(columns: dict[str, list[Any]], partitioner: Any, num_parts: int) -> list[list[int]]:
    """Run a flwr-datasets partitioner over an in-memory Hugging Face ``datasets.Dataset`` built
    from ``columns`` (which hold ``index``: the item ids) and return each partition's sorted ids."""
    import datasets

    datasets.disable_progress_bars()
    partitioner.dataset = datasets.Dataset.from_dict(columns)
    with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():  # their tqdm bars and retry
        warnings.simplefilter("ignore")  # warnings (a failure becomes one ValueError, reworded by the callers)
        return [sorted(int(i) for i in partitioner.load_partition(p)["index"]) for p in range(num_parts)]


def iid(n: int, num_clients: int, seed: int = 0) -> list[list[int]]:
    """IID split of items ``0..n-1`` (flwr-datasets' ``IidPartitioner``).

    A seeded permutation (``numpy.random.default_rng(seed)``) cut into ``num_clients`` contiguous
    shards whose sizes differ by at most 1.

    Args:
        n: the items.
        num_clients: the clients.
        seed: the permutation's seed.

    Returns:
        One sorted index list per client.

    Raises:
        ValueError: when num_clients < 1 or n < num_clients (a client would get nothing).
    """
    if num_clients < 1:
        raise ValueError(f"iid: num_clients must be >= 1, got {num_clients}")
    if n < num_clients:
        raise ValueError(f"iid: {n} items cannot give each of {num_clients} clients one")
    from flwr_datasets.partitioner import IidPartitioner

    perm = np.random.default_rng(seed).permutation(n)
    return _flwr_partitions({"index": perm.tolist()}, IidPartitioner(num_clients), num_clients)


def dirichlet(
    labels: Sequence[Hashable], num_clients: int, alpha: float, seed: int = 0, min_size: int = 1
) -> list[list[int]]:
    """Label-Dirichlet non-IID split (Hsu et al. 2019; flwr-datasets' ``DirichletPartitioner``).

    With self-balancing, the NIID-Bench variant: for each label, client proportions p ~ Dir(alpha *
    1), clients already holding more than N / num_clients items get no more; the draw is repeated
    until every client holds at least ``min_size`` items. Small alpha (0.1) gives few labels per
    client, large alpha (100) approaches IID. Every item is assigned.

    Args:
        labels: one label per item (length N).
        num_clients: the clients.
        alpha: the Dirichlet concentration, > 0.
        seed: the draws' seed.
        min_size: the fewest items a client may hold.

    Returns:
        One sorted index list per client.

    Raises:
        ValueError: for num_clients < 1, alpha <= 0, min_size < 0, num_clients * min_size > N, or
            when the partitioner's draws cannot meet min_size (the message says how many clients
            could be served and what would serve them).
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
    try:
        return _flwr_partitions(
            {"label": [str(x) for x in labels], "index": list(range(n))},
            _dirichlet_partitioner(num_clients, alpha, min_size, seed),
            num_clients,
        )
    except ValueError as exc:
        most = largest_dirichlet(labels, alpha, seed, min_size, num_clients - 1)
        raise ValueError(
            f"dirichlet: {exc} (alpha={alpha}, N={n}, {num_clients} clients, min_size {min_size}); "
            f"at this alpha and min_size at most {most} clients can be served; for {num_clients}: "
            + dirichlet_remedies(labels, num_clients, alpha, seed, min_size)
        ) from None


def dirichlet_remedies(labels: Sequence[Hashable], num_clients: int, alpha: float, seed: int, min_size: int) -> str:
    """What would serve ``num_clients`` where `dirichlet` at ``alpha`` cannot.

    Each option is checked on these labels: ``partition = 'inner_dirichlet'`` (equal shares; works
    for up to N clients) and the smallest alpha among ``alpha * 2**k`` (k = 1..10) at which
    `dirichlet` succeeds with this seed, when one does.

    Args:
        labels: one label per item (length N).
        num_clients: the clients to serve.
        alpha: the Dirichlet concentration that failed.
        seed: the draws' seed.
        min_size: the fewest items a client may hold.

    Returns:
        The options joined by " or ", or "fewer clients" when none serves.
    """
    options = []
    if num_clients <= len(labels):
        options.append("partition = 'inner_dirichlet' (equal shares, the same label mixes)")
    ds = _label_dataset(labels)
    for k in range(1, 11):
        if dirichlet_serves(ds, num_clients, alpha * 2**k, seed, min_size):
            options.append(f"alpha = {alpha * 2**k!r} (the smallest of alpha x 2^k that serves them)")
            break
    return " or ".join(options) if options else "fewer clients"


def _dirichlet_partitioner(num_clients: int, alpha: float, min_size: int, seed: int):
    from flwr_datasets.partitioner import DirichletPartitioner

    return DirichletPartitioner(
        num_clients, "label", float(alpha), min_partition_size=min_size, self_balancing=True, shuffle=True, seed=seed
    )


def largest_dirichlet(
    labels: Sequence[Hashable], alpha: float, seed: int = 0, min_size: int = 1, upper: int | None = None
) -> int:
    """The largest client count up to ``upper`` for which `dirichlet` succeeds with this seed.

    Found by bisection (a failure above a success is assumed, as the draws' retries make it in
    practice).

    Args:
        labels: one label per item (length N).
        alpha: the Dirichlet concentration.
        seed: the draws' seed.
        min_size: the fewest items a client may hold.
        upper: the largest count tried; N when None.

    Returns:
        The count, 0 when even one client fails.
    """
    ds = _label_dataset(labels)
    lo, hi = 0, min(upper if upper is not None else len(labels), len(labels) // max(min_size, 1))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if dirichlet_serves(ds, mid, alpha, seed, min_size):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _label_dataset(labels: Sequence[Hashable]):
    import datasets

    datasets.disable_progress_bars()
    return datasets.Dataset.from_dict({"label": [str(x) for x in labels], "index": list(range(len(labels)))})


def dirichlet_serves(labels, num_clients: int, alpha: float, seed: int = 0, min_size: int = 1) -> bool:
    """Whether `dirichlet` succeeds for ``num_clients`` at this alpha, seed and min_size.

    Args:
        labels (Sequence | datasets.Dataset): a label sequence, or the ``datasets.Dataset`` of them
            this module builds.
        num_clients: the clients.
        alpha: the Dirichlet concentration.
        seed: the draws' seed.
        min_size: the fewest items a client may hold.

    Returns:
        True when the partitioner's draws serve them.
    """
    if num_clients < 1 or num_clients * min_size > len(labels):
        return False
    part = _dirichlet_partitioner(num_clients, alpha, min_size, seed)
    part.dataset = labels if hasattr(labels, "column_names") else _label_dataset(labels)
    try:
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            part.load_partition(0)
        return True
    except ValueError:
        return False


def inner_dirichlet(labels: Sequence[Hashable], num_clients: int, alpha: float, seed: int = 0) -> list[list[int]]:
    """Label-Dirichlet mixes at equal sizes (Acar et al. 2021).

    The sampling of flwr-datasets' ``InnerDirichletPartitioner``: client k's label mix is p_k ~
    Dir(alpha * 1); every client gets floor(N / K) items (the first N mod K one more), dealt one at
    a time in a seeded random order of the clients' slots, each item's label drawn from the client's
    mix over the labels that still have items, so late draws drift towards the labels left.

    Our own rather than the library's, which divides by zero when every label of a client's (near
    one-hot) mix has run out: such a client draws from the labels left in proportion to what is
    left. Succeeds whenever K <= N, where `dirichlet`'s minimum size cannot be met.

    Args:
        labels: one label per item (length N).
        num_clients: the clients K.
        alpha: the Dirichlet concentration, > 0.
        seed: the draws' seed.

    Returns:
        One sorted index list per client.

    Raises:
        ValueError: for num_clients < 1 or > N, or alpha <= 0.
    """
    n = len(labels)
    if not 1 <= num_clients <= n:
        raise ValueError(f"inner_dirichlet: num_clients must be in 1..{n} (the items), got {num_clients}")
    if not alpha > 0:
        raise ValueError(f"inner_dirichlet: alpha must be > 0, got {alpha}")
    rng = np.random.default_rng(seed)
    groups = [rng.permutation(idx) for idx in _label_groups(labels).values()]  # each label's items, shuffled
    left = np.asarray([len(g) for g in groups], dtype=np.int64)
    mixes = rng.dirichlet(np.full(len(groups), float(alpha)), size=num_clients)  # [K, L]
    sizes = [n // num_clients + (1 if i < n % num_clients else 0) for i in range(num_clients)]
    slots = rng.permutation(np.repeat(np.arange(num_clients), sizes))
    out: list[list[int]] = [[] for _ in range(num_clients)]
    for c in slots:
        p = mixes[c] * (left > 0)
        if p.sum() <= 0:  # every label of this client's mix ran out: the labels left, by what is left
            p = left.astype(np.float64)
        lab = int(rng.choice(len(groups), p=p / p.sum()))
        left[lab] -= 1
        out[c].append(int(groups[lab][left[lab]]))
    return [sorted(p) for p in out]


def pathological(
    labels: Sequence[Hashable], num_clients: int, classes_per_client: int, seed: int = 0
) -> list[list[int]]:
    """Pathological (label-based) split (McMahan et al. 2017's shards).

    flwr-datasets' ``PathologicalPartitioner`` in ``first-deterministic`` mode: client i holds
    ``classes_per_client`` labels, the first label i mod L, the others drawn at random (seeded);
    each label's items are divided evenly among the clients holding it. Labels no client draws stay
    unassigned.

    Args:
        labels: one label per item (L distinct).
        num_clients: the clients.
        classes_per_client: labels per client, in 1..L.
        seed: the draws' seed.

    Returns:
        One sorted index list per client.

    Raises:
        ValueError: for num_clients < 1 or classes_per_client outside 1..L.
    """
    distinct = len(set(labels))
    if num_clients < 1:
        raise ValueError(f"pathological: num_clients must be >= 1, got {num_clients}")
    if not 1 <= classes_per_client <= distinct:
        raise ValueError(
            f"pathological: classes_per_client must be in 1..{distinct} (the labels present), got {classes_per_client}"
        )
    from flwr_datasets.partitioner import PathologicalPartitioner

    part = PathologicalPartitioner(
        num_clients, "label", classes_per_client, class_assignment_mode="first-deterministic", shuffle=True, seed=seed
    )
    return _flwr_partitions({"label": [str(x) for x in labels], "index": list(range(len(labels)))}, part, num_clients)


def natural_id(labels: Sequence[Hashable], ids: Sequence[Hashable]) -> list[list[int]]:
    """One client per natural id: a topic, a writer, a speaker.

    flwr-datasets' ``NaturalIdPartitioner``: client i holds every item whose label is ``ids[i]``.

    Args:
        labels: one label per item.
        ids: the natural id of each client.

    Returns:
        One sorted index list per client.

    Raises:
        ValueError: naming an id no item carries, or an id given twice.
    """
    present = {str(x) for x in labels}
    for i, x in enumerate(ids):
        if str(x) not in present:
            raise ValueError(
                f"natural_id: client {i}'s id '{x}' is carried by no item (ids present: {', '.join(sorted(present))})"
            )
    if len({str(x) for x in ids}) != len(ids):
        raise ValueError("natural_id: an id is given to two clients (use the label partition to split one)")
    from flwr_datasets.partitioner import NaturalIdPartitioner

    part = NaturalIdPartitioner(partition_by="label")
    cols = {"label": [str(x) for x in labels], "index": list(range(len(labels)))}
    parts = _flwr_partitions(cols, part, len(present))
    order = {v: k for k, v in part.partition_id_to_natural_id.items()}
    return [parts[order[str(x)]] for x in ids]


def train_test_split(indices: Sequence[int], test_fraction: float, seed: int = 0) -> tuple[list[int], list[int]]:
    """Split ``indices`` (the item ids themselves, e.g. one client's list) into train and test.

    The test part has round(len * test_fraction) items, but at least 1 when len >= 2 and
    test_fraction > 0, and never all of them (at least 1 stays in train); test_fraction 0 gives an
    empty test part. Deterministic by seed.

    Args:
        indices: the item ids.
        test_fraction: the held-out share, in [0, 1).
        seed: the permutation's seed.

    Returns:
        The train and test ids, each sorted.

    Raises:
        ValueError: unless 0 <= test_fraction < 1.
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
