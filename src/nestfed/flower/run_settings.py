"""The ServerApp's run config (``[tool.flwr.app.config]`` of ``flower_app/pyproject.toml``,
overridable with ``flwr run --run-config``), read into ``RunSettings``; types are checked (a
boolean must be ``true`` or ``false``, not a string):

- ``experiment``: the experiment TOML on the SuperLink host: absolute, or relative to the
  installed app bundle (where ``flower_app/experiment.toml`` lands) or to the working directory
  (``resolve_experiment``);
- ``overrides``: ``section.key=value`` overrides separated by ``;``;
- ``run-dir``: the run directory ("" = a new ``<output.dir>/<name>-<time>``); it must not exist
  or be empty unless ``resume`` is true, which continues it from its latest checkpoint;
- ``num-supernodes``: nodes to wait for before the QUERY round (0 = data.num_clients);
  ``connect-timeout-s``: how long to wait for them and for their QUERY replies;
- ``round-timeout-s``: how long a round waits for TRAIN replies; a node that has not replied by
  then (or whose SuperLink reports it unavailable) is dropped from the round with a logged reason;
- ``min-clients``: the fewest accepted updates a round needs (0 = federation.min_clients), else
  the round keeps the global state;
- ``poll-interval-s``: how often replies are pulled from the SuperLink;
- ``evaluate``: also send EVALUATE messages (round 0 and after every round), so that
  metrics.jsonl and summary.json carry held-out metrics as in an embedded run;
- ``secure-aggregation``: run every TRAIN round through Flower's SecAgg+ (the server sees only
  sums; nestfed.flower.secure, docs/secure_aggregation.md), with ``secagg-num-shares`` (0 = every
  sampled node), ``secagg-reconstruction-threshold`` (0 = a majority of the shares),
  ``secagg-clipping-range`` (c >= 1) and ``secagg-quantization-range`` (Q); a method whose
  aggregation needs individual updates is refused before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flwr.common.config import get_project_dir
from flwr.serverapp import Grid

from nestfed.errors import ConfigError
from nestfed.flower.secure import SecAggSettings

DEFAULTS: dict[str, Any] = {
    "experiment": "experiment.toml",
    "overrides": "",
    "run-dir": "",
    "resume": False,
    "num-supernodes": 0,
    "connect-timeout-s": 300.0,
    "round-timeout-s": 600.0,
    "min-clients": 0,
    "poll-interval-s": 0.5,
    "evaluate": False,
    "secure-aggregation": False,
    "secagg-num-shares": 0,
    "secagg-reconstruction-threshold": 0,
    "secagg-clipping-range": 1.0,
    "secagg-quantization-range": 2**24,
}


def _typed(key: str, value: Any, kind: type) -> Any:
    """A run-config value of the declared kind; raises ConfigError naming the key."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, str)
    if not ok:
        want = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
        raise ConfigError(f"run config: {key} = {value!r}, expected {want}")
    return kind(value)


@dataclass(frozen=True)
class RunSettings:
    """The ServerApp's run config, typed; each field is the key of the same name with ``-`` for ``_``.

    Attributes:
        experiment: the experiment TOML (``resolve_experiment``); default ``experiment.toml``.
        overrides: ``section.key=value`` overrides, split at ``;``.
        run_dir: the run directory; "" = a new ``<output.dir>/<name>-<time>``.
        resume: continue ``run_dir`` from its latest checkpoint; default False.
        num_supernodes: the nodes to wait for before the QUERY round; 0 = data.num_clients.
        connect_timeout_s: how long to wait for the nodes and their QUERY replies, in seconds; > 0,
            default 300.
        round_timeout_s: how long a round waits for replies, in seconds; > 0, default 600.
        min_clients: the fewest accepted updates a round needs; 0 = federation.min_clients.
        poll_interval_s: how often replies are pulled from the SuperLink, in seconds; > 0, default 0.5.
        evaluate: also send EVALUATE messages (round 0 and after every round); default False.
        secure_aggregation: run every TRAIN round through Flower's SecAgg+; default False.
        secagg: the SecAgg+ settings, from the ``secagg-*`` keys.
    """

    experiment: str = DEFAULTS["experiment"]
    overrides: tuple[str, ...] = ()
    run_dir: str = ""
    resume: bool = False
    num_supernodes: int = 0
    connect_timeout_s: float = 300.0
    round_timeout_s: float = 600.0
    min_clients: int = 0
    poll_interval_s: float = 0.5
    evaluate: bool = False
    secure_aggregation: bool = False
    secagg: SecAggSettings = SecAggSettings()

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> RunSettings:
        """Read Flower's run config; unknown keys are ignored.

        Args:
            run_config: the run config, {key: value}, keys as in the module docstring.

        Returns:
            The settings, the defaults where a key is absent.

        Raises:
            ConfigError: naming the key, for a wrong type or range.
        """
        rc = {**DEFAULTS, **{k: v for k, v in run_config.items() if k in DEFAULTS}}
        kinds = {k: type(v) for k, v in DEFAULTS.items()}
        v = {k: _typed(k, rc[k], kinds[k]) for k in DEFAULTS}
        overrides = tuple(s.strip() for s in v["overrides"].split(";") if s.strip())
        out = cls(
            v["experiment"],
            overrides,
            v["run-dir"],
            v["resume"],
            v["num-supernodes"],
            v["connect-timeout-s"],
            v["round-timeout-s"],
            v["min-clients"],
            v["poll-interval-s"],
            v["evaluate"],
            v["secure-aggregation"],
            SecAggSettings(
                v["secagg-num-shares"],
                v["secagg-reconstruction-threshold"],
                v["secagg-clipping-range"],
                v["secagg-quantization-range"],
            ),
        )
        out.secagg.check()
        if out.poll_interval_s <= 0 or out.round_timeout_s <= 0 or out.connect_timeout_s <= 0:
            raise ConfigError("run config: poll-interval-s, round-timeout-s and connect-timeout-s must be > 0")
        if out.num_supernodes < 0 or out.min_clients < 0:
            raise ConfigError("run config: num-supernodes and min-clients must be >= 0")
        return out


def resolve_experiment(path: str, app_dir: Path | None) -> Path:
    """Find the experiment file: absolute, else relative to the installed app bundle, else to the cwd.

    Args:
        path: the run config's ``experiment``.
        app_dir: the installed app bundle; None when unknown.

    Returns:
        The file (an absolute ``path`` as it is, whether it exists or not).

    Raises:
        ConfigError: when a relative ``path`` is found in neither place.
    """
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    for base in ([app_dir] if app_dir is not None else []) + [Path.cwd()]:
        if (base / p).is_file():
            return base / p
    raise ConfigError(
        f"run config: experiment = {path!r} not found in the app bundle "
        f"({app_dir}) or the working directory ({Path.cwd()})"
    )


def app_dir_of(grid: Grid) -> Path | None:
    """Where the SuperLink installed this run's app bundle.

    Args:
        grid: the Flower grid of the run.

    Returns:
        The bundle's directory; None when unknown (an in-process grid has none).
    """
    try:
        run = grid.run
        return get_project_dir(run.fab_id, run.fab_version, run.fab_hash)
    except Exception:  # noqa: BLE001 - an in-process grid has no bundle
        return None
