"""What a method changes on the client side: the hooks the client trainer calls.

The trainer (nestfed.federation.client) runs one local round the same way for every method:
load the payload, train the LoRA matrices and any other shipped parameter with AdamW over seeded
batches, reply with the trained arrays. A method's home subclasses `ClientHooks` and
overrides only what it changes (Flower's strategies and PEFT's LoRA variants work the same way):

======================  =====================================================================
hook                    called
======================  =====================================================================
arrays_to_load          before the payload is loaded (add a fresh LoRA, the client's own arrays)
after_load              after loading, before the optimiser exists (adaptive local aggregation)
before_steps            with the trained parameters, before the first step (anchors, importance)
param_groups            the optimiser's parameter groups (a learning rate of the method's own)
before_step             before every local step (a gate schedule)
step_loss               for every batch: compute the loss, call backward, return its value
after_steps             after the last step (rank pruning)
reply_arrays            on the trained arrays before they are sent (keep some on the client)
evaluation_arrays       on the deployed arrays before a held-out evaluation
======================  =====================================================================

State a client keeps between rounds lives in ``ctx.state`` ({group: arrays}); the runner saves it
with every checkpoint (nestfed.federation.run_dir) and a Flower node keeps it in its context.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nestfed.config import TrainConfig
from nestfed.data.clients import ClientData
from nestfed.federation.training import Batch, client_batches
from nestfed.seeds import stream_seed

Arrays = dict[str, torch.Tensor]


@dataclass
class FitContext:
    """One client's local round as the hooks see it.

    Attributes:
        cid: the client id.
        config: the instruction's config (a local copy).
        state: the client's kept state {group: {key: tensor}} (persisted between rounds).
        model: the shared model with the payload loaded.
        data: the client's ClientData.
        train: local settings.
        scratch: values one hook leaves for a later one within this round (never kept, never sent).
    """

    cid: int
    config: dict[str, Any]
    state: dict[str, Arrays]
    model: nn.Module
    data: ClientData
    train: TrainConfig
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def round(self) -> int:
        """The round this instruction is for (1-based; the strategy's ``round`` key)."""
        return int(self.config.get("round", 0))

    @property
    def seed(self) -> int:
        """The federation's seed (the strategy's ``seed`` key)."""
        return int(self.config.get("seed", 0))

    def batches(self, steps: int, stream: str, batch_size: int | None = None) -> Iterator[Batch]:
        """Draw seeded batches of this client's training data.

        Seed rule: federation seed, round, client, stream (nestfed.seeds).

        Args:
            steps: how many batches.
            stream: the random stream's name.
            batch_size: examples per batch; None for ``train.batch_size``.

        Returns:
            An iterator over ``steps`` batches.
        """
        seed = stream_seed(self.seed, self.round, self.cid, stream)
        return client_batches(self.data, steps, batch_size or self.train.batch_size, seed)


class ClientHooks:
    """The default client behaviour (plain LoRA: FedAvg, ZeroPad). See the module docstring.

    Attributes:
        train_a: whether LoRA's A trains and travels back (False: only B, as FFA-LoRA).
        keeps_state: whether clients keep state between rounds (a resume then needs it).
    """

    train_a: bool = True
    keeps_state: bool = False

    def arrays_to_load(self, ctx: FitContext, arrays: Arrays) -> Arrays:
        """Give the payload to load, from the received arrays.

        Args:
            ctx: the client's round.
            arrays: the received arrays.

        Returns:
            The arrays to load into the model (default: as received).
        """
        return arrays

    def after_load(self, ctx: FitContext, arrays: Arrays) -> dict[str, float]:
        """Act after the payload is loaded, before the optimiser exists.

        Args:
            ctx: the client's round (its model holds the payload).
            arrays: the arrays that were loaded.

        Returns:
            Metrics {name: value} (default: none).
        """
        return {}

    def before_steps(self, ctx: FitContext, params: list[nn.Parameter]) -> dict[str, float]:
        """Act on the parameters about to train, before the first step.

        Args:
            ctx: the client's round.
            params: the trained parameters (requires_grad on).

        Returns:
            Metrics {name: value} (default: none).
        """
        return {}

    def param_groups(self, ctx: FitContext, params: list[nn.Parameter]) -> list[dict[str, Any]]:
        """Give AdamW's parameter groups.

        A group may set its own ``lr`` and ``weight_decay``; the others take ``train.lr`` and
        ``train.weight_decay``.

        Args:
            ctx: the client's round.
            params: every trained parameter.

        Returns:
            The groups, each parameter in exactly one (default: one group).
        """
        return [{"params": params}]

    def before_step(self, ctx: FitContext, step: int) -> None:
        """Act before a local step.

        Args:
            ctx: the client's round.
            step: the step, 0-based.
        """

    def step_loss(self, ctx: FitContext, batch: Batch) -> float:
        """Compute one batch's loss and backpropagate it here.

        Multi-pass objectives free their graphs pass by pass.

        Args:
            ctx: the client's round (its model).
            batch: the batch.

        Returns:
            The reported loss value (nats per labelled token).
        """
        loss = batch.loss(ctx.model)
        loss.backward()
        return loss.item()

    def after_steps(self, ctx: FitContext) -> dict[str, float]:
        """Act after the last step, with the model in eval mode.

        Args:
            ctx: the client's round.

        Returns:
            Metrics {name: value} (default: none).
        """
        return {}

    def reply_arrays(self, ctx: FitContext, out: Arrays) -> Arrays:
        """Give the arrays to send back, from the trained ones.

        Args:
            ctx: the client's round.
            out: the trained arrays.

        Returns:
            The reply's arrays (default: all of them).
        """
        return out

    def evaluation_arrays(self, state: dict[str, Arrays], arrays: Arrays) -> Arrays:
        """Give the arrays a client runs for a held-out evaluation.

        Args:
            state: the client's kept state {group: arrays}.
            arrays: the deployed arrays.

        Returns:
            The arrays to evaluate (default: the deployed ones).
        """
        return arrays
