"""The architecture holds: the layer contract (import-linter), no import cycles, a core that names no
method, no function-local import of nestfed, small modules and short functions, and a registry that
is the one place methods are listed."""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nestfed import methods

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "nestfed"
HOMES = {"methods", "experiments", "flower"}  # and cli.py: the places that may name methods


def modules():
    return sorted(SRC.rglob("*.py"))


def test_the_layer_and_acyclic_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe, "import-linter is part of the test extra"
    r = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout and "nestfed's layers point one way KEPT" in r.stdout


def _code_names(tree: ast.AST):
    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and n.body
        and isinstance(n.body[0], ast.Expr)
        and isinstance(n.body[0].value, ast.Constant)
    }
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            yield n.lineno, n.value
        elif isinstance(n, ast.Name):
            yield n.lineno, n.id
        elif isinstance(n, ast.Attribute):
            yield n.lineno, n.attr
        elif isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            yield n.lineno, n.name
        elif isinstance(n, ast.ImportFrom) and n.module:
            yield n.lineno, n.module


def test_the_core_names_no_method():
    """Prose in docstrings may name a method; code (names, strings, imports) outside the homes may not."""
    names = sorted(methods.REGISTRY, key=len, reverse=True) + ["fedsa", "fedex", "flexlora"]
    pattern = re.compile("|".join(re.escape(n) for n in names), re.I)
    hits = []
    for f in modules():
        rel = f.relative_to(SRC)
        if set(rel.parts[:-1]) & HOMES or rel.name == "cli.py":
            continue
        hits += [f"{rel}:{ln}: {s[:40]!r}" for ln, s in _code_names(ast.parse(f.read_text())) if pattern.search(s)]
    assert not hits, "\n".join(hits)


@pytest.mark.slow
def test_no_function_imports_nestfed_locally():
    """A function-local import of nestfed is how cycles used to be dodged; none is left. The two entry
    points alone import what they run when they run it (the command line per command, the FAB's
    ClientApp inside a simulation actor): nothing imports them, so no cycle can hide there, and
    import-linter checks those imports as it checks every other."""
    hits = []
    for f in modules():
        if f.relative_to(SRC) in (Path("cli.py"), Path("flower/node_forwarder.py")):  # entry points, imported by none
            continue
        for fn in ast.walk(ast.parse(f.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in ast.walk(fn):
                    if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("nestfed"):
                        hits.append(f"{f.relative_to(SRC)}:{n.lineno}")
                    elif isinstance(n, ast.Import) and any(a.name.startswith("nestfed") for a in n.names):
                        hits.append(f"{f.relative_to(SRC)}:{n.lineno}")
    assert not hits, hits


def test_modules_stay_small():
    sizes = {str(f.relative_to(SRC)): len(f.read_text().splitlines()) for f in modules()}
    assert max(sizes.values()) <= 600, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]


def docstring_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of ``fn``'s docstring (0 without one): documentation, not code to hold in one's head."""
    first = fn.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first.end_lineno - first.lineno + 1
    return 0


def function_lengths(tree: ast.AST) -> dict[str, int]:
    """{name at its line: lines from its first decorator (or its def) to its last line, its docstring
    excepted} of every function and method in ``tree``."""
    return {
        f"{fn.name}:{fn.lineno}": fn.end_lineno
        - min([fn.lineno] + [d.lineno for d in fn.decorator_list])
        + 1
        - docstring_lines(fn)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def test_function_lengths_count_from_the_decorator_to_the_last_line_without_the_docstring():
    tree = ast.parse(
        "@a\n@b\ndef f():\n    x = 1\n\n    return x\n\n\nclass C:\n    def g(self):\n        pass\n"
        '\n    def h(self):\n        """One.\n\n        Two.\n        """\n        return 1\n'
    )
    assert function_lengths(tree) == {"f:3": 6, "g:10": 2, "h:13": 2}


def test_functions_stay_short():
    long = {
        f"{f.relative_to(SRC)}::{name}": n
        for f in modules()
        for name, n in function_lengths(ast.parse(f.read_text())).items()
        if n >= 80
    }
    assert not long, sorted(long.items(), key=lambda kv: -kv[1])


def test_functions_with_their_docstrings_stay_under_80_lines():
    """The before-stop check's count (def line to last line, docstring included) holds too."""
    long = {
        f"{f.relative_to(SRC)}::{fn.name}": fn.end_lineno - fn.lineno
        for f in modules()
        for fn in ast.walk(ast.parse(f.read_text()))
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.end_lineno - fn.lineno >= 80
    }
    assert not long, f"split these into steps that read on their own: {sorted(long.items(), key=lambda kv: -kv[1])}"


def test_every_method_is_listed_once_and_the_cli_and_schema_follow_the_registry():
    assert list(methods.REGISTRY) == [m.name for m in methods.REGISTRY.values()]
    assert methods.schema().methods == tuple(methods.REGISTRY)
    for m in methods.REGISTRY.values():
        for section, cls in m.sections.items():
            assert methods.schema().sections[section] is cls
    r = subprocess.run([sys.executable, "-m", "nestfed.cli", "methods"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and [
        ln.split()[0]
        for ln in r.stdout.splitlines()
        if ln.strip() and not ln.startswith(" ") and ln.split()[0] in methods.REGISTRY
    ] == list(methods.REGISTRY)


@pytest.mark.parametrize("doc", ["docs/architecture.md", "docs/methods.md"])
def test_the_docs_the_code_cites_exist_and_are_cited(doc):
    assert (ROOT / doc).is_file()
    cited = sum(doc in f.read_text() for f in modules())
    assert cited >= 1
    stale = [
        str(f.relative_to(SRC))
        for f in modules()
        if re.search(r"(?<![/\w])(methods|design|resources)\.md", f.read_text())
    ]
    assert not stale, stale


def modules_loaded(code: str, watched: tuple[str, ...], args=()) -> tuple[str, subprocess.CompletedProcess]:
    """Run ``code`` in a fresh interpreter (``sys`` imported, ``args`` as its argv) and return which of
    ``watched`` it left in ``sys.modules``, printed as a sorted list (``"[]"``: none), with the process."""
    probe = f"import sys\n{code}\nprint('LOADED', sorted(m for m in {watched!r} if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", probe, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("LOADED ")]
    return (line[-1].removeprefix("LOADED ") if line else "no LOADED line"), r


@pytest.mark.slow
def test_the_command_line_answers_without_loading_a_model_library():
    """``nestfed --help``, ``nestfed methods`` and a config error import neither torch nor transformers
    (their start time is measured by bench/perf/cli_start.py)."""
    code = (
        "from nestfed import cli; sys.argv = ['nestfed', *sys.argv[1:]]\n"
        "try:\n    cli.main()\nexcept SystemExit as e:\n    code = e.code"
    )
    for args in (
        ["--help"],
        ["methods"],
        ["run", "configs/tiny.toml", "--set", "lora.rank=3"],
        ["run", "nothere.toml"],
    ):
        loaded, r = modules_loaded(code, ("torch", "transformers", "peft"), args)
        assert loaded == "[]", (args, r.stdout[-500:], r.stderr[-500:])


@pytest.mark.slow
def test_flower_processes_load_peft_only_to_export():
    """A node's worker and the ServerApp import no peft (which imports bitsandbytes, about 1.4 s in
    every process): peft loads when a run exports its adapter (nestfed.nn.peft_export)."""
    code = "import nestfed.flower.worker, nestfed.flower.client_app, nestfed.flower.server_app"
    loaded, r = modules_loaded(code, ("peft", "bitsandbytes"))
    assert loaded == "[]", (r.stdout[-500:], r.stderr[-500:])


def test_every_declaration_names_an_implementation_that_matches_it():
    """The registry's light declarations agree with what their homes implement: a method declared on
    Flower has both halves; its home module defines IMPLEMENTATION; its sections are plain dataclasses
    whose module loads no model library."""
    for m in methods.REGISTRY.values():
        impl = m.implementation
        assert m.on_flower == (impl.client is not None and impl.server is not None), m.name
        assert (impl.client_hooks is not None) == m.on_flower, m.name
