"""Markdown tables: the one writer of every table nestfed's reports and bench/'s scripts print.

A table is a head row, a rule of one ``---|`` per head cell, then the rows, each cell written as
``str(cell)`` between ``| `` and `` |`` (no escaping, no padding: the cells are the caller's text);
`BLANK` is written ``| |``, where an empty string gives ``|  |``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class Blank:
    """The class of `BLANK`, a cell written with one space, ``| |``."""

    def __repr__(self) -> str:
        return "BLANK"


#: a blank cell, ``| |`` (an empty string is written ``|  |``)
BLANK = Blank()


def markdown_row(cells: Iterable[object]) -> str:
    """Write one table row.

    Args:
        cells: the row's cells, each written as ``str(cell)``; `BLANK` as one space.

    Returns:
        ``"| a | b |"`` (no newline); ``"|"`` for no cells.
    """
    return "|" + "".join(" |" if c is BLANK else f" {c} |" for c in cells)


def markdown_table(head: Sequence[object], rows: Iterable[Iterable[object]] = ()) -> list[str]:
    """Write a table's lines.

    Args:
        head: the head row's cells (their count sets the rule's).
        rows: the body's rows (`markdown_row`); none gives the head and rule alone, for a
            caller that appends its rows with `markdown_row`.

    Returns:
        The lines without newlines: the head row, ``"|---|---|"`` (one ``---|`` per head cell),
        then one line per row.
    """
    return [markdown_row(head), "|" + "---|" * len(head), *(markdown_row(r) for r in rows)]
