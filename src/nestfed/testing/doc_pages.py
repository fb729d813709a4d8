"""The code blocks of a documentation page, so that tests run the commands and examples as the page
writes them (tests/flower/test_docs_simulation.py)."""

from __future__ import annotations

import re
from pathlib import Path

FENCED = re.compile(r"^```(\w*)\n(.*?)^```$", flags=re.S | re.M)


def section_blocks(page: Path, heading: str) -> dict[str, list[str]]:
    """Collect the fenced code blocks of one section of a Markdown page.

    The section runs from the heading line to the next heading of the same or a higher level.

    Args:
        page: the Markdown file.
        heading: the heading line, exactly as the page writes it (e.g. ``"## The Python API"``).

    Returns:
        ``{language: [code, ...]}`` in page order, each code without its fences.

    Raises:
        ValueError: naming the page, when the heading is not one of its lines.
    """
    lines = page.read_text().split("\n")
    if heading not in lines:
        raise ValueError(f"{page}: no heading line {heading!r}")
    level = len(heading) - len(heading.lstrip("#"))
    start = lines.index(heading) + 1
    end, fenced = len(lines), False
    for i in range(start, len(lines)):
        if lines[i].startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,%d} " % level, lines[i]):
            end = i
            break
    out: dict[str, list[str]] = {}
    for lang, code in FENCED.findall("\n".join(lines[start:end]) + "\n"):
        out.setdefault(lang, []).append(code)
    return out
