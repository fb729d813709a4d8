"""What FedSLM's and FedMKT's recipes report beside the clients' held-out metrics: the full server
model on every client's test set, the client models' memory against the full model."""

from __future__ import annotations

import dataclasses
from typing import Any

from nestfed.config import ExperimentConfig, TrainConfig
from nestfed.federation.client import ClientTrainer
from nestfed.federation.messages import Arrays, ClientInfo
from nestfed.federation.prepared import Prepared
from nestfed.methods.compressed.setup import CompressedSetup


def evaluate_server(
    prep: Prepared, cfg: ExperimentConfig, arrays: Arrays, scaling: float
) -> dict[str, dict[str, float]]:
    """The full server model (backbone + LoRA ``arrays`` at scale s) on every client's test set.

    Args:
        prep: the prepared experiment (backbone, clients' data).
        cfg: the experiment (``[train]``'s evaluation settings).
        arrays: the server's LoRA arrays.
        scaling: the LoRA scale s.

    Returns:
        {cid (str): held-out metrics}.
    """
    trainer = ClientTrainer(prep.backbone.model, prep.data, cfg.train)
    return {str(cid): trainer.evaluate(cid, arrays, scaling) for cid in sorted(prep.data)}


def mean_ppl(evals: dict[str, dict[str, float]]) -> float:
    """Mean over clients of the held-out perplexity.

    Args:
        evals: {cid: held-out metrics with ``ppl``}.

    Returns:
        The mean (0 for no client).
    """
    return sum(v["ppl"] for v in evals.values()) / max(len(evals), 1)


def compressed_clients(prep: Prepared) -> list[ClientInfo]:
    """The clients as the server sees them (rank 0: they hold SVD cores, not LoRA).

    Args:
        prep: the prepared experiment.

    Returns:
        One ClientInfo per client, in cid order.
    """
    return [ClientInfo(cid, 0, d.num_examples) for cid, d in sorted(prep.data.items())]


def core_train(cfg: ExperimentConfig) -> TrainConfig:
    """The local training settings of the cores: train.* with lr = compression.core_lr.

    Args:
        cfg: the experiment.

    Returns:
        The training settings.
    """
    return dataclasses.replace(cfg.train, lr=cfg.section("compression").core_lr)


def client_memory(setup: CompressedSetup) -> dict[str, Any]:
    """Bytes of every group's client model against the full backbone (parameters + buffers).

    Args:
        setup: the compressed side of the experiment.

    Returns:
        ``full_model_bytes``, ``groups`` ({g: ratio, bytes, ratio_to_full, clients, and with memory
            budgets ``train_footprint_bytes``, the training footprint the ratio was chosen by}) and
            ``mean_ratio_to_full`` over the clients.
    """
    full = setup.bytes["full"]
    groups = {}
    for g, rho in enumerate(setup.ratios):
        groups[str(g)] = {
            "ratio": rho,
            "bytes": setup.bytes[g],
            "ratio_to_full": setup.bytes[g] / full,
            "clients": sorted(c for c, h in setup.client_group.items() if h == g),
        }
        if rho in setup.footprints:
            groups[str(g)]["train_footprint_bytes"] = setup.footprints[rho].bytes
    return {
        "full_model_bytes": full,
        "groups": groups,
        "mean_ratio_to_full": sum(setup.bytes[setup.client_group[c]] for c in setup.client_group)
        / (full * len(setup.client_group)),
    }


def client_fields(setup: CompressedSetup) -> dict[str, Any]:
    """The summary's per-client compression: each client's ratio and, with budgets, its budget.

    Args:
        setup: the compressed side of the experiment.

    Returns:
        ``ratios`` (the groups' rho), ``client_ratio`` ({cid: rho}) and, when memory budgets chose
        the ratios, ``client_memory_mib`` ({cid: budget}) and ``ratio_footprints`` ({rho: {weights,
        trainable, saved, bytes, mib}} of every ratio choice, chosen or not).
    """
    out: dict[str, Any] = {
        "ratios": setup.ratios,
        "client_ratio": {str(k): setup.ratios[g] for k, g in sorted(setup.client_group.items())},
    }
    if setup.budgets is not None:
        out["client_memory_mib"] = {str(k): b for k, b in sorted(setup.budgets.items())}
        out["ratio_footprints"] = {
            f"{rho:g}": {**dataclasses.asdict(f), "bytes": f.bytes, "mib": f.bytes / 2**20}
            for rho, f in sorted(setup.footprints.items())
        }
    return out


def client_columns(setup: CompressedSetup) -> dict[int, dict[str, Any]]:
    """The columns clients.csv adds for compressed clients: each client's ratio rho.

    Args:
        setup: the compressed side of the experiment.

    Returns:
        {cid: {"ratio": rho}}.
    """
    return {cid: {"ratio": setup.ratios[g]} for cid, g in setup.client_group.items()}
