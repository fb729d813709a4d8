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
