"""The documentation site (mkdocs.yml, docs/) builds in strict mode: a broken link, a page missing
from the navigation or an API reference to something that does not exist fails CI."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_site_builds_strictly(tmp_path):
    exe = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert exe, "mkdocs is part of the docs extra (scripts/setup.sh installs it)"
    env = {"PATH": str(Path(sys.executable).parent), "NO_MKDOCS_2_WARNING": "1", "HOME": str(tmp_path)}
    r = subprocess.run(
        [exe, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for page in ("index", "getting-started/index", "tutorial/index", "results/index", "reference/index"):
        assert (tmp_path / "site" / f"{page}.html").is_file(), page
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    assert "RoundLoop" in reference and "NodeStateStore" in reference  # rendered from the docstrings


def test_the_readme_links_only_to_pages_that_exist():
    import re

    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(((?:docs|bench)/[^)#]+)", readme)
    assert targets and all((ROOT / t).exists() for t in targets), [t for t in targets if not (ROOT / t).exists()]
    assert len(readme.splitlines()) <= 250


def test_a_link_to_a_missing_anchor_fails_the_build(tmp_path):
    """mkdocs.yml's validation makes a link to an anchor no page has fail the strict build."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "trust.md", "a") as f:
        f.write("\n[a section](results.md#no-such-section)\n")
    exe = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    env = {"PATH": str(Path(sys.executable).parent), "NO_MKDOCS_2_WARNING": "1", "HOME": str(tmp_path)}
    r = subprocess.run(
        [exe, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert r.returncode != 0 and "does not contain an anchor '#no-such-section'" in r.stdout + r.stderr


def test_the_python_api_example_runs_as_the_page_writes_it(tmp_path):
    import re

    page = (ROOT / "docs" / "getting-started.md").read_text()
    section = page[page.index("## The Python API") :]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    mean_ppl, method = r.stdout.split()
    assert float(mean_ppl) > 1 and method == "prelort"
    assert (tmp_path / "runs" / "from-python" / "adapter" / "adapter_config.json").is_file()
