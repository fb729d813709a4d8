"""FedNL's setup: the delta-rule memory layers beside attention, on the server's model and on
every Flower node alike, and their fresh rules (what the strategy starts from)."""

from __future__ import annotations

from nestfed.config import ConfigError, ExperimentConfig
from nestfed.federation.messages import Arrays
from nestfed.federation.prepared import Prepared
from nestfed.nn.memory import MemorySettings, fresh_rule_arrays, install_memory, resolve_layers


def memory_settings(cfg: ExperimentConfig) -> MemorySettings:
    """The memory layer's settings from the [fednl] section (a constant gate starts at alpha_start)."""
    m = cfg.section("fednl")
    return MemorySettings(
        gate=m.gate,
        alpha_init=m.alpha_start if m.gate == "constant" else m.alpha_init,
        window=m.window,
        beta_window=m.beta_window,
        dynamic_kernel=m.dynamic_kernel,
        chunk_size=m.chunk_size,
        sink=m.sink_tokens,
    )


def memory_layers(prep: Prepared, cfg: ExperimentConfig) -> list[int]:
    """The decoder layers that get a memory (``fednl.layers``, default the LoRA layers).

    The memory must lie at or above the frozen prefix whose outputs were cached (a disabled memory
    layer computes exactly the backbone, so installing it later is safe). Raises ConfigError for a
    layer out of range or below the cached prefix.
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
    """Install the memory layers (if the model has none there yet) and return fresh rules for them,
    payload-keyed. Raises ConfigError as :func:`memory_layers` does."""
    layers = memory_layers(prep, cfg)
    install_memory(prep.backbone.model, memory_settings(cfg), layers)
    return fresh_rule_arrays(prep.backbone.model, layers)
