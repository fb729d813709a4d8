"""Run one method of a prepared experiment into its run directory, embedded (clients in process).

Everything that can fail on bad input (config, data, model-dependent settings of the method) is
checked before the run directory is created (nestfed.experiments.preflight); the round loop
(nestfed.federation.loop) and the run directory (nestfed.federation.run_dir) do the rest.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nestfed import config, methods
from nestfed.config import ConfigError, ExperimentConfig
from nestfed.config.capabilities import Capability
from nestfed.data.clients import ClientData
from nestfed.data.global_eval_set import global_test_set
from nestfed.evaluation.client import evaluate_client
from nestfed.experiments import preflight
from nestfed.experiments.federated_run import Federation, run_federation
from nestfed.experiments.generated import generated_evaluation
from nestfed.experiments.preflight import stored_config as stored_config  # a resume's reference, named here too
from nestfed.experiments.prepare import install_stream_modules
from nestfed.federation import tracking
from nestfed.federation.client import ClientTrainer
from nestfed.federation.evaluation_plan import EvalPlan
from nestfed.federation.in_process import InProcessTransport
from nestfed.federation.loop import OnEvent
from nestfed.federation.messages import GlobalState
from nestfed.federation.prepared import Prepared
from nestfed.federation.run_dir import RunDir
from nestfed.methods.implementation import MethodRun
from nestfed.nn.arrays import apply_arrays


def new_run_dir(cfg: ExperimentConfig, parent: Path | None = None) -> Path:
    """Name a fresh run directory (not created).

    Args:
        cfg: the run's config (output.dir, output.name, the method).
        parent: the parent of a multi-method run; None for a single run.

    Returns:
        ``parent/<method>``, else a not yet existing ``<output.dir>/<name>-<UTC time>`` (``-<i>``
        appended on a clash).
    """
    if parent is not None:
        return parent / cfg.strategy.name
    name = cfg.output.name or cfg.strategy.name
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = Path(cfg.output.dir) / f"{name}-{stamp}"
    i = 1
    while path.exists():
        path = Path(cfg.output.dir) / f"{name}-{stamp}-{i}"
        i += 1
    return path


def global_test_data(prep: Prepared, cfg: ExperimentConfig, precision: str | None = None) -> ClientData | None:
    """The global held-out set (nestfed.data.global_eval_set), built once per preparation and precision.

    Args:
        prep: the preparation; the set is cached in it.
        cfg: the run's config (``evaluation.global_test``: its rows).
        precision: the backbone precision whose frozen prefix it caches (a device tier's,
            ``population.precisions``); None for the backbone's own.

    Returns:
        The set, its frozen prefix cached; None when the config asks for none.

    Raises:
        ConfigError: when the preparation has no client source to draw from.
    """
    rows = cfg.evaluation.global_test
    if not rows:
        return None
    own = prep.cfg.model.quantization
    precision = precision or own
    key = ("global_test", rows) if precision == own else ("global_test", rows, precision)
    if key not in prep.cache:
        source = getattr(prep.data, "source", None)
        if source is None:
            raise ConfigError("evaluation.global_test: this preparation has no client source to draw from")
        d = global_test_set(source, rows, cfg.data.num_clients, cfg.data.seed)
        model = prep.backbones.get(precision, prep.backbone).model
        d.cache_prefix(model, prep.frozen_prefix_layers, cfg.train.eval_batch_size)
        prep.cache[key] = d
    return prep.cache[key]


def server_evaluation(
    mr: MethodRun, cfg: ExperimentConfig, data: ClientData | None
) -> Callable[[int, GlobalState], dict[str, float]] | None:
    """The round's ``eval_global``: the global adapter on the global held-out set.

    The global adapter is the strategy's ``deploy`` for no client, what ``nestfed export`` writes.

    Args:
        mr: the method's run.
        cfg: the run's config.
        data: the global held-out set; None for none.

    Returns:
        The loop's ``server_evaluate(rnd, state)``; None without the set, for a method without one
        global adapter (local-only's clients keep their own) or whose clients run other models.
    """
    if data is None or not methods.get(cfg.strategy.name).can(Capability.GLOBAL_MODEL):
        return None
    if not isinstance(mr.trainer, ClientTrainer):
        return None
    trainer = mr.trainer

    def evaluate(rnd: int, state: GlobalState) -> dict[str, float]:
        arrays, scale = mr.strategy.deploy(state, None)
        apply_arrays(trainer.model, arrays, scale)
        return evaluate_client(trainer.model, data, trainer.train)

    return evaluate


def run_method(
    prep: Prepared,
    cfg: ExperimentConfig,
    run_dir: Path,
    resume: bool = False,
    on_event: OnEvent | None = None,
    report: Callable[[MethodRun, GlobalState], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Run ``cfg.strategy.name`` over the prepared clients into a run directory.

    The truncation curve and dimension importance (nestfed.experiments.mechanisms) are always
    added to the summary.

    Args:
        prep: the preparation.
        cfg: the run's config; it may differ from ``prep.cfg`` only in the sections no preparation
            reads (strategy, federation, train's optimisation settings, output, the methods'
            sections).
        run_dir: the run directory.
        resume: continue after its latest checkpoint (the caller checked that ``cfg`` is the one
            the run directory holds).
        on_event: the round loop's ``on_event``; None for none.
        report: called as ``report(method_run, final_state)`` for further summary fields (e.g. the
            global adapter evaluated as a server model); None for none.

    Returns:
        The run's summary (summary.json).

    Raises:
        ConfigError: for a setting at fault, one line.
        DataError: for data or a file at fault, one line.
        NestfedError: for a run directory at fault, one line.
        RunFailed: naming the run directory, when the rounds fail.
    """
    t0 = time.perf_counter()
    method = methods.get(cfg.strategy.name)
    preflight.check_models(prep, [cfg])
    mr = method.build(prep, cfg)
    install_stream_modules(prep, cfg)
    glob = global_test_data(prep, cfg)
    population = preflight.embedded(cfg, mr.clients, *_footprints(prep))  # an elastic trace, the tracking store
    text = config.dumps_toml(cfg)
    trainer = mr.trainer if isinstance(mr.trainer, ClientTrainer) else None

    def summary(state: GlobalState) -> dict[str, Any]:
        out = _summary_fields(prep, cfg, mr, glob, state)
        if cfg.generation.rows:  # the generated evaluation (nestfed.experiments.generated)
            out["generation"] = generated(prep, cfg, mr, state, run_dir, on_event)
        if report is not None:
            out.update(report(mr, state))
        return out

    def on_global(arrays, scale) -> dict[str, float]:
        apply_arrays(trainer.model, arrays, scale)
        return evaluate_client(trainer.model, glob, trainer.train)

    fed = Federation(
        "embedded",
        mr.strategy,
        InProcessTransport(mr.trainer),
        mr.clients,
        mr.shapes,
        mr.keeps_client_state,
        mr.finish,
        _roster(prep, mr),
        population,
        on_event=on_event,
        sinks=tracking.sinks(cfg.tracking, run_dir, cfg.output.dir, cfg.output.name),
        server_evaluate=server_evaluation(mr, cfg, glob),
        on_global=on_global if glob is not None and trainer is not None else None,
        summary=summary,
    )

    def open_run_dir() -> RunDir:
        return RunDir.open(run_dir, text) if resume else RunDir.create(run_dir, text, config.per_client_inline(cfg))

    return run_federation(cfg, fed, open_run_dir, resume, t0)


def _roster(prep: Prepared, mr: MethodRun) -> dict[str, dict[str, Any]]:
    """The run's roster: the preparation's, each row with the method's own columns (``MethodRun.client_columns``)."""
    roster = prep.roster()
    for cid, columns in mr.client_columns.items():
        if str(cid) in roster:
            roster[str(cid)].update(columns)
    return roster


def _footprints(prep: Prepared) -> tuple[Any, dict[int, str] | None]:
    """(the footprint an elastic budget trace is read with: {precision: bytes(r)} under device
    tiers, else bytes(r), or None unmeasured; {cid: precision} under device tiers, else None)."""
    fp = {q: f.bytes for q, f in prep.footprints.items()} if prep.footprints else None
    if fp is None and prep.footprint is not None:
        fp = prep.footprint.bytes
    return fp, (dict(enumerate(prep.precisions)) if prep.precisions is not None else None)


def _summary_fields(
    prep: Prepared, cfg: ExperimentConfig, mr: MethodRun, glob: Any, state: GlobalState
) -> dict[str, Any]:
    """The summary's preparation fields, client labels, and each panel client's model on the global set."""
    out: dict[str, Any] = {"prepare_time_s": prep.prepare_time_s, "frozen_prefix_layers": prep.frozen_prefix_layers}
    pool = getattr(prep.data, "stats", None)
    if pool is not None:
        out["client_pool"] = dataclasses.asdict(pool)
    if config.per_client_inline(cfg):
        out["client_labels"] = {str(c.cid): prep.label(c.cid) for c in prep.clients}
    trainer = mr.trainer if isinstance(mr.trainer, ClientTrainer) else None
    if glob is not None and trainer is not None:  # what each client runs, on the global set
        out["global_by_client"] = {}
        for cid in loop_panel(cfg, mr):
            arrays, scale = mr.strategy.deploy(state, cid)
            data = global_test_data(prep, cfg, prep.precision(cid)) if prep.mixed_precision else glob
            out["global_by_client"][str(cid)] = trainer.evaluate_on(cid, arrays, scale, data)
    return out


def generated(
    prep: Prepared, cfg: ExperimentConfig, mr: MethodRun, state: GlobalState, run_dir: Path, on_event: OnEvent | None
) -> dict[str, Any]:
    """The summary's ``generation``: answers generated after the last round (nestfed.experiments.generated).

    Args:
        prep: the preparation (its tokenizer).
        cfg: the run's config.
        mr: the method's run.
        state: the final global state.
        run_dir: the run directory, which receives the answers.
        on_event: called as ``on_event("generated", {done, total})`` as answers come; None for none.

    Returns:
        The generated evaluation of the panel's clients (else every client's).
    """
    ranks = {str(c.cid): c.rank for c in mr.clients}
    progress = None if on_event is None else lambda n, k: on_event("generated", {"done": n, "total": k})
    tokenizer = prep.backbone.tokenizer
    return generated_evaluation(
        cfg, mr.trainer, mr.strategy, state, loop_panel(cfg, mr), ranks, tokenizer, run_dir, progress
    )


def loop_panel(cfg: ExperimentConfig, mr: MethodRun) -> list[int]:
    """The clients whose models ``global_by_client`` measures on the global held-out set.

    Args:
        cfg: the run's config.
        mr: the method's run.

    Returns:
        The evaluation panel's ids (EvalPlan, as the mechanism reports use it), else every client's.
    """
    panel = EvalPlan.from_config(cfg).panel
    return [c.cid for c in mr.clients] if panel is None else list(panel)
