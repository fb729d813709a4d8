"""Run one method of a prepared experiment into its run directory, embedded (clients in process).

Everything that can fail on bad input (config, data, model-dependent settings of the method) is
checked before the run directory is created; the round loop (nestfed.federation.loop) and the run
directory (nestfed.federation.run_dir) do the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nestfed import config as C
from nestfed import methods
from nestfed.config import ExperimentConfig
from nestfed.experiments.mechanisms import mechanisms
from nestfed.experiments.prepare import install_stream_modules
from nestfed.federation import tracking
from nestfed.federation.in_process import InProcessTransport
from nestfed.federation.safeguards import Safeguards
from nestfed.federation.loop import OnEvent, RoundLoop
from nestfed.federation.messages import GlobalState
from nestfed.federation.prepared import Prepared
from nestfed.federation.run_dir import RunDir
from nestfed.methods.implementation import MethodRun


def new_run_dir(cfg: ExperimentConfig, parent: Path | None = None) -> Path:
    """A fresh, not yet existing directory ``<output.dir>/<name>-<UTC time>``, or ``parent/<method>``
    for one method of a multi-method run."""
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


def check_method(prep: Prepared, cfg: ExperimentConfig) -> None:
    """The method's checks that need the model (e.g. memory layers in range). Raises ConfigError."""
    methods.get(cfg.strategy.name).check_model(prep, cfg)


def run_method(prep: Prepared, cfg: ExperimentConfig, run_dir: Path, resume: bool = False,
               on_event: OnEvent | None = None,
               report: Callable[[MethodRun, GlobalState], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run ``cfg.strategy.name`` over the prepared clients into ``run_dir``; return the summary.

    ``cfg`` may differ from ``prep.cfg`` only in the sections no preparation reads (strategy,
    federation, train's optimisation settings, output, the methods' sections). With ``resume`` the
    run continues after its latest checkpoint (the caller checked that ``cfg`` is the one the run
    directory holds). ``report(method_run, final_state)``: further summary fields (e.g. the global
    adapter evaluated as a server model); the truncation curve and dimension importance
    (nestfed.experiments.mechanisms) are always added. Raises ConfigError / DataError / NestfedError, each one line.
    """
    t0 = time.perf_counter()
    method = methods.get(cfg.strategy.name)
    check_method(prep, cfg)
    mr = method.build(prep, cfg)
    install_stream_modules(prep, cfg)
    rd = RunDir.open(run_dir) if resume else RunDir.create(run_dir, C.dumps_toml(cfg))
    fed = cfg.federation
    loop = RoundLoop(mr.strategy, InProcessTransport(mr.trainer), mr.clients, fed.rounds, rd, fed.fraction,
                     fed.min_clients, fed.seed, mr.keeps_client_state, safeguards=Safeguards.from_config(cfg),
                     sampling=fed.sampling, on_event=on_event,
                     sinks=tracking.sinks(cfg.tracking, rd.path, cfg.output.dir, cfg.output.name))
    state = loop.run(mr.shapes, resume=resume)
    exports = mr.finish(state)
    extra = {"engine": "embedded", "wall_time_s": time.perf_counter() - t0, "prepare_time_s": prep.prepare_time_s,
             "client_labels": {str(c): d.label for c, d in prep.data.items()}, "rejections": loop.log,
             "frozen_prefix_layers": prep.frozen_prefix_layers}
    extra.update(mechanisms(cfg, mr, state))
    if report is not None:
        extra.update(report(mr, state))
    return rd.finish(cfg, exports, extra)
