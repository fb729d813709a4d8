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
    """A client as the server sees it: id, its LoRA rank r_k, its number of training examples n_k."""

    cid: int
    rank: int
    num_examples: int


@dataclass
class Instruction:
    """The server's message to one client for one round.

    arrays: the payload sent (counted in bytes). config: JSON-able local settings (rank,
    objective, sub-ranks, scaling, seeds). expect: server-side only, never sent: the shape of
    every array the reply must carry, used to validate it; ``may_shrink_rank`` allows a reply
    of lower rank (HetLoRA's self-pruning).
    """

    arrays: Arrays
    config: dict[str, Any]
    expect: dict[str, tuple[int, ...]] = field(default_factory=dict)
    may_shrink_rank: bool = False


@dataclass
class Reply:
    """A client's answer: its trained arrays, n_k (training examples) and metrics (floats)."""

    arrays: Arrays
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class GlobalState:
    """The server's state between rounds: arrays plus JSON-able bookkeeping (e.g. client ranks)."""

    arrays: Arrays
    meta: dict[str, Any] = field(default_factory=dict)
