"""FedNL's setup: the delta-rule memory layers beside attention, on the server's model and on
every Flower node alike, and their fresh rules (what the strategy starts from)."""

from __future__ import annotations

from nestfed.config import ConfigError, ExperimentConfig
from nestfed.federation.messages import Arrays
from nestfed.federation.prepared import Prepared
from nestfed.methods.fednl.warmup import warm_rules
from nestfed.nn.memory import MemorySettings, fresh_rule_arrays, install_memory, resolve_layers


def memory_settings(cfg: ExperimentConfig) -> MemorySettings:
    """The memory layer's settings from the [fednl] section (a constant gate starts at alpha_start).

    Args:
        cfg: the experiment.

    Returns:
        The settings.
    """
    m = cfg.section("fednl")
    return MemorySettings(
        gate=m.gate,
        alpha_init=m.alpha_start if m.gate == "constant" else m.alpha_init,
        gate_scope=m.gate_scope,
        window=m.window,
        sink=m.sink_tokens,
        beta_source=m.beta_source,
        beta_window=m.beta_window,
        conv_size=m.conv_size,
        norm_weight=m.norm_weight,
        output_gate=m.output_gate,
        dynamic_kernel=m.dynamic_kernel,
        chunk_size=m.chunk_size,
    )


def memory_layers(prep: Prepared, cfg: ExperimentConfig) -> list[int]:
    """The decoder layers that get a memory (``fednl.layers``, default the LoRA layers).

    The memory must lie at or above the frozen prefix whose outputs were cached (a disabled memory
    layer computes exactly the backbone, so installing it later is safe).

    Args:
        prep: the prepared experiment (its backbone and cached prefix).
        cfg: the experiment.

    Returns:
        The layer indices.

    Raises:
        ConfigError: for a layer out of range or below the cached prefix.
    """
    try:
        layers = resolve_layers(prep.backbone.model, cfg.section("fednl").layers or cfg.lora.layers, "fednl.layers")
    except ValueError as exc:
        raise ConfigError(str(exc) if str(exc).startswith("fednl.layers") else f"fednl.layers: {exc}") from None
    start = prep.frozen_prefix_layers
    if layers and min(layers) < start:
        raise ConfigError(
            f"fednl.layers: layer {min(layers)} lies in the frozen prefix cached up to layer {start}; "
            "put the memory on LoRA layers or set train.cache_frozen_prefix = false"
        )
    return layers


def install(prep: Prepared, cfg: ExperimentConfig) -> Arrays:
    """Install the memory layers (if the model has none there yet) and return the rules the federation starts from.

    The rules are payload-keyed: fresh ones, fitted to full attention by the server's warm-up when
    ``[fednl] warmup_steps`` > 0 (nestfed.methods.fednl.warmup).

    Args:
        prep: the prepared experiment.
        cfg: the experiment.

    Returns:
        The starting rules.

    Raises:
        ConfigError: as `memory_layers` raises it.
        DataError: when the warm-up's corpus is missing.
    """
    layers = memory_layers(prep, cfg)
    install_memory(prep.backbone.model, memory_settings(cfg), layers)
    return warm_rules(prep, cfg, layers, fresh_rule_arrays(prep.backbone.model, layers))
