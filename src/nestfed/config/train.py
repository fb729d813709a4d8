"""The training section ``[train]``: each client's local steps per round, its evaluation, its
memory levers and its learning-rate schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: train.lr_schedule's values (transformers' schedules of those names)
LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class TrainConfig:
    """Local training of each client per round (AdamW with gradient clipping).

    Attributes:
        local_steps: optimiser steps per client and round.
        batch_size: rows per step.
        lr: AdamW's learning rate.
        weight_decay: AdamW's weight decay.
        max_grad_norm: the gradient norm clipped to.
        eval_batch_size: rows per evaluation forward.
        cache_frozen_prefix: compute the frozen layers below the first adapted one once
            (nestfed.nn.frozen_prefix).
        threads: torch threads; 0 = leave torch's default.
        eval_local: evaluate each client's model right after its local training, on its own test
            set (metrics local_loss / local_accuracy): with the federated evaluation it gives the
            aggregation drop.
        eval_stream_chunk: > 0: evaluate each test row streamed in chunks of this many tokens at
            constant memory (nestfed.evaluation.streaming), for contexts a one-pass forward cannot
            hold.
        eval_stream_window: the stream's softmax window in tokens (0 = the window of the layers a
            method bounded, e.g. FedNL's memory layers, else 1024).
        eval_stream_sinks: the stream's attention sinks in tokens.
        micro_batch_size: a memory lever (any backbone): rows per micro-batch, whose gradients
            accumulate into one step (0 = the whole batch at once).
        gradient_checkpointing: a memory lever: activation checkpointing of the decoder layers (each
            layer's activations recomputed in backward instead of kept: transformers' own,
            use_reentrant=False).
        client_memory_mb: clients' prepared data (nestfed.data.client_pool), built when first
            needed, is kept in memory up to this (least recently used out).
        client_cache: and on disk here ("" = <model cache dir>/clients, shared with Flower nodes;
            "off" = none).
        client_cache_mb: the disk cache's bound.
        lr_schedule: the learning-rate schedule (transformers' get_scheduler): constant, linear or
            cosine decay to 0 after the warm-up (linear from 0). Every parameter group scales alike.
        warmup_steps: the warm-up's steps (or warmup_ratio; one of the two).
        lr_schedule_scope: ``round`` runs the schedule over each round's local_steps (restarting
            every round), ``federation`` over all rounds' steps (step = (round - 1) x local_steps +
            local step, of federation.rounds x local_steps).
        warmup_ratio: the warm-up as ceil(warmup_ratio x the schedule's steps), transformers' rule.
    """

    local_steps: int = 4
    batch_size: int = 4
    lr: float = 3e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    eval_batch_size: int = 8
    cache_frozen_prefix: bool = True
    threads: int = 0
    eval_local: bool = False
    eval_stream_chunk: int = 0
    eval_stream_window: int = 0
    eval_stream_sinks: int = 0
    micro_batch_size: int = 0
    gradient_checkpointing: bool = False
    client_memory_mb: int = 256
    client_cache: str = ""
    client_cache_mb: int = 2048
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    lr_schedule_scope: str = "round"
    warmup_ratio: float = 0.0

    def schedule_steps(self, rounds: int) -> int:
        """Count the steps one learning-rate schedule spans.

        Args:
            rounds: ``federation.rounds``.

        Returns:
            local_steps, times ``rounds`` when it runs across rounds (lr_schedule_scope = federation).
        """
        return self.local_steps * (rounds if self.lr_schedule_scope == "federation" else 1)

    def warmup(self, rounds: int) -> int:
        """Count the schedule's warm-up steps.

        Args:
            rounds: ``federation.rounds``.

        Returns:
            warmup_steps, else ceil(warmup_ratio x its steps) (transformers' TrainingArguments rule).
        """
        return self.warmup_steps or math.ceil(self.warmup_ratio * self.schedule_steps(rounds))

    def schedule_spans_rounds(self) -> bool:
        """Tell whether a round's rates depend on federation.rounds.

        Returns:
            True for a linear or cosine decay, or a warm-up ratio, over the whole federation.
        """
        moves = self.lr_schedule != "constant" or self.warmup_ratio > 0
        return self.lr_schedule_scope == "federation" and moves
