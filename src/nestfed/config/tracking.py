"""The tracking section ``[tracking]``: optional experiment-tracking sinks beside metrics.jsonl.

metrics.jsonl stays the source of truth; a sink receives the same committed lines
(nestfed.federation.tracking) and is caught up from metrics.jsonl on resume, so it never misses or
repeats a round. TensorBoard and MLflow are optional packages (``pip install -e ".[tracking]"``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrackingConfig:
    """Where a run's per-round values go besides metrics.jsonl.

    Attributes:
        tensorboard: write TensorBoard event files into ``<run dir>/tensorboard/``.
        mlflow: log to an MLflow tracking store, one MLflow run per nestfed run (its id kept in
            ``<run dir>/mlflow_run_id``).
        mlflow_uri: the tracking URI ("" = a local SQLite store, ``sqlite:///<output.dir>/mlflow.db``;
            any URI MLflow accepts, e.g. ``http://host:5000``).
        mlflow_experiment: the MLflow experiment ("" = ``output.name``, else ``nestfed``).
    """

    tensorboard: bool = False
    mlflow: bool = False
    mlflow_uri: str = ""
    mlflow_experiment: str = ""


def check_tracking(t: TrackingConfig) -> None:
    """Check ``[tracking]``.

    Args:
        t: the section.

    Raises:
        ValueError: "tracking.<key>: <reason>", for a value at fault.
    """
    if t.mlflow_uri and "://" not in t.mlflow_uri and not t.mlflow_uri.startswith("databricks"):
        raise ValueError(
            f"tracking.mlflow_uri: '{t.mlflow_uri}' is not a URI (e.g. sqlite:///runs/mlflow.db or "
            "http://localhost:5000)"
        )
