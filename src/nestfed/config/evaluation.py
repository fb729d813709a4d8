"""``[evaluation]``: which clients a round evaluates, and the global held-out set (docs/scale.md).

With hundreds of clients, evaluating every client after every round costs more than the round: a
fixed panel (the same clients every round, for every method and seed, so rounds and runs pair
client by client) tracks the curve, and rounds 0 and R evaluate every client (or the panel). The
defaults evaluate every client after every round, as a small federation always did.
"""

from __future__ import annotations

from dataclasses import dataclass

FINALS = ("all", "panel")


@dataclass(frozen=True)
class EvaluationConfig:
    """Which clients a round evaluates, and the global held-out set.

    Attributes:
        clients: the panel evaluated after rounds 1..R-1 (0 = every client), drawn once from
            ``data.seed`` (the seed rule's stream ``eval_panel``).
        final: rounds 0 and R evaluate ``all`` clients or the ``panel``.
        every: evaluate after every ``every``-th round (round R always).
        global_test: rows (blocks or examples) of a global held-out set drawn uniformly from the
            union of every client's held-out records (so from the population's own mixture),
            evaluated on the server under the global adapter after every evaluated round (0 = none).
    """

    clients: int = 0
    final: str = "all"
    every: int = 1
    global_test: int = 0


def check_evaluation(e: EvaluationConfig, num_clients: int) -> None:
    """Check ``[evaluation]``.

    Args:
        e: the section.
        num_clients: ``data.num_clients``, the panel's upper bound.

    Raises:
        ValueError: "evaluation.<key>: <reason>", for the first value at fault.
    """
    if e.clients < 0 or e.clients > num_clients:
        raise ValueError(f"evaluation.clients must be in 0..data.num_clients = {num_clients}, got {e.clients}")
    if e.final not in FINALS:
        raise ValueError(f"evaluation.final must be 'all' or 'panel', got '{e.final}'")
    if e.final == "panel" and not e.clients:
        raise ValueError("evaluation.final = 'panel' needs a panel (evaluation.clients > 0)")
    if e.every < 1:
        raise ValueError(f"evaluation.every must be >= 1, got {e.every}")
    if e.global_test < 0:
        raise ValueError(f"evaluation.global_test must be >= 0, got {e.global_test}")
