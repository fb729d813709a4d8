"""Experiment configs: the core sections (:mod:`nestfed.config.schema`) and the loader
(:mod:`nestfed.config.loader`). Method homes declare their own sections through a
:class:`~nestfed.config.loader.Schema`; nestfed.methods builds the one every entry point uses."""

from nestfed.config.loader import Schema, differences, dumps_toml, from_dict, load, parse_override, replace, to_dict
from nestfed.config.schema import (CORE_SECTIONS, DataConfig, ExperimentConfig, FederationConfig, LoraConfig,
                                   MemoryConfig, ModelConfig, OutputConfig, StrategyConfig, TrainConfig, client_ranks,
                                   r_max, sampled_per_round)
from nestfed.config.server_optimizer import ServerOptimizerConfig
from nestfed.config.tracking import TrackingConfig
from nestfed.config.trust import AttackConfig, PrivacyConfig, RobustConfig, ValidationConfig
from nestfed.errors import ConfigError

__all__ = ["AttackConfig", "PrivacyConfig", "RobustConfig", "ServerOptimizerConfig", "TrackingConfig", "ValidationConfig",
           "CORE_SECTIONS", "ConfigError", "DataConfig", "ExperimentConfig", "FederationConfig", "LoraConfig",
           "MemoryConfig", "ModelConfig", "OutputConfig", "Schema", "StrategyConfig", "TrainConfig", "client_ranks",
           "differences", "dumps_toml", "from_dict", "load", "parse_override", "r_max", "replace", "sampled_per_round",
           "to_dict"]
