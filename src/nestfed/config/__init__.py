"""Experiment configs: the core sections (`nestfed.config.schema`) and the loader
(`nestfed.config.loader`). Method homes declare their own sections through a
`nestfed.config.loader.Schema`; nestfed.methods builds the one every entry point uses."""

from nestfed.config.evaluation import EvaluationConfig
from nestfed.config.generation import GenerationConfig
from nestfed.config.loader import (
    Schema,
    differences,
    dumps_toml,
    from_dict,
    load,
    migrate,
    parse_override,
    replace,
    to_dict,
)
from nestfed.config.population import PopulationConfig
from nestfed.config.schema import (
    CORE_SECTIONS,
    INLINE_CLIENTS,
    DataConfig,
    ExperimentConfig,
    FederationConfig,
    LoraConfig,
    ModelConfig,
    OutputConfig,
    StrategyConfig,
    TrainConfig,
    check_rank,
    client_ranks,
    clients_per_round,
    per_client_inline,
    r_max,
    sampled_per_round,
)
from nestfed.config.server_optimizer import ServerOptimizerConfig
from nestfed.config.tracking import TrackingConfig
from nestfed.config.trust import AttackConfig, PrivacyConfig, RobustConfig, ValidationConfig
from nestfed.errors import ConfigError

__all__ = [
    "AttackConfig",
    "CORE_SECTIONS",
    "ConfigError",
    "DataConfig",
    "EvaluationConfig",
    "GenerationConfig",
    "ExperimentConfig",
    "FederationConfig",
    "INLINE_CLIENTS",
    "LoraConfig",
    "ModelConfig",
    "OutputConfig",
    "PopulationConfig",
    "PrivacyConfig",
    "RobustConfig",
    "Schema",
    "ServerOptimizerConfig",
    "StrategyConfig",
    "TrackingConfig",
    "TrainConfig",
    "ValidationConfig",
    "check_rank",
    "client_ranks",
    "clients_per_round",
    "differences",
    "dumps_toml",
    "from_dict",
    "load",
    "migrate",
    "parse_override",
    "per_client_inline",
    "r_max",
    "replace",
    "sampled_per_round",
    "to_dict",
]
