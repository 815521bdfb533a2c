"""What every view shares: the ``View`` that carries text and HTML, escaping, and aligned tables.

Every function here takes plain data and returns strings; nothing is displayed or imported
from IPython. Everything that comes from the user (source lines, error messages, names) is
HTML-escaped by the caller through :func:`esc` or by the table helpers.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from ..core.units import format_bytes

__all__ = ["View", "esc", "format_of", "delta_class", "text_table", "html_table", "wrap_html"]

_CSS = (
    "<style>"
    ".ipy-gpumem{font-family:var(--jp-code-font-family,monospace);font-size:12px;line-height:1.4}"
    ".ipy-gpumem table{border-collapse:collapse;margin:2px 0}"
    ".ipy-gpumem th,.ipy-gpumem td{padding:1px 8px;text-align:right;white-space:nowrap}"
    ".ipy-gpumem th{border-bottom:1px solid #999;font-weight:600}"
    ".ipy-gpumem td.l,.ipy-gpumem th.l{text-align:left}"
    ".ipy-gpumem td.src{text-align:left;white-space:pre}"
    ".ipy-gpumem .up{color:#c0392b}.ipy-gpumem .down{color:#27864a}.ipy-gpumem .dim{color:#888}"
    ".ipy-gpumem .err{color:#c0392b;font-weight:600}"
    "</style>"
)



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


def esc(value) -> str:
    """``value`` as text, escaped for HTML (quotes included, for attributes)."""
    return html.escape(str(value), quote=True)


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


def html_table(headers: Sequence[str], rows: Iterable[Sequence[object]], left: Sequence[int] = (0,),
               classes: Optional[Sequence[Sequence[str]]] = None, src_col: Optional[int] = None) -> str:
    """An HTML table; every cell is escaped. ``classes[r][c]`` adds a CSS class to a cell."""
    head = "".join(f'<th class="{"l" if i in left else ""}">{esc(h)}</th>' for i, h in enumerate(headers))
    body = []
    for r, row in enumerate(rows):
        cells = []
        for c, cell in enumerate(row):
            names = []
            if c in left:
                names.append("l")
            if c == src_col:
                names.append("src")
            if classes is not None and r < len(classes) and c < len(classes[r]) and classes[r][c]:
                names.append(classes[r][c])
            cells.append(f'<td class="{" ".join(names)}">{esc(cell)}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def wrap_html(inner: str) -> str:
    return f'{_CSS}<div class="ipy-gpumem">{inner}</div>'
