"""The one run path around the round loop: the embedded runner (nestfed.experiments.run) and
Flower's ServerApp (nestfed.flower.server_app) each describe their federation as one
`Federation` and call `run_federation`, which builds the loop from the config and the
method's capabilities, runs it, and finishes the run directory with the same summary fields on
both (the mechanism reports included: the clients evaluate the adapter's prefixes through the
transport).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nestfed import methods
from nestfed.config import ExperimentConfig
from nestfed.errors import RunFailed
from nestfed.experiments.mechanisms import PER_CLIENT, mechanisms
from nestfed.federation.loop import OnEvent, RoundLoop
from nestfed.federation.messages import Arrays, ClientInfo, GlobalState
from nestfed.federation.population import Population
from nestfed.federation.run_dir import Exports, RunDir
from nestfed.federation.strategy import Strategy
from nestfed.federation.tracking import Sink
from nestfed.federation.transport import Transport


@dataclass
class Federation:
    """What one run of the round loop needs beyond its config.

    The loop's own parts are those of nestfed.federation.loop.RoundLoop.

    Attributes:
        engine: ``embedded`` or ``flower`` (the summary's ``engine``).
        strategy: the loop's server strategy.
        transport: the loop's transport.
        clients: the federation that answered.
        shapes: ``{module: (out, in)}`` of the LoRA-adapted layers.
        keeps_client_state: whether the loop checkpoints the clients' kept state.
        exports: ``exports(state)``: what the run directory writes (adapter, files).
        roster: ``{cid: {rank, label, num_examples}}``.
        population: the per-round draws.
        min_clients: the loop's minimum of answering clients; None: ``federation.min_clients``.
        on_event: the loop's event callback; None: none.
        sinks: the loop's tracking sinks.
        server_evaluate: the loop's server-side evaluation; None: none.
        on_global: ``on_global(arrays, s)``: metrics of an adapter on the global held-out set (the
            truncation curve's ``truncation_global``); None without one.
        summary: ``summary(state)``: the engine's further summary fields (e.g. preparation time).
        log: the engine's own lines, kept as the summary's ``events``.
    """

    engine: str
    strategy: Strategy
    transport: Transport
    clients: list[ClientInfo]
    shapes: dict[str, tuple[int, int]]
    keeps_client_state: bool
    exports: Callable[[GlobalState], Exports]
    roster: dict[str, dict[str, Any]]
    population: Population
    min_clients: int | None = None
    on_event: OnEvent | None = None
    sinks: list[Sink] = field(default_factory=list)
    server_evaluate: Callable[[int, GlobalState], dict[str, Any]] | None = None
    on_global: Callable[[Arrays, float], dict[str, float]] | None = None
    summary: Callable[[GlobalState], dict[str, Any]] | None = None
    log: list[str] | None = None


def build_loop(cfg: ExperimentConfig, fed: Federation) -> RoundLoop:
    """The round loop of a federation, its method's capabilities enforced.

    Its run directory is set by `run_federation`, so a refusal writes nothing.

    Args:
        cfg: the experiment config.
        fed: the federation.

    Returns:
        The round loop, without a run directory.

    Raises:
        ConfigError: naming the setting a method or transport asks beyond the method's capabilities.
    """
    m = methods.get(cfg.strategy.name)
    kw: dict[str, Any] = {
        "population": fed.population,
        "on_event": fed.on_event,
        "sinks": fed.sinks,
        "server_evaluate": fed.server_evaluate,
        "capabilities": m.capabilities,
        "method": m.name,
        "refusals": m.refusals,
    }
    if fed.min_clients is not None:
        kw["min_clients"] = fed.min_clients
    return RoundLoop.from_config(cfg, fed.strategy, fed.transport, fed.clients, None, fed.keeps_client_state, **kw)


def committed_round_time(rd: RunDir) -> float:
    """Seconds the rounds committed in a run directory took (their lines' ``time_s``).

    Args:
        rd: the run directory (no metrics.jsonl yet: nothing committed).

    Returns:
        The sum of ``time_s`` over the committed lines (round 0's line has none).

    Raises:
        DataError: as nestfed.federation.run_files.RunFiles.read_metrics, for a malformed line.
    """
    if not rd.metrics_path.is_file():
        return 0.0
    return float(sum(ln.get("time_s", 0.0) for ln in rd.read_metrics()))


def run_federation(
    cfg: ExperimentConfig,
    fed: Federation,
    open_run_dir: Callable[[], RunDir],
    resume: bool = False,
    t0: float | None = None,
) -> dict[str, Any]:
    """Build the loop, open the run directory, run or resume the rounds, and finish the directory.

    Finishing writes the exports, the mechanism reports and the summary.

    Args:
        cfg: the experiment config.
        fed: the federation.
        open_run_dir: creates the run directory, or opens it to resume.
        resume: resume the rounds from the latest checkpoint.
        t0: the ``time.perf_counter()`` the wall time counts from; None: now.

    Returns:
        The summary; its common fields are ``engine``, ``wall_time_s`` (seconds since ``t0``, plus,
        after a resume, ``wall_time_before_resume_s``: the ``time_s`` of the rounds committed before
        it, so a resumed run's time counts its earlier rounds; their setup and round 0 are not
        counted) and ``rejections``.

    Raises:
        ConfigError: when the method's capabilities refuse the config (`build_loop`).
        RunFailed: naming the run directory, when the rounds fail (the directory gets a failed
            summary first).
    """
    t0 = time.perf_counter() if t0 is None else t0
    loop = build_loop(cfg, fed)
    rd = open_run_dir()
    loop.run_dir = rd
    before = committed_round_time(rd) if resume else 0.0

    def common() -> dict[str, Any]:
        out = {"engine": fed.engine, "wall_time_s": before + time.perf_counter() - t0, "rejections": list(loop.log)}
        if resume:
            out["wall_time_before_resume_s"] = before
        return out if fed.log is None else {**out, "events": list(fed.log)}

    try:
        state = loop.run(fed.shapes, resume=resume)
    except RunFailed as exc:  # the rounds so far are committed; the summary says why it stopped
        rd.fail(cfg, str(exc), exc.round, common())
        raise RunFailed(f"{rd.path}: {exc}", exc.round) from None
    exports = fed.exports(state)
    extra = common()  # the wall time of the rounds and the exports; the reports below are not in it
    last = cfg.federation.rounds

    def evaluate(deployments):
        return fed.transport.evaluate(last, deployments, as_sent=True)

    found = mechanisms(cfg, fed.strategy, fed.clients, state, evaluate, loop.evaluation.panel, fed.on_global)
    if fed.summary is not None:
        found.update(fed.summary(state))
    per_client = {k: found.pop(k) for k in PER_CLIENT if k in found}
    extra.update(found)
    if fed.log is not None:
        extra["events"] = list(fed.log)  # with what the reports logged
    return rd.finish(cfg, exports, extra, fed.roster, per_client)
