"""Each option of a config section with its default and meaning, read from the section's dataclass:
the fields and their defaults from ``dataclasses.fields``, the meaning from the class docstring's
``name: meaning`` runs (its Google-style ``Attributes:`` section, the style every options dataclass
is documented in), for ``nestfed methods NAME``."""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import NamedTuple


class OptionDoc(NamedTuple):
    """One option: its key, its default as TOML would write it (a Python repr where TOML has no
    literal), and its meaning (``""`` when the docstring does not describe it on its own)."""

    key: str
    default: str
    meaning: str


def option_docs(cls: type) -> list[OptionDoc]:
    """The options of a section's dataclass ``cls``, in field order. A field's meaning is the text
    after the first ``<field>:`` of the docstring (whitespace joined) up to the next field's or a
    ``Raises`` section; fields described together (``a, b: ...``) share that text; ``""`` for a
    field the docstring does not name."""
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    text = " ".join((inspect.getdoc(cls) or "").split())
    heads = [  # (start, end, the fields it names) of every "name:" / "a, b:" that names only fields
        (m.start(), m.end(), m.group(1).split(", "))
        for m in re.finditer(r"(?<![\w.`])((?:[a-z_]\w*, )*[a-z_]\w*):\s", text)
        if set(m.group(1).split(", ")) <= names
    ]
    meanings: dict[str, str] = {}
    for i, (_, end, group) in enumerate(heads):
        stop = heads[i + 1][0] if i + 1 < len(heads) else len(text)
        meaning = _plain(re.split(r" Raises:? ", text[end:stop])[0]).strip().rstrip(";,").strip()
        for name in group:
            meanings.setdefault(name, meaning)
    return [OptionDoc(f.name, _default(f), meanings.get(f.name, "")) for f in fields]


def _plain(text: str) -> str:
    """Sphinx roles and literals as a terminal shows them: ``:func:`~a.b.c``` -> ``c``."""
    text = re.sub(r":(?:func|class|meth|mod|attr):`~?(?:[\w]+\.)*([\w]+)`", r"\1", text)
    return text.replace("``", "`")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return repr(value)
