"""What a method's home provides, and the shared shape of the LoRA methods' homes.

A :class:`Method` is one registry line (nestfed.methods.REGISTRY): its config sections (one
options dataclass each: defaults written once, checked in ``__post_init__``), its cross-section
checks, and how it sets up a run on a prepared experiment: a strategy (server), a trainer (the
clients: nestfed.federation.client.ClientTrainer with the method's hooks, or its own), and what
it exports. The round loop, the run directory and the entry points never ask which method runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nestfed.config import ExperimentConfig, client_ranks, r_max
from nestfed.federation.client import ClientTrainer
from nestfed.federation.hooks import ClientHooks
from nestfed.federation.in_process import Trainer
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState
from nestfed.federation.prepared import Prepared
from nestfed.federation.run_dir import Exports
from nestfed.federation.strategy import LoraSettings, Strategy


@dataclass
class MethodRun:
    """A method set up on a prepared experiment: strategy, trainer, clients, LoRA shapes, whether
    its clients keep state between rounds, and ``finish(state) -> Exports`` after the last round."""

    strategy: Strategy
    trainer: Trainer
    clients: list[ClientInfo]
    shapes: dict[str, tuple[int, int]]
    keeps_client_state: bool
    finish: Callable[[GlobalState], Exports]


@dataclass
class ClientSide:
    """A method's client on one node (Flower): its trainer and the arrays the server's strategy
    starts from that only a model can give (e.g. fresh memory rules; {} for most methods)."""

    trainer: ClientTrainer
    initial_arrays: Arrays


@dataclass(frozen=True)
class Method:
    """One method's home, as the registry holds it.

    name: what ``strategy.name`` and ``--methods`` accept; summary: one line for listings;
    sections: {config section: options dataclass} this home owns (a section may be shared by homes:
    the same dataclass); check_config(cfg): cross-section checks, raising ValueError("<section.key>:
    <reason>"); check_model(prep, cfg): checks that need the model, raising ConfigError, run before
    any file is written; build(prep, cfg) -> MethodRun; client(prep, cfg) -> ClientSide and
    server(cfg, initial_arrays) -> Strategy: the two halves on Flower (None: not on Flower);
    equal_ranks: every client must have the same rank; keeps_client_state(cfg): whether its
    clients keep state between rounds under this config (a resume needs that state);
    robust_aggregation: why its strategy cannot cut its replies into rank blocks (a robust rule or
    central DP is then refused with this reason), "" when it can (``robust_aggregate``,
    nestfed.federation.robust); global_adapter: whether its export is one global LoRA adapter whose
    rank prefixes a client could run (False: e.g. local-only training, which has none; the
    truncation curve and dimension importance skip it); client_hooks(cfg): the client hooks of a
    method whose clients run the LoRA client trainer (what ``nestfed export --client`` asks how a
    client runs an adapter; None for the others); server_optimizer: why its global state
    cannot take a server optimiser's step (``server_optimizer.name`` other than the identity is then
    refused with this reason), "" when it can: every floating array keeps its shape from round to
    round and the aggregate minus the state is an update (nestfed.federation.server_optimizer).
    """

    name: str
    summary: str
    build: Callable[[Prepared, ExperimentConfig], MethodRun]
    sections: Mapping[str, type] = field(default_factory=dict)
    check_config: Callable[[ExperimentConfig], None] | None = None
    check_model: Callable[[Prepared, ExperimentConfig], None] | None = None
    client: Callable[[Prepared, ExperimentConfig], ClientSide] | None = None
    server: Callable[[ExperimentConfig, Arrays], Strategy] | None = None
    equal_ranks: bool = False
    keeps_client_state: Callable[[ExperimentConfig], bool] = lambda cfg: False
    robust_aggregation: str = "its server does not aggregate LoRA updates (docs/trust.md)"
    global_adapter: bool = True
    client_hooks: Callable[[ExperimentConfig], ClientHooks] | None = None
    server_optimizer: str = ("its server does not combine parameter updates, so its state has no pseudo-gradient "
                             "(docs/architecture.md, Server optimisers)")

    @property
    def on_flower(self) -> bool:
        """Whether the method runs on Flower's deployment engine."""
        return self.client is not None and self.server is not None


def lora_settings(cfg: ExperimentConfig) -> LoraSettings:
    """The LoRA numbers every LoRA strategy needs, from the config: r_max, lora_alpha, the scaling
    convention, the initialisation seed and the federation's seed."""
    return LoraSettings(r_max=r_max(cfg), lora_alpha=cfg.lora.lora_alpha, scaling=cfg.lora.scaling,
                        init_seed=cfg.lora.init_seed, seed=cfg.federation.seed)


def lora_method(name: str, summary: str, strategy: Callable[[ExperimentConfig, Arrays], Strategy],
                hooks: Callable[[ExperimentConfig], ClientHooks] = lambda cfg: ClientHooks(),
                setup: Callable[[Prepared, ExperimentConfig], Arrays] | None = None, **kw: Any) -> Method:
    """The home of a method whose clients run the client trainer on the shared backbone.

    strategy(cfg, initial_arrays) -> its server strategy; hooks(cfg) -> its client hooks;
    setup(prep, cfg) -> initial arrays: what it adds to the model before its first round (e.g.
    memory layers), on the server's model and on every Flower node alike. ``kw``: the other
    :class:`Method` fields (sections, checks, equal_ranks).
    """

    def client(prep: Prepared, cfg: ExperimentConfig) -> ClientSide:
        initial = setup(prep, cfg) if setup is not None else {}
        return ClientSide(ClientTrainer(prep.backbone.model, prep.data, cfg.train, hooks(cfg),
                                        privacy=cfg.privacy, attack=cfg.attack), initial)

    def build(prep: Prepared, cfg: ExperimentConfig) -> MethodRun:
        side = client(prep, cfg)
        st = strategy(cfg, side.initial_arrays)

        def finish(state: GlobalState) -> Exports:
            return Exports(st.export(state), prep.backbone.source, st.export_files(state))

        ranks = client_ranks(cfg)  # this method's ranks (a comparison may run methods at other ranks)
        clients = [ClientInfo(c.cid, ranks[c.cid], c.num_examples) for c in prep.clients]
        return MethodRun(st, side.trainer, clients, prep.shapes, side.trainer.hooks.keeps_state, finish)

    kw.setdefault("robust_aggregation", "")
    kw.setdefault("server_optimizer", "")
    return Method(name, summary, build, client=client, server=strategy, client_hooks=hooks,
                  keeps_client_state=lambda cfg: hooks(cfg).keeps_state, **kw)
