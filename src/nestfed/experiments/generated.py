"""The generated evaluation after a run's last round (``[generation]``): every client answers its
first ``generation.rows`` held-out prompts with the model it runs (the strategy's deployment for
it, through its hooks: its own adapter, a local-only client's own, FedNL's memory and window), and
the global adapter truncated to each of ``generation.ranks`` answers every client's prompts too;
each answer is scored against the reference (nestfed.evaluation.text_scores), together with the
reference's perplexity under the same model.

The prompts are the held-out rows' prompts as the run trained them (``data.template``), cut where
their labels start; the references are the labelled responses, decoded without special tokens.
The answers go to ``generations/final.jsonl`` and ``generations/rank<r>.jsonl`` in the run
directory (one JSON object per answer: client, rank, prompt, reference, answer and its scores;
written atomically), and the scores into the summary's ``generation``: per client, per rank group
and over all clients (mean with its 95% t interval over clients), and per truncation rank.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nestfed.config import ExperimentConfig
from nestfed.data.clients import ClientData
from nestfed.evaluation.generation import Decoding, generate
from nestfed.evaluation.lm import evaluate_lm
from nestfed.evaluation.text_scores import answer_scores, mean_scores
from nestfed.experiments.intervals import mean_interval
from nestfed.experiments.mechanisms import skip_reason
from nestfed.federation.aggregation import truncate_rank
from nestfed.federation.client import ClientTrainer
from nestfed.federation.messages import Arrays, GlobalState
from nestfed.federation.strategy import Strategy
from nestfed.io import atomic
from nestfed.methods.implementation import lora_settings
from nestfed.nn.arrays import apply_arrays

METRICS = ("rouge_l", "exact_match", "accuracy", "ppl")


def prompts_and_references(d: ClientData, rows: int, tokenizer) -> tuple[list[list[int]], list[str], list[int]]:
    """The first held-out rows of a client that have a labelled response, as prompts and references.

    Args:
        d: the client's data (``test_ids`` and ``test_labels``, [N, T]; -100 marks an unlabelled
            token).
        rows: how many rows at most.
        tokenizer: the backbone's tokenizer (decodes the references).

    Returns:
        The prompts (the ids before each row's first labelled token), the references (the labelled
        tokens decoded without special tokens, stripped) and the rows' indices.
    """
    prompts, refs, idx = [], [], []
    for i in range(d.test_ids.shape[0]):
        marked = (d.test_labels[i] != -100).nonzero().flatten()
        if marked.numel() == 0 or int(marked[0]) == 0:
            continue
        first, last = int(marked[0]), int(marked[-1])
        prompts.append(d.test_ids[i, :first].tolist())
        refs.append(tokenizer.decode(d.test_ids[i, first : last + 1].tolist(), skip_special_tokens=True).strip())
        idx.append(i)
        if len(prompts) == rows:
            break
    return prompts, refs, idx


def stop_ids(tokenizer) -> list[int]:
    """The tokens an answer ends at.

    Args:
        tokenizer: the backbone's tokenizer.

    Returns:
        The ids, sorted: EOS and the chat template's end of turn where it is one token.
    """
    out = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    for marker in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>"):
        ids = tokenizer.convert_tokens_to_ids(marker)
        if isinstance(ids, int) and ids != tokenizer.unk_token_id and ids is not None:
            out.add(ids)
    return sorted(out)


def client_trainer(trainer: Any, cid: int) -> ClientTrainer | None:
    """The LoRA client trainer that runs one client.

    Args:
        trainer: the run's client trainer, or a trainer of model groups (with ``trainer_for``, e.g.
            compressed clients').
        cid: the client id.

    Returns:
        The run's own trainer or the client's model group's; None for a client that runs no such
        trainer (it cannot be asked to generate here).
    """
    if isinstance(trainer, ClientTrainer):
        return trainer
    pick = getattr(trainer, "trainer_for", None)
    found = pick(cid) if pick is not None else None
    return found if isinstance(found, ClientTrainer) else None


class Counter:
    """Answers done so far, reported as they come.

    Args:
        progress: called as ``progress(done, total)`` after each addition; None: not reported.
        total: the answers in all.
    """

    def __init__(self, progress: Callable[[int, int], None] | None, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def add(self, n: int) -> None:
        """Count more answers done and report the count.

        Args:
            n: the answers just done.
        """
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)


def _answers(
    trainer: ClientTrainer,
    cid: int,
    arrays: Arrays,
    scale: float,
    as_sent: bool,
    cfg: ExperimentConfig,
    tokenizer,
    count: Counter,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Client ``cid``'s answers under ``arrays`` (as the client runs them, or exactly as sent) and
    their mean scores with the references' perplexity."""
    g = cfg.generation
    d = trainer.data[cid]
    model = trainer.model_of(cid)  # its tier's backbone (population.precisions)
    prompts, refs, idx = prompts_and_references(d, g.rows, tokenizer)
    if as_sent:
        apply_arrays(model, arrays, scale)
    else:
        apply_arrays(model, trainer.hooks.evaluation_arrays(trainer.client_state.get(cid, {}), arrays), scale)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    decoding = Decoding(g.max_new_tokens, g.temperature, g.top_p, g.seed)
    before = count.done
    outs = generate(
        model,
        prompts,
        decoding,
        stop_ids(tokenizer),
        pad,
        g.batch_size,
        lambda n: count.add(before + n - count.done),
    )
    rows = []
    for p, r, o in zip(prompts, refs, outs):
        answer = tokenizer.decode(o, skip_special_tokens=True).strip()
        rows.append(
            {"prompt": tokenizer.decode(p), "reference": r, "answer": answer, **answer_scores(answer, r, g.verbaliser)}
        )
    scores = mean_scores([{k: v for k, v in x.items() if k in METRICS} for x in rows])
    sel = torch.tensor(idx, dtype=torch.long)
    ev = evaluate_lm(model, d.test_labels[sel], d.test_ids[sel], batch_size=trainer.train.eval_batch_size)
    scores["ppl"] = ev["ppl"]
    return rows, scores


def _summaries(per_client: dict[str, dict[str, float]], ranks: dict[str, int | str]) -> dict[str, Any]:
    """Over all clients and per rank group (``ranks``: {cid: its rank, or its model group's name}):
    each metric's mean with its 95% half width over clients."""

    def stats(cids: list[str]) -> dict[str, dict[str, float]]:
        out = {}
        for m in METRICS:
            vals = [per_client[c][m] for c in cids if m in per_client[c] and math.isfinite(per_client[c][m])]
            if vals:
                i = mean_interval(vals)
                out[m] = {"mean": i.mean, "half": i.half_width}
        return out

    groups: dict[int | str, list[str]] = {}
    for c in per_client:
        groups.setdefault(ranks.get(c, 0), []).append(c)
    order = sorted(groups, key=lambda r: (isinstance(r, str), str(r).zfill(8)))
    return {"all": stats(list(per_client)), "by_rank": {str(r): stats(groups[r]) for r in order}}


def rank_groups(trainer: Any, ranks: dict[str, int]) -> dict[str, int | str]:
    """The group each client's scores are summarised under.

    Args:
        trainer: the run's client trainer; a trainer of model groups has ``group_of`` ({cid: group}).
        ranks: ``{cid: its LoRA rank}`` (0: none).

    Returns:
        ``{cid: group}``: its LoRA rank, or, for a client without one run by a trainer of model
        groups, ``"group <g>"``.
    """
    group_of = getattr(trainer, "group_of", None) or {}
    return {c: (f"group {group_of[int(c)]}" if not r and int(c) in group_of else r) for c, r in ranks.items()}


def generated_evaluation(
    cfg: ExperimentConfig,
    trainer: Any,
    strategy: Strategy,
    state: GlobalState,
    clients: list[int],
    ranks: dict[str, int],
    tokenizer,
    run_dir: Path,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Run the generated evaluation (module docstring).

    Each client answers under ``strategy.deploy(state, cid)`` as its hooks run it; the global adapter
    (``strategy.export``) truncated to each of ``generation.ranks`` answers at s(r)
    (LoraSettings.scale), unless the export is not one nested adapter (``truncation_skipped`` says
    why).

    Args:
        cfg: the experiment config (its ``generation`` section).
        trainer: the run's client trainer (`client_trainer`).
        strategy: the run's server strategy.
        state: the final global state.
        clients: the client ids that answer.
        ranks: ``{cid: its LoRA rank}`` (`rank_groups`).
        tokenizer: the backbone's tokenizer.
        run_dir: the run directory (``generations/*.jsonl`` are written there).
        progress: called as ``progress(answers done, answers in all)`` after every batch of answers.

    Returns:
        The summary's ``generation``; ``{"skipped": reason}`` when a client runs no LoRA client
        trainer.
    """
    g = cfg.generation
    t0 = time.perf_counter()
    decoding = {"max_new_tokens": g.max_new_tokens, "temperature": g.temperature, "top_p": g.top_p, "seed": g.seed}
    out: dict[str, Any] = {"rows": g.rows, "template": cfg.data.template, "decoding": decoding}
    lines, per_client = [], {}
    total = g.rows * len(clients) * (1 + len(set(g.ranks)))
    count = Counter(progress, total)
    for cid in clients:
        own = client_trainer(trainer, cid)
        if own is None:
            return {"skipped": f"client {cid} runs no LoRA client trainer to generate with"}
        arrays, scale = strategy.deploy(state, cid)
        rows, per_client[str(cid)] = _answers(own, cid, arrays, scale, False, cfg, tokenizer, count)
        lines += [{"client": cid, "rank": rank_groups(trainer, ranks).get(str(cid)), **r} for r in rows]
    atomic.write_text(run_dir / "generations" / "final.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
    out["clients"] = per_client
    out.update(_summaries(per_client, rank_groups(trainer, ranks)))
    if g.ranks:
        out.update(_truncated(cfg, trainer, strategy, state, clients, tokenizer, run_dir, count))
    out["seconds"] = time.perf_counter() - t0
    return out


def _truncated(cfg, trainer, strategy, state, clients, tokenizer, run_dir, count) -> dict[str, Any]:
    """``truncation``: {r: scores over clients} of the global adapter at each generation rank."""
    if not isinstance(trainer, ClientTrainer):
        return {"truncation_skipped": "the clients run models of their own, not one global adapter"}
    arrays, _ = strategy.export(state)
    reason = skip_reason(cfg, arrays, strategy.export_files(state))
    if reason:
        return {"truncation_skipped": reason}
    settings = lora_settings(cfg)
    out: dict[str, Any] = {"truncation": {}}
    for r in sorted(set(cfg.generation.ranks)):
        if r > settings.r_max:
            continue
        cut, scale = truncate_rank(arrays, r), settings.scale(r)
        lines, at_r = [], {}
        for cid in clients:
            rows, at_r[str(cid)] = _answers(trainer, cid, cut, scale, True, cfg, tokenizer, count)
            lines += [{"client": cid, "rank": r, **x} for x in rows]
        atomic.write_text(run_dir / "generations" / f"rank{r}.jsonl", "".join(json.dumps(x) + "\n" for x in lines))
        out["truncation"][str(r)] = {"clients": at_r, **_summaries(at_r, {})["all"]}
    return out
