"""The docstrings of the packages in COVERED are in the Google style mkdocs.yml declares, so the API
reference renders their parameter, return and raise tables (docs/reference.md; the style:
issue 36, item 4).

griffe (the parser mkdocstrings uses) loads ``nestfed`` from src without importing it and parses
every docstring with mkdocs.yml's own options. For every public module-level function, public class
and public method (names without a leading underscore, in public classes) of a covered module:

- a docstring whose first line is a one-line summary ending with a period, then a blank line;
- an ``Args:`` section naming every parameter (not self/cls), and no name the signature lacks;
  a class's ``__init__`` parameters go in the class docstring (dataclasses excepted);
- a ``Returns:`` (or ``Yields:``) section when the function returns something: a return annotation
  other than None, or, unannotated, a ``return <value>`` or ``yield`` in its body (properties are
  exempt: their summary says what they are);
- dataclasses and NamedTuples list every public field (an annotated name of the class body, with or
  without a default; ClassVars excepted) under ``Attributes:``;
- griffe's own warnings (a malformed section, an unknown parameter) fail too.

A public method overriding a method that a base class documents (an ``Args:`` section, or no
parameter but self) needs only its summary: the base documents parameters and return. A Protocol
of nestfed counts as a base of every class that defines or inherits all its public methods.

A command of the command line (a function decorated ``@<app>.command(...)``: Typer, Click) needs
only its summary too: its docstring is its ``--help`` text, printed as it is, and each parameter is
a CLI option or argument whose ``help=`` that ``--help`` already prints; an ``Args:`` section would
print the options twice, or copy them behind Click's ``\\f``, a second text to keep in step.

COVERED names the package nestfed itself: every module of it, a new one included.
"""

from __future__ import annotations

import ast
import logging
import re
import textwrap
from pathlib import Path

import pytest

griffe = pytest.importorskip("griffe", reason="the docs extra (mkdocstrings-python)")
yaml = pytest.importorskip("yaml", reason="the docs extra (mkdocs)")

ROOT = Path(__file__).resolve().parents[1]

COVERED = ["nestfed"]  # dotted names; a package covers its modules: every module of nestfed

Kind = griffe.DocstringSectionKind
RECORD_BASES = {"NamedTuple", "typing.NamedTuple", "TypedDict", "typing.TypedDict"}


def parser_options() -> dict:
    """The Google parser's options as mkdocs.yml gives them to mkdocstrings (one source for both)."""

    class Loader(yaml.SafeLoader):  # mkdocs.yml may carry !!python/name tags: read them as strings
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    cfg = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    handler = next(p["mkdocstrings"] for p in cfg["plugins"] if isinstance(p, dict) and "mkdocstrings" in p)
    options = handler["handlers"]["python"]["options"]
    assert options["docstring_style"] == "google"
    return dict(options.get("docstring_options") or {})


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class Checker:
    """Parses docstrings with the Google parser, collecting griffe's warnings, and lists problems."""

    def __init__(self, options: dict) -> None:
        self.options = options
        self._parsed: dict[int, tuple[object, list, list[str]]] = {}  # the object kept: its id stays its own
        self.protocols: list = []  # the Protocol classes a class may implement without naming them

    def add_protocols(self, module) -> None:
        """Note every Protocol class of module and its submodules (their classes' nested ones too)."""
        stack = [module]
        while stack:
            obj = stack.pop()
            for member in obj.members.values():
                if member.is_alias:
                    continue
                if member.is_class and any(str(b) in ("Protocol", "typing.Protocol") for b in member.bases):
                    self.protocols.append(member)
                if member.is_module or member.is_class:
                    stack.append(member)

    def parse(self, obj) -> tuple[list, list[str]]:
        """(sections, griffe's warnings) of obj's docstring, parsed once."""
        key = id(obj)
        if key not in self._parsed:
            records = _Records()
            log = logging.getLogger("griffe")
            log.addHandler(records)
            try:
                sections = griffe.parse_google(obj.docstring, **self.options) if obj.docstring else []
            finally:
                log.removeHandler(records)
            self._parsed[key] = (obj, sections, records.messages)
        return self._parsed[key][1:]

    def names(self, obj, kind) -> list[str] | None:
        """The names an obj's docstring section of this kind lists; None without such a section."""
        found = [s for s in self.parse(obj)[0] if s.kind is kind]
        if not found:
            return None
        return [item.name.lstrip("*") for s in found for item in s.value]

    def module_problems(self, module) -> list[str]:
        problems: list[str] = []
        for member in module.members.values():
            if member.is_alias or member.name.startswith("_"):
                continue
            if member.is_function:
                problems += self.function_problems(member)
            elif member.is_class:
                problems += self.class_problems(member)
        return problems

    def where(self, obj) -> str:
        return f"{obj.path} ({obj.relative_filepath}:{obj.lineno})"

    def summary_problems(self, obj) -> list[str]:
        if not obj.docstring or not obj.docstring.value.strip():
            return [f"{self.where(obj)}: add a docstring (a one-line summary ending with a period)"]
        lines = obj.docstring.value.splitlines()
        problems = [f"{self.where(obj)}: griffe: {w.split(': ', 1)[-1]}" for w in self.parse(obj)[1]]
        if not lines[0].strip().endswith(".") or (len(lines) > 1 and lines[1].strip()):
            problems.append(
                f"{self.where(obj)}: make the first line a one-line summary ending with a period, then a blank line"
                f" (it reads {lines[0].strip()!r})"
            )
        return problems

    def args_problems(self, obj, params: list[str], owner=None) -> list[str]:
        """Args of obj's docstring (or owner's, for a class's __init__) against params."""
        holder = owner or obj
        documented = self.names(holder, Kind.parameters)
        if documented is None:
            return [f"{self.where(holder)}: add an `Args:` section naming {', '.join(params)}"] if params else []
        problems = []
        if missing := [p for p in params if p not in documented]:
            problems.append(f"{self.where(holder)}: add `Args:` entries for {', '.join(missing)}")
        if extra := [d for d in documented if d not in params]:
            problems.append(f"{self.where(holder)}: `Args:` names {', '.join(extra)}, which the signature lacks")
        return problems

    def function_problems(self, func, cls=None) -> list[str]:
        problems = self.summary_problems(func)
        if not func.docstring:
            return problems
        params = [p.name for p in func.parameters]
        if cls is not None and params and params[0] in ("self", "cls") and "staticmethod" not in func.labels:
            params = params[1:]
        is_property = any("property" in label for label in func.labels)
        if is_property:
            return problems
        if is_command(func):  # typer's help= documents its parameters, in its --help
            return problems
        if cls is not None and self.overrides_documented(cls, func.name):  # the base documents it
            if self.names(func, Kind.parameters) is not None:
                problems += self.args_problems(func, params)
            return problems
        problems += self.args_problems(func, params)
        has_returns = self.names(func, Kind.returns) is not None or self.names(func, Kind.yields) is not None
        returns = self.returns_value(func)
        if returns and not has_returns:
            problems.append(f"{self.where(func)}: add a `Returns:` (or `Yields:`) section: what it gives back")
        if returns is False and has_returns:
            problems.append(f"{self.where(func)}: it returns None: drop the `Returns:` section")
        return problems

    def returns_value(self, func) -> bool | None:
        """True when func returns (or yields) a value, False when it is annotated None, None when unsure."""
        if func.returns is not None:
            text = str(func.returns)
            return text not in ("None", "NoReturn", "Never", "typing.NoReturn", "typing.Never")
        try:
            tree = ast.parse(textwrap.dedent(func.source))
        except (SyntaxError, ValueError, OSError):
            return None
        body = tree.body[0]
        stack = list(body.body)
        while stack:
            node = stack.pop()
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
                continue
            if isinstance(node, ast.Yield | ast.YieldFrom):
                return True
            if isinstance(node, ast.Return) and node.value is not None:
                if not (isinstance(node.value, ast.Constant) and node.value.value is None):
                    return True
            stack.extend(ast.iter_child_nodes(node))
        return False

    def overrides_documented(self, cls, name: str) -> bool:
        """Whether a base class of cls (transitively), or a Protocol cls implements, documents a method
        `name`: its docstring has an Args section, or it takes no parameter but self."""
        seen: set[str] = set()
        stack = list(self.bases(cls)) + self.implemented(cls)
        while stack:
            base = stack.pop()
            if base.path in seen:
                continue
            seen.add(base.path)
            member = base.members.get(name)
            if member is not None and not member.is_alias and member.is_function and member.docstring:
                if self.names(member, Kind.parameters) is not None or len(member.parameters) <= 1:
                    return True
            stack.extend(self.bases(base))
        return False

    def implemented(self, cls) -> list:
        """The Protocols cls satisfies structurally: it defines or inherits every public method of one."""
        have, stack = set(), [cls]
        while stack:
            c = stack.pop()
            have |= {n for n, m in c.members.items() if not m.is_alias and m.is_function}
            stack.extend(self.bases(c))
        out = []
        for protocol in self.protocols:
            wanted = {n for n, m in protocol.members.items() if m.is_function and not n.startswith("_")}
            if protocol is not cls and wanted and wanted <= have:
                out.append(protocol)
        return out

    def bases(self, cls) -> list:
        try:
            return [b for b in cls.resolved_bases if b.is_class]
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):  # an external base: not documented here
            return []

    def fields(self, cls) -> list[str]:
        """The public fields of a dataclass or NamedTuple: the annotated names of its class body, with or
        without a default, ClassVar ones excepted (read from the source: griffe drops the ClassVar)."""
        try:
            tree = ast.parse(textwrap.dedent(cls.source))
        except (SyntaxError, ValueError, OSError):
            return []
        return [
            node.target.id
            for node in tree.body[0].body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and not node.target.id.startswith("_") and not is_classvar(node.annotation)
        ]  # fmt: skip

    def class_problems(self, cls) -> list[str]:
        problems = self.summary_problems(cls)
        record = "dataclass" in cls.labels or any(str(b) in RECORD_BASES for b in cls.bases)
        if record and cls.docstring:
            documented = self.names(cls, Kind.attributes) or []
            if missing := [f for f in self.fields(cls) if f not in documented]:
                problems.append(f"{self.where(cls)}: add `Attributes:` entries for {', '.join(missing)}")
        if cls.docstring and (attrs := self.names(cls, Kind.attributes)):
            if extra := [a for a in attrs if a not in cls.all_members]:
                problems.append(f"{self.where(cls)}: `Attributes:` names {', '.join(extra)}, which the class lacks")
        init = cls.members.get("__init__")
        if not record and init is not None and not init.is_alias and cls.docstring:
            params = [p.name for p in init.parameters][1:]
            problems += self.args_problems(init, params, owner=cls)
        for member in cls.members.values():
            if member.is_alias or member.name.startswith("_"):
                continue
            if member.is_function:
                problems += self.function_problems(member, cls)
            elif member.is_class:
                problems += self.class_problems(member)
        return problems


def is_command(func) -> bool:
    """Whether a function is a command of a CLI app (decorated ``@<app>.command`` or ``@<app>.command(...)``)."""
    return any(str(d.value).split("(", 1)[0].endswith(".command") for d in func.decorators)


def is_classvar(annotation: ast.expr) -> bool:
    """Whether an annotation is ClassVar, bare or subscripted, named plainly, through typing, or quoted."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return False
    if isinstance(annotation, ast.Subscript):
        annotation = annotation.value
    return (isinstance(annotation, ast.Name) and annotation.id == "ClassVar") or (
        isinstance(annotation, ast.Attribute) and annotation.attr == "ClassVar"
    )


@pytest.fixture(scope="module")
def package():
    return griffe.load("nestfed", search_paths=[str(ROOT / "src")], docstring_parser="google", allow_inspection=False)


@pytest.fixture(scope="module")
def checker(package):
    checker = Checker(parser_options())
    checker.add_protocols(package)
    return checker


def covered_modules(package, name: str) -> list:
    obj = package[name.removeprefix("nestfed.")] if name != "nestfed" else package
    if not obj.is_module:
        raise AssertionError(f"{name} in COVERED is not a module or package")
    modules, stack = [], [obj]
    while stack:
        module = stack.pop()
        modules.append(module)
        stack.extend(m for m in module.modules.values() if not m.is_alias)
    return modules


@pytest.mark.parametrize("name", COVERED)
def test_the_covered_docstrings_are_in_the_google_style(package, checker, name):
    problems = [p for module in covered_modules(package, name) for p in checker.module_problems(module)]
    assert not problems, f"{len(problems)} docstring problems in {name}:\n" + "\n".join(problems)


BROKEN = '''
"""A module."""
import typing
from dataclasses import dataclass
from typing import ClassVar, Protocol

import typer


def documented(x: int, y: int = 0) -> int:
    """Add two numbers.

    Args:
        x: the first.
        y: the second.

    Returns:
        Their sum.

    Raises:
        ValueError: when x is negative.
    """


def no_args(x, y):
    """Add two numbers, with no sections at all.
    And a summary that runs on."""
    return x + y


def extra_arg(x: int) -> None:
    """Nothing.

    Args:
        x: the number.
        z: not a parameter.
    """


def generator(n):
    """Count.

    Args:
        n: how far.
    """
    yield from range(n)


def malformed(x: int) -> None:
    """Nothing.

    Args:
        x the number, without its colon.
    """


@dataclass
class Options:
    """Options.

    Attributes:
        a: documented.
    """

    a: int = 0
    b: int = 1
    c: int
    kind: ClassVar[str] = "options"
    kinds: typing.ClassVar[tuple[str, ...]] = ()
    quoted: "ClassVar[int]" = 0


class Base:
    """A base."""

    def hook(self, value: int) -> None:
        """Use a value.

        Args:
            value: the value.
        """

    def count(self) -> int:
        """Count.

        Returns:
            The count.
        """
        return 1


class Hook(Protocol):
    """What a hook does."""

    def handle(self, event: str) -> bool:
        """Handle an event.

        Args:
            event: the event.

        Returns:
            Whether it was handled.
        """

    def close(self) -> None:
        """Close."""


class Implementation:
    """A Hook without naming it."""

    def handle(self, event: str) -> bool:
        """Handle it this way."""
        return True

    def close(self) -> None:
        """Close this way."""


class HalfHook:
    """Only one of Hook's methods: not a Hook."""

    def handle(self, event: str) -> bool:
        """Handle it this way."""
        return True


app = typer.Typer()


@app.command("go")
def command(path: str = typer.Argument(..., help="where")) -> None:
    """Go somewhere (typer's help= documents the argument)."""


@app.command()
def bad_command(path: str) -> None:
    """Go somewhere,
    with a summary that runs on."""


class Child(Base):
    """A child, built from a size.

    Args:
        size: the size.
        other: not a parameter.
    """

    def __init__(self, size: int, name: str):
        self.size = size

    def hook(self, value: int) -> None:
        """Use the value the child's way."""

    def count(self) -> int:
        """Count the child's way."""
        return 2

    def own(self, value: int) -> int:
        """Its own method."""
        return value
'''


def test_the_checker_finds_each_kind_of_problem(tmp_path):
    (tmp_path / "broken.py").write_text(BROKEN)
    module = griffe.load("broken", search_paths=[str(tmp_path)], docstring_parser="google", allow_inspection=False)
    checker = Checker(parser_options())
    checker.add_protocols(module)
    problems = checker.module_problems(module)
    by_name: dict[str, list[str]] = {}
    for p in problems:
        by_name.setdefault(p.split(" ")[0], []).append(p)
    exempt = ("broken.Child.hook", "broken.Child.count", "broken.Implementation.handle")  # documented on a base
    exempt += ("broken.command",)  # a CLI command: its options' help= documents them
    for documented in ("broken.documented", "broken.Base", "broken.Hook", "broken.Implementation", *exempt):
        assert documented not in by_name, by_name[documented]
    assert len(by_name["broken.bad_command"]) == 1 and "one-line summary" in by_name["broken.bad_command"][0]
    assert len(by_name["broken.no_args"]) == 3  # summary, Args, Returns
    assert "add an `Args:` section naming x, y" in by_name["broken.no_args"][1]
    assert "add a `Returns:`" in by_name["broken.no_args"][2]
    line = BROKEN.splitlines().index("def extra_arg(x: int) -> None:") + 1
    assert len(by_name["broken.extra_arg"]) == 2
    assert by_name["broken.extra_arg"][1].endswith(f"broken.py:{line}): `Args:` names z, which the signature lacks")
    assert "griffe: Parameter 'z' does not appear" in by_name["broken.extra_arg"][0]  # griffe's own warning
    assert len(by_name["broken.generator"]) == 1 and "Yields" in by_name["broken.generator"][0]
    assert any("griffe:" in p for p in by_name["broken.malformed"])
    assert len(by_name["broken.Options"]) == 1  # a field without a default counts, a ClassVar does not
    assert by_name["broken.Options"][0].endswith("add `Attributes:` entries for b, c")
    child = by_name["broken.Child"]
    assert any("add `Args:` entries for name" in p for p in child)
    assert any("`Args:` names other" in p for p in child)
    assert len(by_name["broken.Child.own"]) == 2  # Args (value), Returns
    assert len(by_name["broken.HalfHook.handle"]) == 2  # Args (event), Returns: it implements no Protocol


def test_no_sphinx_roles_in_the_sources():
    """mkdocstrings' Google parser leaves ``:func:`x``` as literal text: name objects in backticks."""
    role = re.compile(r":(?:func|class|meth|data|attr|mod|exc|obj):`")
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "src" / "nestfed").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if role.search(line)
    ]
    assert not found, "write `name` instead of a Sphinx role at: " + ", ".join(found)
