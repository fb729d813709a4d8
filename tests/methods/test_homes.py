"""The rules every method's home keeps (docs/tutorial.md, step 1), checked for every registered
method, each failure saying what to do:

- the home is a package under src/nestfed/methods/ whose ``__init__.py`` declares ``METHOD`` and
  loads no model library (the command line imports every home when it starts);
- ``METHOD``'s home names a module of that package, imported only when a run needs it, which
  defines ``IMPLEMENTATION``;
- a shipped config under configs/ runs it (``strategy.name``).
"""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from nestfed import methods

ROOT = Path(__file__).resolve().parents[2]
HOMES = ROOT / "src" / "nestfed" / "methods"
HEAVY = ("torch", "transformers", "peft")


def shipped_methods() -> set[str]:
    """The strategy names the shipped configs set (what a config ``extends`` is read too)."""
    names = set()
    for f in (ROOT / "configs").rglob("*.toml"):
        name = tomllib.loads(f.read_text()).get("strategy", {}).get("name")
        if name:
            names.add(name)
    return names


@pytest.mark.parametrize("name", sorted(methods.REGISTRY))
def test_the_home_is_a_package_whose_declaration_loads_no_model_library(name):
    package = HOMES / name
    assert (package / "__init__.py").is_file(), f"{name}: make its home a package, src/nestfed/methods/{name}/"
    probe = (
        f"import sys, nestfed.methods.{name} as m; m.METHOD; print(sorted(x for x in {HEAVY!r} if x in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", (
        f"src/nestfed/methods/{name}/__init__.py loads {r.stdout.strip()}: keep only METHOD and its options "
        "there and move the strategy and its imports to strategy.py (docs/tutorial.md, step 1)"
    )


@pytest.mark.parametrize("name", sorted(methods.REGISTRY))
def test_the_declaration_names_a_module_of_its_home_that_implements_it(name):
    home = methods.get(name).home
    assert isinstance(home, str) and home.startswith(f"nestfed.methods.{name}."), (
        f"{name}: METHOD's home must name a module of its package as a string, e.g. "
        f"'nestfed.methods.{name}.strategy', so that it is imported only when a run needs it"
    )
    assert methods.get(name).implementation is not None


def test_every_method_has_a_shipped_config():
    missing = sorted(set(methods.REGISTRY) - shipped_methods())
    assert not missing, (
        f"no config under configs/ sets strategy.name to {missing}: ship configs/methods/<name>.toml "
        "(extends = '../bbc_news.toml'; copy configs/methods/zeropad.toml)"
    )
