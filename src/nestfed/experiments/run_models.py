"""The models a finished run leaves, rebuilt and measured again: every client's held-out metrics
under what it runs after the last round (its deployed arrays and its kept state), optionally with
every delta-rule memory knocked out (alpha = 0; nestfed.nn.memory.memory_knocked_out), which says
whether an answer depends on the memory (Benfeghoul et al. 2025, arXiv 2510.05901: a hybrid
model's component-level check).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nestfed import methods
from nestfed.errors import NestfedError
from nestfed.experiments.prepare import prepare
from nestfed.federation.client import ClientTrainer
from nestfed.federation.run_dir import RunDir
from nestfed.nn.memory import memory_knocked_out, memory_rules


def client_evaluations(run_dir: str | Path, knocked_out: bool = False, prep: Any = None) -> dict[str, dict[str, float]]:
    """Every client's held-out metrics as it runs after a run's latest checkpoint.

    Each client runs the strategy's ``deploy`` for it, through its hooks' ``evaluation_arrays``
    with its kept state.

    Args:
        run_dir: the run directory.
        knocked_out: evaluate with every memory's read removed (alpha = 0).
        prep: a preparation of the run's config to reuse; None: prepared here.

    Returns:
        ``{client: held-out metrics}``.

    Raises:
        NestfedError: for a run whose clients do not run the LoRA client trainer, or, with
            ``knocked_out``, a run without memory layers.
    """
    rd = RunDir(run_dir)
    cfg = methods.load_run_config(rd.config_path)
    method = methods.get(cfg.strategy.name)
    prep = prep if prep is not None else prepare(cfg)
    mr = method.build(prep, cfg)
    if not isinstance(mr.trainer, ClientTrainer):
        raise NestfedError(f"{run_dir}: {method.name}'s clients do not run the LoRA client trainer")
    ck = rd.latest_checkpoint(method.keeps_client_state(cfg))
    mr.trainer.client_state = ck.client_state or {}
    if knocked_out and not memory_rules(mr.trainer.model):
        raise NestfedError(f"{run_dir}: {method.name} has no memory to knock out")
    out = {}
    for c in mr.clients:
        arrays, scale = mr.strategy.deploy(ck.state, c.cid)
        if knocked_out:
            with memory_knocked_out(mr.trainer.model_of(c.cid)):
                out[str(c.cid)] = mr.trainer.evaluate(c.cid, arrays, scale)
        else:
            out[str(c.cid)] = mr.trainer.evaluate(c.cid, arrays, scale)
    return out
