"""What travels between server and clients, independent of the runtime (embedded or Flower).

Arrays are flat ``{name: tensor}`` dicts with PEFT-style names; configs and metrics are
JSON-able scalars and lists, so both map onto Flower's ArrayRecord / ConfigRecord / MetricRecord.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

Arrays = dict[str, torch.Tensor]


@dataclass
class ClientInfo:
    """A client as the server sees it.

    Attributes:
        cid: its id.
        rank: its LoRA rank r_k.
        num_examples: its number of training examples n_k.
        round_rank: the rank it trains at this round when that is below r_k (elastic ranks,
            nestfed.federation.population); 0 (the default) for its own.
    """

    cid: int
    rank: int
    num_examples: int
    round_rank: int = 0


@dataclass
class Instruction:
    """The server's message to one client for one round.

    Attributes:
        arrays: the payload sent (counted in bytes).
        config: JSON-able local settings (rank, objective, sub-ranks, scaling, seeds).
        expect: server-side only, never sent: {key: shape} of every array the reply must carry,
            used to validate it.
        may_shrink_rank: allow a reply of lower rank (HetLoRA's self-pruning); default False.
    """

    arrays: Arrays
    config: dict[str, Any]
    expect: dict[str, tuple[int, ...]] = field(default_factory=dict)
    may_shrink_rank: bool = False


@dataclass
class Reply:
    """A client's answer.

    Attributes:
        arrays: its trained arrays.
        num_examples: n_k, its training examples.
        metrics: {name: float}.
    """

    arrays: Arrays
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class GlobalState:
    """The server's state between rounds: arrays plus JSON-able bookkeeping.

    Attributes:
        arrays: the global arrays.
        meta: JSON-able bookkeeping (e.g. client ranks).
        optimizer: the server optimiser's state, {``m/<key>`` or ``v/<key>``: float64 tensor shaped
            like ``arrays[key]``} (nestfed.federation.server_optimizer), kept apart from
            ``arrays`` so that no strategy, payload, deployment or export ever sees it;
            checkpointed with the arrays. Only the round loop's server optimiser writes it; a
            strategy neither reads nor keeps it (empty with the default ``sgd`` at lr 1).
    """

    arrays: Arrays
    meta: dict[str, Any] = field(default_factory=dict)
    optimizer: Arrays = field(default_factory=dict)


@dataclass
class SecureSum:
    """What secure aggregation reveals of one round: sums over the contributing clients.

    Never a single client's vector (nestfed.federation.secure_sum; docs/secure_aggregation.md).

    Attributes:
        sums: {LoRA key: sum_k n_k pad(reply_k - sent_k)}, zero-padded along the rank dimension to
            the round's common rank r, float64.
        counts: [r] float64, sum_k n_k [j < r_k] (counts[0] = N, the total n_k).
        clients: the ids whose vectors are in the sums (the server learns who took part).
    """

    sums: Arrays
    counts: torch.Tensor
    clients: list[int]
