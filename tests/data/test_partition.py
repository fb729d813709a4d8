"""Client partitions (flwr-datasets' partitioners and our two): disjoint, covering, sorted,
seeded; Dirichlet skew follows alpha, pathological clients hold their number of labels."""

from __future__ import annotations

import re
from collections import Counter
from itertools import combinations

import numpy as np
import pytest

from nestfed.data.partition import (
    by_label,
    dirichlet,
    dirichlet_serves,
    iid,
    inner_dirichlet,
    largest_dirichlet,
    natural_id,
    pathological,
    train_test_split,
)


def _check_disjoint_sorted(parts):
    for p in parts:
        assert p == sorted(p)
    for a, b in combinations(parts, 2):
        assert not set(a) & set(b)


# 10 classes x 100 items, interleaved
LABELS10 = [f"c{i % 10}" for i in range(1000)]


def test_by_label_exclusive_and_shared():
    labels = ["a"] * 4 + ["b"] * 3 + ["c"] * 7 + ["d"] * 2
    parts = by_label(labels, [["a"], ["b", "c"], ["c"]], seed=0)
    _check_disjoint_sorted(parts)
    assert parts[0] == [0, 1, 2, 3]
    assert set(range(4, 7)) <= set(parts[1])
    c_items = set(range(7, 14))
    c1, c2 = set(parts[1]) & c_items, set(parts[2])
    assert c1 | c2 == c_items and {len(c1), len(c2)} == {3, 4}  # 7 split as evenly as possible
    assert set().union(*parts) == set(range(14))  # the "d" items stay unassigned
    assert by_label(labels, [["a"], ["b", "c"], ["c"]], seed=0) == parts
    splits = {tuple(by_label(labels, [["c"], ["c"]], seed=s)[0]) for s in range(5)}
    assert len(splits) > 1  # the shared label's split depends on the seed


def test_by_label_unknown_label():
    with pytest.raises(ValueError, match=r"client 1 .*'zzz'|'zzz'.*client 1"):
        by_label(["a", "b"], [["a"], ["b", "zzz"]])


def test_dirichlet_covers_and_is_seeded():
    parts = dirichlet(LABELS10, num_clients=8, alpha=0.5, seed=3)
    _check_disjoint_sorted(parts)
    assert sorted(i for p in parts for i in p) == list(range(1000))
    assert min(len(p) for p in parts) >= 1
    assert dirichlet(LABELS10, 8, 0.5, seed=3) == parts
    assert dirichlet(LABELS10, 8, 0.5, seed=4) != parts
    big = dirichlet(LABELS10, 8, 0.5, seed=3, min_size=60)
    assert min(len(p) for p in big) >= 60


def _mean_top_label_share(parts, labels):
    """Average over clients of the share of the client's most frequent label (1.0 = one label)."""
    return float(np.mean([Counter(labels[i] for i in p).most_common(1)[0][1] / len(p) for p in parts]))


def test_dirichlet_small_alpha_is_more_skewed():
    skewed = np.mean([_mean_top_label_share(dirichlet(LABELS10, 10, 0.1, seed=s), LABELS10) for s in range(3)])
    flat = np.mean([_mean_top_label_share(dirichlet(LABELS10, 10, 100.0, seed=s), LABELS10) for s in range(3)])
    # IID would give about 0.1 + noise; alpha=0.1 puts most of a client's data in one or two labels
    assert flat < 0.25
    assert skewed > 0.5
    assert skewed > flat + 0.3


def test_dirichlet_impossible():
    with pytest.raises(ValueError, match="exceeds"):
        dirichlet(["a"] * 5, num_clients=3, alpha=1.0, min_size=2)
    with pytest.raises(ValueError, match="alpha"):
        dirichlet(["a"] * 5, num_clients=2, alpha=0.0)
    # 2 labels x 5 items over 5 clients, each needing 2 of them, with near-one-hot proportions
    labels = ["a"] * 5 + ["b"] * 5
    with pytest.raises(
        ValueError, match=r"at most 2 clients can be served; for 5: partition = 'inner_dirichlet'"
    ) as err:
        dirichlet(labels, num_clients=5, alpha=0.001, min_size=2)
    # every remedy the message names works: inner_dirichlet, and the alpha it computed
    alpha = float(re.search(r"alpha = ([0-9.e+-]+) \(the smallest", str(err.value)).group(1))
    assert alpha == pytest.approx(0.001 * 2**10)
    assert [len(p) for p in inner_dirichlet(labels, 5, 0.001)] == [2] * 5
    assert min(len(p) for p in dirichlet(labels, num_clients=5, alpha=alpha, min_size=2)) >= 2
    assert not dirichlet_serves(labels, 5, alpha / 2, min_size=2)  # ... and is the smallest of the ladder


def test_iid():
    parts = iid(103, 4, seed=1)
    _check_disjoint_sorted(parts)
    assert sorted(i for p in parts for i in p) == list(range(103))
    assert sorted(len(p) for p in parts) == [25, 26, 26, 26]
    assert iid(103, 4, seed=1) == parts and iid(103, 4, seed=2) != parts
    # IidPartitioner's contiguous shards of the seeded permutation, by hand
    perm = np.random.default_rng(1).permutation(103)
    assert parts == [
        sorted(perm[:26].tolist()),
        sorted(perm[26:52].tolist()),
        sorted(perm[52:78].tolist()),
        sorted(perm[78:].tolist()),
    ]
    with pytest.raises(ValueError):
        iid(3, 4)


def test_pathological_clients_hold_their_number_of_labels():
    parts = pathological(LABELS10, num_clients=10, classes_per_client=2, seed=0)
    _check_disjoint_sorted(parts)
    held = [sorted({LABELS10[i] for i in p}) for p in parts]
    assert all(len(h) == 2 for h in held)
    assert all(f"c{i}" in h for i, h in enumerate(held))  # first-deterministic: client i holds label i
    for lab in {x for h in held for x in h}:  # each held label's 100 items divided among its holders
        assert sum(1 for p in parts for i in p if LABELS10[i] == lab) == 100
    assert pathological(LABELS10, 10, 2, seed=0) == parts and pathological(LABELS10, 10, 2, seed=1) != parts
    one = pathological(LABELS10, 10, 1, seed=0)
    assert [sorted({LABELS10[i] for i in p}) for p in one] == [[f"c{i}"] for i in range(10)]
    with pytest.raises(ValueError, match=r"classes_per_client must be in 1..10"):
        pathological(LABELS10, 4, 11)


def test_natural_id_gives_each_client_its_label_in_order():
    labels = ["b", "a", "c", "a", "b", "c", "a"]
    assert natural_id(labels, ["c", "a"]) == [[2, 5], [1, 3, 6]]
    with pytest.raises(ValueError, match=r"client 1's id 'z' is carried by no item"):
        natural_id(labels, ["a", "z"])
    with pytest.raises(ValueError, match="given to two clients"):
        natural_id(labels, ["a", "a"])


def test_train_test_split():
    idx = list(range(100, 150))
    train, test = train_test_split(idx, 0.2, seed=0)
    assert len(test) == 10 and len(train) == 40
    assert sorted(train + test) == idx and train == sorted(train) and test == sorted(test)
    assert train_test_split(idx, 0.2, seed=0) == (train, test)
    assert train_test_split(idx, 0.2, seed=1) != (train, test)
    assert [len(x) for x in train_test_split([7, 9], 0.01)] == [1, 1]  # at least one test item
    assert train_test_split([7, 9, 11], 0.99)[0] != []  # at least one train item
    assert train_test_split([5], 0.5) == ([5], [])
    assert train_test_split([1, 2, 3], 0.0) == ([1, 2, 3], [])
    with pytest.raises(ValueError):
        train_test_split(idx, 1.0)


def test_inner_dirichlet_gives_equal_shares_where_dirichlet_cannot_serve_every_client():
    labels = ["a"] * 30 + ["b"] * 30 + ["c"] * 40  # 100 items, 40 clients, alpha 0.1
    with pytest.raises(ValueError, match="at most"):
        dirichlet(labels, num_clients=40, alpha=0.1, min_size=2)
    parts = inner_dirichlet(labels, num_clients=40, alpha=0.1, seed=0)
    assert sorted(len(p) for p in parts) == [2] * 20 + [3] * 20  # 100 = 40 x 2 + 20
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(100))  # disjoint, every item dealt
    assert inner_dirichlet(labels, num_clients=40, alpha=0.1, seed=0) == parts
    one_label = sum(len({labels[i] for i in p}) == 1 for p in parts)
    assert one_label > 20  # alpha 0.1: most clients hold one label
    with pytest.raises(ValueError, match="num_clients must be in 1..100"):
        inner_dirichlet(labels, num_clients=101, alpha=0.1)


def test_largest_dirichlet_is_the_bisection_of_what_the_partitioner_serves():
    labels = ["a"] * 50 + ["b"] * 50
    most = largest_dirichlet(labels, alpha=0.5, seed=0, min_size=2, upper=50)
    assert 1 <= most <= 50
    assert len(dirichlet(labels, most, 0.5, seed=0, min_size=2)) == most
    if most < 50:
        with pytest.raises(ValueError):
            dirichlet(labels, most + 1, 0.5, seed=0, min_size=2)
