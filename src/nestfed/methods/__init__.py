"""The methods, one home each, and the registry that drives the CLI's list and config validation.

Adding a method is one new home (a module or package here that defines ``METHOD``, a
`nestfed.methods.method.Method`) plus one line in `REGISTRY`. Every entry point
loads configs through `schema` (the registry's sections, names and checks), so a method's
options are validated, with the file and key named, before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nestfed import config
from nestfed.config import ConfigError, ExperimentConfig
from nestfed.config.capabilities import Capability, asked_by, refusal
from nestfed.errors import NestfedError
from nestfed.methods import (
    fed_plora,
    fed_sb,
    fedala,
    fedavg,
    fedex_lora,
    fedmkt,
    fednl,
    fedprox,
    fedsa_lora,
    fedslm,
    fedssi,
    fedsvd,
    ffa_lora,
    flexlora,
    flora,
    hetlora,
    local_only,
    lora_fair,
    prelort,
    raflora,
    ravan,
    zeropad,
)
from nestfed.methods.method import Method

REGISTRY: dict[str, Method] = {
    m.name: m
    for m in (
        prelort.METHOD,
        zeropad.METHOD,
        hetlora.METHOD,
        flora.METHOD,
        ffa_lora.METHOD,
        fedavg.METHOD,
        fednl.METHOD,
        fedprox.METHOD,
        fedala.METHOD,
        fedssi.METHOD,
        fedslm.METHOD,
        fedmkt.METHOD,
        local_only.METHOD,
        flexlora.METHOD,
        fedsa_lora.METHOD,
        fedex_lora.METHOD,
        fedsvd.METHOD,
        lora_fair.METHOD,
        raflora.METHOD,
        fed_sb.METHOD,
        ravan.METHOD,
        fed_plora.METHOD,
    )
}


def get(name: str) -> Method:
    """The registered method ``name``.

    Args:
        name: the method's name.

    Returns:
        Its declaration.

    Raises:
        ConfigError: listing the known ones, for an unknown name.
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(f"unknown method '{name}' (known: {', '.join(REGISTRY)})") from None


def _sections() -> dict[str, type]:
    out: dict[str, type] = {}
    for m in REGISTRY.values():
        for name, cls in m.sections.items():
            if out.setdefault(name, cls) is not cls:
                raise TypeError(f"section [{name}] is declared with two different options classes")
    return out


def _check(cfg: ExperimentConfig) -> None:
    """The running method's capabilities against what the config asks for
    (nestfed.config.capabilities), then its cross-section checks. Raises ValueError("<section.key>:
    <reason>")."""
    m = REGISTRY[cfg.strategy.name]
    reasons = dict(m.refusals)
    if not m.can(Capability.HETEROGENEOUS_RANKS):
        got = (
            f"got {list(cfg.lora.ranks)}"
            if len(set(cfg.lora.ranks)) > 1
            else f"the population draws {cfg.population.support(cfg.lora.r_max)}"
        )
        reasons.setdefault(
            Capability.HETEROGENEOUS_RANKS,
            f"it needs equal ranks, {got} (heterogeneous ranks: {', '.join(heterogeneous())})",
        )
        reasons.setdefault(
            Capability.ELASTIC_RANKS, "it needs one rank for every client, so no client can train at a lower one"
        )
    line = refusal(m.name, m.capabilities, asked_by(cfg), reasons)
    if line is not None:
        raise ValueError(line)
    if m.check_config is not None:
        m.check_config(cfg)


def heterogeneous() -> list[str]:
    """The registered methods that take clients of different ranks and run on Flower.

    Returns:
        Their names, in registry order.
    """
    return [m.name for m in REGISTRY.values() if m.can(Capability.HETEROGENEOUS_RANKS) and m.on_flower]


def declaring(capability: Capability) -> list[str]:
    """The registered methods that declare ``capability``, in registry order.

    Args:
        capability: the capability.

    Returns:
        Their names.
    """
    return [m.name for m in REGISTRY.values() if m.can(capability)]


def named(text: str | None, default: str) -> list[str]:
    """The methods a comma-separated ``--methods`` value names, checked against the registry.

    Args:
        text: the value, e.g. ``"prelort,zeropad"``; None: ``default`` alone.
        default: the config's ``strategy.name``.

    Returns:
        The names, in the order given.

    Raises:
        NestfedError: for an unknown name or a name listed twice (the message names ``--methods``).
    """
    names = [m.strip() for m in text.split(",")] if text is not None else [default]
    for m in names:
        if m not in REGISTRY:
            raise NestfedError(f"--methods: unknown method '{m}' (known: {', '.join(REGISTRY)})")
        if names.count(m) > 1:
            raise NestfedError(f"--methods: '{m}' is listed twice")
    return names


def listing() -> list[str]:
    """One plain line per registered method, in registry order, its columns aligned.

    Returns:
        The lines: the name, the sections it owns, whether it runs on Flower ("flower" or
        "embedded only"), its summary.
    """
    rows = [
        (m.name, ", ".join(f"[{s}]" for s in m.sections) or "-", "flower" if m.on_flower else "embedded only")
        for m in REGISTRY.values()
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return [" ".join(f"{v:{w}s}" for v, w in zip(r, widths)) + " " + m.summary for r, m in zip(rows, REGISTRY.values())]


def schema() -> config.Schema:
    """What configs may hold beyond the core sections.

    Every registered home's sections, the names ``strategy.name`` accepts and the cross-section
    checks, built from `REGISTRY` on each call, so a home registered later is known at once.

    Returns:
        The schema.
    """
    moved = {old: new for m in REGISTRY.values() for old, new in m.moved.items()}
    former: dict[str, dict[str, Any]] = {}
    for m in REGISTRY.values():
        for section, keys in m.former.items():
            former.setdefault(section, {}).update(keys)
    return config.Schema(sections=_sections(), methods=tuple(REGISTRY), check=_check, moved=moved, former=former)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Read and validate an experiment TOML (``extends`` followed), with overrides.

    Args:
        path: the TOML file; None for the defaults.
        overrides: ``section.key=value`` strings, applied in order.

    Returns:
        The validated config.

    Raises:
        ConfigError: naming the file and key at fault.
    """
    return config.load(path, overrides, schema())


def load_run_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """A run directory's config.toml, with overrides.

    A resolved config, which an earlier nestfed may have written with settings that moved since
    (nestfed.config.loader.migrate).

    Args:
        path: the run directory's config.toml.
        overrides: ``section.key=value`` strings, applied in order.

    Returns:
        The validated config.

    Raises:
        ConfigError: naming the file and key at fault.
    """
    return config.load(path, overrides, schema(), stored=True)


def config_from_dict(data: Mapping[str, Any], source: str = "<config>", stored: bool = False) -> ExperimentConfig:
    """Validate a parsed TOML document (e.g. the resolved config a Flower server sends).

    Args:
        data: the parsed document.
        source: what error messages call it.
        stored: a resolved config a run recorded (migrated as `load_run_config`'s).

    Returns:
        The validated config.

    Raises:
        ConfigError: naming the source and key at fault.
    """
    s = schema()
    return config.from_dict(config.migrate(data, s) if stored else data, source, s)


def with_method(cfg: ExperimentConfig, name: str) -> ExperimentConfig:
    """A config running another method, validated (e.g. fedavg with unequal ranks is refused).

    Args:
        cfg: the experiment.
        name: the method to run.

    Returns:
        The validated copy.

    Raises:
        ConfigError: for an unknown method or a setting it refuses.
    """
    get(name)
    return config.replace(cfg, schema(), strategy={"name": name})


def replace_config(cfg: ExperimentConfig, **sections: dict[str, Any]) -> ExperimentConfig:
    """A validated copy with fields of named sections replaced (nestfed.config.replace).

    Args:
        cfg: the experiment.
        **sections: {section: {field: value}} to replace.

    Returns:
        The validated copy.

    Raises:
        ConfigError: for a value the schema refuses.
    """
    return config.replace(cfg, schema(), **sections)


__all__ = [
    "REGISTRY",
    "Capability",
    "Method",
    "declaring",
    "config_from_dict",
    "get",
    "listing",
    "load_config",
    "replace_config",
    "schema",
    "with_method",
]
