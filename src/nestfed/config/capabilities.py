"""What a method can do: one typed set per method, declared on its registry line
(nestfed.methods.method.Method.capabilities), refused by default, enforced when a config is
loaded and again by the round loop for every transport (nestfed.federation.loop).

A capability is asked for by a setting (`asked_by`: the config; a transport adds its own,
e.g. Flower and its secure aggregation). A method that does not declare a capability it is asked
for is refused with one line, ``<field>: <method> cannot <what>: <reason>``, the reason being the
method's own (``Method.refusals``) or the capability's default. The invariant tests
(tests/methods/test_capabilities.py) hold every declaring method to what the capability means.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Any


class Capability(StrEnum):
    """One thing a method may be asked to do (docs/architecture.md, "What a method can do")."""

    #: clients of different ranks r_k in one federation (``lora.ranks``, ``[population]``)
    HETEROGENEOUS_RANKS = "heterogeneous_ranks"
    #: a client trains this round at a rank below its own (``population.elastic``)
    ELASTIC_RANKS = "elastic_ranks"
    #: the aggregate cut into rank blocks, each combined by a robust rule or with central DP's noise
    ROBUST_AGGREGATION = "robust_aggregation"
    #: the aggregate rebuilt from secure sums alone (Flower's SecAgg+; ``aggregate_secure``)
    SECURE_AGGREGATION = "secure_aggregation"
    #: the aggregate minus the state is a pseudo-gradient a server optimiser can step
    SERVER_OPTIMIZER = "server_optimizer"
    #: the client and server halves run on Flower's deployment and simulation engines
    FLOWER = "flower"
    #: a run resumes from its checkpoint to the state an uninterrupted run reaches (client state included)
    RESUME = "resume"
    #: one global model the server holds that every client could run (the server's global
    #: evaluation, ``evaluation.global_test``)
    GLOBAL_MODEL = "global_model"
    #: clients train over a backbone whose linear layers bitsandbytes holds quantised (``model.quantization``)
    QUANTIZED_BACKBONE = "quantized_backbone"
    #: that global model is one LoRA adapter of rank r_max whose rank prefixes a client can run
    #: (``nestfed export --rank``, the truncation curve, dimension importance)
    EXPORT_AT_RANK = "export_at_rank"


#: {capability: (what a refusal says the method cannot do, the default reason)}
WHAT: dict[Capability, tuple[str, str]] = {
    Capability.HETEROGENEOUS_RANKS: ("take clients of different ranks", "its clients must all have the same rank"),
    Capability.ELASTIC_RANKS: (
        "train an elastic rank",
        "its clients do not train a LoRA prefix of the global adapter (docs/scale.md, elastic ranks)",
    ),
    Capability.ROBUST_AGGREGATION: (
        "aggregate robustly or with central DP",
        "its server does not aggregate LoRA updates in rank blocks (docs/trust.md)",
    ),
    Capability.SECURE_AGGREGATION: (
        "aggregate from secure sums alone",
        "its rule needs individual updates (docs/secure_aggregation.md)",
    ),
    Capability.SERVER_OPTIMIZER: (
        "take a server optimiser",
        "its server does not combine parameter updates, so its state has no pseudo-gradient "
        "(docs/architecture.md, Server optimisers)",
    ),
    Capability.FLOWER: ("run on Flower", "it runs only embedded; use nestfed run"),
    Capability.RESUME: ("resume a run", "its state cannot be restored from a checkpoint"),
    Capability.GLOBAL_MODEL: (
        "evaluate one global model",
        "its clients do not share one global model (each keeps its own)",
    ),
    Capability.QUANTIZED_BACKBONE: (
        "train over a quantised backbone",
        "its clients need the backbone's dense weights (docs/scale.md, quantised backbones)",
    ),
    Capability.EXPORT_AT_RANK: (
        "export its global adapter at a rank",
        "it has no global LoRA adapter of rank r_max that clients run a prefix of",
    ),
}


# the capability sets several methods share; each home builds its set from them and single ones
#: clients of any rank r_k <= r_max, each training a LoRA prefix of the global adapter (a shorter
#: one in a round when elastic)
RANK_PREFIX_CLIENTS = frozenset({Capability.HETEROGENEOUS_RANKS, Capability.ELASTIC_RANKS})
#: a server whose aggregate is the mean of the clients' updates block by block, so a robust rule or
#: central DP can replace the mean and a server optimiser can step its pseudo-gradient
MEAN_AGGREGATOR = frozenset({Capability.ROBUST_AGGREGATION, Capability.SERVER_OPTIMIZER})
#: one global LoRA adapter of rank r_max that every client runs a rank prefix of: the server
#: evaluates it and exports it at any rank
GLOBAL_ADAPTER = frozenset({Capability.GLOBAL_MODEL, Capability.EXPORT_AT_RANK})


def asked_by(cfg: Any) -> dict[Capability, str]:
    """Find the capabilities an experiment config asks for.

    Args:
        cfg: an ExperimentConfig (typed loosely: this module sits below the schema).

    Returns:
        ``{capability: the field that asks}``.
    """
    out: dict[Capability, str] = {}
    if len(set(cfg.lora.ranks)) > 1:
        out[Capability.HETEROGENEOUS_RANKS] = "lora.ranks"
    elif len(cfg.population.support(cfg.lora.r_max)) > 1:
        out[Capability.HETEROGENEOUS_RANKS] = "population"
    if cfg.population.elastic != "none":
        out[Capability.ELASTIC_RANKS] = "population.elastic"
    if cfg.robust.rule != "mean":
        out[Capability.ROBUST_AGGREGATION] = "robust.rule"
    elif cfg.privacy.mode == "central":
        out[Capability.ROBUST_AGGREGATION] = "privacy.mode"
    if not cfg.server_optimizer.identity:
        out[Capability.SERVER_OPTIMIZER] = "server_optimizer.name"
    if cfg.model.quantization != "none":
        out[Capability.QUANTIZED_BACKBONE] = "model.quantization"
    elif any(q != "none" for q in cfg.population.precisions):
        out[Capability.QUANTIZED_BACKBONE] = "population.precisions"
    return out


def refusal(
    method: str, declared: Iterable[Capability], asked: Mapping[Capability, str], reasons: Mapping[Capability, str]
) -> str | None:
    """Write the one line refusing the first capability asked for that a method lacks.

    Args:
        method: the method's name.
        declared: the capabilities it declares.
        asked: ``{capability: field}``, what is asked for.
        reasons: the method's own reasons (``Method.refusals``); a capability's default otherwise.

    Returns:
        ``<field>: <method> cannot <what>: <reason>``; None when all are declared.
    """
    have = set(declared)
    for cap, where in asked.items():
        if cap not in have:
            what, default = WHAT[cap]
            return f"{where}: {method} cannot {what}: {reasons.get(cap) or default}"
    return None
