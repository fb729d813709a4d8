"""FedNL's options: section ``[fednl]``. The memory layer itself is configured by the core
``[memory]`` section (nestfed.config.schema.MemoryConfig)."""

from __future__ import annotations

from dataclasses import dataclass

TRAVEL = ("all", "rules", "none")


@dataclass(frozen=True)
class FedNLOptions:
    """travel: what crosses the wire, ``all`` (LoRA on q, k, v plus the memory rules) or ``rules``
    (only the memory rules: beta's projection and the gate; each client keeps its LoRA) or ``none``
    (the local-only baseline: each client keeps its LoRA and its rules, nothing is aggregated, so
    the federated model and the client's own are the same and the aggregation drop is zero by
    construction)."""

    travel: str = "all"

    def __post_init__(self) -> None:
        if self.travel not in TRAVEL:
            raise ValueError(f"travel must be 'all', 'rules' or 'none', got '{self.travel}'")
