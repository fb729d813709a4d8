"""The documentation site (mkdocs.yml, docs/) builds in strict mode: a broken link, a page missing
from the navigation or an API reference to something that does not exist fails CI. Without building,
every relative link and #anchor of docs/*.md is checked against the files and their headings."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

slugify = pytest.importorskip("markdown.extensions.toc", reason="the docs extra").slugify

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
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
    for section in ("Parameters", "Returns", "Raises"):  # Google-style sections rendered as tables
        assert f'<span class="doc-section-title">{section}:</span>' in reference, section


def test_the_readme_links_only_to_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(((?:docs|bench)/[^)#]+)", readme)
    assert targets and all((ROOT / t).exists() for t in targets), [t for t in targets if not (ROOT / t).exists()]
    assert len(readme.splitlines()) <= 250


@pytest.mark.slow
def test_a_link_to_a_missing_anchor_fails_the_build(tmp_path):
    """mkdocs.yml's validation makes a link to an anchor no page has fail the strict build."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "src").symlink_to(ROOT / "src")  # mkdocstrings' paths: [src], this checkout's, not the installed one
    with open(tmp_path / "docs" / "trust.md", "a") as f:
        f.write("\n[a section](results.md#no-such-section)\n")
    exe = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    env = {"PATH": str(Path(sys.executable).parent), "NO_MKDOCS_2_WARNING": "1", "HOME": str(tmp_path)}
    r = subprocess.run(
        [exe, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert r.returncode != 0 and "does not contain an anchor '#no-such-section'" in r.stdout + r.stderr


@pytest.mark.slow
def test_the_python_api_example_runs_as_the_page_writes_it(tmp_path):
    page = (ROOT / "docs" / "getting-started.md").read_text()
    section = page[page.index("## The Python API") :]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    mean_ppl, method = r.stdout.split()
    assert float(mean_ppl) > 1 and method == "prelort"
    assert (tmp_path / "runs" / "from-python" / "adapter" / "adapter_config.json").is_file()


FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def page_text(page: Path) -> str:
    """A page without its fenced code blocks and inline code (whose brackets are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text()))


def anchors(page: Path) -> set[str]:
    """The heading anchors MkDocs gives a page: Python-Markdown's toc slugs of the heading text
    (markup dropped), a repeated slug suffixed _1, _2, ...; on a page of ``::: module`` directives
    also ``module`` and what mkdocstrings renders under it (``module.name``, prefixes checked)."""
    text = FENCE.sub("", page.read_text())
    out: set[str] = set()
    seen: dict[str, int] = {}
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1)).replace("`", "").replace("*", "")
        slug = slugify(heading, "-")
        seen[slug] = seen.get(slug, -1) + 1
        out.add(slug if seen[slug] == 0 else f"{slug}_{seen[slug]}")
    out |= {m.group(1) for m in re.finditer(r"^::: ([\w.]+)", text, re.M)}
    return out


def broken_links(docs: Path) -> list[str]:
    """Every relative link and #anchor of ``docs/*.md`` that does not resolve inside ``docs``:
    ``page:target: why`` per broken one (links to http(s) and mailto are not followed)."""
    bad = []
    cache: dict[Path, set[str]] = {}
    for page in sorted(docs.glob("*.md")):
        for target in LINK.findall(page_text(page)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page.resolve()
            if not dest.is_relative_to(docs.resolve()):
                bad.append(f"{page.name}:{target}: outside docs/ (not part of the site)")
            elif not dest.exists():
                bad.append(f"{page.name}:{target}: no such file")
            elif anchor and dest.suffix == ".md":
                known = cache.setdefault(dest, anchors(dest))
                if anchor not in known and not any(anchor.startswith(k + ".") for k in known):
                    bad.append(f"{page.name}:{target}: no such anchor")
    return bad


def test_every_relative_link_and_anchor_of_the_docs_resolves():
    """Without building the site (seconds): every link of docs/*.md to a page, file or #anchor."""
    assert broken_links(ROOT / "docs") == []


def test_the_link_check_finds_a_missing_page_anchor_and_file(tmp_path):
    (tmp_path / "a.md").write_text(
        "# Title\n\n## Run `nestfed` (the CLI)\n\n## Run `nestfed` (the CLI)\n\n"
        "[ok](#run-nestfed-the-cli_1) [ok](b.md#b-page) ![ok](img.png) [ok](https://example.org/#x)\n"
        "[bad](#run-nestfed) [bad](b.md#nope) [bad](c.md) [bad](../outside.md)\n"
        "```bash\n[not a link](nowhere.md)\n```\n`[not a link](nowhere.md)`\n"
    )
    (tmp_path / "b.md").write_text("# B page\n")
    (tmp_path / "img.png").write_bytes(b"")
    assert broken_links(tmp_path) == [
        "a.md:#run-nestfed: no such anchor",
        "a.md:b.md#nope: no such anchor",
        "a.md:c.md: no such file",
        "a.md:../outside.md: outside docs/ (not part of the site)",
    ]
