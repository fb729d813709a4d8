"""What a method declares: one registry line (nestfed.methods.REGISTRY) that the command line and the
config loader read without importing torch.

A :class:`Method` holds what is known before any model exists: the method's name, a one-line
summary, its config sections (one options dataclass each: defaults written once, checked in
``__post_init__``), its cross-section checks, and what it can and cannot do, each as the reason
why not ("" = it can). What runs (its strategy, client hooks, setup) is its implementation
(nestfed.methods.implementation.Implementation), in the module ``home`` names, imported the first
time a run needs it: ``nestfed --help``, ``nestfed methods`` and a config error never load a model
library. The round loop, the run directory and the entry points never ask which method runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nestfed.config import ExperimentConfig

if TYPE_CHECKING:  # the implementation side (torch, the round loop) is imported only when a run needs it
    from nestfed.federation.hooks import ClientHooks
    from nestfed.federation.messages import Arrays
    from nestfed.federation.prepared import Prepared
    from nestfed.federation.strategy import Strategy
    from nestfed.methods.implementation import ClientSide, Implementation, MethodRun

NO_AGGREGATION = "its server does not aggregate LoRA updates (docs/trust.md)"
NO_PSEUDO_GRADIENT = (
    "its server does not combine parameter updates, so its state has no pseudo-gradient "
    "(docs/architecture.md, Server optimisers)"
)
NO_ELASTIC = "its clients do not train a LoRA prefix of the global adapter (docs/scale.md, elastic ranks)"


@dataclass(frozen=True)
class Method:
    """One method as the registry holds it.

    name: what ``strategy.name`` and ``--methods`` accept; summary: one line for listings; home: the
    module whose ``IMPLEMENTATION`` runs it (or the :class:`Implementation` itself); sections:
    {config section: options dataclass} this home owns (a section may be shared by homes: the same
    dataclass); check_config(cfg): cross-section checks, raising ValueError("<section.key>: <reason>");
    equal_ranks: every client must have the same rank; flower: whether it runs on Flower's engines
    (its implementation has both halves, ``client`` and ``server``); global_adapter: whether its
    export is one global LoRA adapter whose rank prefixes a client could run (False: e.g. local-only
    training; the truncation curve and dimension importance skip it).

    What it cannot do, each the reason shown when a config asks for it ("" = it can):
    robust_aggregation: why its strategy cannot cut its replies into rank blocks (a robust rule or
    central DP is refused); server_optimizer: why its global state cannot take a server optimiser's
    step (nestfed.federation.server_optimizer); elastic_ranks: why a client cannot train this round at
    a rank below its own (``population.elastic``, nestfed.config.population).
    """

    name: str
    summary: str
    home: Any  # str (a module path) or an Implementation
    sections: Mapping[str, type] = field(default_factory=dict)
    check_config: Callable[[ExperimentConfig], None] | None = None
    equal_ranks: bool = False
    flower: bool = False
    global_adapter: bool = True
    robust_aggregation: str = NO_AGGREGATION
    server_optimizer: str = NO_PSEUDO_GRADIENT
    elastic_ranks: str = NO_ELASTIC

    @property
    def implementation(self) -> Implementation:
        """What runs the method: ``home``'s ``IMPLEMENTATION`` (imported on first use). Raises
        ImportError / AttributeError naming the home when it has none."""
        if not isinstance(self.home, str):
            return self.home
        module = importlib.import_module(self.home)
        try:
            return module.IMPLEMENTATION
        except AttributeError:
            raise AttributeError(f"method {self.name}: {self.home} defines no IMPLEMENTATION") from None

    @property
    def on_flower(self) -> bool:
        """Whether the method runs on Flower's deployment and simulation engines."""
        return self.flower

    # -- the implementation's parts, as the entry points call them ------------------------------------
    def build(self, prep: Prepared, cfg: ExperimentConfig) -> MethodRun:
        """The method set up on a prepared experiment: strategy, trainer, clients, exports."""
        return self.implementation.build(prep, cfg)

    def client(self, prep: Prepared, cfg: ExperimentConfig) -> ClientSide:
        """The client half on one Flower node. Raises TypeError for a method that is not on Flower."""
        if self.implementation.client is None:
            raise TypeError(f"{self.name} does not run on Flower")
        return self.implementation.client(prep, cfg)

    def server(self, cfg: ExperimentConfig, initial: Arrays) -> Strategy:
        """The server half on Flower. Raises TypeError for a method that is not on Flower."""
        if self.implementation.server is None:
            raise TypeError(f"{self.name} does not run on Flower")
        return self.implementation.server(cfg, initial)

    def check_model(self, prep: Prepared, cfg: ExperimentConfig) -> None:
        """The checks that need the model (e.g. memory layers in range); raise ConfigError. Run
        before any file is written."""
        if self.implementation.check_model is not None:
            self.implementation.check_model(prep, cfg)

    def keeps_client_state(self, cfg: ExperimentConfig) -> bool:
        """Whether its clients keep state between rounds under ``cfg`` (a resume then needs it)."""
        return self.implementation.keeps_client_state(cfg)

    def client_hooks(self, cfg: ExperimentConfig) -> ClientHooks | None:
        """The client hooks of a method whose clients run the LoRA client trainer (what ``nestfed
        export --client`` asks how a client runs an adapter); None for the others."""
        hooks = self.implementation.client_hooks
        return None if hooks is None else hooks(cfg)


def lora_method(name: str, summary: str, home: Any, **kw: Any) -> Method:
    """The declaration of a method whose clients run the client trainer on the shared backbone
    (nestfed.methods.implementation.lora_implementation): on Flower, and able to aggregate robustly,
    to take a server optimiser's step and to serve elastic ranks unless ``kw`` gives the reason why not.
    ``kw``: the other :class:`Method` fields (sections, checks, equal_ranks)."""
    kw.setdefault("robust_aggregation", "")
    kw.setdefault("server_optimizer", "")
    kw.setdefault("elastic_ranks", "")
    kw.setdefault("flower", True)
    return Method(name, summary, home, **kw)
