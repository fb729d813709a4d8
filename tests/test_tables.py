"""Every generated table of measured results equals its regeneration from bench/results
(bench/tools/tables.py), every table on the results page is a generated one, and a hand-edited number is
caught."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def tables_module():
    spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "bench" / "tools" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_every_committed_table_is_its_regeneration():
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tools" / "tables.py"), "--check"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_table_on_the_results_page_is_generated():
    """Outside the generated blocks only the verdicts summary (between its own markers: it quotes
    the generated tables' numbers by claim) may hold a table."""
    text = (ROOT / "docs" / "results.md").read_text()
    outside = re.sub(r"^<!-- (table: [^\n]*|verdicts) -->\n.*?^<!-- /(table|verdicts) -->", "", text, flags=re.S | re.M)
    assert "<!-- table:" not in outside.replace("`<!-- table:", "")  # every block closed
    hand = [ln for ln in outside.splitlines() if ln.lstrip().startswith("|")]  # in a list item too
    assert not hand, "a hand-written table in docs/results.md"


def test_a_number_edited_by_hand_is_caught(tmp_path):
    t = tables_module()
    page = tmp_path / "page.md"
    spec = "bench/results/main_job_seeds/comparison.json table=1 reference=prelort"
    good = f"<!-- table: {spec} -->\n{t.render(spec)}<!-- /table -->\n"
    page.write_text(good)
    assert t.regenerate(page) == (good, [])
    page.write_text(good.replace("51.14 ± 0.88", "48.31 ± 0.34"))  # PreLort's r = 16 made ZeroPad's
    new, changed = t.regenerate(page)
    assert changed == [spec] and new == good


def test_every_renderer_names_one_bench_script_in_its_folder():
    """bench/'s scripts live in perf/, studies/ and tools/ (bench/README.md) under names unique across
    them, and every script a renderer names is found there (fednl_tables and summaries are named in
    code, not in BENCH_RENDERERS); a name no folder holds is an error naming the folders."""
    t = tables_module()
    names = [p.stem for folder in t.FOLDERS for p in (ROOT / "bench" / folder).glob("*.py")]
    assert len(names) == len(set(names)) > 20
    assert not [p.name for p in (ROOT / "bench").glob("*.py") if p.name != "gpu_check.py"]  # only the forwarder
    scripts = {script for script, _ in t.BENCH_RENDERERS.values()} | {"fednl_tables", "summaries"}
    assert t.bench_script("summaries") == ROOT / "bench" / "tools" / "summaries.py"
    assert t.bench_script("fedslm_recovery") == ROOT / "bench" / "studies" / "fedslm_recovery.py"
    assert all(t.bench_script(s).parent.name in t.FOLDERS for s in scripts)
    with pytest.raises(FileNotFoundError, match=r"no_such_bench\.py in any of bench/\{perf,studies,tools\}"):
        t.bench_script("no_such_bench")
