"""``[generation]``: the generated evaluation after the last round (nestfed.experiments.generated):
each client's held-out prompts answered by the model it runs, and the global adapter's answers
at chosen truncation ranks, scored against the references (ROUGE-L, exact match, a verbaliser's
accuracy) and written to the run directory. Off by default (``rows = 0``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GenerationConfig:
    """The generated evaluation after the last round.

    Attributes:
        rows: held-out prompts per client answered after the last round (0 = no generated
            evaluation).
        max_new_tokens: tokens generated per answer at most.
        temperature: 0 = greedy, else sampling.
        top_p: the nucleus.
        seed: sampling's (per prompt).
        batch_size: prompts per batch.
        verbaliser: the labels a classification answer is read as (the first one the answer names,
            case-insensitive, whole words; accuracy against the reference; empty = none).
        ranks: truncation ranks r at which the global adapter also answers every client's prompts
            (a nested method's prefixes; empty = none).
    """

    rows: int = 0
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    batch_size: int = 8
    verbaliser: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()


def check_generation(g: GenerationConfig, task: str, template: str, templates: tuple[str, ...]) -> None:
    """Check the instruction settings: ``data.template``, then ``[generation]``.

    Args:
        g: the ``[generation]`` section.
        task: ``data.task`` (a generated evaluation needs ``instruction``).
        template: ``data.template``.
        templates: the known templates.

    Raises:
        ValueError: "<section>.<key>: <reason>", for the first value at fault.
    """
    if template not in templates:
        raise ValueError(f"data.template: unknown template '{template}' (known: {', '.join(templates)})")
    if g.rows < 0:
        raise ValueError(f"generation.rows must be >= 0, got {g.rows}")
    if g.rows and task != "instruction":
        raise ValueError(f"generation.rows: a generated evaluation answers instruction prompts (data.task = '{task}')")
    if g.max_new_tokens < 1 or g.batch_size < 1:
        raise ValueError("generation.max_new_tokens and generation.batch_size must be >= 1")
    if g.temperature < 0 or not 0 < g.top_p <= 1:
        raise ValueError(f"generation.temperature must be >= 0 and top_p in (0, 1], got {g.temperature}, {g.top_p}")
    if any(r < 1 for r in g.ranks):
        raise ValueError(f"generation.ranks: every rank must be >= 1, got {list(g.ranks)}")
