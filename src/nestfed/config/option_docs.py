"""Each option of a config section with its default and meaning, read from the section's dataclass,
for ``nestfed methods NAME``.

The fields and their defaults come from ``dataclasses.fields``, the meanings from the class
docstring's ``name: meaning`` runs: the entries of its Google-style ``Attributes:`` section (the
style every options dataclass is documented in), or of the whole docstring when it has no such
section.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import NamedTuple


class OptionDoc(NamedTuple):
    """One option of a config section.

    Attributes:
        key: the option's key.
        default: its default as TOML would write it (a Python repr where TOML has no literal).
        meaning: what the docstring says of it; ``""`` when the docstring does not describe it.
    """

    key: str
    default: str
    meaning: str


def option_docs(cls: type) -> list[OptionDoc]:
    """List the options of a section's dataclass, with their defaults and meanings.

    A field's meaning is the text after the first ``<field>:`` of the docstring's ``Attributes:``
    section (of the whole docstring without one), whitespace joined, up to the next field's; fields
    described together (``a, b: ...``) share that text.

    Args:
        cls: the section's dataclass.

    Returns:
        Its options, in field order; a field the docstring does not name has the meaning ``""``.
    """
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    text = " ".join(_attributes(inspect.getdoc(cls) or "").split())
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


def _attributes(doc: str) -> str:
    """The indented lines of a Google-style docstring's ``Attributes:`` section, else the whole docstring."""
    lines = doc.splitlines()
    heads = [i for i, line in enumerate(lines) if line.strip() == "Attributes:"]
    if not heads:
        return doc
    indent = len(lines[heads[0]]) - len(lines[heads[0]].lstrip())
    block = []
    for line in lines[heads[0] + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        block.append(line)
    return "\n".join(block)


def _plain(text: str) -> str:
    """Sphinx roles and literals as a terminal shows them: ```a.b.c``` -> ``c``."""
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
