"""``[population]``: who the clients are beyond their data: their LoRA ranks, drawn from a
distribution or from device memory budgets, ranks that change from round to round (elastic), and
whether a client is online and finishes its round (docs/scale.md).

Every draw follows the one seed rule (nestfed.seeds): the ranks and budgets of the clients are a
property of the experiment, drawn from ``data.seed`` (the same for every method and every
``federation.seed`` of a comparison, as the data partition is); who is online, who drops out and
the elastic ranks are drawn per round from ``federation.seed``, so a resumed run draws them again
exactly.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from nestfed.seeds import stream_seed

#: {value: share} written in TOML as an inline table, ``{2 = 0.4, 4 = 0.3, 8 = 0.2, 16 = 0.1}``
Shares = tuple[tuple[int, float], ...]

RANK_DRAWS = ("stratified", "independent")
ELASTIC = ("none", "uniform", "trace")
#: the backbone precisions (``model.quantization``'s values), the most precise first: the order in
#: which a memory budget tries them (`choose_tier`)
PRECISIONS = ("none", "int8", "nf4")
#: bytes of a client's training footprint at rank r, one per backbone precision
Footprints = Mapping[str, Callable[[int], int]]


@dataclass(frozen=True)
class PopulationConfig:
    """The clients as a population.

    A method serves an elastic rank by training the prefix of that rank, or refuses the setting
    with its reason (the ELASTIC_RANKS capability, nestfed.config.capabilities).

    Attributes:
        rank_shares: {rank r: share} the clients' ranks r_k are drawn from (shares sum to 1); empty
            = ``lora.ranks``, which it then replaces (lora.ranks must then be left at one value).
        memory_mib: {device memory in MiB: share}: alternatively each client's memory budget is
            drawn from these tiers and its rank is the largest of ``rank_choices`` whose training
            footprint fits the budget (the footprint model of nestfed.nn.footprint, measured on the
            backbone when the experiment is prepared), at the precision ``precisions`` chooses. A
            method that chooses what a budget holds itself (FedSLM and FedMKT: a compression ratio
            from ``compression.ratio_choices``) gets the same budgets and no LoRA tier.
        rank_choices: the ranks a memory budget chooses from (empty = 1, 2, 4, ... up to
            lora.r_max).
        precisions: the backbone precisions a memory budget chooses from (values of
            ``model.quantization``; empty = ``model.quantization`` alone, every client on the one
            backbone). With several, each client's tier is the most precise backbone whose
            footprint holds at least the smallest of ``rank_choices``, then the largest rank that
            fits at that precision (`choose_tier`; docs/scale.md, device tiers): precision first,
            since a lower precision costs every rank (nf4 costs the main job 23% held-out
            perplexity, bench/results/quantization_main_job), where a lower rank only narrows the
            adapter.
        rank_draw: ``stratified`` (each value's count is its share of data.num_clients, rounded by
            largest remainders, on a seeded permutation of the clients) or ``independent`` (every
            client draws on its own).
        elastic: ``none``; ``uniform`` (each round a sampled client trains at a rank drawn uniformly
            from the federation's ranks up to its own, as if its free memory varied); ``trace``
            (the ranks of ``elastic_trace``).
        elastic_trace: a CSV file with columns round, client and rank, or memory_mib (a budget
            trace, each budget turned into the largest rank whose footprint fits, a budget that
            holds none sitting the round out); a (round, client) it does not list trains at its own
            rank.
        availability: the probability that a client is online in a round (sampling draws from the
            online clients).
        dropout: the probability that a sampled client drops out before it replies.
    """

    rank_shares: Shares = ()
    memory_mib: Shares = ()
    rank_choices: tuple[int, ...] = ()
    precisions: tuple[str, ...] = ()
    rank_draw: str = "stratified"
    elastic: str = "none"
    elastic_trace: str = ""
    availability: float = 1.0
    dropout: float = 0.0

    @property
    def draws_ranks(self) -> bool:
        """Whether the clients' ranks come from this section (shares or memory budgets), not lora.ranks."""
        return bool(self.rank_shares or self.memory_mib)

    def tiers(self, own: str) -> list[str]:
        """List the backbone precisions the clients may hold, the most precise first.

        Args:
            own: ``model.quantization``.

        Returns:
            ``precisions`` in `PRECISIONS`' order, else ``[own]``.
        """
        return sorted(set(self.precisions), key=PRECISIONS.index) if self.precisions else [own]

    def support(self, r_max_setting: int) -> list[int]:
        """List the ranks a client may be given, sorted.

        Args:
            r_max_setting: ``lora.r_max`` as set (0 = unset).

        Returns:
            The shares' ranks, or the memory budgets' choices (``rank_choices``, else 1, 2, 4, ...
            up to ``r_max_setting``); [] when lora.ranks decides.
        """
        if self.rank_shares:
            return sorted(r for r, _ in self.rank_shares)
        if self.memory_mib:
            if self.rank_choices:
                return sorted(set(self.rank_choices))
            return [2**i for i in range(int(math.log2(r_max_setting)) + 1)] if r_max_setting else []
        return []


def _check_shares(name: str, shares: Shares) -> None:
    if not shares:
        return
    keys = [k for k, _ in shares]
    if len(set(keys)) != len(keys):
        raise ValueError(f"population.{name}: a value is listed twice ({keys})")
    if any(k < 1 for k in keys):
        raise ValueError(f"population.{name}: every value must be a positive integer, got {keys}")
    if any(not s > 0 for _, s in shares):
        raise ValueError(f"population.{name}: every share must be > 0, got {[s for _, s in shares]}")
    total = sum(s for _, s in shares)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"population.{name}: the shares sum to {total:g}, not 1")


def check_population(p: PopulationConfig, lora_ranks: Sequence[int], r_max_setting: int) -> None:
    """Check ``[population]`` against ``lora.ranks`` and ``lora.r_max``.

    Args:
        p: the section.
        lora_ranks: ``lora.ranks``.
        r_max_setting: ``lora.r_max`` as set (0 = unset).

    Raises:
        ValueError: "population.<key>: <reason>", for the first value at fault.
    """
    _check_shares("rank_shares", p.rank_shares)
    _check_shares("memory_mib", p.memory_mib)
    if p.rank_shares and p.memory_mib:
        raise ValueError("population.rank_shares and population.memory_mib both choose the ranks; set one")
    if p.draws_ranks and len(lora_ranks) > 1:
        which = "rank_shares" if p.rank_shares else "memory_mib"
        raise ValueError(
            f"population.{which} draws the clients' ranks and lora.ranks lists {list(lora_ranks)}; "
            "set one (lora.ranks = [r] is then ignored)"
        )
    if any(r < 1 for r in p.rank_choices):
        raise ValueError(f"population.rank_choices: every rank must be >= 1, got {list(p.rank_choices)}")
    if p.memory_mib and not p.rank_choices and not r_max_setting:
        raise ValueError(
            "population.memory_mib: give population.rank_choices or lora.r_max (the ranks a budget chooses from)"
        )
    if p.rank_choices and not p.memory_mib:
        raise ValueError("population.rank_choices: only population.memory_mib chooses from it")
    unknown = [q for q in p.precisions if q not in PRECISIONS]
    if unknown:
        raise ValueError(f"population.precisions: unknown {unknown} (known: {', '.join(PRECISIONS)})")
    if len(set(p.precisions)) != len(p.precisions):
        raise ValueError(f"population.precisions: a precision is listed twice ({list(p.precisions)})")
    if p.precisions and not p.memory_mib:
        raise ValueError("population.precisions: only population.memory_mib chooses from it")
    if any(q != "none" for q in p.precisions) and importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(
            "population.precisions: int8 and nf4 need bitsandbytes, which is not installed "
            "(scripts/setup.sh installs it; or pip install bitsandbytes)"
        )
    if p.rank_draw not in RANK_DRAWS:
        raise ValueError(f"population.rank_draw: '{p.rank_draw}' is not one of {', '.join(RANK_DRAWS)}")
    if p.elastic not in ELASTIC:
        raise ValueError(f"population.elastic: '{p.elastic}' is not one of {', '.join(ELASTIC)}")
    if (p.elastic == "trace") != bool(p.elastic_trace):
        raise ValueError(
            "population.elastic_trace: a trace file goes with population.elastic = 'trace', and only with it"
        )
    if not 0 < p.availability <= 1:
        raise ValueError(f"population.availability must be in (0, 1], got {p.availability}")
    if not 0 <= p.dropout < 1:
        raise ValueError(f"population.dropout must be in [0, 1), got {p.dropout}")


def draw(shares: Shares, n: int, how: str, seed: int, stream: str) -> list[int]:
    """Draw one value per client 0..n-1 from shares.

    Args:
        shares: {value: share}.
        n: the clients.
        how: ``stratified`` (value v appears floor(share_v n) times plus one for the largest
            remainders, ties to the smaller value, on a permutation of the clients) or
            ``independent`` (each client draws on its own).
        seed: the seed (``data.seed``); the draws come from the seed rule's stream ``stream`` of
            (seed, 0, 0).
        stream: the stream's name.

    Returns:
        The values, client by client.

    Raises:
        ValueError: for no shares or n < 1.
    """
    if not shares or n < 1:
        raise ValueError("draw needs shares and at least one client")
    values = [v for v, _ in sorted(shares)]
    p = np.asarray([s for _, s in sorted(shares)], dtype=np.float64)
    p = p / p.sum()
    rng = np.random.default_rng(stream_seed(seed, 0, 0, stream))
    if how == "independent":
        return [int(values[i]) for i in rng.choice(len(values), size=n, p=p)]
    exact = p * n
    counts = np.floor(exact).astype(int)
    for i in sorted(range(len(values)), key=lambda i: (-(exact[i] - counts[i]), i))[: n - int(counts.sum())]:
        counts[i] += 1
    out = np.repeat(np.asarray(values), counts)
    return [int(v) for v in out[rng.permutation(n)]]


def draw_budgets(p: PopulationConfig, num_clients: int, seed: int) -> list[int]:
    """Draw every client's memory budget from ``population.memory_mib``.

    The one draw of the budgets (stream ``population/memory`` of ``data.seed``), whichever method
    turns them into what a client trains: every method of a comparison gives each client the same
    budget.

    Args:
        p: the ``[population]`` section, with ``memory_mib``.
        num_clients: ``data.num_clients``.
        seed: ``data.seed``.

    Returns:
        Every client's budget, MiB.

    Raises:
        ValueError: without ``memory_mib``.
    """
    if not p.memory_mib:
        raise ValueError("population.memory_mib: no budgets to draw")
    return draw(p.memory_mib, num_clients, p.rank_draw, seed, "population/memory")


def choose_tier(mib: int, choices: Sequence[int], sizes: Mapping[str, Mapping[int, int]]) -> tuple[str, int] | None:
    """Choose a memory budget's tier (docs/scale.md, device tiers).

    The most precise backbone that holds at least the smallest rank choice, then the largest rank
    that fits at that precision.

    Args:
        mib: the budget, MiB.
        choices: the ranks it chooses from.
        sizes: {precision: {rank: footprint bytes}}, precisions among `PRECISIONS`.

    Returns:
        (precision, rank); None when no precision holds any rank.
    """
    for precision in sorted(sizes, key=PRECISIONS.index):
        fits = [r for r in choices if sizes[precision][r] <= mib * 2**20]
        if fits:
            return precision, max(fits)
    return None


def assign_tiers(
    p: PopulationConfig,
    lora_ranks: Sequence[int],
    r_max_setting: int,
    num_clients: int,
    seed: int,
    footprints: Footprints | Callable[[int], int] | None = None,
    own: str = "none",
    lora_tiers: bool = True,
) -> tuple[list[int], list[int] | None, list[str]]:
    """Assign every client its rank, its backbone precision and, for memory budgets, its budget.

    From ``rank_shares`` (`draw`, stream ``population/rank``), from ``memory_mib`` (budgets
    drawn by `draw_budgets`; the tier, precision and rank, by `choose_tier` among
    ``p.tiers(own)`` and the rank choices), else ``lora.ranks`` broadcast. Without memory budgets
    every client holds ``own``. With ``lora_tiers`` False (a method whose own setup chooses what a
    budget holds, ``Method.chooses_memory``) the budgets are drawn alike and no tier is chosen:
    ``lora.ranks`` broadcast, every client at ``own``.

    Args:
        p: the ``[population]`` section.
        lora_ranks: ``lora.ranks``.
        r_max_setting: ``lora.r_max`` as set (0 = unset).
        num_clients: ``data.num_clients``.
        seed: ``data.seed``.
        footprints: {precision: bytes of a client's training footprint at rank r}
            (nestfed.nn.footprint) for every precision of ``p.tiers(own)``, or one callable for
            ``own``; None before the model is loaded.
        own: ``model.quantization``.
        lora_tiers: whether the budgets choose each client's LoRA tier (precision and rank); False
            draws the budgets only.

    Returns:
        (rank r_k of every client, every client's memory budget in MiB or None, every client's
        backbone precision).

    Raises:
        ValueError: naming ``population.memory_mib`` and the client when a budget fits no tier,
            or when budgets need a footprint and none is given (the model is not loaded yet).
    """
    tiers = p.tiers(own)
    if p.rank_shares:
        return draw(p.rank_shares, num_clients, p.rank_draw, seed, "population/rank"), None, [own] * num_clients
    if p.memory_mib and not lora_tiers:
        ranks = list(lora_ranks) * (num_clients if len(lora_ranks) == 1 else 1)
        return ranks, draw_budgets(p, num_clients, seed), [own] * num_clients
    if p.memory_mib:
        if footprints is None:
            raise ValueError(
                "population.memory_mib: the ranks follow from the backbone's footprint, known once the "
                "experiment is prepared"
            )
        if callable(footprints):
            footprints = {own: footprints}
        budgets = draw_budgets(p, num_clients, seed)
        choices = p.support(r_max_setting)
        sizes = {q: {r: footprints[q](r) for r in choices} for q in tiers}
        ranks, precisions = [], []
        for cid, mib in enumerate(budgets):
            tier = choose_tier(mib, choices, sizes)
            if tier is None:
                least = tiers[-1]
                where = f" at any precision of {tiers}" if len(tiers) > 1 else ""
                at = f" at {least}" if len(tiers) > 1 else ""
                raise ValueError(
                    f"population.memory_mib: client {cid}'s budget of {mib} MiB holds no rank of {choices}{where} "
                    f"(rank {choices[0]}{at} needs {sizes[least][choices[0]] / 2**20:.0f} MiB; nestfed.nn.footprint)"
                )
            precisions.append(tier[0])
            ranks.append(tier[1])
        return ranks, budgets, precisions
    ranks = list(lora_ranks)
    return (ranks * num_clients if len(ranks) == 1 else ranks), None, [own] * num_clients


def assign_ranks(
    p: PopulationConfig,
    lora_ranks: Sequence[int],
    r_max_setting: int,
    num_clients: int,
    seed: int,
    footprint: Footprints | Callable[[int], int] | None = None,
    own: str = "none",
) -> tuple[list[int], list[int] | None]:
    """Assign every client its rank and, for memory budgets, its budget.

    `assign_tiers` without the precisions.

    Args:
        p: the ``[population]`` section.
        lora_ranks: ``lora.ranks``.
        r_max_setting: ``lora.r_max`` as set (0 = unset).
        num_clients: ``data.num_clients``.
        seed: ``data.seed``.
        footprint: as `assign_tiers`' ``footprints``.
        own: ``model.quantization``.

    Returns:
        (rank r_k of every client, every client's memory budget in MiB or None).

    Raises:
        ValueError: as `assign_tiers`.
    """
    ranks, budgets, _ = assign_tiers(p, lora_ranks, r_max_setting, num_clients, seed, footprint, own)
    return ranks, budgets
