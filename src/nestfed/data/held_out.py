"""Unlabeled server text held out from every client (FedSLM's D_server, FedMKT's public set).

The clients' data come from `nestfed.data.clients.build_client_data`: each client's records
are split into train and test; the test records are all used, and packing for language
modelling consumes only the leading train records until ``max_train`` blocks are filled. The
remaining train records of every client were never seen by anyone: they are the server's pool.
Drawing it from each client's own partition keeps D_server in the clients' domains (the paper's
setting, arXiv 2607.29071 step 4) while no record is shared with any client's train or test set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nestfed.data import partition, tasks, templates
from nestfed.data.clients import load_partitions
from nestfed.data.tasks import _field
from nestfed.errors import ConfigError, DataError


def consumed_texts(texts: Sequence[str], tokenizer, block_size: int, max_blocks: int) -> int:
    """How many leading texts packing uses to fill ``max_blocks`` blocks.

    The packing is `nestfed.data.tasks.pack_causal_lm`'s; n is the smallest with sum_{i<n}
    (tokens_i + 1 eos) >= the stream tokens packing keeps (``block_size - 1`` per block after a BOS
    token, `nestfed.data.tasks.bos_id`).

    Args:
        texts: the documents in packing order.
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        block_size: tokens per block.
        max_blocks: the blocks to fill.

    Returns:
        n, or all texts when they do not fill the blocks.
    """
    limit = max_blocks * (block_size - (tasks.bos_id(tokenizer) is not None))
    total = 0
    for n, text in enumerate(texts, 1):
        total += len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1
        if total >= limit:
            return n
    return len(texts)


def server_pools(
    records: Sequence,
    parts: Sequence[Sequence[int]],
    test_fraction: float,
    seed: int,
    tokenizer,
    block_size: int,
    max_train: int,
    task: str = "causal_lm",
) -> list[list[int]]:
    """Per client, the indices of its records used by no client (neither train rows nor test).

    Mirrors build_client_data's split (seed + cid) and its use of the train records: packing for
    ``task = "causal_lm"`` (`consumed_texts`), the first ``max_train`` records for
    ``"instruction"`` (one row each).

    Args:
        records: the source's records.
        parts: the record indices of each client.
        test_fraction: ``data.test_fraction``.
        seed: ``data.seed``.
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        block_size: tokens per block.
        max_train: ``data.max_train``.
        task: ``causal_lm`` or ``instruction``.

    Returns:
        One index list per client, in the split's order.
    """
    pools = []
    for cid, idx in enumerate(parts):
        train_idx, _ = partition.train_test_split(idx, test_fraction, seed + cid)
        if task == "causal_lm":
            n = consumed_texts([records[i].text for i in train_idx], tokenizer, block_size, max_train)
        else:
            n = min(max_train, len(train_idx))
        pools.append(list(train_idx[n:]))
    return pools


def server_text(
    records: Sequence,
    pools: Sequence[Sequence[int]],
    tokenizer,
    block_size: int,
    blocks: int,
    as_text: Callable[[Any], str] = lambda r: r.text,
) -> tasks.TokenDataset:
    """Blocks of server text drawn evenly from the clients' pools.

    ceil(blocks / K) blocks are packed from each client's pool, then the whole is cut to ``blocks``.
    The labels are only for evaluation: elicitation never reads them.

    Args:
        records: the source's records.
        pools: per client, the indices of its unused records (`server_pools`).
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        block_size: tokens per block.
        blocks: the blocks to return.
        as_text: a record's text (its ``text``; an instruction record's whole exchange in the run's
            template).

    Returns:
        input_ids and labels, [blocks, block_size] each.

    Raises:
        DataError: when a client's pool cannot fill its share of the blocks.
    """
    per = math.ceil(blocks / max(len(pools), 1))
    parts = []
    for cid, pool in enumerate(pools):
        ds = tasks.pack_causal_lm([as_text(records[i]) for i in pool], tokenizer, block_size, max_blocks=per)
        if len(ds) < per:
            raise DataError(
                f"client {cid}: only {len(ds)} held-out blocks for the server text "
                f"({per} needed); lower compression.server_blocks or data.max_train"
            )
        parts.append(ds.input_ids)
    ids = torch.cat(parts)[:blocks]
    return tasks.TokenDataset(ids, ids.clone())


def load_server_text(cfg, tokenizer, blocks: int, loaded=None) -> tasks.TokenDataset:
    """The server text of an experiment config.

    For ``data.task = "causal_lm"`` the held-out documents are packed; for ``"instruction"`` the
    held-out records' whole exchanges in ``data.template``
    (`nestfed.data.templates.example_text`) are packed the same way.

    Args:
        cfg (ExperimentConfig): the experiment.
        tokenizer (PreTrainedTokenizerBase): the backbone's tokenizer.
        blocks: the blocks to return.
        loaded (tuple | None): a `nestfed.data.clients.load_partitions` result; read here when
            None.

    Returns:
        input_ids and labels, [blocks, data.block_size] each.

    Raises:
        ConfigError: for another task, or a template the tokenizer cannot render.
        DataError: when there is too little held-out text.
    """
    d = cfg.data
    if d.task not in ("causal_lm", "instruction"):
        raise ConfigError(f"data.task: the server text is packed from documents or instruction records, got '{d.task}'")
    records, _, parts = loaded or load_partitions(d)
    pools = server_pools(records, parts, d.test_fraction, d.seed, tokenizer, d.block_size, d.max_train, d.task)
    if d.task == "causal_lm":
        return server_text(records, pools, tokenizer, d.block_size, blocks)
    try:
        templates.check_template(tokenizer, d.template)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None

    def exchange(r) -> str:
        return templates.example_text(
            tokenizer, d.template, _field(r, "instruction"), _field(r, "input", ""), _field(r, "output")
        )

    return server_text(records, pools, tokenizer, d.block_size, blocks, exchange)
