"""Tiny backbones pretrained here, once per model cache: a frozen backbone that can already do a task
with full attention, for claims about what a method adds to such a backbone at a CPU's budget.

``tiny-llama-mqar``: a Llama of hidden size 64, 2 layers and 2 heads of 32 dimensions, with the
byte tokenizer, trained from its random start (``model.seed``) with full attention on multi-query
associative recall (nestfed.data.mqar) over every candidate token: keys from the even candidates,
values from the odd ones (so every ``[mqar]`` vocabulary's keys and values are ones it has
recalled), fillers from all of them; 4 pairs, 4 queries, a gap of 16 fillers; 3,000 AdamW steps of
32 rows at lr 3e-3 (about a minute on 2 cores; 44% recall with full attention at seed 0, chance
1.6%). The recall it reaches with full attention is written beside it (``pretraining.json``).
Zoology (Arora et al. 2024) trains its MQAR models the same way, on the task itself, from scratch.

`ensure_pretrained` builds a missing one before the backbone is loaded (nestfed.experiments.
prepare calls it); the folder appears atomically (nestfed.io.atomic.write_dir), so an interrupted
pretraining leaves nothing half-written, and the same seed gives the same weights on one machine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from nestfed.config import ModelConfig
from nestfed.data.mqar import Vocab, single_tokens
from nestfed.experiments.mqar_training import MqarTask, recall_accuracy, train_on_mqar
from nestfed.io import atomic
from nestfed.nn.backbone import PRETRAINED_TINY, byte_tokenizer, pretrained_tiny_dir

STEPS, BATCH, LR = 3000, 32, 3e-3


def mqar_layout(tokenizer) -> MqarTask:
    """The pretraining's task.

    Keys are the even candidates, values the odd ones (the roles nestfed.data.mqar.vocabularies
    gives them in every pool), fillers all of them; 4 pairs, 4 queries, a gap of 16.

    Args:
        tokenizer: the byte tokenizer (its single-token candidates).

    Returns:
        The task.
    """
    cand = single_tokens(tokenizer)
    return MqarTask(Vocab(tuple(cand[0::2]), tuple(cand[1::2])), tuple(cand))


def tiny_mqar_model(vocab_size: int, seed: int):
    """The untrained ``tiny-llama-mqar`` architecture (module docstring), seeded.

    Args:
        vocab_size: the tokenizer's vocabulary size.
        seed: the ``torch.manual_seed`` of its initial weights.

    Returns:
        A ``LlamaForCausalLM``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def pretrain_mqar(seed: int, steps: int = STEPS, say: Callable[[str], None] | None = None):
    """Train ``tiny-llama-mqar`` from its seeded start (module docstring).

    Args:
        seed: the seed of the initial weights and the rows (the recall is measured at seed + 1).
        steps: the AdamW steps.
        say: called with a progress line every 500 steps; None: silent.

    Returns:
        The model, its tokenizer and facts: steps, rows, seconds, final loss, recall accuracy with
        full attention, the task.
    """
    tok = byte_tokenizer()
    model = tiny_mqar_model(len(tok), seed)
    task = mqar_layout(tok)
    t0 = time.perf_counter()

    def progress(step: int, loss: float) -> None:
        if say is not None and (step + 1) % 500 == 0:
            say(f"pretraining tiny-llama-mqar: step {step + 1}/{steps}, loss {loss:.3f}")

    loss = train_on_mqar(model, [{"params": list(model.parameters()), "lr": LR}], task, steps, BATCH, seed, progress)
    facts = {
        "steps": steps,
        "rows": steps * BATCH,
        "seconds": time.perf_counter() - t0,
        "final_loss": loss,
        "full_attention_recall": recall_accuracy(model, task, 256, seed + 1),
        "task": {"pairs": task.pairs, "queries": task.queries, "gap": task.gap, "batch": BATCH, "lr": LR},
    }
    return model, tok, facts


def ensure_pretrained(cfg: ModelConfig, say: Callable[[str], None] | None = None, steps: int = STEPS) -> Path | None:
    """Pretrain a tiny backbone into its cache folder when it is one of PRETRAINED_TINY and not there.

    Args:
        cfg: the model config (``name``, ``seed``, the cache folder).
        say: called with progress lines; None: silent.
        steps: the AdamW steps.

    Returns:
        The folder (written atomically); None for any other model.
    """
    if cfg.name not in PRETRAINED_TINY:
        return None
    path = pretrained_tiny_dir(cfg)
    if (path / "config.json").is_file():
        return path
    if say is not None:
        say(f"pretraining {cfg.name} once (about a minute), into {path}")
    model, tok, facts = pretrain_mqar(cfg.seed, steps, say)

    def build(tmp: Path) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "pretraining.json").write_text(json.dumps(facts, indent=2) + "\n")

    return atomic.write_dir(path, build)
