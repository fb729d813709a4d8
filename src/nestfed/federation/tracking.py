"""Experiment-tracking sinks: TensorBoard and MLflow, fed the lines metrics.jsonl commits.

metrics.jsonl is the source of truth (nestfed.federation.run_dir). The round loop hands every
committed line to each sink right after the commit (``log``), and at its start hands the lines
already committed (``open``): a sink catches up on what it missed (a crash between the commit and
the sink, a sink added to an existing run on resume) and never repeats a round.

- `TensorBoardSink` writes scalar events into ``<run dir>/tensorboard/`` through
  ``torch.utils.tensorboard.SummaryWriter``. On resume it starts with ``purge_step`` at the first
  committed round: TensorBoard's readers then drop what earlier sessions wrote from that step on,
  and the committed lines are written again, so the event files hold exactly metrics.jsonl.
- `MlflowSink` logs to one MLflow run per nestfed run (its id kept in
  ``<run dir>/mlflow_run_id``; the resolved config logged as its params), each line in one
  ``log_batch`` call, at step = round. On resume it reads which rounds the run holds (the
  ``round`` metric's history) and logs the others.

The values are `scalars` of each line: every finite number in it, keyed by its path
(``eval/0/ppl``, ``clients/1/metrics/train_loss``, ``bytes_up``), plus ``eval/mean/<metric>``.
"""

from __future__ import annotations

import json
import math
import os
import time
import tomllib
from pathlib import Path
from typing import Any, Protocol

from nestfed.config.tracking import TrackingConfig
from nestfed.errors import ConfigError
from nestfed.io import atomic


class Sink(Protocol):
    """A tracking sink: ``open(committed lines)`` once, ``log(line)`` per committed round, ``close`` at the end.

    Attributes:
        name: the sink's name (``tensorboard``, ``mlflow``).
    """

    name: str

    def open(self, lines: list[dict[str, Any]]) -> None:
        """Catch up on the lines already committed.

        Args:
            lines: the committed metrics lines (a fresh run: round 0's, or none).
        """

    def log(self, line: dict[str, Any]) -> None:
        """Log one committed round's line.

        Args:
            line: the metrics line.
        """

    def close(self, finished: bool) -> None:
        """Flush and close.

        Args:
            finished: whether every round of the run has been committed.
        """


def leaves(tree: dict[str, Any], sep: str) -> dict[str, Any]:
    """Flatten nested dicts: their non-dict values keyed by their path.

    Args:
        tree: the nested dicts.
        sep: the path separator.

    Returns:
        {path: value}, e.g. ``{"eval": {"0": {"ppl": 4.0}}}`` -> ``{"eval/0/ppl": 4.0}`` with
        sep "/".
    """
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update({f"{k}{sep}{kk}": vv for kk, vv in leaves(v, sep).items()})
        else:
            out[str(k)] = v
    return out


def scalars(line: dict[str, Any]) -> dict[str, float]:
    """Pick every finite number of a metrics line (bools and lists left out), keyed by its path.

    Args:
        line: the metrics line.

    Returns:
        {path joined with "/": value}, plus ``eval/mean/<metric>``: the mean over clients of each
        held-out metric.
    """
    out = {
        k: float(v)
        for k, v in leaves(line, "/").items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }
    per_client = [v for v in line.get("eval", {}).values() if isinstance(v, dict)]
    for metric in sorted({k for v in per_client for k in v}):
        vals = [v[metric] for v in per_client if isinstance(v.get(metric), (int, float)) and math.isfinite(v[metric])]
        if vals:
            out[f"eval/mean/{metric}"] = sum(vals) / len(vals)
    return out


class TensorBoardSink:
    """Scalar events in a folder (``torch.utils.tensorboard``; the ``tensorboard`` package).

    Args:
        log_dir: the events' folder.

    Raises:
        ConfigError: when the package is missing.
    """

    name = "tensorboard"

    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                'tracking.tensorboard = true needs the tensorboard package (pip install -e ".[tracking]")'
            ) from None
        self._writer_class = SummaryWriter
        self.log_dir = Path(log_dir)
        self.writer = None

    def open(self, lines: list[dict[str, Any]]) -> None:
        """Start a writer that purges from the first committed round, and write the lines again."""
        # every session starts with SessionLog.START at its first step (a fresh run at 0 too), so that
        # every loader (TensorBoard's Rust and Python ones, EventAccumulator) purges a crashed
        # session's steps when the resumed one writes them again
        purge = lines[0]["round"] if lines else 0
        self.writer = self._writer_class(log_dir=str(self.log_dir), purge_step=purge)
        for line in lines:
            self.log(line)

    def log(self, line: dict[str, Any]) -> None:
        """Write the line's scalars at step = round, and flush."""
        for key, value in scalars(line).items():
            self.writer.add_scalar(key, value, global_step=int(line["round"]))
        self.writer.flush()

    def close(self, finished: bool) -> None:
        """Close the writer."""
        if self.writer is not None:
            self.writer.close()


class MlflowSink:
    """One MLflow run per nestfed run (the ``mlflow`` or ``mlflow-skinny`` package).

    Args:
        uri: the tracking store's URI.
        experiment: the MLflow experiment's name (created when absent).
        run_name: the MLflow run's name.
        id_file: where the run id is kept, written atomically.
        params: the run's params {name: text}, logged when the run is created.

    Raises:
        ConfigError: when the package is missing, or (on `open`) the store cannot be opened
            (naming the URI).
    """

    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_name: str, id_file: Path, params: dict[str, str] | None = None):
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError(
                'tracking.mlflow = true needs the mlflow package (pip install -e ".[tracking]")'
            ) from None
        self._metric, self._param = Metric, Param
        self.uri, self.experiment, self.run_name, self.id_file = uri, experiment, run_name, Path(id_file)
        self.params = params or {}
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = ""

    def _run(self) -> str:
        if self.id_file.is_file():
            return self.id_file.read_text().strip()
        exp = self.client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(self.experiment)
        run_id = self.client.create_run(exp_id, run_name=self.run_name).info.run_id
        params = [self._param(k, v[:6000]) for k, v in sorted(self.params.items())]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(run_id, params=params[i : i + 100])
        atomic.write_text(self.id_file, run_id + "\n")
        return run_id

    def open(self, lines: list[dict[str, Any]]) -> None:
        """Create or reopen the MLflow run, and log the lines it does not hold."""
        try:
            self.run_id = self._run()
            logged = {m.step for m in self.client.get_metric_history(self.run_id, "round")}
        except Exception as exc:  # any store error: one line naming the store
            raise ConfigError(f"tracking.mlflow_uri = {self.uri}: {type(exc).__name__}: {exc}") from None
        for line in lines:
            if int(line["round"]) not in logged:
                self.log(line)

    def log(self, line: dict[str, Any]) -> None:
        """Log the line's scalars at step = round, in batches of at most 1000."""
        ts, step = int(time.time() * 1000), int(line["round"])
        values = scalars(line)
        metrics = [self._metric(k, v, ts, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self, finished: bool) -> None:
        """Mark the run FINISHED, or KILLED when the run did not finish."""
        if self.run_id:
            self.client.set_terminated(self.run_id, "FINISHED" if finished else "KILLED")


def mlflow_uri(t: TrackingConfig, output_dir: str) -> str:
    """Give the MLflow tracking URI.

    Args:
        t: the ``[tracking]`` section.
        output_dir: the output folder.

    Returns:
        ``tracking.mlflow_uri``, else a local SQLite store ``mlflow.db`` in ``output_dir``.
    """
    return t.mlflow_uri or f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


def check_store(t: TrackingConfig, output_dir: str) -> None:
    """Refuse an MLflow store that cannot be written, before a run directory is written.

    A server URI (http, https, databricks) is left to MLflow.

    Args:
        t: the ``[tracking]`` section; nothing is checked without ``tracking.mlflow``.
        output_dir: the output folder.

    Raises:
        ConfigError: naming tracking.mlflow_uri, for a local (``sqlite:///`` or ``file:`` / plain
            path) URI whose folder cannot be created or written.
    """
    if not t.mlflow:
        return
    uri = mlflow_uri(t, output_dir)
    if uri.startswith("sqlite:///"):
        folder = Path(uri[len("sqlite:///") :]).parent
    elif uri.startswith("file:"):
        folder = Path(uri[len("file:") :].removeprefix("//"))
    elif "://" in uri or uri.startswith("databricks"):
        return
    else:
        folder = Path(uri)
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(
            f"tracking.mlflow_uri: {uri}: {probe} is not a writable folder, so the MLflow store cannot be created there"
        )


def sinks(t: TrackingConfig, run_dir: Path, output_dir: str, output_name: str) -> list[Sink]:
    """Build the sinks ``[tracking]`` asks for, for one run directory.

    Args:
        t: the ``[tracking]`` section.
        run_dir: the run directory; its MLflow run is named after it (``<parent>/<name>`` inside
            a multi-method or seeds parent).
        output_dir: the output folder (the default MLflow store's home).
        output_name: the MLflow experiment's name when ``tracking.mlflow_experiment`` is empty
            (else ``nestfed``).

    Returns:
        The sinks, TensorBoard's first.

    Raises:
        ConfigError: when a sink's package is missing.
    """
    run_dir = Path(run_dir)
    out: list[Sink] = []
    if t.tensorboard:
        out.append(TensorBoardSink(run_dir / "tensorboard"))
    if t.mlflow:
        out.append(
            MlflowSink(
                mlflow_uri(t, output_dir),
                t.mlflow_experiment or output_name or "nestfed",
                _run_name(run_dir, output_dir),
                run_dir / "mlflow_run_id",
                config_params(run_dir),
            )
        )
    return out


def config_params(run_dir: Path) -> dict[str, str]:
    """Read the run's resolved config as MLflow params, so runs can be told apart and filtered.

    Args:
        run_dir: the run directory (its ``config.toml``).

    Returns:
        {``section.key``: value as text (lists and bools as JSON)}; {} when the file is not there
        yet.
    """
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        return {}
    return {
        k: json.dumps(v) if isinstance(v, (list, bool)) else str(v)
        for k, v in leaves(tomllib.loads(path.read_text(encoding="utf-8")), ".").items()
    }


def _run_name(run_dir: Path, output_dir: str) -> str:
    """The run directory's path below ``output_dir`` (``bbc_news-.../seed0/prelort``), or its name."""
    try:
        return str(run_dir.resolve().relative_to(Path(output_dir).resolve()))
    except ValueError:
        return run_dir.name
