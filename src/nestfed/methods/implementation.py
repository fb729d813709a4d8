"""What runs a method: its implementation, the shared shape of the LoRA methods' homes, and a method
set up on a prepared experiment.

A method's declaration (nestfed.methods.method.Method, the registry line) names the module whose
``IMPLEMENTATION`` is an `Implementation`: how it sets up a run on a prepared experiment (a
strategy for the server, a trainer for the clients: nestfed.federation.client.ClientTrainer with
the method's hooks, or its own), its two halves on Flower, its model-dependent checks and whether
its clients keep state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from nestfed.config import ExperimentConfig, client_ranks, r_max
from nestfed.federation.client import ClientTrainer
from nestfed.federation.hooks import ClientHooks
from nestfed.federation.in_process import Trainer
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState
from nestfed.federation.prepared import Prepared, tier_config
from nestfed.federation.run_dir import Exports
from nestfed.federation.strategy import LoraSettings, Strategy


@dataclass
class MethodRun:
    """A method set up on a prepared experiment.

    Attributes:
        strategy: the server's strategy.
        trainer: runs the clients' local rounds.
        clients: the clients with their ranks and example counts.
        shapes: {module: (out, in)} of the LoRA layers.
        keeps_client_state: whether its clients keep state between rounds.
        finish: ``finish(state) -> Exports`` after the last round.
        client_columns: {cid: {column: value}} the method adds to each client's row of the run's
            roster (clients.csv), e.g. a compressed client's ratio; {} for none.
    """

    strategy: Strategy
    trainer: Trainer
    clients: list[ClientInfo]
    shapes: dict[str, tuple[int, int]]
    keeps_client_state: bool
    finish: Callable[[GlobalState], Exports]
    client_columns: dict[int, dict[str, Any]] = field(default_factory=dict)


@dataclass
class ClientSide:
    """A method's client on one node (Flower).

    Attributes:
        trainer: the node's client trainer.
        initial_arrays: the arrays the server's strategy starts from that only a model can give
            (e.g. fresh memory rules; {} for most methods).
    """

    trainer: ClientTrainer
    initial_arrays: Arrays


@dataclass(frozen=True)
class Implementation:
    """What runs one method.

    Attributes:
        build: ``build(prep, cfg) -> MethodRun``.
        client: ``client(prep, cfg) -> ClientSide``, the client half on Flower; None: not on Flower.
        server: ``server(cfg, initial_arrays) -> Strategy``, the server half on Flower; None: not on
            Flower.
        check_model: ``check_model(prep, cfg)``: checks that need the model, raising ConfigError,
            run before any file is written; None for none.
        keeps_client_state: ``keeps_client_state(cfg)``: whether its clients keep state between
            rounds under this config.
        client_hooks: ``client_hooks(cfg)``: the client hooks of a method whose clients run the LoRA
            client trainer; None for the others.
    """

    build: Callable[[Prepared, ExperimentConfig], MethodRun]
    client: Callable[[Prepared, ExperimentConfig], ClientSide] | None = None
    server: Callable[[ExperimentConfig, Arrays], Strategy] | None = None
    check_model: Callable[[Prepared, ExperimentConfig], None] | None = None
    keeps_client_state: Callable[[ExperimentConfig], bool] = lambda cfg: False
    client_hooks: Callable[[ExperimentConfig], ClientHooks] | None = None


def lora_settings(cfg: ExperimentConfig) -> LoraSettings:
    """The LoRA numbers every LoRA strategy needs, from the config.

    r_max, lora_alpha, the scaling convention, the initialisation seed and the federation's seed.

    Args:
        cfg: the experiment.

    Returns:
        The settings.
    """
    return LoraSettings(
        r_max=r_max(cfg),
        lora_alpha=cfg.lora.lora_alpha,
        scaling=cfg.lora.scaling,
        init_seed=cfg.lora.init_seed,
        seed=cfg.federation.seed,
    )


def lora_implementation(
    strategy: Callable[[ExperimentConfig, Arrays], Strategy],
    hooks: Callable[[ExperimentConfig], ClientHooks] = lambda cfg: ClientHooks(),
    setup: Callable[[Prepared, ExperimentConfig], Arrays] | None = None,
    report: Callable[[Prepared, ExperimentConfig], dict[str, Any]] | None = None,
    **kw: Any,
) -> Implementation:
    """The implementation of a method whose clients run the client trainer on the shared backbone.

    Args:
        strategy: ``strategy(cfg, initial_arrays)`` -> its server strategy.
        hooks: ``hooks(cfg)`` -> its client hooks; plain ClientHooks by default.
        setup: ``setup(prep, cfg)`` -> initial arrays: what it adds to the model before its first
            round (e.g. memory layers), on the server's model and on every Flower node alike; None
            for nothing.
        report: ``report(prep, cfg)`` -> the method's own summary fields, measured by its setup
            (e.g. a warm-up's cost), in an embedded run's summary; None for none.
        **kw: the other `Implementation` fields (check_model).

    Returns:
        The implementation, with both halves on Flower.
    """

    def client(prep: Prepared, cfg: ExperimentConfig) -> ClientSide:
        initial = setup(prep, cfg) if setup is not None else {}
        own = cfg.model.quantization
        for q, backbone in prep.backbones.items():  # device tiers: every other precision's model alike
            if q != own and setup is not None:
                setup(replace(prep, backbone=backbone), tier_config(cfg, q))
        models = {cid: prep.backbones[q].model for cid, q in enumerate(prep.precisions or []) if q != own}
        trainer = ClientTrainer(
            prep.backbone.model, prep.data, cfg.train, hooks(cfg), privacy=cfg.privacy, attack=cfg.attack, models=models
        )
        return ClientSide(trainer, initial)

    def build(prep: Prepared, cfg: ExperimentConfig) -> MethodRun:
        side = client(prep, cfg)
        st = strategy(cfg, side.initial_arrays)

        def finish(state: GlobalState) -> Exports:
            fields = report(prep, cfg) if report is not None else {}
            return Exports(st.export(state), prep.backbone.source, st.export_files(state), fields)

        # this method's ranks (a comparison may run methods at other ranks); memory budgets through the
        # footprint measured when the experiment was prepared
        footprints = {q: f.bytes for q, f in prep.footprints.items()} if prep.footprints else None
        ranks = client_ranks(cfg, footprints or (prep.footprint.bytes if prep.footprint is not None else None))
        clients = [ClientInfo(c.cid, ranks[c.cid], c.num_examples) for c in prep.clients]
        return MethodRun(st, side.trainer, clients, prep.shapes, side.trainer.hooks.keeps_state, finish)

    return Implementation(
        build,
        client=client,
        server=strategy,
        client_hooks=hooks,
        keeps_client_state=lambda cfg: hooks(cfg).keeps_state,
        **kw,
    )
