"""The nestfed ServerApp: any Flower-capable nestfed method driven through Flower's Message API.

It is a transport of the one round loop (nestfed.federation.loop): sampling, validation,
aggregation, the metrics line, checkpoints, resume and the run directory are the embedded runner's
own. Only the exchange differs: one Flower message per node (nestfed.flower.transport).

The run config (``[tool.flwr.app.config]`` of ``flower_app/pyproject.toml``, overridable with
``flwr run --run-config``) is read by nestfed.flower.run_settings, which lists its keys: the
experiment TOML and its overrides, the run directory and ``resume``, the nodes to wait for and the
timeouts, ``min-clients``, ``evaluate`` and ``secure-aggregation`` with its SecAgg+ settings.

A run: the experiment is loaded and checked for Flower, the run directory is checked new (or its
resume accepted), the nodes are waited for and QUERYed (each node's partition, rank, n_k, LoRA
shapes, base model and, for a method that needs them, the initial arrays only a model gives, e.g.
FedNL's fresh memory rules), what they formed is checked, and only then is anything written: every
check before that is nestfed.experiments.preflight's. Clients' kept state stays on the nodes, on
their disks, keyed by the run directory and round (nestfed.flower.node_state), so a method whose
clients keep state resumes on Flower too: after a crash of the SuperLink or of the ServerApp,
``resume = true`` with the same ``run-dir`` continues from the latest checkpoint and each node from
its state of that round.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from nestfed import config, methods
from nestfed.config import ExperimentConfig
from nestfed.errors import RunFailed
from nestfed.experiments import preflight
from nestfed.experiments.federated_run import Federation, run_federation
from nestfed.experiments.run import new_run_dir
from nestfed.federation import tracking
from nestfed.federation.population import Population
from nestfed.federation.run_dir import Exports, RunDir
from nestfed.federation.strategy import Strategy
from nestfed.flower.exchange import wait_for_nodes
from nestfed.flower.run_settings import RunSettings, app_dir_of, resolve_experiment
from nestfed.flower.transport import FlowerTransport, QueryResult, query


@dataclass
class FlowerRun:
    """One nestfed experiment on a Flower grid (see the module docstring).

    Attributes:
        grid: the Flower grid.
        settings: the run settings.
        app_dir: the installed app bundle, where a relative experiment path is looked for first;
            None when unknown.
        log: every line said, in order.
    """

    grid: Grid
    settings: RunSettings
    app_dir: Path | None = None
    log: list[str] = field(default_factory=list)

    def say(self, text: str) -> None:
        """Log a line through Flower's logger and keep it in ``log``.

        Args:
            text: the line.
        """
        log(logging.INFO, "[nestfed] %s", text)
        self.log.append(text)

    def load_config(self) -> ExperimentConfig:
        """Load the experiment, validated, and its method checked for Flower.

        Returns:
            The config.

        Raises:
            ConfigError: for an experiment not found, an invalid config or a method not on Flower.
        """
        path = resolve_experiment(self.settings.experiment, self.app_dir)
        return preflight.flower_config(path, self.settings.overrides)

    def gather_clients(self, cfg: ExperimentConfig, cfg_text: str, min_clients: int) -> QueryResult:
        """Wait for the nodes, QUERY them, and check what they report.

        Args:
            cfg: the experiment's config.
            cfg_text: the resolved experiment, sent to every node.
            min_clients: the fewest clients the run needs.

        Returns:
            What the QUERY round found (nestfed.flower.transport.query).

        Raises:
            NestfedError: as nestfed.experiments.preflight.flower_clients (too few clients), or
                when the probed node refuses the experiment's client count
                (nestfed.flower.exchange.wait_for_nodes).
            ConfigError: as nestfed.experiments.preflight.flower_clients (a rank above r_max).
        """
        s = self.settings
        want = s.num_supernodes or cfg.data.num_clients
        nodes = wait_for_nodes(self.grid, want, cfg_text, s.connect_timeout_s, s.poll_interval_s)
        self.say(f"{len(nodes)} nodes connected (waited for {want})")
        q = query(self.grid, nodes, cfg, cfg_text, s, self.say)
        preflight.flower_clients(cfg, q.clients, min_clients, len(nodes), want, q.refusal)
        return q

    def federation(
        self,
        cfg: ExperimentConfig,
        q: QueryResult,
        strategy: Strategy,
        population: Population,
        run_dir: Path,
        min_clients: int,
    ) -> Federation:
        """The federation the QUERY round found, as the one run path takes it.

        Args:
            cfg: the experiment's config.
            q: what the QUERY round found.
            strategy: the method's server side.
            population: the population's per-round draws.
            run_dir: the run directory (its resolved path keys the nodes' kept state).
            min_clients: the fewest accepted updates a round needs.

        Returns:
            The federation: its exports carry the nodes' base model; its summary lists the
            clients, their ranks and labels.
        """
        transport = FlowerTransport(
            self.grid, self.settings, q.node_of, config.dumps_toml(cfg), q, self.say, str(run_dir.resolve())
        )
        labels = {str(c.cid): q.info[str(c.cid)].get("label", "") for c in q.clients}
        roster = {
            str(c.cid): {"rank": c.rank, "label": labels[str(c.cid)], "num_examples": c.num_examples} for c in q.clients
        }
        if cfg.population.precisions:  # device tiers: each node's precision, as its QUERY reported it
            for c in q.clients:
                roster[str(c.cid)]["precision"] = q.info[str(c.cid)].get("precision") or cfg.model.quantization

        def summary(state) -> dict[str, Any]:
            if not config.per_client_inline(cfg):
                return {}
            return {
                "clients": [c.cid for c in q.clients],
                "ranks": [c.rank for c in q.clients],
                "client_labels": labels,
            }

        return Federation(
            "flower",
            strategy,
            transport,
            q.clients,
            q.shapes,
            methods.get(cfg.strategy.name).keeps_client_state(cfg),
            lambda state: Exports(strategy.export(state), q.base_model, strategy.export_files(state)),
            roster,
            population,
            min_clients=min_clients,
            on_event=lambda kind, info: self.say(info["text"]) if kind == "log" else None,
            sinks=tracking.sinks(cfg.tracking, run_dir, cfg.output.dir, cfg.output.name),
            summary=summary,
            log=self.log,
        )

    def run(self) -> dict[str, Any]:
        """Validate, query the nodes, run the rounds through the loop, finish the run directory.

        Returns:
            The run's summary (summary.json).

        Raises:
            ConfigError: for a setting at fault, before anything is written.
            DataError: for a corrupted checkpoint or metrics file of a resume.
            NestfedError: for a run directory at fault, or too few clients.
            RunFailed: naming the run directory, when the rounds fail.
        """
        t_start = time.perf_counter()
        s = self.settings
        cfg = self.load_config()
        cfg_text = config.dumps_toml(cfg)
        run_dir = Path(s.run_dir).expanduser() if s.run_dir else new_run_dir(cfg)
        rd = preflight.flower_run_dir(cfg, run_dir, s.resume, lambda c: self.say(f"resume: config.toml now has {c}"))
        min_clients = s.min_clients or cfg.federation.min_clients
        q = self.gather_clients(cfg, cfg_text, min_clients)
        strategy = methods.get(cfg.strategy.name).server(cfg, q.initial_arrays)
        population = preflight.flower_federation(cfg, q.clients, s.secagg if s.secure_aggregation else None)
        fed = self.federation(cfg, q, strategy, population, run_dir, min_clients)

        def open_run_dir() -> RunDir:
            if rd is not None:
                self.say(f"resuming {run_dir}")
                return rd
            return RunDir.create(run_dir, cfg_text, config.per_client_inline(cfg))

        try:
            summary = run_federation(cfg, fed, open_run_dir, s.resume, t_start)
        except RunFailed as exc:
            self.say(f"failed: {exc}")
            raise
        for rnd in summary.get("rounds_mostly_dropped", []):
            self.say(f"WARNING: round {rnd} lost most of its sampled clients (see metrics.jsonl's dropped)")
        self.say(f"done: {run_dir}")
        return summary


def run_on_grid(grid: Grid, run_config: dict[str, Any]) -> dict[str, Any]:
    """Run the experiment a run config names on a grid.

    Args:
        grid: the Flower grid.
        run_config: Flower's run config (nestfed.flower.run_settings).

    Returns:
        The run's summary.
    """
    settings = RunSettings.from_run_config(run_config)
    return FlowerRun(grid, settings, app_dir_of(grid)).run()


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """The ServerApp entry point: read the run config and run the experiment.

    Args:
        grid: the Flower grid.
        context: the run's context (its ``run_config``).
    """
    run_on_grid(grid, dict(context.run_config))
