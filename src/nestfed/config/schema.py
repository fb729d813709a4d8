"""The core sections of an experiment config: frozen dataclasses, one per TOML table.

- ``[model]`` -> `ModelConfig` (nestfed.config.model), ``[lora]``, ``[data]``, ``[train]``
  (nestfed.config.train), ``[strategy]`` (only the method's name), ``[federation]``, ``[output]``;
- the trust sections ``[validation]``, ``[robust]``, ``[privacy]``, ``[attack]``
  (nestfed.config.trust);
- ``[server_optimizer]`` (how the server applies the aggregate, nestfed.config.server_optimizer);
- ``[tracking]`` (TensorBoard and MLflow sinks, nestfed.config.tracking);
- ``[population]`` (ranks drawn from a distribution or memory budgets, elastic ranks, availability;
  nestfed.config.population);
- ``[evaluation]`` (which clients a round evaluates, the global held-out set;
  nestfed.config.evaluation) and ``[generation]`` (nestfed.config.generation).

A method's own options live in sections its home declares (``[hetlora]``, ``[compression]``,
FedNL's ``[fednl]`` with its memory layer, ...; nestfed.methods), held in
`ExperimentConfig.sections`. Values that types cannot check are checked by `check_core`,
which raises ValueError("<section.key>: <reason>"); the loader (nestfed.config.loader) prefixes the
file.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from nestfed.config.evaluation import EvaluationConfig, check_evaluation
from nestfed.config.generation import GenerationConfig, check_generation
from nestfed.config.model import ModelConfig, check_model
from nestfed.config.population import PopulationConfig, assign_ranks, check_population
from nestfed.config.server_optimizer import ServerOptimizerConfig, check_server_optimizer
from nestfed.config.sources import REGISTRY as source_registry
from nestfed.config.sources import check_source
from nestfed.config.sources import get as source_of
from nestfed.config.tracking import TrackingConfig, check_tracking
from nestfed.config.train import LR_SCHEDULES, TrainConfig
from nestfed.config.trust import AttackConfig, PrivacyConfig, RobustConfig, ValidationConfig, check_trust


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (Hu et al., 2021) injected into the frozen backbone.

    Attributes:
        target_modules: the Linear layers adapted: names matched against a module path's last
            component, or regexes over the whole path (nestfed.nn.lora.target_module_names).
        ranks: one rank r_k per client (a single value is broadcast to every client).
        r_max: the global adapter's rank (0 = max(ranks)); a client rank above it is an error.
        lora_alpha: alpha of the scale s, > 0.
        scaling: ``fixed`` uses s = lora_alpha / r_max at every sub-rank and client (docs/methods.md
            section 1, the PreLort decision); ``rank`` uses PEFT's s = lora_alpha / r_k.
        layers: decoder-layer indices that receive adapters; empty = all; negative indices count
            from the top (``[-4, -3, -2, -1]`` = the top four layers).
        init_seed: the seed of the global adapter's initialisation (nestfed.nn.lora.init_adapter_state).
        lora_dropout: dropout on the LoRA path's input in training (PEFT's ``lora_dropout``; off at
            evaluation; 0 = none), drawn from the seed rule's stream of (seed, round, client).
    """

    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    ranks: tuple[int, ...] = (8,)
    r_max: int = 0
    lora_alpha: float = 16.0
    scaling: str = "fixed"
    layers: tuple[int, ...] = ()
    init_seed: int = 0
    lora_dropout: float = 0.0


@dataclass(frozen=True)
class DataConfig:
    """Data source, task and non-IID partition.

    A source's own options live in its own section (the NIAH generator's ``[niah]``, the recall
    generator's ``[recall]``).

    Attributes:
        source: one of the source registry's (nestfed.config.sources: bbc_news, newsgroups, mmlu,
            instructions, mmlu_domains, niah, recall, long_texts, file); ``file`` is a local JSON
            lines, JSON, CSV or parquet file at ``path``.
        path: the ``file`` source's file.
        task: causal_lm (packed blocks of block_size tokens) | instruction (loss on the response)
            | multiple_choice (loss on the gold letter).
        partition: (nestfed.data.partition; flwr-datasets' partitioners) label (client_labels lists
            the labels of each client; empty = one natural id per client, flwr-datasets'
            NaturalIdPartitioner) | dirichlet (over labels, concentration dirichlet_alpha; every
            client at least one item, which fails for more clients than the corpus can serve at
            that alpha) | inner_dirichlet (the same label mixes, every client an equal share of the
            items: flwr-datasets' InnerDirichletPartitioner, which always succeeds; a client's mix
            drifts to the labels left when its own run out) | pathological (classes_per_client
            labels per client) | iid.
        unit: what the partition deals out: ``document`` (the source's records) or ``block`` (the
            corpus packed into blocks of block_size tokens per label, then dealt out: for more
            clients than documents; causal_lm only; a client's train and test blocks may then come
            from one document).
        num_clients: K, the clients.
        client_labels: the ``label`` partition's labels of each client.
        dirichlet_alpha: the Dirichlet concentration, > 0.
        classes_per_client: the ``pathological`` partition's labels per client.
        text_column: the ``file`` source's text column.
        label_column: the ``file`` source's label column, the label the partition reads ("" = no
            label, for iid only).
        test_fraction: the share of each client's records held out for its test set, in (0, 1).
        block_size: tokens per block, >= 8.
        max_train: the cap on a client's training set, in blocks (causal_lm) or examples (other
            tasks).
        max_test: the cap on a client's test set, likewise.
        seed: the seed of the partition, the train/test splits and the population's draws.
        template: the prompt format of instruction records (nestfed.data.templates): ``alpaca``,
            ``chat`` (the tokenizer's own chat template) or ``flowertune``; the same at training and
            at evaluation.
    """

    source: str = "bbc_news"
    path: str = ""
    task: str = "causal_lm"
    partition: str = "label"
    unit: str = "document"
    num_clients: int = 5
    client_labels: tuple[tuple[str, ...], ...] = ()
    dirichlet_alpha: float = 0.5
    classes_per_client: int = 2
    text_column: str = "text"
    label_column: str = "label"
    test_fraction: float = 0.2
    block_size: int = 128
    max_train: int = 16
    max_test: int = 4
    seed: int = 0
    template: str = "alpaca"


@dataclass(frozen=True)
class StrategyConfig:
    """The federated method; its own options are in the section its home declares (e.g. ``[hetlora]``).

    Attributes:
        name: one of the registry's methods (nestfed.methods); empty = the registry's first, PreLort.
    """

    name: str = ""


@dataclass(frozen=True)
class FederationConfig:
    """The round loop.

    Attributes:
        rounds: R, the rounds.
        fraction: the share of the K clients sampled per round, in (0, 1].
        min_clients: the accepted replies a round needs to aggregate.
        seed: the seed of sampling, batches and every per-round draw (nestfed.seeds).
        sampling: ``fixed`` (max(1, round(fraction * K)) clients without replacement) or
            ``poisson`` (each client independently with probability ``fraction``, what differential
            privacy's accountant assumes).
        hold_replies: accepted replies the server keeps in a round before a mean-type rule folds
            them into running sums (nestfed.federation.folding: its memory then stays that of
            hold_replies replies, however many clients reply).
    """

    rounds: int = 3
    fraction: float = 1.0
    min_clients: int = 1
    seed: int = 0
    sampling: str = "fixed"
    hold_replies: int = 32


@dataclass(frozen=True)
class OutputConfig:
    """Where run directories go, and what a run reports.

    Attributes:
        dir: the folder run directories are made in.
        name: the run's name (default: the strategy name).
        plots: draw the run's plots.
        label: the run's name in comparisons over seeds (default: the method, its non-default
            options and a non-default server optimiser; nestfed.experiments.report.run_label).
        truncations: the ranks r at which the final global adapter's prefix is evaluated on every
            client's held-out data (the truncation curve, nestfed.experiments.mechanisms; ranks
            above r_max are left out; empty = none).
        client_detail: where each round's per-client numbers go: ``inline`` (in the metrics line),
            ``file`` (``clients.jsonl``, the metrics line keeping summaries by rank group) or
            ``auto`` (a file beyond `INLINE_CLIENTS` clients).
    """

    dir: str = "runs"
    name: str = ""
    plots: bool = True
    label: str = ""
    truncations: tuple[int, ...] = (1, 2, 4, 8, 16)
    client_detail: str = "auto"


@dataclass(frozen=True)
class ExperimentConfig:
    """A whole experiment: one field per core section, and the method homes' own sections.

    Attributes:
        model: ``[model]``.
        lora: ``[lora]``.
        data: ``[data]``.
        train: ``[train]``.
        strategy: ``[strategy]``.
        federation: ``[federation]``.
        output: ``[output]``.
        validation: ``[validation]``.
        robust: ``[robust]``.
        privacy: ``[privacy]``.
        attack: ``[attack]``.
        server_optimizer: ``[server_optimizer]``.
        tracking: ``[tracking]``.
        population: ``[population]``.
        evaluation: ``[evaluation]``.
        generation: ``[generation]``.
        sections: {section name: its options dataclass}, every registered one, defaults where the
            file has none.
        given: the path fields as written where loading made them absolute
            (``{"model.name": "models/my-llama"}``): config.toml records each beside its resolved
            value; not part of the experiment (never compared).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    robust: RobustConfig = field(default_factory=RobustConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    server_optimizer: ServerOptimizerConfig = field(default_factory=ServerOptimizerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    population: PopulationConfig = field(default_factory=PopulationConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    sections: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    given: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), compare=False)

    def section(self, name: str) -> Any:
        """Give the options dataclass of a method's section.

        Args:
            name: the section's name.

        Returns:
            Its options.

        Raises:
            KeyError: naming the section when the config was built without it
                (nestfed.methods.schema() builds every registered one).
        """
        try:
            return self.sections[name]
        except KeyError:
            raise KeyError(
                f"no [{name}] section in this config (known: {', '.join(self.sections) or 'none'})"
            ) from None


#: The core sections, in the order a resolved config is written.
CORE_SECTIONS = (
    "model",
    "lora",
    "data",
    "train",
    "strategy",
    "federation",
    "output",
    "validation",
    "robust",
    "privacy",
    "attack",
    "server_optimizer",
    "tracking",
    "population",
    "evaluation",
    "generation",
)
SOURCES = tuple(source_registry)  # the data sources (nestfed.config.sources), in registry order
TASKS = ("causal_lm", "instruction", "multiple_choice")
TEMPLATES = ("alpaca", "chat", "flowertune")  # the prompt formats of instruction records (nestfed.data.templates)
PARTITIONS = ("label", "dirichlet", "inner_dirichlet", "pathological", "iid")
UNITS = ("document", "block")


#: the client count up to which a run's per-client numbers stay in the metrics lines and its tables
#: and plots show every client; beyond it they summarise by rank group (docs/scale.md)
INLINE_CLIENTS = 12


def per_client_inline(cfg: ExperimentConfig) -> bool:
    """Tell whether a run's per-client numbers stay in its metrics lines (``output.client_detail``).

    Args:
        cfg: the experiment.

    Returns:
        True for ``inline``, or ``auto`` with at most `INLINE_CLIENTS` clients.
    """
    detail = cfg.output.client_detail
    return detail == "inline" or (detail == "auto" and cfg.data.num_clients <= INLINE_CLIENTS)


def client_ranks(cfg: ExperimentConfig, footprint=None) -> list[int]:
    """Give every client its rank r_k.

    Args:
        cfg: the experiment.
        footprint: ``footprint(r) -> bytes`` for memory budgets, or {precision: that} for every
            precision of ``population.precisions``; None before the model is loaded.

    Returns:
        The ranks drawn by ``[population]`` (rank shares, or memory budgets through the footprint,
        nestfed.config.population.assign_ranks), else ``lora.ranks`` broadcast.

    Raises:
        ValueError: when memory budgets need a footprint and none is given.
    """
    p, lo, own = cfg.population, cfg.lora, cfg.model.quantization
    return assign_ranks(p, lo.ranks, lo.r_max, cfg.data.num_clients, cfg.data.seed, footprint, own)[0]


def r_max(cfg: ExperimentConfig) -> int:
    """Give the global adapter's rank.

    Args:
        cfg: the experiment.

    Returns:
        ``lora.r_max`` or, when 0, the largest rank a client may have.
    """
    return cfg.lora.r_max or max(cfg.population.support(cfg.lora.r_max) or cfg.lora.ranks)


def check_rank(rank: object, r_max: int, where: str = "", error: type[Exception] = ValueError) -> None:
    """Check a LoRA rank against the global adapter's: an integer r with 1 <= r <= r_max.

    Args:
        rank: the rank (a bool, or a value that is not an integer, is refused too).
        r_max: the global adapter's rank.
        where: what holds the rank, prefixed to the message ("node config", "client 3", "--rank").
        error: the exception class raised.

    Raises:
        error: "[<where>: ]rank <rank!r> is not an integer in [1, r_max = <r_max>]".
    """
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 1 <= rank <= r_max:
        raise error(f"{where + ': ' if where else ''}rank {rank!r} is not an integer in [1, r_max = {r_max}]")


def clients_per_round(fraction: float, population: int) -> int:
    """Count the clients a ``fixed`` sampling draws each round (the one rule every caller uses).

    Args:
        fraction: ``federation.fraction``, the share of the population sampled.
        population: the federation's size K (clients).

    Returns:
        max(1, round(fraction * K)) (Python's round: halves go to the even integer).
    """
    return max(1, round(fraction * population))


def sampled_per_round(cfg: ExperimentConfig) -> int:
    """Count the clients sampled each round.

    Args:
        cfg: the experiment.

    Returns:
        `clients_per_round` of federation.fraction and data.num_clients.
    """
    return clients_per_round(cfg.federation.fraction, cfg.data.num_clients)


def check_schedule(t: TrainConfig, lora: LoraConfig, rounds: int) -> None:
    """Check the learning-rate schedule's and lora_dropout's values (check_core's part for them).

    Args:
        t: ``[train]``.
        lora: ``[lora]``.
        rounds: ``federation.rounds``.

    Raises:
        ValueError: "<section.key>: <reason>".
    """
    if not 0.0 <= lora.lora_dropout < 1.0:
        raise ValueError(f"lora.lora_dropout must be in [0, 1), got {lora.lora_dropout}")
    if t.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"train.lr_schedule: unknown schedule '{t.lr_schedule}' (known: {', '.join(LR_SCHEDULES)})")
    if t.lr_schedule_scope not in ("round", "federation"):
        raise ValueError(f"train.lr_schedule_scope: '{t.lr_schedule_scope}' is neither 'round' nor 'federation'")
    if t.warmup_steps < 0:
        raise ValueError(f"train.warmup_steps must be >= 0, got {t.warmup_steps}")
    if not 0 <= t.warmup_ratio < 1:
        raise ValueError(f"train.warmup_ratio must be in [0, 1), got {t.warmup_ratio}")
    if t.warmup_steps and t.warmup_ratio:
        raise ValueError("train.warmup_steps and train.warmup_ratio: give one of the two warm-ups, not both")
    if t.warmup(rounds) > t.schedule_steps(rounds):
        span = "each round's" if t.lr_schedule_scope == "round" else "the federation's"
        raise ValueError(
            f"train.warmup_steps: a warm-up of {t.warmup(rounds)} steps is longer than {span} "
            f"{t.schedule_steps(rounds)} steps (train.lr_schedule_scope = '{t.lr_schedule_scope}')"
        )


def check_data(cfg: ExperimentConfig) -> None:
    """Check ``[data]`` (and its source's own checks).

    Args:
        cfg: the experiment.

    Raises:
        ValueError: "data.<key>: <reason>".
    """
    d = cfg.data
    if d.task not in TASKS:
        raise ValueError(f"data.task: unknown task '{d.task}' (known: {', '.join(TASKS)})")
    if d.partition not in PARTITIONS:
        raise ValueError(f"data.partition: unknown partition '{d.partition}' (known: {', '.join(PARTITIONS)})")
    if d.num_clients < 1:
        raise ValueError("data.num_clients must be >= 1")
    if d.unit not in UNITS:
        raise ValueError(f"data.unit: unknown unit '{d.unit}' (known: {', '.join(UNITS)})")
    check_source(cfg)  # the source's tasks, units, path and own checks (nestfed.config.sources)
    if d.dirichlet_alpha <= 0:
        raise ValueError("data.dirichlet_alpha (the Dirichlet concentration) must be > 0")
    if d.classes_per_client < 1:
        raise ValueError("data.classes_per_client must be >= 1")
    if not 0 < d.test_fraction < 1:
        raise ValueError("data.test_fraction must be in (0, 1)")
    if d.block_size < 8:
        raise ValueError("data.block_size must be >= 8 tokens")
    if d.max_train < 1 or d.max_test < 1:
        raise ValueError("data.max_train and data.max_test must be >= 1 (blocks or examples per client)")


def check_lora(cfg: ExperimentConfig) -> None:
    """Check ``[lora]`` and ``[population]``'s ranks.

    Args:
        cfg: the experiment.

    Raises:
        ValueError: "lora.<key>: <reason>" (or "population...").
    """
    lo, n = cfg.lora, cfg.data.num_clients
    if not lo.ranks or any(r < 1 for r in lo.ranks):
        raise ValueError(f"lora.ranks: every rank must be a positive integer, got {list(lo.ranks)}")
    if len(lo.ranks) not in (1, n):
        raise ValueError(f"lora.ranks: {len(lo.ranks)} ranks for data.num_clients = {n} clients")
    if lo.r_max < 0:
        raise ValueError("lora.r_max must be >= 0")
    check_population(cfg.population, lo.ranks, lo.r_max)
    precisions = cfg.population.precisions
    if precisions and cfg.model.quantization not in precisions:
        raise ValueError(
            f"population.precisions: {list(precisions)} leaves out model.quantization = "
            f"'{cfg.model.quantization}', the server's backbone (its evaluation and export); list it"
        )
    drawn = cfg.population.support(lo.r_max)
    if lo.r_max and max(drawn or lo.ranks) > lo.r_max:
        field = "population" if drawn else "lora.ranks"
        raise ValueError(f"{field}: rank {max(drawn or lo.ranks)} is above the global maximum lora.r_max = {lo.r_max}")
    if lo.lora_alpha <= 0:
        raise ValueError(f"lora.lora_alpha must be > 0, got {lo.lora_alpha}")
    if lo.scaling not in ("fixed", "rank"):
        raise ValueError("lora.scaling must be 'fixed' or 'rank'")
    if not lo.target_modules:
        raise ValueError("lora.target_modules is empty")


def check_federation(cfg: ExperimentConfig) -> None:
    """Check ``[federation]``, ``[output]``, ``[evaluation]`` and ``[generation]``.

    Args:
        cfg: the experiment.

    Raises:
        ValueError: "<section.key>: <reason>".
    """
    f, d = cfg.federation, cfg.data
    if f.rounds < 1:
        raise ValueError("federation.rounds must be >= 1")
    if not 0 < f.fraction <= 1:
        raise ValueError("federation.fraction must be in (0, 1]")
    if f.min_clients < 1:
        raise ValueError("federation.min_clients must be >= 1")
    if f.sampling not in ("fixed", "poisson"):
        raise ValueError(f"federation.sampling must be 'fixed' or 'poisson', got '{f.sampling}'")
    if f.hold_replies < 1:
        raise ValueError(f"federation.hold_replies must be >= 1, got {f.hold_replies}")
    if cfg.output.client_detail not in ("auto", "inline", "file"):
        raise ValueError(f"output.client_detail must be auto, inline or file, got '{cfg.output.client_detail}'")
    check_evaluation(cfg.evaluation, d.num_clients)
    check_generation(cfg.generation, d.task, d.template, TEMPLATES)
    if cfg.evaluation.global_test and not source_of(d.source).shared:
        raise ValueError(f"evaluation.global_test: the {d.source} clients have no shared records to draw from")
    if f.min_clients > sampled_per_round(cfg):
        raise ValueError(
            f"federation.min_clients = {f.min_clients} is above the {sampled_per_round(cfg)} clients "
            f"sampled per round (federation.fraction = {f.fraction:g} of data.num_clients = "
            f"{d.num_clients}): no round could ever aggregate"
        )
    if any(r < 1 for r in cfg.output.truncations):
        raise ValueError(f"output.truncations: every rank must be >= 1, got {list(cfg.output.truncations)}")


def check_train(cfg: ExperimentConfig) -> None:
    """Check ``[train]``.

    Args:
        cfg: the experiment.

    Raises:
        ValueError: "train.<key>: <reason>".
    """
    t = cfg.train
    if t.local_steps < 1 or t.batch_size < 1 or t.lr <= 0:
        raise ValueError("train.local_steps, train.batch_size and train.lr must be positive")
    if t.weight_decay < 0 or t.max_grad_norm < 0:
        raise ValueError("train.weight_decay and train.max_grad_norm must be >= 0")
    check_schedule(t, cfg.lora, cfg.federation.rounds)
    if t.client_memory_mb < 1 or t.client_cache_mb < 1:
        raise ValueError("train.client_memory_mb and train.client_cache_mb must be >= 1")
    if min(t.threads, t.eval_stream_chunk, t.eval_stream_window, t.eval_stream_sinks, t.micro_batch_size) < 0:
        raise ValueError(
            "train.threads, train.eval_stream_chunk, train.eval_stream_window, train.eval_stream_sinks and "
            "train.micro_batch_size must be >= 0"
        )
    if t.eval_batch_size < 1:
        raise ValueError("train.eval_batch_size must be >= 1")


def check_core(cfg: ExperimentConfig) -> None:
    """Check the core sections' values that types cannot check, section by section, in this order.

    Names, ranks, ranges, combinations.

    Args:
        cfg: the experiment.

    Raises:
        ValueError: "<section.key>: <reason>", for the first value at fault.
    """
    check_model(cfg.model)
    check_data(cfg)
    check_lora(cfg)
    check_federation(cfg)
    check_train(cfg)
    f = cfg.federation
    check_trust(
        cfg.validation,
        cfg.robust,
        cfg.privacy,
        cfg.attack,
        cfg.data.num_clients,
        sampled_per_round(cfg),
        f.fraction,
        f.sampling,
    )
    check_server_optimizer(cfg.server_optimizer)
    check_tracking(cfg.tracking)
