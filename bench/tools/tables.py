"""Every table of measured results in the docs, regenerated from its results file in bench/results.

A generated table sits between two markers in a docs page:

    <!-- table: bench/results/main_job_seeds/comparison.json table=0 reference=prelort -->
    | ... the table ... |
    <!-- /table -->

The marker names the results file (several joined by ``+``: their rows under one header),
which of the rendered Markdown's tables to keep (``table=N``, 0-based; default 0) and, for a
comparison, the reference label. The file is rendered by the code that wrote it: comparison rows
(a JSON list: ``nestfed compare``'s comparison.json, a ``--table`` file) by
nestfed.experiments.comparison.markdown; a bench's JSON by that bench's ``table`` (keyed by its
``bench`` field), or by the function a marker names (``renderer=summaries.aggregation``:
bench/tools/summaries.py); a Markdown results file is taken as it is.

    .venv/bin/python bench/tools/tables.py            # rewrite every block from its results file
    .venv/bin/python bench/tools/tables.py --check    # exit 1 naming each block that differs (tests/test_tables.py)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
#: bench/'s folders of scripts (bench/README.md); a renderer's script is found by its name in them
FOLDERS = ("perf", "studies", "tools")
BLOCK = re.compile(r"(<!-- table: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def bench_script(name: str) -> Path:
    """bench/<folder>/<name>.py, whichever of :data:`FOLDERS` holds it (the scripts' names are unique
    across the folders). Raises FileNotFoundError when none does."""
    found = [path for folder in FOLDERS if (path := ROOT / "bench" / folder / f"{name}.py").is_file()]
    if not found:
        raise FileNotFoundError(f"no bench script {name}.py in any of bench/{{{','.join(FOLDERS)}}}")
    return found[0]


def bench_module(name: str):
    """bench/<folder>/<name>.py (:func:`bench_script`) as a module (the bench scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", bench_script(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: a bench JSON's ``bench`` field -> (bench script, its renderer's name)
BENCH_RENDERERS = {
    "faults": ("faults", "table"),
    "robustness": ("robustness", "table"),
    "scale": ("scale", "table"),
    "prelort_dilution": ("prelort_dilution", "table"),
    "fednl_streaming_ce": ("fednl_streaming_ce", "table"),
    "fedslm_memory": ("fedslm_memory", "table"),
    "flower_vs_embedded": ("flower_vs_embedded", "table"),
    "fedslm_recovery": ("fedslm_recovery", "table"),
    "fedslm_recovery_seeds": ("fedslm_recovery", "merged"),
    "fednl_recall": ("fednl_recall", "table"),
    "fednl_mqar": ("fednl_mqar", "table"),
    "fednl_mqar_capability": ("fednl_mqar_capability", "table"),
    "generation_speed": ("generation_speed", "table"),
    "quantization_memory": ("quantization_memory", "table"),
    "fedslm_ratio_budgets": ("fedslm_ratio_budgets", "table"),
    "rank_transfer": ("rank_transfer", "table"),
}


def renderer(data) -> Callable[..., str]:
    """The function that renders a results file's parsed JSON ``data`` as Markdown. Raises
    ValueError for a file no renderer is known for."""
    if isinstance(data, list) and data and "client_memory_ratio" in data[0]:  # the compressed comparison's rows
        from nestfed.experiments.compressed_comparison import markdown

        return markdown
    if isinstance(data, list):  # comparison rows
        from nestfed.experiments.comparison import markdown

        return markdown
    if isinstance(data, dict) and data.get("bench") in BENCH_RENDERERS:  # a bench that names itself
        script, fn = BENCH_RENDERERS[data["bench"]]
        return getattr(bench_module(script), fn)
    if isinstance(data, dict) and "runs" in data:  # bench/studies/fednl_tables.py's tables
        return bench_module("fednl_tables").markdown
    if isinstance(data, dict) and "accuracy_final" in data:  # one FedNL run's summary
        return bench_module("fednl_tables").single_run
    bench = data.get("bench") if isinstance(data, dict) else None
    if bench is None and isinstance(data, dict) and "attackers" in data:  # robustness.json names no bench
        bench = "robustness"
    if bench is None and isinstance(data, dict) and "deployment_over_embedded_round_time" in data:  # nor these
        bench = "flower_vs_embedded"
    if bench in BENCH_RENDERERS:
        script, fn = BENCH_RENDERERS[bench]
        return getattr(bench_module(script), fn)
    raise ValueError(f"no renderer for a results file of bench {bench!r}")


def tables_of(markdown: str) -> list[str]:
    """The Markdown tables of ``markdown`` (runs of lines that start with ``|``), in order."""
    out, current = [], []
    for line in markdown.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            out.append("\n".join(current))
            current = []
    if current:
        out.append("\n".join(current))
    return out


def parse_spec(spec: str) -> tuple[Path, int, dict[str, str]]:
    """(results path, table index, options) of a marker's ``path key=value ...`` (a value with spaces
    in shell quotes: ``reference="all fp32"``)."""
    path, *rest = shlex.split(spec)
    opts = dict(kv.split("=", 1) for kv in rest)
    return ROOT / path, int(opts.pop("table", "0")), opts


def render(spec: str) -> str:
    """The table a marker's spec names, regenerated from its results file; paths joined by ``+``
    stack their tables' rows under the first one's header. Raises ValueError / FileNotFoundError
    naming the spec."""
    paths, *rest = shlex.split(spec)
    if "+" in paths:
        parts = [render(shlex.join([p, *rest])).splitlines() for p in paths.split("+")]
        return "\n".join(parts[0] + [ln for part in parts[1:] for ln in part[2:]]) + "\n"
    path, index, opts = parse_spec(spec)
    if path.suffix == ".md":
        text = path.read_text()
    else:
        data = json.loads(path.read_text())
        if "renderer" in opts:  # renderer=<bench module>.<function>
            module, _, function = opts.pop("renderer").partition(".")
            fn = getattr(bench_module(module), function)
        else:
            fn = renderer(data)
        text = fn(data, opts["reference"]) if "reference" in opts else fn(data)
    found = tables_of(text)
    if index >= len(found):
        raise ValueError(f"{spec}: the rendered file has {len(found)} tables")
    return found[index] + "\n"


def regenerate(page: Path) -> tuple[str, list[str]]:
    """The page with every block regenerated, and the specs whose block changed."""
    text = page.read_text()
    changed: list[str] = []

    def one(m: re.Match) -> str:
        body = render(m["spec"])
        if body != m["body"]:
            changed.append(m["spec"])
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(one, text), changed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 if any block differs")
    args = ap.parse_args()
    drift = []
    for page in PAGES:
        new, changed = regenerate(page)
        drift += [f"{page.relative_to(ROOT)}: {spec}" for spec in changed]
        if changed and not args.check:
            page.write_text(new)
    for d in drift:
        print(("differs from its results file: " if args.check else "regenerated: ") + d)
    sys.exit(1 if drift and args.check else 0)


if __name__ == "__main__":
    main()
