"""Every check a run must pass before anything is written, one home each, for both ways in: the
command line (through nestfed.experiments.run and nestfed.experiments.campaign) and Flower's
ServerApp (nestfed.flower.server_app). Each raises ConfigError / DataError / NestfedError, one line
naming the setting or file at fault, and writes nothing.

- the method against the model (its ``check_model``: memory layers in range, compression targets);
- the population's elastic trace (read and checked against the clients' ranks);
- the tracking store (an MLflow folder that cannot be written);
- a resume's acceptance: the checkpoint it continues (readable, its clients' state where the
  transport keeps it) and the config it continues with (only federation.rounds and [tracking] may
  change; config.toml is then rewritten and the changes returned);
- Flower's own: the method runs on Flower, the run directory is new or resumed, enough nodes
  answered the QUERY round and none above lora.r_max, no setting only the embedded runner serves
  (``EMBEDDED_ONLY``), and secure aggregation only where the aggregation needs no individual
  update and the round's SecAgg+ settings fit (``SumSettings``).

What the config alone decides (types, ranges, the method's capabilities against what the config
asks, cross-section checks) is checked when it is loaded (nestfed.methods.load_config); what the
round loop asks of the method and transport is refused when the loop is built
(nestfed.experiments.federated_run.build_loop), before the run directory is opened.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from nestfed import config, methods
from nestfed.config import ExperimentConfig
from nestfed.config.capabilities import Capability
from nestfed.config.population import Footprints
from nestfed.errors import ConfigError, NestfedError
from nestfed.federation import tracking
from nestfed.federation.messages import ClientInfo
from nestfed.federation.population import Population
from nestfed.federation.prepared import Prepared
from nestfed.federation.run_dir import KEPT, ON_NODES, RunDir
from nestfed.federation.safeguards import Safeguards

EMBEDDED_ONLY = {  # setting: why Flower refuses it
    "evaluation.global_test": "on Flower no server holds the clients' held-out records to draw a global held-out "
    "set from (the embedded runner has one; docs/scale.md)",
    "generation.rows": "the generated evaluation runs embedded (nestfed run), which writes the answers into the "
    "run directory; on Flower the nodes would have to send their texts back",
}


class SumSettings(Protocol):
    """The secure aggregation's settings as far as a preflight needs them.

    Flower's SecAgg+: nestfed.flower.secure.SecAggSettings.
    """

    def check_clients(self, k: int) -> None:
        """Check that a round of k sampled nodes can run with these settings.

        Args:
            k: the nodes sampled per round.

        Raises:
            ConfigError: when it cannot.
        """


# -- every engine --------------------------------------------------------------------------------
def check_models(prep: Prepared, cfgs: Iterable[ExperimentConfig]) -> None:
    """Check each config's method against the prepared model, all before the first run directory.

    Args:
        prep: the prepared model and clients.
        cfgs: the configs; each method's ``check_model`` runs (e.g. memory layers in range).

    Raises:
        ConfigError: naming the setting that does not fit the model.
    """
    for cfg in cfgs:
        methods.get(cfg.strategy.name).check_model(prep, cfg)


def embedded(
    cfg: ExperimentConfig,
    clients: Sequence[ClientInfo],
    footprint: Footprints | Callable[[int], int] | None = None,
    precisions: Mapping[int, str] | None = None,
) -> Population:
    """Check an embedded run's federation: its population, then the tracking store.

    Args:
        cfg: the experiment's config.
        clients: the clients.
        footprint: bytes(r) of the backbone at rank r, or {precision: that} for device tiers, for
            an elastic trace of memory budgets; None for none.
        precisions: {cid: backbone precision}, with a footprint per precision.

    Returns:
        The population's per-round draws over ``clients``, its elastic trace read and checked
        against their ranks.

    Raises:
        ConfigError: for a bad elastic trace or a tracking store that cannot be written.
    """
    out = Population.from_config(cfg, clients, footprint, precisions)
    tracking.check_store(cfg.tracking, cfg.output.dir)
    return out


def stored_config(rd: RunDir) -> ExperimentConfig:
    """The config a resume is checked against.

    Args:
        rd: the run directory.

    Returns:
        The resolved config its latest checkpoint recorded (so a hand-edited config.toml is
        caught), else config.toml's.

    Raises:
        ConfigError: naming the file, for a config that does not load.
        DataError: naming the file, for an unreadable checkpoint.
    """
    recorded = rd.recorded_config()
    if recorded is None:
        return methods.load_run_config(rd.config_path)
    data, path = recorded
    return methods.config_from_dict(data, f"{path} (the config it recorded)", stored=True)


def accept_resume(rd: RunDir, wanted: ExperimentConfig, home: str = KEPT) -> list[str]:
    """Accept the resume of a run directory with a config.

    Its latest checkpoint must be readable, with the clients' kept state where the transport keeps
    it (RunDir.check_resume), and ``wanted`` equal to ``stored_config`` but for federation.rounds
    and [tracking] (RunDir.accept_config: config.toml is then rewritten).

    Args:
        rd: the run directory.
        wanted: the config the run continues with.
        home: where the transport keeps the clients' state: KEPT embedded, ON_NODES on Flower.

    Returns:
        The changes (``section.key: old -> new``).

    Raises:
        NestfedError: for a checkpoint that cannot be resumed here or a config that differs.
        DataError: for a corrupted checkpoint or metrics file.
    """
    rd.check_resume(methods.get(wanted.strategy.name).keeps_client_state(wanted), home)
    return rd.accept_config(stored_config(rd), wanted, config.dumps_toml(wanted))


# -- Flower ------------------------------------------------------------------------------------
def flower_config(path: Path, overrides: Sequence[str]) -> ExperimentConfig:
    """Load a Flower run's experiment, validated.

    Args:
        path: the experiment's TOML.
        overrides: ``key=value`` overrides.

    Returns:
        The config.

    Raises:
        ConfigError: for an invalid config, or a method that does not run on Flower (e.g. one
            whose clients hold compressed models the ServerApp cannot set up).
    """
    cfg = methods.load_config(path, list(overrides))
    line = methods.get(cfg.strategy.name).refusal({Capability.FLOWER: "strategy.name"})
    if line is not None:
        raise ConfigError(f"{path}: {line}")
    return cfg


def flower_run_dir(
    cfg: ExperimentConfig, run_dir: Path, resume: bool, on_change: Callable[[str], None]
) -> RunDir | None:
    """Check a Flower run's tracking store, then its run directory.

    Args:
        cfg: the experiment's config.
        run_dir: the run directory.
        resume: continue the existing run directory (``accept_resume``, with the clients' state
            on the nodes).
        on_change: called with each change made to config.toml.

    Returns:
        With ``resume``, the run directory, its resume accepted; else None once ``run_dir`` is
        absent or empty.

    Raises:
        ConfigError: for a tracking store that cannot be written.
        DataError: for a corrupted checkpoint or metrics file.
        NestfedError: for a run directory that exists and is not empty, or a resume refused.
    """
    tracking.check_store(cfg.tracking, cfg.output.dir)
    if resume:
        rd = RunDir.open(run_dir, config.dumps_toml(cfg))
        for change in accept_resume(rd, cfg, ON_NODES):
            on_change(change)
        return rd
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise NestfedError(f"run config: run-dir {run_dir} exists and is not empty; set resume = true to continue it")
    return None


def flower_clients(
    cfg: ExperimentConfig, clients: Sequence[ClientInfo], min_clients: int, nodes: int, want: int, node_says: str
) -> None:
    """Check what the QUERY round found.

    Args:
        cfg: the experiment's config.
        clients: the clients that answered.
        min_clients: the fewest clients needed.
        nodes: the nodes connected.
        want: data.num_clients.
        node_says: a node's refusal of that count; "" for none.

    Raises:
        NestfedError: when fewer than ``min_clients`` answered (one line naming ``nodes`` against
            ``want`` when a node refused that count).
        ConfigError: for a client whose rank is above lora.r_max.
    """
    if len(clients) < min_clients:
        raise NestfedError(
            f"only {len(clients)} nodes answered the query; min-clients is {min_clients}"
            + (f"; {nodes} nodes for data.num_clients = {want}, and a node says: {node_says}" if node_says else "")
        )
    for c in clients:
        config.check_rank(c.rank, config.r_max(cfg), f"node of client {c.cid}", ConfigError)


def flower_federation(
    cfg: ExperimentConfig, clients: Sequence[ClientInfo], secure: SumSettings | None = None
) -> Population:
    """Check the federation the nodes formed.

    No setting only the embedded runner serves (``EMBEDDED_ONLY``); under secure aggregation no
    robust rule or central DP (they need individual updates), and a round's sampled nodes within
    its bounds.

    Args:
        cfg: the experiment's config.
        clients: the clients that answered.
        secure: the secure aggregation's settings; None without it.

    Returns:
        The population's per-round draws, its elastic trace read and checked.

    Raises:
        ConfigError: naming the setting at fault.
    """
    asked = {"evaluation.global_test": cfg.evaluation.global_test, "generation.rows": cfg.generation.rows}
    for key, why in EMBEDDED_ONLY.items():
        if asked[key]:
            raise ConfigError(f"{key}: {why}")
    if secure is not None:
        if Safeguards.from_config(cfg).rule.active:
            raise ConfigError(
                "run config: secure-aggregation: a robust rule or central DP needs individual "
                "updates, which secure aggregation hides; docs/secure_aggregation.md"
            )
        secure.check_clients(config.clients_per_round(cfg.federation.fraction, len(clients)))
    return Population.from_config(cfg, clients)
