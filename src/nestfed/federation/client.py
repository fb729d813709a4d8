"""The client trainer.

It loads an instruction's arrays into the shared model, runs the local steps, and returns the
update.

One trainer serves every client of an embedded run (clients run one after another on one model);
a Flower ClientApp wraps the same trainer for one client. The trainer never knows which method
made the instruction: what a method changes on the client is its `ClientHooks`
(nestfed.federation.hooks). Instruction config keys read here: ``scaling`` (s), ``round``,
``seed``; ``rank`` is the strategy's and the hooks'.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from nestfed.config import AttackConfig, PrivacyConfig, TrainConfig
from nestfed.data.clients import ClientData
from nestfed.evaluation.client import evaluate_client
from nestfed.federation.attacks import attacked_reply, attacks
from nestfed.federation.hooks import ClientHooks, FitContext
from nestfed.federation.lr_schedule import client_schedule
from nestfed.federation.messages import Arrays, Instruction, Reply
from nestfed.federation.privacy import local_dp
from nestfed.federation.training import seeded_steps
from nestfed.nn.arrays import apply_arrays, extra_parameters, lora_arrays, lora_parameters
from nestfed.nn.lora import lora_modules
from nestfed.nn.placement import model_device, release
from nestfed.seeds import stream_seed


@dataclass
class ClientTrainer:
    """Runs local training and evaluation for the clients of one model.

    Attributes:
        model: the backbone with LoRA layers injected.
        data: {cid: ClientData}.
        train: local settings (steps, batch size and micro-batch size, AdamW lr / weight decay,
            gradient clipping).
        hooks: the method's client hooks; the plain `ClientHooks` by default.
        client_state: {cid: {group: arrays}} kept between rounds (saved with checkpoints).
        privacy: the ``[privacy]`` section (local DP noises each reply).
        attack: the ``[attack]`` section (which clients attack their update, and how).
        models: {cid: the model of a client whose tier holds the backbone at another precision
            (``population.precisions``; LoRA injected alike)}; a client not listed runs ``model``.
    """

    model: nn.Module
    data: dict[int, ClientData]
    train: TrainConfig
    hooks: ClientHooks = field(default_factory=ClientHooks)
    client_state: dict[int, dict[str, Arrays]] = field(default_factory=dict)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    models: dict[int, nn.Module] = field(default_factory=dict)

    def model_of(self, cid: int) -> nn.Module:
        """Give the model a client trains and evaluates on.

        Args:
            cid: the client's id.

        Returns:
            Its tier's model (``models``), else ``model``.
        """
        return self.models.get(cid, self.model)

    def fit(self, cid: int, instruction: Instruction) -> Reply:
        """Train a client from the instruction's arrays.

        What before_steps and the steps draw from torch's global generator (LoRA dropout's masks) is
        seeded by the seed rule (federation seed, round, client, stream ``lora_dropout``), the
        caller's state restored after.

        Args:
            cid: the client's id.
            instruction: the arrays and config (``scaling``, ``round``, ``seed``, ...) the server sent.

        Returns:
            The reply: the trained arrays, n_k (the client's example count) and metrics:
            ``train_loss`` (mean over steps, nats/token), ``train_tokens`` (labelled tokens seen),
            ``rank``, ``train_time_s`` (seconds), the hooks' metrics and, with
            ``train.eval_local``, ``local_*`` (the client's own model before aggregation).

        Raises:
            KeyError: for an unknown client.
        """
        hooks = self.hooks
        model = self.model_of(cid)
        ctx = FitContext(
            cid, dict(instruction.config), self.client_state.setdefault(cid, {}), model, self.data[cid], self.train
        )
        t0 = time.perf_counter()
        arrays = hooks.arrays_to_load(ctx, dict(instruction.arrays))
        apply_arrays(model, arrays, float(ctx.config["scaling"]))
        local_metrics = hooks.after_load(ctx, arrays)
        params = lora_parameters(model, hooks.train_a)
        extras = extra_parameters(model, arrays)  # other shipped parameters train too
        for p in extras.values():
            p.requires_grad_(True)
        params += list(extras.values())
        model.train()
        with seeded_steps(stream_seed(ctx.seed, ctx.round, cid, "lora_dropout"), model_device(model)):
            local_metrics.update(hooks.before_steps(ctx, params))
            model.train()  # the steps train in training mode, whatever before_steps left
            opt = torch.optim.AdamW(
                hooks.param_groups(ctx, params), lr=self.train.lr, weight_decay=self.train.weight_decay
            )
            attack = attacks(self.attack, cid)
            steps = 0 if attack == "free_rider" else self.train.local_steps  # a free rider trains nothing
            losses, tokens = self._local_steps(ctx, params, opt, steps)
        model.eval()
        for p in params:
            p.requires_grad_(False)
        metrics: dict[str, float] = {"train_loss": sum(losses) / max(len(losses), 1), "train_tokens": float(tokens)}
        metrics.update(local_metrics)
        metrics.update(hooks.after_steps(ctx))
        if self.train.eval_local:  # the client's own model before aggregation (the aggregation drop)
            ev = evaluate_client(model, ctx.data, self.train)
            metrics.update({f"local_{k}": v for k, v in ev.items()})
        out = lora_arrays(model, hooks.train_a)
        out.update({k: p.detach().clone() for k, p in extras.items()})
        out = hooks.reply_arrays(ctx, out)
        if self.privacy.mode == "local":
            g = torch.Generator().manual_seed(stream_seed(ctx.seed, ctx.round, cid, "dp_local"))
            out, metrics["update_norm_before_dp"] = local_dp(instruction.arrays, out, self.privacy, g)
        if attack is not None:
            g = torch.Generator().manual_seed(stream_seed(ctx.seed, ctx.round, cid, "attack"))
            out = attacked_reply(attack, instruction.arrays, out, self.attack, g)
        ranks = [m.rank for m in lora_modules(model).values()]
        metrics["rank"] = float(max(ranks)) if ranks else 0.0
        metrics["train_time_s"] = time.perf_counter() - t0
        del opt, params
        release(model_device(model))  # the next client's peak is its own
        return Reply(out, ctx.data.num_examples, metrics)

    def _local_steps(
        self, ctx: FitContext, params: list[torch.nn.Parameter], opt: torch.optim.Optimizer, steps: int
    ) -> tuple[list[float], int]:
        """Run ``steps`` optimiser steps (micro-batches accumulate one step's gradient, clipped to
        ``train.max_grad_norm``, the round's learning-rate schedule stepped after each); return each
        step's loss (nats/token) and the labelled tokens seen."""
        schedule = client_schedule(opt, self.train, ctx.round, int(ctx.config.get("rounds", 0)))
        losses, tokens = [], 0
        for step, batch in enumerate(ctx.batches(steps, "batches")):
            self.hooks.before_step(ctx, step)
            opt.zero_grad(set_to_none=True)
            losses.append(
                sum(self.hooks.step_loss(ctx, micro) for micro in batch.micro_batches(self.train.micro_batch_size))
            )
            tokens += int((batch.labels[:, 1:] != -100).sum())
            if self.train.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, self.train.max_grad_norm)
            opt.step()
            if schedule is not None:
                schedule.step()
        return losses, tokens

    def evaluate(self, cid: int, arrays: Arrays, scaling: float) -> dict[str, float]:
        """Evaluate a client's model on its held-out data, as the client runs the arrays.

        The client runs them through its hooks' evaluation_arrays (with its kept state).

        Args:
            cid: the client's id.
            arrays: the arrays to evaluate.
            scaling: the LoRA scale.

        Returns:
            Held-out loss, perplexity (and accuracy for multiple choice).

        Raises:
            KeyError: for an unknown client.
        """
        return self.evaluate_on(cid, arrays, scaling, self.data[cid])

    def evaluate_as_sent(self, cid: int, arrays: Arrays, scaling: float) -> dict[str, float]:
        """Evaluate ``arrays`` exactly as given, without the client's kept state.

        A global adapter (or a prefix of it) measured on the client's held-out data.

        Args:
            cid: the client's id.
            arrays: the arrays to evaluate.
            scaling: the LoRA scale.

        Returns:
            `evaluate`'s metrics.

        Raises:
            KeyError: for an unknown client.
        """
        model = self.model_of(cid)
        apply_arrays(model, arrays, scaling)
        return evaluate_client(model, self.data[cid], self.train)

    def evaluate_on(self, cid: int, arrays: Arrays, scaling: float, data: ClientData) -> dict[str, float]:
        """Evaluate a client's model on another held-out set (e.g. the global held-out set).

        Args:
            cid: the client's id; its deployed arrays and kept state make the model.
            arrays: the arrays to evaluate.
            scaling: the LoRA scale.
            data: the data whose test rows are evaluated.

        Returns:
            `evaluate`'s metrics.
        """
        arrays = self.hooks.evaluation_arrays(self.client_state.get(cid, {}), arrays)
        model = self.model_of(cid)
        apply_arrays(model, arrays, scaling)
        return evaluate_client(model, data, self.train)
