"""Tables that fit the terminal without cutting the names they exist to show.

rich shrinks a table that is too wide by wrapping or cutting its cells
(``zero2…``). Here each column is exactly as wide as its widest line, so that a
name is never cut; a table that does not fit first breaks its longest headers
at spaces, then leaves out its optional columns (each table names what it
left out; ``--json`` has everything), and a column marked ``wrap`` takes what
the others leave, its cells broken at spaces and ``-``/``_``/``/``/``.``/``,``
(never inside a number: ``3.2``, ``1,024`` and ``-0.5`` stay whole).

It imports nothing but rich, so that both :mod:`llmem_plugin.summary` (below
the CLI) and :mod:`llmem_plugin.cli.report` can use it without an import circle.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Sequence

from rich.cells import cell_len, chop_cells
from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["Column", "fit_columns", "fitted_table", "print_fitted", "table_width"]

# A rich Table in its default style spends 3 cells per column and 1 more: one cell of padding either side
# (rich/table.py, Table.__init__: padding=(0, 1), pad_edge=True) and the borders, one between each two
# columns and one at either edge (Table._extra_width with box=HEAVY_HEAD, show_edge=True).
_PER_COLUMN = 3
_EDGE = 1
# The options that change those cells; fitted_table refuses them.
_LAYOUT_OPTIONS = frozenset({"box", "padding", "pad_edge", "show_edge", "collapse_padding", "expand", "width",
                             "min_width"})
# A wrapping column keeps at least this many cells per line (or its longest header word, if longer).
# A choice, not a measurement: 12 cells hold on one line every figure the tables print ("-1,234.56 /"
# is 11), so a wrapped figure is never split across lines.
_MIN_WRAP = 12
# Break after a space, "/" or "_"; after "-", "." or "," only where no digit follows, so that a number
# ("3.2", "1,024", "-0.5", "+1.30%") is never split.
_BREAK_AFTER = re.compile(r"(?<=[\s/_])|(?<=[-.,])(?!\d)")
_BREAK_AT_SPACES = re.compile(r"(?<=\s)")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Column:
    """One column of a fitted table.

    Attributes:
        header: The header; at narrow widths it may be broken at its spaces.
        cells: The rows' texts, top to bottom; a newline starts a second line.
        justify: ``"left"`` or ``"right"``.
        drop: 0 for a column always shown; otherwise the column is left out
            when the table does not fit, the highest ``drop`` first (a column
            whose cells are all empty before any other).
        wrap: Whether the column takes the width the others leave and breaks
            its cells to it, instead of being as wide as its widest cell.
        style: The rich style of its cells.
    """

    header: str
    cells: Sequence[str]
    justify: str = "left"
    drop: int = 0
    wrap: bool = False
    style: str | None = None

    @property
    def empty(self) -> bool:
        """Whether every cell is empty."""
        return not any(self.cells)

    def width(self, *, header_broken: bool = False) -> int:
        """Cells the widest line takes: of the cells, and of the header whole or (``header_broken``) its
        longest word. At least 1: rich gives an empty column one cell (``Table._calculate_column_widths``:
        ``_range.maximum or 1``)."""
        head = self.header.split() if header_broken else self.header.split("\n")
        return max([cell_len(line) for text in self.cells for line in text.split("\n")]
                   + [cell_len(word) for word in head] + [1])

    def narrowest(self, *, header_broken: bool = False) -> int:
        """The fewest cells the column can take: its widest line; for a wrapping column, its widest cell line
        up to ``_MIN_WRAP``, or its longest header word if longer (its header is broken at spaces only)."""
        if not self.wrap:
            return self.width(header_broken=header_broken)
        widest_cell = max([cell_len(line) for text in self.cells for line in text.split("\n")] + [1])
        longest_word = max([cell_len(word) for word in self.header.split()] + [1])
        return max(min(widest_cell, _MIN_WRAP), longest_word)


def table_width(widths: Sequence[int]) -> int:
    """Cells a table whose columns hold ``widths`` cells takes, borders and padding included."""
    return sum(widths) + _PER_COLUMN * len(widths) + _EDGE


def _need(columns: Sequence[Column], broken: Collection[int], *, full: bool = False) -> int:
    """The width of the table with the headers whose ``id`` is in ``broken`` broken: its wrapping columns at
    their narrowest (``full``: at their widest line), the rest at their widest line."""
    return table_width([c.width() if c.wrap and full else c.narrowest(header_broken=id(c) in broken)
                        for c in columns])


def fit_columns(columns: Sequence[Column], width: int) -> tuple[list[Column], list[Column], set[int]]:
    """Which columns a table ``width`` cells wide shows.

    Headers are broken at their spaces first, the one that saves most first,
    while the table is wider than ``width`` with its wrapping columns
    unbroken (so that a wrapping column gets the room a broken header
    frees); then, while the table is wider than ``width`` with its wrapping
    columns at their narrowest, the optional columns are left out (empty
    ones, then the highest ``drop``, the rightmost of equals); then any
    header whose break is no longer needed is joined again. A table whose
    kept columns do not fit even so is returned as narrow as it gets (rich
    then cuts it).

    Returns:
        (the columns shown, the columns left out, the ``id`` of each column whose header is broken).
    """
    shown, left_out, broken = list(columns), [], set()
    while (need := _need(shown, broken, full=True)) > width:
        saving = [(need - _need(shown, broken | {id(c)}, full=True), i)
                  for i, c in enumerate(shown) if id(c) not in broken]
        best = max(saving, default=(0, 0), key=lambda s: (s[0], -s[1]))
        if best[0] <= 0:
            break
        broken.add(id(shown[best[1]]))
    while _need(shown, broken) > width:
        optional = [(c.empty, c.drop, i) for i, c in enumerate(shown) if c.drop]
        if not optional:
            break  # every column is needed: the table is as narrow as it gets
        left_out.append(shown.pop(max(optional)[2]))
    for c in reversed([c for c in shown if id(c) in broken]):
        if _need(shown, broken - {id(c)}, full=True) <= width:
            broken.discard(id(c))
    return shown, left_out, broken


def _break(text: str, width: int, pattern: re.Pattern = _BREAK_AFTER) -> str:
    """``text`` broken into lines of at most ``width`` cells after the characters ``pattern`` splits at
    (a piece longer than ``width`` is cut into ``width``-cell pieces)."""
    lines = []
    for line in text.split("\n"):
        current = ""
        for piece in pattern.split(line):
            if cell_len(current + piece.rstrip()) > width:  # the line is full (a trailing space may overhang)
                if current.strip():
                    lines.append(current.rstrip())
                current = ""
            word = piece.rstrip()
            if cell_len(word) > width:  # a piece wider than the column: cut, keeping its trailing space
                *whole, last = chop_cells(word, width)
                lines.extend(whole)
                piece = last + piece[len(word):]
            current += piece
        lines.append(current.rstrip())
    return "\n".join(lines)


def _wrap_widths(wrapping: Sequence[Column], room: int) -> dict[int, int]:
    """The width of each wrapping column: each at its narrowest, then ``room``'s rest given a cell at a time
    to the narrowest column whose cells are not yet on one line each, then to those whose header is not."""
    widths = {id(c): c.narrowest() for c in wrapping}
    left = room - sum(widths.values())
    for target in (lambda c: Column(header="", cells=c.cells).width(), lambda c: c.width()):
        while left > 0:
            growing = [c for c in wrapping if widths[id(c)] < target(c)]
            if not growing:
                break
            widths[id(min(growing, key=lambda c: widths[id(c)]))] += 1
            left -= 1
    return widths


def fitted_table(columns: Sequence[Column], width: int, *, row_styles: Sequence[str | None] | None = None,
                 sections: Collection[int] = (), **table_options) -> tuple[Table, list[str]]:
    """A rich Table of ``columns`` that fits ``width`` cells without cutting any cell of a column that does
    not wrap.

    Args:
        columns: The columns, left to right (every one with the same number of cells).
        width: The console's width.
        row_styles: A rich style per row (None: unstyled).
        sections: The rows that start a new section (a rule above them, as ``Table.add_section``).
        **table_options: Passed to :class:`rich.table.Table` (``title``, ``title_justify``...); not those
            that change its borders or padding, which the widths assume.

    Returns:
        (the table, the headers of the columns left out, each on one line, left to right).
    """
    num_rows = len(columns[0].cells) if columns else 0
    assert all(len(c.cells) == num_rows for c in columns), "every column holds one cell per row"
    assert row_styles is None or len(row_styles) == num_rows, "one style per row"
    assert not _LAYOUT_OPTIONS & table_options.keys(), f"the widths assume rich's default {sorted(_LAYOUT_OPTIONS)}"
    shown, left_out, broken = fit_columns(columns, width)
    fixed = [c.width(header_broken=id(c) in broken) for c in shown if not c.wrap]
    wrapping = [c for c in shown if c.wrap]
    room = width - table_width(fixed) - _PER_COLUMN * len(wrapping)
    wrap_width = _wrap_widths(wrapping, room)
    table = Table(**table_options)
    for c in shown:
        w = wrap_width[id(c)] if c.wrap else c.width(header_broken=id(c) in broken)
        header = _break(c.header, w, _BREAK_AT_SPACES) if id(c) in broken or c.wrap else c.header
        table.add_column(Text(header), justify=c.justify, style=c.style, no_wrap=True, min_width=w, max_width=w)
    for i in range(num_rows):
        if i in sections:
            table.add_section()
        cells = [Text(_break(c.cells[i], wrap_width[id(c)]) if c.wrap else c.cells[i]) for c in shown]
        table.add_row(*cells, style=None if row_styles is None else row_styles[i])
    return table, [" ".join(c.header.split()) for c in columns if c in left_out]


def print_fitted(console: Console, columns: Sequence[Column], **options) -> None:
    """Print :func:`fitted_table` at the console's width and, under it, one line naming the columns it left
    out.

    Args:
        console: Where to print; its ``width`` is the table's.
        columns: The columns, left to right.
        **options: :func:`fitted_table`'s keyword arguments.
    """
    table, left_out = fitted_table(columns, console.width, **options)
    console.print(table)
    if left_out:
        console.print(Text(f"left out at {console.width} columns: {', '.join(left_out)} (--json has them all)",
                           style="dim"))
