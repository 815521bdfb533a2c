"""What every view shares: the ``View`` that carries text and HTML, escaping, and aligned tables.

Every function here takes plain data and returns strings; nothing is displayed or imported
from IPython. Everything that comes from the user (source lines, error messages, names) is
HTML-escaped by the caller through :func:`esc` (``display.escape``) or by the table helpers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from ..core.units import format_bytes
from .escape import esc  # every view's HTML escaping, kept importable from here

__all__ = ["View", "esc", "format_of", "delta_class", "text_table", "html_table", "wrap_html", "CELL_CSS"]

# Every style is inline, on the element it styles: an untrusted notebook (a copy someone sent,
# one opened fresh from disk) drops <style> elements and keeps style attributes, filtered by
# JupyterLab's sanitizer, which keeps a declaration only when its value is in CSS's own grammar
# (keywords, lengths, #hex colours). So each value here is plain; where a better value is not
# in that grammar (a var()) it follows a plain one for the same property, which is what an untrusted
# copy keeps.
#: The container: monospace at a code cell's size, and a scroll bar rather than a cut edge for a
#: table wider than the output area.
_BOX = ("font-family:monospace;font-family:var(--jp-code-font-family,monospace);font-size:12px;line-height:1.4;"
        "max-width:100%;overflow-x:auto")
_TABLE = "border-collapse:collapse;margin:2px 0;font-size:12px"  # the frontend styles tables too: ours wins inline
_PAD = "padding:1px 5px"
#: Headers wrap at their spaces ("host peak / in line"), so no header makes its column wide.
_HEAD = f"{_PAD};vertical-align:bottom;border-bottom:1px solid #999999;font-weight:600;white-space:normal"
#: Numbers stay whole and right-aligned; words and source wrap at their spaces when the table would not
#: fit, never inside a word or an identifier (``overflow-wrap:anywhere`` let a narrow output squeeze a column
#: to "backwar|d" and "set_t|o_none"): a table that cannot fit scrolls in its box (``_BOX``).
_NUMBER = f"{_PAD};vertical-align:top;text-align:right;white-space:nowrap"
_WORDS = f"{_PAD};vertical-align:top;text-align:left;white-space:normal;overflow-wrap:break-word"
_SOURCE = f"{_PAD};vertical-align:top;text-align:left;white-space:pre-wrap;overflow-wrap:break-word"
#: A cell's style name (``classes[r][c]``) as its colour: a growth red and a "fits" green that read on white
#: (4.6:1 and more) and, through the front end's own theme colours where it has them (JupyterLab's and
#: Notebook 7's error and success colours), on a dark theme too (4.6:1 and more against #111, where the plain
#: green read 4.1:1); the plain value first, for an untrusted copy.
CELL_CSS = {"up": "color:#c0392b;color:var(--jp-error-color1,#c0392b)",
            "down": "color:#27864a;color:var(--jp-success-color0,#27864a)", "dim": "color:#888888",
            "err": "color:#c0392b;color:var(--jp-error-color1,#c0392b);font-weight:600"}


@dataclass(frozen=True)
class View:
    """One rendering in two MIME types, and the data it shows: what magics return and hooks display.

    ``data`` is the object the view was drawn from (a ``WhoReport``, a list of ``DeviceMemory``,
    a ``CellRecord``...), so code and tests read numbers from it instead of scraping the text.
    """

    text: str
    html: str
    data: object = field(default=None, compare=False, repr=False)

    def __repr__(self) -> str:
        return self.text

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(self.text)  # terminal IPython and every front end without HTML

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        bundle = {"text/plain": self.text, "text/html": self.html}
        wanted = set(include or bundle) - set(exclude or ())
        return {mime: body for mime, body in bundle.items() if mime in wanted}


def format_of(part: Optional[int], whole: Optional[int]) -> str:
    """``9.53 / 15.78 GiB`` (one unit when both share it), or just the part without a whole."""
    if not whole:
        return format_bytes(part)
    a, b = format_bytes(part), format_bytes(whole)
    unit_a, unit_b = a.rsplit(" ", 1)[-1], b.rsplit(" ", 1)[-1]
    if unit_a == unit_b and unit_a != "bytes":
        return f"{a.rsplit(' ', 1)[0]} / {b}"
    return f"{a} / {b}"


def delta_class(delta: Optional[int]) -> str:
    if not delta:
        return "dim"
    return "up" if delta > 0 else "down"


def text_table(headers: Sequence[str], rows: Iterable[Sequence[str]], left: Sequence[int] = (0,)) -> str:
    """Aligned plain-text table; columns listed in ``left`` are left-aligned, others right."""
    rows = [list(map(str, r)) for r in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row[: len(widths)]):
            widths[i] = max(widths[i], len(cell))

    def fmt(cells):
        out = []
        for i, cell in enumerate(cells):
            if i == len(cells) - 1 and i in left:
                out.append(cell)  # no trailing padding on a left-aligned last column
            else:
                out.append(cell.ljust(widths[i]) if i in left else cell.rjust(widths[i]))
        return "  ".join(out).rstrip()

    lines = [fmt(list(headers)), "  ".join("-" * w for w in widths)]
    lines.extend(fmt(r) for r in rows)
    return "\n".join(lines)


def _html_order(count: int, src_col: Optional[int]) -> list:
    """Column order in HTML: the source right after the first column (the line or the cell), the
    column a reader looks at first, where a narrow output area cannot push it out of sight."""
    order = list(range(count))
    if src_col is not None and 1 < src_col < count:
        order.remove(src_col)
        order.insert(1, src_col)
    return order


#: A table with a source column and at least this many other columns (besides its first) stacks each
#: row (:func:`_stacked_table`): six numbers leave a 716 px output too little room for the source.
STACK_FROM = 6
#: A word column whose longest value is longer than this goes under its row, full width.
LONG_WORDS = 24
#: Text across a stacked table wraps within this width (an output area is 596 px wide in a 1280 px window with
#: JupyterLab's sidebar open, less the line column), so it stays in sight when a wide table scrolls sideways.
ACROSS_PX = 530
#: The first row of a stacked row: a light rule above it keeps its rows together as one.
_GROUP = "border-top:1px solid rgba(128,128,128,0.3)"


def _stacked_table(headers, rows, left, classes, src_col) -> str:
    """A wide table with source code, three rows per row: the first column and the source across
    the whole width (the line a reader looks for first, never squeezed to a word a line), then the
    numbers and short words under it, then each long word column ("by role") across the width."""
    rows = [list(map(str, row)) for row in rows]
    rest = [c for c in range(len(headers)) if c not in (0, src_col)]
    long_words = [c for c in rest if c in left and max((len(r[c]) for r in rows if c < len(r)), default=0) > LONG_WORDS]
    under = [c for c in rest if c not in long_words]
    span = max(len(under), 1)

    def cell(r: int, c: int, style: str, value: str, extra: str = "") -> str:
        names = classes[r] if classes is not None and r < len(classes) else ()
        name = names[c] if c < len(names) else ""
        colour = f";{CELL_CSS.get(name, '')}" if name else ""
        cls = f' class="{esc(name)}"' if name else ""
        text = esc(value)
        if extra:  # across the width: wrapped within the output area even when the numbers scroll
            text = f'<div style="max-width:{ACROSS_PX}px">{text}</div>'
        return f"<td{extra}{cls} style=\"{style}{colour}\">{text}</td>"

    head = (f'<tr><th style="{_HEAD};text-align:left">{esc(headers[0])}</th>'
            f'<th colspan="{span}" style="{_HEAD};text-align:left">{esc(headers[src_col])}</th></tr>'
            f'<tr><th style="{_HEAD};text-align:left"></th>' + "".join(
                f'<th style="{_HEAD};text-align:{"left" if c in left else "right"}">{esc(headers[c])}</th>'
                for c in under) + "</tr>")
    body = []
    for r, row in enumerate(rows):
        row += [""] * (len(headers) - len(row))
        body.append("<tr>" + cell(r, 0, f"{_WORDS};{_GROUP}", row[0])
                    + cell(r, src_col, f"{_SOURCE};{_GROUP}", row[src_col], f' colspan="{span}"') + "</tr>")
        body.append(f'<tr><td style="{_WORDS}"></td>' + "".join(
            cell(r, c, _WORDS if c in left else _NUMBER, row[c]) for c in under) + "</tr>")
        for c in long_words:
            if row[c].strip():
                body.append(f'<tr><td style="{_WORDS}"></td>' + cell(r, c, _WORDS, f"{headers[c]}: {row[c]}",
                                                                    f' colspan="{span}"') + "</tr>")
    return f'<table style="{_TABLE}"><thead>{head}</thead><tbody>{"".join(body)}</tbody></table>'


def html_table(headers: Sequence[str], rows: Iterable[Sequence[object]], left: Sequence[int] = (0,),
               classes: Optional[Sequence[Sequence[str]]] = None, src_col: Optional[int] = None) -> str:
    """An HTML table; every cell is escaped and carries its own inline style (see ``_BOX``):
    ``left`` columns are words (left-aligned, wrapping), the others numbers (right-aligned, whole),
    ``src_col`` source (its whitespace kept, placed after the first column), and ``classes[r][c]``
    a cell's colour (:data:`CELL_CSS`). A table with source and :data:`STACK_FROM` other columns
    gives each row the whole width for its source (:func:`_stacked_table`)."""
    if src_col is not None and 0 < src_col < len(headers) and len(headers) - 2 >= STACK_FROM:
        return _stacked_table(headers, rows, left, classes, src_col)
    order = _html_order(len(headers), src_col)

    def style(c: int) -> str:
        return _SOURCE if c == src_col else _WORDS if c in left else _NUMBER

    head = "".join(f'<th style="{_HEAD};text-align:{"left" if c in left else "right"}">{esc(headers[c])}</th>'
                   for c in order)
    body = []
    for r, row in enumerate(rows):
        row = list(row)
        names = classes[r] if classes is not None and r < len(classes) else ()
        cells = []
        for c in order:
            if c >= len(row):
                continue
            name = names[c] if c < len(names) else ""
            # the class names the meaning (up, down, dim, err); the inline colour shows it
            named = f' class="{esc(name)}" style="{style(c)};{CELL_CSS.get(name, "")}"' if name else f' style="{style(c)}"'
            cells.append(f"<td{named}>{esc(row[c])}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<table style="{_TABLE}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def wrap_html(inner: str) -> str:
    """The container every view's HTML sits in: its styles inline, no ``<style>`` element."""
    return f'<div class="ipy-gpumem" style="{_BOX}">{inner}</div>'
