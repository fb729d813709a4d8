"""The model-side halves of FedMKT (strategy.py): the server learner and the client trainer.

Both distil with FedMKT's objective (nestfed.methods.fedmkt.distillation) on the public text and compute top-k
knowledge on it. The client's small model (its SVD cores) never leaves the client: it is its kept
state (group ``own``, checkpointed with every round) and is evaluated from there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from nestfed.federation.client import ClientTrainer
from nestfed.federation.messages import Arrays, Instruction, Reply
from nestfed.federation.run_dir import ClientState
from nestfed.federation.training import train_on_blocks
from nestfed.methods.fedmkt.distillation import (
    CE,
    INDICES,
    VALUES,
    knowledge,
    merge_knowledge,
    mutual_loss,
    select_min_ce,
)
from nestfed.nn.arrays import apply_arrays, extra_parameters
from nestfed.nn.frozen_prefix import CachedText
from nestfed.nn.keys import peft_key
from nestfed.nn.lora import lora_modules
from nestfed.seeds import stream_seed

OWN = "own"

KNOWLEDGE = (VALUES, INDICES, CE)


@torch.no_grad()
def text_knowledge(model: nn.Module, text: CachedText, labels: torch.Tensor, k: int, batch_size: int = 8) -> Arrays:
    """Top-k knowledge of a model (as loaded) on every block of a text, computed batch by batch.

    Args:
        model: the model.
        text: the public blocks as the model sees them.
        labels: [N, T] public labels.
        k: tokens kept per position.
        batch_size: blocks per forward pass.

    Returns:
        {public.values [N, T, k], public.indices [N, T, k], public.ce [N]} (distillation.knowledge).
    """
    was_training = model.training
    model.eval()
    n = text.input_ids.shape[0]
    parts = []
    for i in range(0, n, batch_size):
        idx = torch.arange(i, min(n, i + batch_size))
        parts.append(knowledge(text.logits(model, idx), labels[idx], k))
    model.train(was_training)
    return merge_knowledge(parts)


def _rows(know: Arrays, idx: torch.Tensor) -> Arrays:
    return {key: know[key][idx] for key in KNOWLEDGE}


@dataclass
class ServerDistiller:
    """FedMKT's server: the full model with LoRA, distilling from the clients on the public text.

    Attributes:
        model: the backbone with LoRA layers.
        public: the public blocks as it sees them.
        labels: [N, T] public labels (the LM part of the objective).
        scaling: the LoRA scale s.
        topk: logits kept per token (``fedmkt.topk``).
        lm_weight: the LM loss's weight (``fedmkt.lm_weight``).
        steps: distillation steps per round (``fedmkt.server_steps``).
        batch_size: public blocks per step.
        lr: the LoRA's AdamW learning rate (``fedmkt.server_lr``).
        seed: the federation's seed (batch order).
    """

    model: nn.Module
    public: CachedText
    labels: torch.Tensor
    scaling: float
    topk: int = 10
    lm_weight: float = 0.9
    steps: int = 5
    batch_size: int = 4
    lr: float = 5e-3
    seed: int = 0

    def knowledge(self, adapter: Arrays) -> Arrays:
        """The server model's knowledge on the public text under an adapter.

        Args:
            adapter: the server's LoRA arrays.

        Returns:
            The knowledge (`text_knowledge`).
        """
        apply_arrays(self.model, adapter, self.scaling)
        return text_knowledge(self.model, self.public, self.labels, self.topk)

    def distill(self, adapter: Arrays, teachers: list[Arrays], rnd: int) -> tuple[Arrays, dict[str, float]]:
        """``steps`` steps of FedMKT's objective towards, per block, the lowest-CE knowledge of all.

        The candidates are the server's own knowledge (first) and the teachers'.

        Args:
            adapter: the server's LoRA arrays at the round's start.
            teachers: the clients' knowledge, in client-id order.
            rnd: the round (the batch order's seed).

        Returns:
            The trained adapter (A and B) and metrics ``server_distill_loss`` (nats, last step),
                ``server_teacher_share`` (fraction of blocks taught by a client), ``server_time_s``.
        """
        t0 = time.perf_counter()
        own = self.knowledge(adapter)
        target, choice = select_min_ce([own, *teachers])
        params = []
        for m in lora_modules(self.model).values():
            if m.rank:
                params += [m.lora_A.weight, m.lora_B.weight]

        def loss_of(idx: torch.Tensor) -> torch.Tensor:
            logits = self.public.logits(self.model, idx)
            return mutual_loss(logits, self.labels[idx], _rows(target, idx), self.lm_weight)

        self.model.train()
        losses = train_on_blocks(
            params,
            loss_of,
            self.labels.shape[0],
            self.steps,
            self.batch_size,
            self.lr,
            stream_seed(self.seed, rnd, 0, "distill_server"),
        )
        self.model.eval()
        out = {}
        for name, m in lora_modules(self.model).items():
            if m.rank:
                out[peft_key(name, "lora_A")] = m.lora_A.weight.detach().clone()
                out[peft_key(name, "lora_B")] = m.lora_B.weight.detach().clone()
        return out, {
            "server_distill_loss": losses[-1] if losses else float("nan"),
            "server_teacher_share": float((choice > 0).float().mean()),
            "server_time_s": time.perf_counter() - t0,
        }


@dataclass
class MutualClientTrainer:
    """FedMKT's client: distil from the server's knowledge, train on private data, send knowledge.

    The client's own trainable arrays are its kept state (``client_state[cid]["own"]``), never sent.

    Attributes:
        base: the group model's ClientTrainer (private training and evaluation).
        public: the public blocks as this model sees them.
        labels: [N, T] public labels.
        initial: the model's initial trainable arrays (its cores diag(S)).
        topk: logits kept per token.
        lm_weight: the LM loss's weight.
        steps: public distillation steps per round.
        batch_size: public blocks per step.
        lr: the cores' AdamW learning rate on the public text.
    """

    base: ClientTrainer
    public: CachedText
    labels: torch.Tensor
    initial: Arrays
    topk: int = 10
    lm_weight: float = 0.9
    steps: int = 2
    batch_size: int = 4
    lr: float = 1e-2

    @property
    def client_state(self) -> ClientState:
        """The clients' kept state (the base trainer's): {cid: {"own": arrays}}."""
        return self.base.client_state

    @client_state.setter
    def client_state(self, state: ClientState) -> None:
        self.base.client_state = state

    def own(self, cid: int) -> Arrays:
        """The client's own model: its kept arrays, or the initial ones before its first round.

        Args:
            cid: the client.

        Returns:
            Its trainable arrays.
        """
        return self.base.client_state.get(cid, {}).get(OWN, self.initial)

    def fit(self, cid: int, instruction: Instruction) -> Reply:
        """One FedMKT client round; the instruction carries the server's knowledge (``public.*``).

        Args:
            cid: the client.
            instruction: the round's instruction.

        Returns:
            A reply carrying the client's knowledge on the public text; metrics: ClientTrainer.fit's
                plus ``distill_loss`` (nats, last public step) and ``server_share`` (fraction of
                public blocks where the server's knowledge was the target).

        Raises:
            KeyError: when the instruction lacks the server's knowledge.
        """
        cfg = instruction.config
        model = self.base.model
        missing = [k for k in KNOWLEDGE if k not in instruction.arrays]
        if missing:
            raise KeyError(f"client {cid}: the FedMKT instruction lacks {missing}")
        own = self.own(cid)
        apply_arrays(model, own, 1.0)
        mine = text_knowledge(model, self.public, self.labels, self.topk)
        target, choice = select_min_ce([mine, {k: instruction.arrays[k] for k in KNOWLEDGE}])
        params = list(extra_parameters(model, own).values())

        def loss_of(idx: torch.Tensor) -> torch.Tensor:
            return mutual_loss(self.public.logits(model, idx), self.labels[idx], _rows(target, idx), self.lm_weight)

        model.train()
        losses = train_on_blocks(
            params,
            loss_of,
            self.labels.shape[0],
            self.steps,
            self.batch_size,
            self.lr,
            stream_seed(int(cfg.get("seed", 0)), int(cfg.get("round", 0)), cid, "distill_client"),
        )
        model.eval()
        distilled = {k: p.detach().clone() for k, p in extra_parameters(model, own).items()}
        reply = self.base.fit(
            cid, Instruction(distilled, {"scaling": 1.0, "round": cfg.get("round", 0), "seed": cfg.get("seed", 0)})
        )
        self.base.client_state.setdefault(cid, {})[OWN] = reply.arrays
        apply_arrays(model, reply.arrays, 1.0)
        know = text_knowledge(model, self.public, self.labels, self.topk)
        metrics = dict(reply.metrics)
        metrics.update(
            {"distill_loss": losses[-1] if losses else float("nan"), "server_share": float((choice > 0).float().mean())}
        )
        return Reply(know, reply.num_examples, metrics)

    def evaluate_as_sent(self, cid: int, arrays: Arrays, scaling: float) -> dict[str, float]:
        """Refused: these clients run compressed models, and no global adapter is sent to evaluate as it is.

        The method does not declare ``EXPORT_AT_RANK``.

        Args:
            cid: the client.
            arrays: the arrays.
            scaling: the LoRA scale.

        Returns:
            Never: it always raises.

        Raises:
            TypeError: always.
        """
        raise TypeError("compressed clients have no global adapter to evaluate as sent")

    def evaluate(self, cid: int, arrays: Arrays, scaling: float) -> dict[str, float]:
        """The client's own model on its test set.

        Args:
            cid: the client.
            arrays: ignored (nothing is deployed to it).
            scaling: ignored.

        Returns:
            The held-out metrics.
        """
        return self.base.evaluate(cid, self.own(cid), 1.0)
