"""A client's held-out metrics under the model as loaded: one pass, per row group, or streamed.

Returns ``loss`` (nats per labelled token), ``ppl`` = exp(loss), ``tokens`` and, for multiple
choice, ``accuracy``; with ``ClientData.test_groups`` also ``loss@<group>`` / ``accuracy@<group>``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from nestfed.config import TrainConfig
from nestfed.data.clients import ClientData
from nestfed.evaluation.lm import evaluate_lm
from nestfed.evaluation.streaming import stream_evaluate
from nestfed.nn.bounded_attention import enabled_bounds


def pool_groups(results: list[tuple[str, dict[str, float]]], per_group: bool) -> dict[str, float]:
    """Held-out metrics over several row groups.

    ``loss`` and ``accuracy`` are weighted by labelled tokens (for multiple choice, one per row:
    row-weighted).

    Args:
        results: [(group name, its metrics)], each metrics dict with ``loss``, ``tokens`` and maybe
            ``accuracy``.
        per_group: also report ``loss@<group>`` and ``accuracy@<group>``.

    Returns:
        ``loss``, ``ppl``, ``tokens``, ``accuracy`` when any group has it, and the per-group
            metrics.
    """
    out: dict[str, float] = {}
    total = count = correct = answers = 0.0
    for name, ev in results:
        if per_group:
            out[f"loss@{name}"] = ev["loss"]
            if "accuracy" in ev:
                out[f"accuracy@{name}"] = ev["accuracy"]
        total += ev["loss"] * ev["tokens"]
        count += ev["tokens"]
        if "accuracy" in ev:
            correct += ev["accuracy"] * ev["tokens"]
            answers += ev["tokens"]
    loss = total / max(count, 1.0)
    out.update({"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count})
    if answers:
        out["accuracy"] = correct / answers
    return out


def evaluate_client(model: nn.Module, d: ClientData, train: TrainConfig) -> dict[str, float]:
    """Held-out metrics of a model as loaded on a client's test set.

    One pass is `nestfed.evaluation.lm.evaluate_lm`. With ``test_groups``, each group of rows
    is run alone (so rows of one length are not padded to another's) and reported as
    ``loss@<group>`` and ``accuracy@<group>`` too. With ``train.eval_stream_chunk`` > 0 each row
    streams through nestfed.evaluation.streaming at constant memory (`evaluate_streamed`).

    Args:
        model: the backbone with the payload loaded.
        d: the client's data.
        train: the evaluation settings (``eval_batch_size``, ``eval_stream_*``).

    Returns:
        The metrics (module docstring).

    Raises:
        ValueError: as `evaluate_streamed` raises it.
    """
    if train.eval_stream_chunk > 0:
        return evaluate_streamed(model, d, train)
    if not d.test_groups:
        return evaluate_lm(
            model,
            d.test_labels,
            None if d.test_hidden is not None else d.test_ids,
            d.test_hidden,
            d.start,
            train.eval_batch_size,
            d.letter_ids,
        )
    results = []
    for name, idx in d.test_groups.items():
        lab = d.test_labels[idx]
        keep = int((lab != -100).any(0).nonzero().max()) + 1 if (lab != -100).any() else lab.shape[1]
        ev = evaluate_lm(
            model,
            lab[:, :keep],
            None if d.test_hidden is not None else d.test_ids[idx, :keep],
            None if d.test_hidden is None else d.test_hidden[idx, :keep],
            d.start,
            train.eval_batch_size,
            d.letter_ids,
        )
        results.append((name, ev))
    return pool_groups(results, per_group=True)


def evaluate_streamed(model: nn.Module, d: ClientData, train: TrainConfig) -> dict[str, float]:
    """Streamed evaluation for long contexts, per group when ``test_groups`` is set.

    The stream's window and sinks are ``train.eval_stream_window`` / ``train.eval_stream_sinks``, or
    where 0 the largest of the layers whose linear path the evaluated payload enabled (FedNL's
    memory window and sinks), the window 1024 tokens when none is: so a baseline compared with FedNL
    streams through FedNL's window only when ``train.eval_stream_window`` says so, whatever the
    order the methods ran in.

    With sinks, the sinks sit at cache positions (nestfed.evaluation.streaming's default, what keeps
    contexts past the backbone's trained length usable), so the numbers then differ from a one-pass
    evaluation, which keeps them at their own positions.

    Args:
        model: the backbone with the payload loaded.
        d: the client's data.
        train: the evaluation settings (``eval_stream_chunk``, ``eval_stream_window``,
            ``eval_stream_sinks``).

    Returns:
        The metrics (module docstring).

    Raises:
        ValueError: when the frozen prefix is cached (streams need token ids) or a layer lacks
            bounded attention.
    """
    if d.test_hidden is not None:
        raise ValueError("train.eval_stream_chunk needs train.cache_frozen_prefix = false (streams start from tokens)")
    layers = enabled_bounds(model).values()  # only the layers this run's payload enabled: never another method's
    window = train.eval_stream_window or max((b.window for b in layers), default=0) or 1024
    sink = train.eval_stream_sinks or max((b.sink for b in layers), default=0)
    groups = d.test_groups or {"all": torch.arange(d.test_ids.shape[0])}
    results = [
        (
            name,
            stream_evaluate(
                model, d.test_ids[idx], d.test_labels[idx], train.eval_stream_chunk, window, d.letter_ids, sink
            ),
        )
        for name, idx in groups.items()
    ]
    return pool_groups(results, per_group=bool(d.test_groups))
