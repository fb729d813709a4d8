"""FedMKT's run on a prepared experiment (the method is declared in nestfed.methods.fedmkt): the
server distiller, one mutual-distillation trainer per compressed group, the strategy."""

from __future__ import annotations

from nestfed.config import ExperimentConfig, r_max
from nestfed.federation.client import ClientTrainer
from nestfed.federation.messages import GlobalState
from nestfed.federation.prepared import Prepared
from nestfed.federation.run_dir import Exports
from nestfed.methods.compressed.evaluation import (
    client_columns,
    client_fields,
    client_memory,
    compressed_clients,
    core_train,
    evaluate_server,
    mean_ppl,
)
from nestfed.methods.compressed.groups import GroupedTrainer
from nestfed.methods.compressed.setup import prepare_compressed
from nestfed.methods.fedmkt.clients import MutualClientTrainer, ServerDistiller
from nestfed.methods.fedmkt.strategy import FedMKT
from nestfed.methods.implementation import Implementation, MethodRun
from nestfed.nn.arrays import apply_arrays
from nestfed.nn.lora import init_adapter_state


def build(prep: Prepared, cfg: ExperimentConfig) -> MethodRun:
    """FedMKT set up on a prepared experiment.

    The server distiller on the full model (LoRA of rank lora.r_max), one mutual-distillation
    trainer per compressed group, the FedMKT strategy; after the last round the server's LoRA.

    Args:
        prep: the prepared experiment.
        cfg: the experiment.

    Returns:
        The method run.
    """
    setup = prepare_compressed(prep, cfg)
    m, c = cfg.section("fedmkt"), cfg.section("compression")
    r = r_max(cfg)
    scale = cfg.lora.lora_alpha / r
    labels = setup.server_text.labels
    server = ServerDistiller(
        prep.backbone.model,
        setup.public["strong"],
        labels,
        scale,
        m.topk,
        m.lm_weight,
        m.server_steps,
        m.batch_size,
        m.server_lr,
        cfg.federation.seed,
    )
    trainers = {
        g: MutualClientTrainer(
            ClientTrainer(model, setup.data[g], core_train(cfg), privacy=cfg.privacy, attack=cfg.attack),
            setup.public[g],
            labels,
            setup.initial[g],
            m.topk,
            m.lm_weight,
            m.client_steps,
            m.batch_size,
            c.core_lr,
        )
        for g, model in setup.models.items()
    }
    strategy = FedMKT(
        server,
        init_adapter_state(prep.shapes, r, cfg.lora.init_seed),
        setup.client_group,
        setup.ratios,
        cfg.federation.seed,
    )

    def finish(state: GlobalState) -> Exports:
        for g, model in setup.models.items():
            apply_arrays(model, setup.initial[g], 1.0)
        adapter, s = strategy.export(state)
        ev = evaluate_server(prep, cfg, adapter, s)
        extra = {
            "server_eval": ev,
            "server_mean_ppl": mean_ppl(ev),
            "client_memory": client_memory(setup),
            **client_fields(setup),
            "public_blocks": int(labels.shape[0]),
            "server_last_round": state.meta.get("server", {}),
            "round0": "compressed clients",
        }
        return Exports((adapter, s), prep.backbone.source, {}, extra)

    trainer = GroupedTrainer(trainers, setup.client_group)
    return MethodRun(strategy, trainer, compressed_clients(prep), {}, True, finish, client_columns(setup))


IMPLEMENTATION = Implementation(
    build, check_model=lambda prep, cfg: prepare_compressed(prep, cfg) and None, keeps_client_state=lambda cfg: True
)
