"""Read, override, validate and write experiment configs (TOML <-> frozen dataclasses).

An experiment is a TOML file whose tables map onto the core sections (nestfed.config.schema), the
sections data sources declare (nestfed.config.sources: ``[niah]``) and the sections method homes
declare (a `Schema`, built by the registry in nestfed.methods).
Command-line overrides use dotted keys, ``--set lora.ranks=[2,4,8]``. An unknown section or key,
a value of the wrong type and a value out of range raise `ConfigError` naming the file and
the dotted key at fault; nothing is read from or written to a run directory here.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import tomllib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from nestfed.config.schema import CORE_SECTIONS, ExperimentConfig, StrategyConfig, check_core
from nestfed.config.sources import sections as source_sections
from nestfed.errors import ConfigError


@dataclass(frozen=True)
class Schema:
    """What a config may hold beyond the core sections.

    Attributes:
        sections: {section name: options dataclass} declared by method homes (each dataclass checks
            its own values in ``__post_init__``, raising ValueError("<key>: <reason>")).
        methods: the names ``strategy.name`` accepts.
        check: cross-section checks of the named method, called with the whole config, raising
            ValueError("<section.key>: <reason>"); None = none.
        moved: {former section: the section that now holds its keys}, for a one-line pointer.
        former: {section: {key: what a run written before the key existed ran with}} (a value, or a
            function of the whole stored document), which `migrate` fills into a stored
            config lacking the key, so that an earlier run directory resumes, exports and compares
            as it ran when a default has changed since.
    """

    sections: Mapping[str, type] = field(default_factory=dict)
    methods: tuple[str, ...] = ()
    check: Callable[[ExperimentConfig], None] | None = None
    moved: Mapping[str, str] = field(default_factory=dict)
    former: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def _coerce(value: Any, tp: Any, where: str) -> Any:  # noqa: C901 (one branch per TOML type a field may hold)
    """Convert a TOML value to the annotated type ``tp``; raise ConfigError naming ``where``."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) != 2 or args[1] is not Ellipsis:  # a fixed-length tuple: one value per position
            if not isinstance(value, (list, tuple)) or len(value) != len(args):
                raise ConfigError(f"{where}: expected {len(args)} values, got {value!r}")
            return tuple(_coerce(v, t, f"{where}[{i}]") for i, (v, t) in enumerate(zip(value, args)))
        inner = args[0]
        if _is_table(tp):
            if isinstance(value, dict):  # {2 = 0.4, 4 = 0.6}: TOML's keys are strings
                value = [[_key(k, f"{where}.{k}"), v] for k, v in value.items()]
            elif not isinstance(value, (list, tuple)) or not all(isinstance(v, (list, tuple)) for v in value):
                raise ConfigError(f"{where}: expected a table {{value = share, ...}}, got {value!r}")
        elif not isinstance(value, (list, tuple)):
            value = [value]  # a scalar broadcast to a one-element list
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
        if not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}")  # pragma: no cover


def _is_table(tp: Any) -> bool:
    """Whether ``tp`` is a {value: share} table: ``tuple[tuple[int, float], ...]`` (written as an
    inline TOML table, nestfed.config.population.Shares)."""
    args = typing.get_args(tp)
    return (
        typing.get_origin(tp) is tuple
        and len(args) == 2
        and args[1] is Ellipsis
        and typing.get_args(args[0]) == (int, float)
    )


def _key(k: Any, where: str) -> int:
    """An inline table's key as the integer it names ("16" -> 16). Raises ConfigError otherwise."""
    if isinstance(k, int) and not isinstance(k, bool):
        return k
    if isinstance(k, str) and k.strip().isdigit():
        return int(k)
    raise ConfigError(f"{where}: the key must be a positive integer, got {k!r}")


def _hint(word: str, known: list[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def _all_sections(schema: Schema) -> dict[str, type]:
    """The non-core sections: the data sources' (nestfed.config.sources) and the method homes'."""
    return {**source_sections(), **schema.sections}


def _section(cls: type, table: dict[str, Any], name: str, source: str, schema: Schema) -> Any:
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in table.items():
        if key not in known:
            moved = next((s for s in _all_sections(schema) if key.startswith(s + "_")), None)
            where = f" (these options live in their own section: [{moved}] {key[len(moved) + 1 :]})" if moved else ""
            raise ConfigError(
                f"{source}: unknown key '{name}.{key}' (known: {', '.join(sorted(known))}){where or _hint(key, known)}"
            )
        kwargs[key] = _coerce(value, hints[key], f"{source}: {name}.{key}")
    try:
        return cls(**kwargs)
    except ValueError as exc:
        raise ConfigError(f"{source}: {name}.{exc}") from None


def parse_override(text: str) -> tuple[str, Any]:
    """Parse a ``section.key=value`` override.

    Args:
        text: the override as given on the command line.

    Returns:
        (``section.key``, value): the value read as TOML, else kept as a plain string.

    Raises:
        ConfigError: when there is no '=' or no dotted key.
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


def from_dict(data: Mapping[str, Any], source: str = "<config>", schema: Schema = Schema()) -> ExperimentConfig:
    """Build and validate an ExperimentConfig from nested dicts (a parsed TOML document).

    Args:
        data: ``{section: {key: value}}``.
        source: where the document comes from, for the error messages.
        schema: the sections and methods beyond the core.

    Returns:
        The config.

    Raises:
        ConfigError: naming ``source`` and the section or key at fault.
    """
    hints = typing.get_type_hints(ExperimentConfig)
    sections = _all_sections(schema)
    core, extra = {}, {name: cls() for name, cls in sections.items()}
    known = list(CORE_SECTIONS) + list(sections)
    for name, table in data.items():
        if not isinstance(table, dict):
            what = "section" if name in known else "top-level key"
            raise ConfigError(f"{source}: {what} '{name}' must be a table of keys ([{name}] ...), got {table!r}")
        if name in schema.moved and name not in known:
            new = schema.moved[name]
            raise ConfigError(f"{source}: [{name}] is now part of [{new}]: move its keys there ({new}.<key>)")
        if name not in known:
            raise ConfigError(f"{source}: unknown section '[{name}]' (known: {', '.join(known)}){_hint(name, known)}")
        if name in CORE_SECTIONS:
            core[name] = _section(hints[name], table, name, source, schema)
        else:
            extra[name] = _section(sections[name], table, name, source, schema)
    if schema.methods and not core.get("strategy", StrategyConfig()).name:
        core["strategy"] = StrategyConfig(schema.methods[0])  # the registry's first method is the default
    cfg = ExperimentConfig(**core, sections=MappingProxyType(extra))
    validate(cfg, source, schema)
    return cfg


def validate(cfg: ExperimentConfig, source: str, schema: Schema) -> None:
    """Run the core checks, check the method's name, then the method's own cross-section checks.

    Args:
        cfg: the config.
        source: where it comes from, for the error message.
        schema: the methods and their checks.

    Raises:
        ConfigError: "<source>: <section.key>: <reason>".
    """
    if schema.methods and cfg.strategy.name not in schema.methods:
        raise ConfigError(
            f"{source}: strategy.name: unknown method '{cfg.strategy.name}' (known: {', '.join(schema.methods)})"
        )
    try:
        check_core(cfg)
        if schema.check is not None:
            schema.check(cfg)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _read_toml(p: Path, seen: set[Path]) -> dict[str, Any]:
    """Read a TOML file; a top-level ``extends = "other.toml"`` (relative to the file) is read
    first and this file's tables are merged over it key by key."""
    if p.is_dir():
        raise ConfigError(f"{p}: is a directory, not a config file")
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    if p.resolve() in seen:
        raise ConfigError(f"{p}: 'extends' loops back to itself")
    try:
        data = tomllib.loads(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from None
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


def apply_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Set ``section.key=value`` overrides in parsed TOML tables.

    Args:
        data: ``{section: {key: value}}``, changed in place.
        overrides: the overrides, in order (a later one wins).

    Returns:
        ``data``.

    Raises:
        ConfigError: for a malformed override or a section that is not a table.
    """
    for text in overrides:
        key, value = parse_override(text)
        section, name = key.split(".")
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"override '{text}': '{section}' is not a table")
        table[name] = value
    return data


def migrate(data: Mapping[str, Any], schema: Schema = Schema()) -> dict[str, Any]:
    """Put a stored resolved config's moved settings where they live now.

    A former section's keys go into the section that holds them (``schema.moved``), a core key named
    ``<section>_<key>`` into the section that owns it (``data.niah_train_length`` ->
    ``niah.train_length``), and a section gets the keys added since with the values it ran with
    then (``schema.former``). A user's own config is not migrated: it gets the one-line pointer
    instead, and the current defaults.

    Args:
        data: a resolved config written by an earlier nestfed (a run directory's config.toml).
        schema: the moves and former values.

    Returns:
        A migrated copy.
    """
    out = {name: dict(table) if isinstance(table, dict) else table for name, table in data.items()}
    for old, new in schema.moved.items():
        if isinstance(out.get(old), dict) and old not in _all_sections(schema):
            out[new] = {**out.pop(old), **out.get(new, {})}
    owners = _all_sections(schema)
    for name in CORE_SECTIONS:
        table = out.get(name)
        if not isinstance(table, dict):
            continue
        for key in [k for k in table if any(k.startswith(s + "_") for s in owners)]:
            owner = next(s for s in owners if key.startswith(s + "_"))
            out.setdefault(owner, {}).setdefault(key[len(owner) + 1 :], table.pop(key))
    for name, keys in schema.former.items():
        table = out.get(name)
        if isinstance(table, dict):
            for key, value in keys.items():
                if key not in table:
                    table[key] = value(data) if callable(value) else value
    return out


def load(
    path: str | Path | None,
    overrides: list[str] | tuple[str, ...] = (),
    schema: Schema = Schema(),
    stored: bool = False,
) -> ExperimentConfig:
    """Read a TOML experiment file (following ``extends``) and apply ``section.key=value`` overrides.

    Path fields are made absolute (`resolve_paths`); the values as written are kept in
    ``given``.

    Args:
        path: the file; None = the defaults.
        overrides: ``section.key=value`` overrides.
        schema: the sections and methods beyond the core.
        stored: the file is a run directory's resolved config (`migrate` first).

    Returns:
        The validated config.

    Raises:
        ConfigError: for a file missing or unreadable, not UTF-8, TOML syntax, an unknown section or
            key, a bad type or value.
    """
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        data = _read_toml(Path(path), set())
        if stored:
            data = migrate(data, schema)
    if overrides:  # a value at fault may come from either
        source = f"{source} with --set {' '.join(overrides)}" if path is not None else f"--set {' '.join(overrides)}"
    data = apply_overrides(data, overrides)
    given = given_comments(Path(path).read_text()) if stored and path is not None else resolve_paths(data)
    cfg = from_dict(data, source, schema)
    return dataclasses.replace(cfg, given=MappingProxyType(given)) if given else cfg


def given_comments(text: str) -> dict[str, str]:
    """Read the ``# given as "..."`` comments `dumps_toml` writes beside resolved paths.

    A stored config keeps them when it is written again.

    Args:
        text: a resolved config's TOML text.

    Returns:
        ``{"section.key": value as written}``.
    """
    out, section = {}, ""
    for line in text.splitlines():
        head = re.fullmatch(r"\[(\w+)\]\s*", line)
        if head:
            section = head.group(1)
            continue
        m = re.fullmatch(r'(\w+) = .*  # given as ("(?:[^"\\]|\\.)*")\s*', line)
        if m and section:
            out[f"{section}.{m.group(1)}"] = tomllib.loads(f"v = {m.group(2)}")["v"]
    return out


#: (section, key) of the fields that name a file or directory: made absolute when a config is loaded
PATH_FIELDS = (("model", "name"), ("model", "cache_dir"), ("data", "path"), ("population", "elastic_trace"))


def resolve_paths(data: dict[str, Any]) -> dict[str, str]:
    """Make the path fields absolute against the working directory, so a run directory works from any folder.

    ``model.name`` when it names an existing directory (a built-in model's name stays a name),
    ``data.path`` and ``population.elastic_trace`` when they exist (a missing one keeps its text for
    the error that names it), ``model.cache_dir`` always.

    Args:
        data: parsed TOML tables, changed in place.

    Returns:
        ``{"section.key": value as written}`` for every field it changed.
    """
    given = {}
    for section, key in PATH_FIELDS:
        table = data.get(section)
        value = table.get(key) if isinstance(table, dict) else None
        if not isinstance(value, str) or not value:
            continue
        path = Path(value).expanduser()
        if (key == "name" and not path.is_dir()) or (key != "cache_dir" and not path.exists()):
            continue
        resolved = str(path.resolve())
        if resolved != value:
            table[key] = resolved
            given[f"{section}.{key}"] = value
    return given


def to_dict(cfg: ExperimentConfig) -> dict[str, dict[str, Any]]:
    """Turn the resolved config into nested plain dicts, core sections first.

    Args:
        cfg: the config.

    Returns:
        ``{section: {key: value}}``, tuples as lists.
    """

    def plain(v: Any) -> Any:
        return [plain(x) for x in v] if isinstance(v, tuple) else v

    out = {name: {k: plain(v) for k, v in dataclasses.asdict(getattr(cfg, name)).items()} for name in CORE_SECTIONS}
    for name, options in cfg.sections.items():
        out[name] = {k: plain(v) for k, v in dataclasses.asdict(options).items()}
    return out


def dumps_toml(cfg: ExperimentConfig) -> str:
    """Serialise the resolved config to TOML text, reloadable by `load`.

    A {value: share} table is written as an inline table, ``{2 = 0.4, 4 = 0.6}``; a resolved path
    carries its value as written in a ``# given as "..."`` comment.

    Args:
        cfg: the config.

    Returns:
        The TOML text.
    """
    lines = []
    for section, table in to_dict(cfg).items():
        obj = getattr(cfg, section) if section in CORE_SECTIONS else cfg.section(section)
        hints = typing.get_type_hints(type(obj))
        lines.append(f"[{section}]")
        for key, value in table.items():
            if _is_table(hints.get(key)):
                text = "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value) + "}"
            else:
                text = _toml_value(value)
            if f"{section}.{key}" in cfg.given:  # the path as written, beside its resolved value
                text += f"  # given as {_toml_value(cfg.given[f'{section}.{key}'])}"
            lines.append(f"{key} = {text}")
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


def replace(cfg: ExperimentConfig, schema: Schema, **sections: dict[str, Any]) -> ExperimentConfig:
    """Copy a config with fields of named sections replaced, and validate the copy.

    ``replace(cfg, schema, strategy={'name': 'flora'})``.

    Args:
        cfg: the config.
        schema: the sections and methods beyond the core.
        **sections: ``{section: {key: value}}`` the fields to replace.

    Returns:
        The validated copy.

    Raises:
        ConfigError: for a value at fault.
    """
    core, extra = {}, dict(cfg.sections)
    for name, values in sections.items():
        try:
            if name in CORE_SECTIONS:
                core[name] = dataclasses.replace(getattr(cfg, name), **values)
            else:
                extra[name] = dataclasses.replace(cfg.section(name), **values)
        except ValueError as exc:
            raise ConfigError(f"<override>: {name}.{exc}") from None
    out = dataclasses.replace(cfg, **core, sections=MappingProxyType(extra))
    validate(out, "<override>", schema)
    return out


def differences(old: ExperimentConfig, new: ExperimentConfig) -> list[str]:
    """List the dotted keys whose values differ between two configs.

    Args:
        old: one config.
        new: the other.

    Returns:
        ``section.key: old -> new`` lines, sorted.
    """
    a, b = to_dict(old), to_dict(new)
    out = []
    for section in sorted(set(a) | set(b)):
        for key in sorted(set(a.get(section, {})) | set(b.get(section, {}))):
            x, y = a.get(section, {}).get(key), b.get(section, {}).get(key)
            if x != y:
                out.append(f"{section}.{key}: {x!r} -> {y!r}")
    return out
