"""Which clients a round evaluates, and their deployments computed one client at a time.

The settings are ``[evaluation]`` (nestfed.config.evaluation; docs/scale.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from nestfed.config import ExperimentConfig
from nestfed.federation.messages import Arrays, GlobalState
from nestfed.federation.strategy import Strategy
from nestfed.seeds import stream_seed


@dataclass(frozen=True)
class EvalPlan:
    """Which clients a round evaluates (``[evaluation]``, nestfed.config.evaluation).

    Attributes:
        panel: the client ids evaluated after rounds 1..R-1; None (the default) for every client.
        final_all: whether rounds 0 and R evaluate every client (else the panel); default True.
        every: evaluate after every ``every``-th round (round R always); default 1.
    """

    panel: tuple[int, ...] | None = None
    final_all: bool = True
    every: int = 1

    @classmethod
    def from_config(cls, cfg: ExperimentConfig) -> EvalPlan:
        """Build ``[evaluation]``'s plan.

        Args:
            cfg: the experiment; its ``[evaluation]`` and ``data.num_clients``, ``data.seed``.

        Returns:
            The plan: its panel is ``evaluation.clients`` ids drawn once from the seed rule's stream
            ``eval_panel`` of (data.seed, 0, 0), sorted (None, every client, when 0 or at least
            the federation's size).
        """
        e, k = cfg.evaluation, cfg.data.num_clients
        panel = None
        if e.clients and e.clients < k:
            rng = np.random.default_rng(stream_seed(cfg.data.seed, 0, 0, "eval_panel"))
            panel = tuple(sorted(int(i) for i in rng.choice(k, size=e.clients, replace=False)))
        return cls(panel, e.final == "all", e.every)

    def evaluates(self, rnd: int, rounds: int) -> bool:
        """Tell whether a round is evaluated (rounds 0 and R always).

        Args:
            rnd: the round, 0..rounds.
            rounds: the federation's round count R.

        Returns:
            Whether round ``rnd`` is evaluated.
        """
        return rnd == 0 or rnd == rounds or rnd % self.every == 0

    def clients(self, rnd: int, rounds: int, everyone: Sequence[int]) -> list[int]:
        """List the client ids evaluated after a round.

        Args:
            rnd: the round, 0..rounds.
            rounds: the federation's round count R.
            everyone: the federation's clients (on Flower, those a node serves).

        Returns:
            The ids of ``everyone`` evaluated after round ``rnd``; [] for no evaluation this round.
        """
        last = rnd == 0 or rnd == rounds
        if not self.evaluates(rnd, rounds):
            return []
        if self.panel is None or (last and self.final_all):
            return list(everyone)
        present = set(everyone)
        return [c for c in self.panel if c in present]


class Deployments(Mapping):
    """What each listed client runs, {cid: (arrays, scale s)}, computed when read.

    Each value is the strategy's ``deploy``, so a round never holds every client's adapter at once.

    Args:
        strategy: the strategy that deploys.
        state: the global state deployed.
        cids: the listed clients (the mapping's keys, in this order).
    """

    def __init__(self, strategy: Strategy, state: GlobalState, cids: Sequence[int]):
        self.strategy, self.state, self.cids = strategy, state, list(cids)

    def __getitem__(self, cid: int) -> tuple[Arrays, float]:
        if cid not in self.cids:
            raise KeyError(cid)
        return self.strategy.deploy(self.state, cid)

    def __iter__(self) -> Iterator[int]:
        return iter(self.cids)

    def __len__(self) -> int:
        return len(self.cids)
