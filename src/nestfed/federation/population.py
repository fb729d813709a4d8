"""What a round draws about its clients beyond the sample.

Who is online, who drops out after being sampled, and the rank a sampled client can train at
this round (``[population]``, nestfed.config.population; docs/scale.md).

Every draw comes from the seed rule's streams of (federation.seed, round, 0): ``online``,
``dropout`` and ``elastic_rank``, one generator per round over the clients in id order, so a
resumed run draws them again exactly, and a setting left at its default draws nothing (a run is
then what it was without the section).
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from nestfed.config import ExperimentConfig
from nestfed.config.population import PRECISIONS, Footprints, PopulationConfig
from nestfed.errors import ConfigError
from nestfed.federation.messages import ClientInfo
from nestfed.seeds import stream_seed


def trace_has_budgets(path: str | Path) -> bool:
    """Tell whether an elastic trace gives memory budgets rather than ranks.

    Budgets (a ``memory_mib`` column) become ranks through the backbone's footprint.

    Args:
        path: the trace's CSV file.

    Returns:
        Whether it has a ``memory_mib`` column; False for a missing or unreadable file
        (`read_trace` reports it).
    """
    try:
        with Path(path).open(newline="", encoding="utf-8") as f:
            return "memory_mib" in (csv.DictReader(f).fieldnames or [])
    except OSError:
        return False


def read_trace(
    path: str | Path,
    ranks: dict[int, int],
    footprint: Footprints | Callable[[int], int] | None = None,
    precisions: Mapping[int, str] | None = None,
) -> dict[tuple[int, int], int]:
    """Read an elastic trace: the rank each client trains at in each round.

    Args:
        path: a CSV file with columns ``round`` (1-based), ``client`` and ``rank``, or
            ``memory_mib`` (the client's memory budget that round, in MiB: its rank is then the
            largest of the federation's ranks up to its own whose ``footprint(r)`` bytes fit at
            the client's precision, and 0 when none fits: the client sits that round out).
        ranks: {cid: the client's own rank r_k}.
        footprint: bytes(r) of the backbone at rank r (nestfed.nn.footprint), or {precision: that}
            for device tiers (``population.precisions``); needed for budgets.
        precisions: {cid: the client's backbone precision}, with a footprint per precision.

    Returns:
        {(round, client): rank}.

    Raises:
        ConfigError: naming the file and line, for a missing file or column, a value that is not a
            positive integer, an unknown client, a rank above the client's own or not among the
            federation's ranks (the segments of nested methods are cut at those: a rank inside a
            segment would count in one rule and not in its sum form), a (round, client) given
            twice, budgets without a footprint, or a budget that holds no rank at the client's
            precision but would at a lower one (a round at another precision than the client's
            tier is not built: its data, frozen prefix and kept state live on its tier's backbone).
    """
    federation = sorted(set(ranks.values()))
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"population.elastic_trace: {p} not found")
    out: dict[tuple[int, int], int] = {}
    with p.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        fields = set(reader.fieldnames or [])
        value = "memory_mib" if "memory_mib" in fields and "rank" not in fields else "rank"
        missing = {"round", "client", value} - fields
        if missing:
            raise ConfigError(
                f"{p}: missing column(s) {', '.join(sorted(missing))} (needs round, client and rank or memory_mib)"
            )
        if value == "memory_mib" and footprint is None:
            raise ConfigError(
                f"{p}: memory budgets become ranks through the backbone's footprint, which this server "
                "does not measure (give ranks, or run embedded)"
            )
        tiers = {"": footprint} if callable(footprint) else dict(footprint or {})
        sizes = {q: {r: f(r) for r in federation} for q, f in tiers.items()} if value == "memory_mib" else {}
        for line, row in enumerate(reader, 2):
            rnd, cid, v = _trace_row(f"{p}:{line}", row, value, ranks)
            if value == "memory_mib":
                q = "" if callable(footprint) else (precisions or {}).get(cid, "none")
                r = _budget_rank(f"{p}:{line}", cid, v, ranks[cid], federation, sizes, q)
            else:
                r = _trace_rank(f"{p}:{line}", cid, v, ranks[cid], federation)
            if (rnd, cid) in out:
                raise ConfigError(f"{p}:{line}: round {rnd}, client {cid} is given twice")
            out[(rnd, cid)] = r
    return out


def _trace_row(where: str, row: dict[str, str], value: str, ranks: dict[int, int]) -> tuple[int, int, int]:
    """(round, client, rank or budget) of one trace line, checked; ConfigError naming ``where``."""
    try:
        rnd, cid, v = int(row["round"]), int(row["client"]), int(row[value])
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: round, client and {value} must be integers, got {dict(row)}") from None
    if rnd < 1 or v < 1:
        raise ConfigError(f"{where}: round and {value} must be >= 1")
    if cid not in ranks:
        raise ConfigError(f"{where}: client {cid} is not in the federation (0..{len(ranks) - 1})")
    return rnd, cid, v


def _trace_rank(where: str, cid: int, r: int, own: int, federation: list[int]) -> int:
    """A trace's rank, checked against the client's own rank ``own`` and the federation's ranks."""
    if r > own:
        raise ConfigError(f"{where}: rank {r} is above client {cid}'s own rank {own}")
    if r not in federation:
        raise ConfigError(f"{where}: rank {r} is not one of the federation's ranks {federation}")
    return r


def _budget_rank(
    where: str, cid: int, mib: int, own: int, federation: list[int], sizes: dict[str, dict[int, int]], q: str
) -> int:
    """The largest of the federation's ranks up to ``own`` whose footprint at precision ``q``
    (``sizes``: {precision: {rank: bytes}}) fits ``mib`` MiB; 0 when none does (the client sits
    the round out). ConfigError when none fits at ``q`` but one would at a lower precision."""
    fits = [r for r in federation if r <= own and sizes[q][r] <= mib * 2**20]
    lower = [t for t in PRECISIONS[PRECISIONS.index(q) + 1 :] if t in sizes] if q else []
    if not fits and any(sizes[t][min(federation)] <= mib * 2**20 for t in lower):
        raise ConfigError(
            f"{where}: client {cid}'s budget of {mib} MiB holds no rank at its precision {q} but "
            f"would at {', '.join(lower)}; a round at a lower precision than the client's tier is "
            "not built (its data and state live on its tier's backbone; docs/scale.md, device tiers)"
        )
    return max(fits, default=0)


@dataclass
class Population:
    """The per-round draws of one run.

    Attributes:
        availability: P(a client is online in a round); default 1.
        dropout: P(a sampled client drops out before replying); default 0.
        elastic: ``none`` (the default) | ``uniform`` | ``trace``.
        ranks: the federation's distinct ranks R_fed (an elastic rank is drawn from those up to
            the client's own).
        trace: {(round, client): rank} (`read_trace`).
        seed: federation.seed.
    """

    availability: float = 1.0
    dropout: float = 0.0
    elastic: str = "none"
    ranks: list[int] = field(default_factory=list)
    trace: dict[tuple[int, int], int] = field(default_factory=dict)
    seed: int = 0

    @classmethod
    def from_config(
        cls,
        cfg: ExperimentConfig,
        clients: Sequence[ClientInfo],
        footprint: Footprints | Callable[[int], int] | None = None,
        precisions: Mapping[int, str] | None = None,
    ) -> Population:
        """Build the population of an experiment's ``[population]``.

        Args:
            cfg: the experiment.
            clients: the federation's clients (their ranks r_k).
            footprint: bytes(r) of the backbone (nestfed.nn.footprint), or {precision: that} for
                device tiers, for a trace of memory budgets.
            precisions: {cid: backbone precision}, with a footprint per precision.

        Returns:
            The population.

        Raises:
            ConfigError: for a bad elastic trace (`read_trace`).
        """
        p: PopulationConfig = cfg.population
        own = {c.cid: c.rank for c in clients}
        trace = read_trace(p.elastic_trace, own, footprint, precisions) if p.elastic == "trace" else {}
        return cls(p.availability, p.dropout, p.elastic, sorted({c.rank for c in clients}), trace, cfg.federation.seed)

    def online(self, rnd: int, clients: Sequence[ClientInfo]) -> list[ClientInfo]:
        """Draw the clients online in a round: each with probability ``availability`` (all at 1).

        Args:
            rnd: the round.
            clients: the federation's clients, in id order.

        Returns:
            The online clients, in the given order.
        """
        if self.availability >= 1:
            return list(clients)
        rng = np.random.default_rng(stream_seed(self.seed, rnd, 0, "online"))
        up = rng.random(len(clients)) < self.availability
        return [c for c, u in zip(clients, up) if u]

    def dropouts(self, rnd: int, sampled: Sequence[ClientInfo]) -> dict[int, str]:
        """Draw the sampled clients that drop out of a round before replying.

        Each drops out with probability ``dropout`` (none at 0); so do those whose budget in the
        trace holds no rank.

        Args:
            rnd: the round.
            sampled: the round's sampled clients, in id order.

        Returns:
            {cid: why} of the dropouts.
        """
        out = {
            c.cid: "its memory budget this round holds no rank (population.elastic_trace)"
            for c in sampled
            if self.trace.get((rnd, c.cid), -1) == 0
        }
        if self.dropout > 0:
            rng = np.random.default_rng(stream_seed(self.seed, rnd, 0, "dropout"))
            gone = rng.random(len(sampled)) < self.dropout
            out.update(
                {
                    c.cid: f"dropped out after sampling (population.dropout = {self.dropout:g})"
                    for c, g in zip(sampled, gone)
                    if g and c.cid not in out
                }
            )
        return out

    def this_round(self, rnd: int, sampled: Sequence[ClientInfo]) -> list[ClientInfo]:
        """Give the sampled clients the rank each trains at in a round (``ClientInfo.round_rank``).

        ``uniform`` draws from R_fed up to the client's own rank, ``trace`` reads it (its own when
        the trace lists none).

        Args:
            rnd: the round.
            sampled: the round's sampled clients.

        Returns:
            The clients, with ``round_rank`` set where it is below their own rank; unchanged
            without elastic ranks.
        """
        if self.elastic == "none":
            return list(sampled)
        rng = np.random.default_rng(stream_seed(self.seed, rnd, 0, "elastic_rank"))
        out = []
        for c in sampled:
            if self.elastic == "uniform":
                choices = [r for r in self.ranks if r <= c.rank] or [c.rank]
                r = int(choices[int(rng.integers(len(choices)))])
            else:
                r = self.trace.get((rnd, c.cid), c.rank) or c.rank  # 0: it sits the round out (dropouts)
            out.append(replace(c, round_rank=r) if r < c.rank else c)
        return out
