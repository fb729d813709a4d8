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
        ``full_model_bytes``, ``groups`` ({g: ratio, bytes, ratio_to_full}) and
            ``mean_ratio_to_full`` over the clients.
    """
    full = setup.bytes["full"]
    return {
        "full_model_bytes": full,
        "groups": {
            str(g): {"ratio": rho, "bytes": setup.bytes[g], "ratio_to_full": setup.bytes[g] / full}
            for g, rho in enumerate(setup.ratios)
        },
        "mean_ratio_to_full": sum(setup.bytes[setup.client_group[c]] for c in setup.client_group)
        / (full * len(setup.client_group)),
    }
