"""A client's compression ratio chosen by its memory budget (``compression.ratio_choices`` with
``population.memory_mib``; docs/scale.md, device tiers).

The preparation draws every client's budget as for any method (nestfed.config.population.draw_budgets,
the same stream, so every method of a comparison gives each client the same budget) and leaves
the choice to the compressed methods' setup (``Method.chooses_memory``). Here each choice's
compressed client model is derived from the bases (computed once, at the largest choice), its
training footprint measured with nestfed.nn.footprint's accounting
(`nestfed.nn.footprint.TrainedFootprint`: the model's weights, 16 bytes per trained core entry,
and the tensors autograd saves for one (micro-)batch of the configured shape, entering the layer
the group's frozen prefix is cached to), and each client takes the largest ratio whose footprint
fits its budget. A budget that holds no choice is an error naming the client, before any file is
written.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from nestfed.config import ConfigError, ExperimentConfig
from nestfed.nn.footprint import TrainedFootprint

MIB = 2**20


def choose_ratio(mib: int, footprints: Mapping[float, int]) -> float | None:
    """Choose a budget's compression ratio: the largest whose footprint fits.

    Args:
        mib: the budget, MiB.
        footprints: {ratio rho: training footprint of its compressed client model, bytes}.

    Returns:
        The largest rho with footprint <= mib * 2**20; None when none fits.
    """
    fits = [rho for rho, b in footprints.items() if b <= mib * MIB]
    return max(fits) if fits else None


def choose_ratios(budgets: Mapping[int, int], footprints: Mapping[float, int]) -> dict[int, float]:
    """Choose every client's compression ratio from its budget (`choose_ratio`).

    Args:
        budgets: {cid: memory budget, MiB}.
        footprints: {ratio rho: training footprint of its compressed client model, bytes}.

    Returns:
        {cid: rho}.

    Raises:
        ConfigError: naming ``population.memory_mib``, the client, its budget and what the smallest
            choice needs, for the first client whose budget holds no choice.
    """
    out = {}
    for cid in sorted(budgets):
        rho = choose_ratio(budgets[cid], footprints)
        if rho is None:
            least = min(footprints)
            raise ConfigError(
                f"population.memory_mib: client {cid}'s budget of {budgets[cid]} MiB holds no compression ratio of "
                f"compression.ratio_choices {sorted(footprints)} (rho = {least:g} needs "
                f"{footprints[least] / MIB:.1f} MiB; nestfed.nn.footprint)"
            )
        out[cid] = rho
    return out


def ratio_footprints(
    models: Mapping[float, nn.Module], trained: list[str], cfg: ExperimentConfig, start: int
) -> dict[float, TrainedFootprint]:
    """Measure the training footprint of every choice's compressed client model.

    Args:
        models: {rho: the compressed model derived at rho}.
        trained: the module paths whose cores train (``compression.train_layers``).
        cfg: the experiment (``[train]``'s batch and micro-batch, ``data.block_size``).
        start: the decoder layer the group models' cached prefixes enter (0 = none cached).

    Returns:
        {rho: footprint}.
    """
    out = {}
    for rho, m in models.items():
        cores = [m.get_submodule(n).sigma for n in trained]
        out[rho] = TrainedFootprint.measure(m, cores, cfg.train, cfg.data.block_size, start)
    return out


def budget_ratios(
    budgets: Mapping[int, int] | None,
    models: Mapping[float, nn.Module],
    trained: list[str],
    cfg: ExperimentConfig,
    start: int,
) -> tuple[dict[int, float], dict[float, TrainedFootprint]]:
    """Every client's compression ratio chosen by its budget, and the footprints it was chosen by.

    Args:
        budgets: {cid: memory budget, MiB} (``Prepared.budgets``); None when none were drawn.
        models: {rho: the compressed model derived at rho}, one per ``compression.ratio_choices``.
        trained: the module paths whose cores train.
        cfg: the experiment.
        start: the decoder layer the group models' cached prefixes enter.

    Returns:
        ({cid: rho}, {rho: footprint}).

    Raises:
        ConfigError: naming ``population.memory_mib`` when no budgets were drawn or a budget holds
            no choice (`choose_ratios`).
    """
    if budgets is None:
        raise ConfigError("compression.ratio_choices: the preparation drew no memory budgets (population.memory_mib)")
    footprints = ratio_footprints(models, trained, cfg, start)
    return choose_ratios(budgets, {rho: f.bytes for rho, f in footprints.items()}), footprints
