"""What every method of one experiment shares once it is prepared.

The backbone with LoRA layers (rank r_max), every client's data, the clients as the server sees
them, and the LoRA layers' shapes. Built by nestfed.experiments.prepare; handed to a method's home
to set up its run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from nestfed.config import ExperimentConfig
from nestfed.data.clients import ClientData
from nestfed.federation.messages import ClientInfo
from nestfed.nn.backbone import Backbone


@dataclass
class Prepared:
    """One prepared experiment.

    Attributes:
        cfg: the config it was prepared from.
        backbone: the frozen model (LoRA injected) and its tokenizer.
        data: {cid: ClientData}, built when a client is first read
            (nestfed.data.client_pool.ClientPool; a plain dict in tests).
        clients: [ClientInfo] (rank r_k, n_k) of the registered clients.
        shapes: {LoRA module path: (out, in)}.
        prepare_time_s: seconds spent preparing.
        cache: what a method's setup derives once and reuses across the methods of one comparison
            (e.g. compressed models), keyed by its own keys.
        start: the decoder layer the cached frozen prefix ends at (0 = none cached); None to read
            it from the data.
        budgets: {cid: memory budget in MiB} when memory budgets drew the ranks
            (``population.memory_mib``); else None.
        footprint: the memory model that chose the ranks from ``budgets`` (nestfed.nn.footprint),
            at the backbone's own precision (``model.quantization``).
        ranks: every client's rank r_k, registered or not.
        backbones: {precision: the frozen model at that ``model.quantization``, LoRA injected} of
            every precision a client holds (``population.precisions``), ``backbone`` under its
            own; empty = ``backbone`` alone.
        precisions: every client's backbone precision, registered or not; None = every client on
            ``backbone``.
        footprints: {precision: memory model} of every precision the budgets chose from; None
            without budgets.
    """

    cfg: ExperimentConfig
    backbone: Backbone
    data: Mapping[int, ClientData]
    clients: list[ClientInfo]
    shapes: dict[str, tuple[int, int]]
    prepare_time_s: float
    cache: dict[Any, Any] = field(default_factory=dict)
    start: int | None = None
    budgets: dict[int, int] | None = None
    footprint: Any = None
    ranks: list[int] | None = None
    backbones: dict[str, Backbone] = field(default_factory=dict)
    precisions: list[str] | None = None
    footprints: dict[str, Any] | None = None

    @property
    def frozen_prefix_layers(self) -> int:
        """Decoder layers whose outputs are cached (the lowest adapted layer; 0 = none cached)."""
        if self.start is not None:
            return self.start
        return next(iter(self.data.values())).start if self.data else 0

    def precision(self, cid: int) -> str:
        """Give a client's backbone precision (``model.quantization`` of its tier).

        Args:
            cid: the client's id.

        Returns:
            Its precision: ``none``, ``int8`` or ``nf4``.
        """
        return self.precisions[cid] if self.precisions is not None else self.cfg.model.quantization

    def backbone_of(self, cid: int) -> Backbone:
        """Give the frozen backbone a client trains and evaluates on: its tier's precision.

        Args:
            cid: the client's id.

        Returns:
            The backbone of `precision` (``backbone`` at its own precision).
        """
        return self.backbones.get(self.precision(cid), self.backbone)

    @property
    def mixed_precision(self) -> bool:
        """Whether the clients hold backbones of more than one precision (device tiers)."""
        return self.precisions is not None and len(set(self.precisions)) > 1

    def label(self, cid: int) -> str:
        """Give a client's label, without building its data when the pool registered it.

        Args:
            cid: the client's id.

        Returns:
            The client's label.
        """
        label = getattr(self.data, "label", None)
        return label(cid) if label is not None else self.data[cid].label

    def roster(self) -> dict[str, dict[str, Any]]:
        """List every registered client (a run's per-client table).

        Returns:
            {str(cid): {rank, label, num_examples[, memory_mib][, precision]}}: the precision where
            budgets choose it (``population.precisions``, device tiers).
        """
        out = {}
        for c in self.clients:
            row: dict[str, Any] = {"rank": c.rank, "label": self.label(c.cid), "num_examples": c.num_examples}
            if self.budgets is not None:
                row["memory_mib"] = self.budgets.get(c.cid)
            if self.cfg.population.precisions:
                row["precision"] = self.precision(c.cid)
            out[str(c.cid)] = row
        return out


def tier_config(cfg: ExperimentConfig, precision: str) -> ExperimentConfig:
    """The experiment as a client of one backbone precision sees it (``model.quantization``).

    Args:
        cfg: the experiment.
        precision: the client's backbone precision (``population.precisions``).

    Returns:
        ``cfg`` with ``model.quantization = precision`` (``cfg`` itself at its own precision).
    """
    if precision == cfg.model.quantization:
        return cfg
    return replace(cfg, model=replace(cfg.model, quantization=precision))
