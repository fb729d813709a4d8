"""The global held-out set: held-out records drawn from every client's distribution at once
(``evaluation.global_test``; docs/scale.md).

Its records are a seeded uniform sample of the union of every client's held-out (test) records, so
the set follows the population's own mixture of labels (each client's held-out share of it) and
holds no record any client trains on. The server evaluates it itself (a simulation's evaluation
device, not a protocol step: in a deployment no server holds the clients' held-out data).
"""

from __future__ import annotations

import numpy as np
import torch

from nestfed.data import tasks
from nestfed.data.clients import ClientData, ClientSource, tokenise
from nestfed.errors import DataError
from nestfed.seeds import stream_seed


def global_test_set(source: ClientSource, rows: int, num_clients: int, seed: int) -> ClientData:
    """The global held-out set: ``rows`` rows drawn from every client's held-out records.

    The pool is the union of the clients' held-out record indices, shuffled with the seed rule's
    stream ``global_test`` of (seed, 0, 0).

    Args:
        source: the clients' source (its records, partition and tokenizer).
        rows: how many rows to keep: blocks for causal_lm, examples otherwise.
        num_clients: the clients whose held-out records are pooled (cids 0 .. num_clients - 1).
        seed: the federation's seed.

    Returns:
        ClientData with empty train tensors ([0, T]), the rows as its test split, and label
            ``"global"``.

    Raises:
        DataError: when the clients' held-out records give no row.
    """
    d = source.cfg.data
    pool = sorted({i for cid in range(num_clients) for i in source.records_of(cid)[1]})
    order = np.random.default_rng(stream_seed(seed, 0, 0, "global_test")).permutation(len(pool))
    picked = [pool[i] for i in order]
    records = source.loaded[0]
    test = tokenise(records, picked, d, source.tokenizer, rows)
    if len(test) == 0:
        raise DataError("evaluation.global_test: the clients' held-out records give no row")
    empty = torch.zeros(0, test.input_ids.shape[1], dtype=torch.long)
    letter_ids = tasks.letter_token_ids(source.tokenizer) if d.task == "multiple_choice" else None
    return ClientData(
        empty, empty.clone(), test.input_ids[:rows], test.labels[:rows], letter_ids=letter_ids, label="global"
    )
