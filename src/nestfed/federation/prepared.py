"""What every method of one experiment shares once it is prepared: the backbone with LoRA layers
(rank r_max), every client's data, the clients as the server sees them, and the LoRA layers' shapes.
Built by nestfed.experiments.prepare; handed to a method's home to set up its run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nestfed.config import ExperimentConfig
from nestfed.data.clients import ClientData
from nestfed.federation.messages import ClientInfo
from nestfed.nn.backbone import Backbone


@dataclass
class Prepared:
    """cfg: the config it was prepared from; backbone: the frozen model (LoRA injected) and its
    tokenizer; data: {cid: ClientData}; clients: [ClientInfo] (rank r_k, n_k); shapes: {LoRA module
    path: (out, in)}; prepare_time_s: seconds spent; cache: what a method's setup derives once and
    reuses across the methods of one comparison (e.g. compressed models), keyed by its own keys."""

    cfg: ExperimentConfig
    backbone: Backbone
    data: dict[int, ClientData]
    clients: list[ClientInfo]
    shapes: dict[str, tuple[int, int]]
    prepare_time_s: float
    cache: dict[Any, Any] = field(default_factory=dict)

    @property
    def frozen_prefix_layers(self) -> int:
        """Decoder layers whose outputs are cached (the lowest adapted layer; 0 = none cached)."""
        return next(iter(self.data.values())).start if self.data else 0
