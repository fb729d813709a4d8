"""What a method declares: one registry line (nestfed.methods.REGISTRY) that the command line and the
config loader read without importing torch.

A `Method` holds what is known before any model exists: the method's name, a one-line
summary, its config sections (one options dataclass each: defaults written once, checked in
``__post_init__``), its cross-section checks, and what it can do: one typed set of capabilities
(nestfed.config.capabilities), refused unless declared. What runs (its strategy, client hooks,
setup) is its implementation (nestfed.methods.implementation.Implementation), in the module
``home`` names, imported the first time a run needs it: ``nestfed --help``, ``nestfed methods``
and a config error never load a model library. The round loop, the run directory and the entry
points never ask which method runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nestfed.config import ExperimentConfig
from nestfed.config.capabilities import Capability, refusal

if TYPE_CHECKING:  # the implementation side (torch, the round loop) is imported only when a run needs it
    from nestfed.federation.hooks import ClientHooks
    from nestfed.federation.messages import Arrays
    from nestfed.federation.prepared import Prepared
    from nestfed.federation.strategy import Strategy
    from nestfed.methods.implementation import ClientSide, Implementation, MethodRun


@dataclass(frozen=True)
class Method:
    """One method as the registry holds it.

    The capabilities are the one declaration of what the method can do: anything not in the set is
    refused, at config load and by the round loop for every transport. A method with ``FLOWER`` has
    both halves of its implementation (``client`` and ``server``).

    Attributes:
        name: what ``strategy.name`` and ``--methods`` accept.
        summary: one line for listings.
        home: the module whose ``IMPLEMENTATION`` runs it (a module path), or the
            `Implementation` itself.
        sections: {config section: options dataclass} this home owns (a section may be shared by
            homes: the same dataclass).
        check_config: ``check_config(cfg)``: cross-section checks, raising
            ValueError("<section.key>: <reason>"); None for none.
        capabilities: what it can do (nestfed.config.capabilities.Capability).
        refusals: {capability: why not}, the method's own reason for a capability it lacks (the
            capability's default reason otherwise).
        moved: {former section: the section of this home that now holds its keys}; a config with the
            former one gets a one-line pointer.
        former: {section: {key: the value runs written before the key existed ran with, or a
            function of the stored document}} (nestfed.config.loader.migrate: an earlier run
            directory resumes as it ran after a default changed).
        comparison: how ``nestfed run --methods`` compares it with others: ``lora`` (the clients run
            the backbone with a LoRA adapter: nestfed.experiments.comparison) or ``compressed``
            (clients run compressed models: every method is then reported with client and server
            perplexity, client memory and bytes, nestfed.experiments.compressed_comparison).
        chooses_memory: whether the method's own setup chooses what each client's memory budget
            (``population.memory_mib``) holds, as FedSLM's and FedMKT's choose a compression ratio;
            the preparation then draws and records the budgets as for every method
            (``Prepared.budgets``, the same draw) and skips the LoRA tier choice (backbone
            precision and LoRA rank, nestfed.config.population.choose_tier).
    """

    name: str
    summary: str
    home: Any  # str (a module path) or an Implementation
    sections: Mapping[str, type] = field(default_factory=dict)
    check_config: Callable[[ExperimentConfig], None] | None = None
    capabilities: frozenset[Capability] = frozenset()
    refusals: Mapping[Capability, str] = field(default_factory=dict)
    moved: Mapping[str, str] = field(default_factory=dict)
    former: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    comparison: str = "lora"
    chooses_memory: bool = False

    def can(self, capability: Capability) -> bool:
        """Whether the method declares a capability.

        Args:
            capability: the capability asked.

        Returns:
            True when it is in `capabilities`.
        """
        return capability in self.capabilities

    def refusal(self, asked: Mapping[Capability, str]) -> str | None:
        """The one line refusing the first asked capability the method lacks.

        The line is nestfed.config.capabilities.refusal's.

        Args:
            asked: {capability: the setting that asks for it}.

        Returns:
            The refusal, or None when the method declares them all.
        """
        return refusal(self.name, self.capabilities, asked, self.refusals)

    @property
    def implementation(self) -> Implementation:
        """What runs the method: ``home``'s ``IMPLEMENTATION``, imported on first use.

        Raises:
            ImportError: naming the home when it cannot be imported.
            AttributeError: naming the home when it has no ``IMPLEMENTATION``.
        """
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
        return self.can(Capability.FLOWER)

    # -- the implementation's parts, as the entry points call them ------------------------------------
    def build(self, prep: Prepared, cfg: ExperimentConfig) -> MethodRun:
        """The method set up on a prepared experiment: strategy, trainer, clients, exports.

        Args:
            prep: the prepared experiment (backbone, data, clients).
            cfg: the experiment.

        Returns:
            The method run.
        """
        return self.implementation.build(prep, cfg)

    def client(self, prep: Prepared, cfg: ExperimentConfig) -> ClientSide:
        """The client half on one Flower node.

        Args:
            prep: the prepared experiment (backbone, data, clients).
            cfg: the experiment.

        Returns:
            The node's trainer and the arrays the server's strategy starts from.

        Raises:
            TypeError: for a method that is not on Flower.
        """
        if self.implementation.client is None:
            raise TypeError(f"{self.name} does not run on Flower")
        return self.implementation.client(prep, cfg)

    def server(self, cfg: ExperimentConfig, initial: Arrays) -> Strategy:
        """The server half on Flower.

        Args:
            cfg: the experiment.
            initial: the arrays the clients' setup gives (`ClientSide`'s ``initial_arrays``).

        Returns:
            The server's strategy.

        Raises:
            TypeError: for a method that is not on Flower.
        """
        if self.implementation.server is None:
            raise TypeError(f"{self.name} does not run on Flower")
        return self.implementation.server(cfg, initial)

    def check_model(self, prep: Prepared, cfg: ExperimentConfig) -> None:
        """The checks that need the model (e.g. memory layers in range).

        Run before any file is written.

        Args:
            prep: the prepared experiment (backbone, data, clients).
            cfg: the experiment.

        Raises:
            ConfigError: for a setting the model cannot run.
        """
        if self.implementation.check_model is not None:
            self.implementation.check_model(prep, cfg)

    def keeps_client_state(self, cfg: ExperimentConfig) -> bool:
        """Whether its clients keep state between rounds (a resume then needs it).

        Args:
            cfg: the experiment.

        Returns:
            True when they do under ``cfg``.
        """
        return self.implementation.keeps_client_state(cfg)

    def client_hooks(self, cfg: ExperimentConfig) -> ClientHooks | None:
        """The client hooks of a method whose clients run the LoRA client trainer.

        What ``nestfed export --client`` asks how a client runs an adapter.

        Args:
            cfg: the experiment.

        Returns:
            The hooks, or None for a method whose clients run their own trainer.
        """
        hooks = self.implementation.client_hooks
        return None if hooks is None else hooks(cfg)


def lora_method(name: str, summary: str, home: Any, capabilities: frozenset[Capability], **kw: Any) -> Method:
    """The declaration of a method whose clients run the client trainer on the shared backbone.

    Its implementation (nestfed.methods.implementation.lora_implementation) has both halves, so it
    runs on Flower (``FLOWER`` is added), and its LoRA layers wrap a quantised base as they wrap a
    dense one, a merged residual kept in float beside it (``QUANTIZED_BACKBONE`` is added).

    Args:
        name: the method's name.
        summary: one line for listings.
        home: the module whose ``IMPLEMENTATION`` runs it.
        capabilities: everything else it can do.
        **kw: the other `Method` fields (sections, checks, refusals).

    Returns:
        The declaration.
    """
    shared = {Capability.FLOWER, Capability.QUANTIZED_BACKBONE}
    return Method(name, summary, home, capabilities=frozenset(capabilities) | shared, **kw)
