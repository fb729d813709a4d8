"""The client trainer: loads an instruction's arrays into the shared model, runs local steps of
the method's objective on the client's partition, and returns its update.

One trainer serves every client of an embedded run (clients run one after another on one model);
a Flower ClientApp wraps the same trainer for one client. The trainer never knows which strategy
made the instruction: the instruction's config names the objective and what trains.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nestfed.adapters.lora import (PEFT_PREFIX, init_adapter_state, lora_modules, module_of, module_shapes,
                                   peft_key)
from nestfed.adapters.memory import sync_memory
from nestfed.config import TrainConfig
from nestfed.distillation import block_batches
from nestfed.evaluate import evaluate_lm
from nestfed.federation.messages import Arrays, Instruction, Reply
from nestfed.federation import client_state as local
from nestfed.federation.objectives import OBJECTIVES, Batch, tail_norm
from nestfed.frozen_prefix import labelled_length, prefix_features


@dataclass
class ClientData:
    """One client's tokenised partition.

    train_ids / test_ids: [N, T] token ids; train_labels / test_labels: [N, T] (-100 = no loss).
    train_hidden / test_hidden: the frozen prefix's outputs [N, T, d] entering layer ``start``
    (None = run the whole model). letter_ids: the 4 answer-letter token ids for multiple choice.
    """

    train_ids: torch.Tensor
    train_labels: torch.Tensor
    test_ids: torch.Tensor
    test_labels: torch.Tensor
    train_hidden: torch.Tensor | None = None
    test_hidden: torch.Tensor | None = None
    start: int = 0
    letter_ids: list[int] | None = None
    label: str = ""
    # optional named groups of test rows ({name: row indices [n]}, e.g. NIAH's context lengths):
    # evaluation adds accuracy@<name> / loss@<name> per group
    test_groups: dict[str, torch.Tensor] | None = None

    @property
    def num_examples(self) -> int:
        """n_k: training examples (blocks or prompts)."""
        return int(self.train_ids.shape[0])

    def cache_prefix(self, model: nn.Module, start: int, batch_size: int = 8) -> None:
        """Compute and keep the frozen layers' outputs for train and test (see frozen_prefix),
        each row only up to its last labelled token (what every loss and metric here reads)."""
        self.start = start
        if start > 0:
            self.train_hidden = prefix_features(model, self.train_ids, start, batch_size,
                                                labelled_length(self.train_labels))
            self.test_hidden = prefix_features(model, self.test_ids, start, batch_size,
                                               labelled_length(self.test_labels))


def extra_parameters(model: nn.Module, arrays: Arrays) -> dict[str, nn.Parameter]:
    """The payload keys that name a plain model parameter (not a LoRA matrix or FLoRA stack).

    Key ``base_model.model.<parameter path>`` names ``model.get_parameter(<parameter path>)``:
    how methods ship parameters other than LoRA (a memory gate, an SVD core). Raises KeyError for
    a key that names neither a LoRA layer nor a parameter.
    """
    modules = lora_modules(model)
    out = {}
    for key in arrays:
        try:
            if module_of(key)[0] in modules:
                continue
        except KeyError:
            pass
        path = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else None
        try:
            out[key] = model.get_parameter(path) if path else None
        except AttributeError:
            out[key] = None
        if out[key] is None:
            raise KeyError(f"payload key {key} names no LoRA layer or parameter of the model")
    return out


def apply_arrays(model: nn.Module, arrays: Arrays, scaling: float) -> None:
    """Load a payload into the model.

    ``lora_A`` / ``lora_B`` keys set each LoRA layer's adapter (rank from the shapes); a LoRA
    layer without them gets rank 0. ``merged_A`` / ``merged_B`` keys set FLoRA's frozen merged
    stack; without them the stack is removed. Every LoRA layer's scale becomes ``scaling``.
    Any other key is copied into the parameter it names (:func:`extra_parameters`).
    Raises KeyError for a key that names nothing, ValueError for a shape mismatch.
    """
    extras = extra_parameters(model, arrays)
    for name, m in lora_modules(model).items():
        a, b = arrays.get(peft_key(name, "lora_A")), arrays.get(peft_key(name, "lora_B"))
        if a is None:
            a, b = torch.zeros(0, m.in_features), torch.zeros(m.out_features, 0)
        m.set_weights(a, b)
        m.scaling = float(scaling)
        ma, mb = arrays.get(f"{PEFT_PREFIX}{name}.merged_A"), arrays.get(f"{PEFT_PREFIX}{name}.merged_B")
        m.set_merged(ma, mb)
    with torch.no_grad():
        for key, param in extras.items():
            if param.shape != arrays[key].shape:
                raise ValueError(f"payload key {key}: shape {tuple(arrays[key].shape)}, parameter {tuple(param.shape)}")
            param.copy_(arrays[key])
    sync_memory(model, arrays)  # FedNL: memory layers run where the payload carries their rules


def derive_seed(*parts: int) -> int:
    """A deterministic 63-bit seed from integers (seed, round, client, ...): resume stays exact."""
    h = 0
    for p in parts:
        h = (h * 1_000_003 + int(p)) % (2**63 - 1)
    return h


@dataclass
class ClientTrainer:
    """Runs local training and evaluation for the clients of one model.

    model: the backbone with LoRA layers injected; data: {cid: ClientData}; train: local settings
    (steps, batch size, AdamW lr / weight decay, gradient clipping).
    """

    model: nn.Module
    data: dict[int, ClientData]
    train: TrainConfig
    # per-client state kept between rounds (federation/client_state.py): {cid: {group: arrays}}
    client_state: dict[int, dict[str, Arrays]] = field(default_factory=dict)

    def _batches(self, d: ClientData, steps: int, batch_size: int, seed: int):
        for idx_t in block_batches(d.num_examples, steps, batch_size, seed):
            if d.train_hidden is not None:
                yield Batch(d.train_labels[idx_t], hidden=d.train_hidden[idx_t], start=d.start)
            else:
                yield Batch(d.train_labels[idx_t], input_ids=d.train_ids[idx_t])

    def fit(self, cid: int, instruction: Instruction) -> Reply:
        """Train client ``cid`` from the instruction's arrays; return trained arrays, n_k, metrics.

        Metrics: ``train_loss`` (mean over steps, nats/token), ``train_time_s`` (seconds),
        ``train_tokens`` (labelled tokens seen, counting each sub-rank pass once), ``rank``.
        Raises KeyError for an unknown client or objective.
        """
        cfg: dict[str, Any] = dict(instruction.config)  # a local copy: client-side keys start with "_"
        d = self.data[cid]
        t0 = time.perf_counter()
        arrays = dict(instruction.arrays)
        if "fresh_lora_seed" in cfg:  # FLoRA: a new LoRA of rank r_k each round
            fresh = init_adapter_state(module_shapes(self.model), int(cfg["rank"]), int(cfg["fresh_lora_seed"]))
            arrays.update(fresh)
        arrays = local.with_kept_arrays(self, cid, cfg, arrays)  # FedNL "rules": the client's own LoRA
        apply_arrays(self.model, arrays, float(cfg["scaling"]))
        local_metrics = local.adapt_local_aggregation(self, cid, cfg, arrays)  # FedALA
        objective = OBJECTIVES[cfg.get("objective", "plain")]
        train_b_only = cfg.get("train", "AB") == "B"
        params = []
        for m in lora_modules(self.model).values():
            if m.rank == 0:
                continue
            m.lora_A.weight.requires_grad_(not train_b_only)
            m.lora_B.weight.requires_grad_(True)
            params += [m.lora_B.weight] if train_b_only else [m.lora_A.weight, m.lora_B.weight]
        extras = extra_parameters(self.model, arrays)  # other shipped parameters train too
        for p in extras.values():
            p.requires_grad_(True)
        params += list(extras.values())
        self.model.train()
        local_metrics.update(local.regulariser_inputs(self, cid, cfg, params))  # FedProx, FedSSI
        opt = torch.optim.AdamW(params, lr=self.train.lr, weight_decay=self.train.weight_decay)
        losses, tokens = [], 0
        seed = derive_seed(int(cfg.get("seed", 0)), int(cfg.get("round", 0)), cid)
        for step, batch in enumerate(self._batches(d, self.train.local_steps, self.train.batch_size, seed)):
            local.on_step(self.model, cfg, step)  # FedNL's constant-gate schedule
            opt.zero_grad(set_to_none=True)
            losses.append(objective(self.model, batch, cfg))
            tokens += int((batch.labels[:, 1:] != -100).sum())
            if self.train.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, self.train.max_grad_norm)
            opt.step()
        self.model.eval()
        for p in params:
            p.requires_grad_(False)
        metrics: dict[str, float] = {"train_loss": sum(losses) / len(losses), "train_tokens": float(tokens)}
        metrics.update(local_metrics)
        if cfg.get("objective") == "hetlora":
            metrics.update(self._hetlora_prune(cfg))
        if self.train.eval_local:  # the client's own model before aggregation (the aggregation drop)
            ev = self._evaluate_loaded(d)
            metrics.update({f"local_{k}": v for k, v in ev.items()})
        out = {}
        for name, m in lora_modules(self.model).items():
            if m.rank == 0:
                continue
            if not train_b_only:
                out[peft_key(name, "lora_A")] = m.lora_A.weight.detach().clone()
            out[peft_key(name, "lora_B")] = m.lora_B.weight.detach().clone()
        out.update({k: p.detach().clone() for k, p in extras.items()})
        local.store_local_model(self, cid, cfg, out)  # FedALA's local model
        out = local.store_kept_arrays(self, cid, cfg, out)  # FedNL "rules": LoRA stays here
        ranks = [m.rank for m in lora_modules(self.model).values()]
        metrics["rank"] = float(max(ranks)) if ranks else 0.0
        metrics["train_time_s"] = time.perf_counter() - t0
        return Reply(out, d.num_examples, metrics)

    def _hetlora_prune(self, cfg: dict[str, Any]) -> dict[str, float]:
        """HetLoRA's rank self-pruning: shrink to floor(prune_ratio * r) when the tail norm fell."""
        tail = float(cfg.get("hetlora_tail", 0.25))
        with torch.no_grad():
            norm = float(tail_norm(self.model, tail))
        prev = float(cfg.get("hetlora_prev_tail", -1.0))
        r = int(cfg["rank"])
        pruned = 0.0
        if cfg.get("hetlora_pruning", True) and prev >= 0 and norm < prev and r > 1:
            new_r = max(1, math.floor(float(cfg.get("hetlora_prune_ratio", 0.9)) * r))
            if new_r < r:
                for m in lora_modules(self.model).values():
                    m.set_weights(m.lora_A.weight[:new_r], m.lora_B.weight[:, :new_r])
                with torch.no_grad():
                    norm = float(tail_norm(self.model, tail))
                pruned = float(r - new_r)
        return {"tail_norm": norm, "pruned": pruned}

    def evaluate(self, cid: int, arrays: Arrays, scaling: float) -> dict[str, float]:
        """Held-out loss, perplexity (and accuracy for multiple choice) of client ``cid`` under ``arrays``."""
        d = self.data[cid]
        apply_arrays(self.model, local.evaluation_arrays(self, cid, arrays), scaling)
        return self._evaluate_loaded(d)

    def _evaluate_loaded(self, d: ClientData) -> dict[str, float]:
        """evaluate_lm of the model as loaded on the client's test set; with ``test_groups``,
        also ``loss@<group>`` and ``accuracy@<group>`` per group of rows (each group run alone,
        so rows of one length are not padded to another's). With ``train.eval_stream_chunk`` > 0
        each row streams through nestfed.streaming (constant memory, memory layers' window)."""
        if self.train.eval_stream_chunk > 0:
            return self._evaluate_streamed(d)
        if not d.test_groups:
            return evaluate_lm(self.model, d.test_labels, None if d.test_hidden is not None else d.test_ids,
                               d.test_hidden, d.start, self.train.eval_batch_size, d.letter_ids)
        out: dict[str, float] = {}
        total = count = correct = rows = 0.0
        for name, idx in d.test_groups.items():
            lab = d.test_labels[idx]
            keep = int((lab != -100).any(0).nonzero().max()) + 1 if (lab != -100).any() else lab.shape[1]
            ev = evaluate_lm(self.model, lab[:, :keep], None if d.test_hidden is not None else d.test_ids[idx, :keep],
                             None if d.test_hidden is None else d.test_hidden[idx, :keep], d.start,
                             self.train.eval_batch_size, d.letter_ids)
            out[f"loss@{name}"] = ev["loss"]
            total += ev["loss"] * ev["tokens"]
            count += ev["tokens"]
            if "accuracy" in ev:
                out[f"accuracy@{name}"] = ev["accuracy"]
                correct += ev["accuracy"] * len(idx)
                rows += len(idx)
        loss = total / max(count, 1.0)
        out.update({"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count})
        if rows:
            out["accuracy"] = correct / rows
        return out

    def _evaluate_streamed(self, d: ClientData) -> dict[str, float]:
        """Streamed evaluation (long contexts): per group when ``test_groups`` is set, as above.
        With ``memory.sink_tokens`` > 0 the sinks sit at cache positions (nestfed.streaming's
        default, what keeps contexts past the backbone's trained length usable), so the numbers
        then differ from a one-pass evaluation, which keeps them at their own positions.
        Raises ValueError when the frozen prefix is cached (streams need token ids) or a layer
        lacks a memory module."""
        from nestfed.adapters.memory import memory_rules
        from nestfed.streaming import stream_evaluate

        if d.test_hidden is not None:
            raise ValueError("train.eval_stream_chunk needs train.cache_frozen_prefix = false (streams start from tokens)")
        rules = memory_rules(self.model)
        window = max((r.settings.window for r in rules.values()), default=0) or 1024
        sink = max((r.settings.sink for r in rules.values()), default=0)
        chunk = self.train.eval_stream_chunk
        groups = d.test_groups or {"all": torch.arange(d.test_ids.shape[0])}
        out: dict[str, float] = {}
        total = count = correct = rows = 0.0
        for name, idx in groups.items():
            ev = stream_evaluate(self.model, d.test_ids[idx], d.test_labels[idx], chunk, window, d.letter_ids, sink)
            if d.test_groups:
                out[f"loss@{name}"] = ev["loss"]
                if "accuracy" in ev:
                    out[f"accuracy@{name}"] = ev["accuracy"]
            total += ev["loss"] * ev["tokens"]
            count += ev["tokens"]
            if "accuracy" in ev:
                correct += ev["accuracy"] * len(idx)
                rows += len(idx)
        loss = total / max(count, 1.0)
        out.update({"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": count})
        if rows:
            out["accuracy"] = correct / rows
        return out

