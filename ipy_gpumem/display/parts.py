"""One list of parts, two renderings: aligned text for terminals and HTML for notebooks, from the same data.

A view builds each of its sections once, as a list of parts, and :func:`render` turns the list
into a :class:`~ipy_gpumem.display.view.View` (Rich's idea: one segment list, two renderers). Each
part type renders itself to text and to HTML side by side, so the two renderings cannot drift
apart: a number shown in one is shown in the other. Everything that came from the user is
escaped here, once.

Example:
    >>> view = render([Heading("Who holds it"), Line(Span("+1.00 GiB", "up"), Span(" allocated"))])
    >>> print(view.text)
    Who holds it
    +1.00 GiB allocated
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple, Union

from .view import CELL_CSS, View, esc, html_table, text_table, wrap_html

__all__ = ["Span", "Line", "Para", "Heading", "Table", "Details", "Code", "Numbered", "Raw", "Blank", "Block",
           "render", "TEXT_WIDTH"]

#: Text paragraphs wrap at this width (a terminal shows the panel without horizontal scrolling).
TEXT_WIDTH = 100
#: Inline styles per span style; colours are mid-tones that read on light and dark themes.
_SPAN_CSS = {
    "": "", "dim": "opacity:0.75", "up": CELL_CSS["up"], "down": CELL_CSS["down"], "err": CELL_CSS["err"],
    "bold": "font-weight:700", "code": "font-family:monospace;font-family:var(--jp-code-font-family,monospace)",
}


def _span_html(text: str, style: str) -> str:
    css = _SPAN_CSS.get(style, style)
    return f'<span style="{css}">{esc(text)}</span>' if css else esc(text)


@dataclass(frozen=True)
class Span:
    """A run of text with one style: ``""``, ``"dim"``, ``"up"``, ``"down"``, ``"err"``, ``"bold"``, ``"code"``."""

    text: str
    style: str = ""


@dataclass(frozen=True, init=False)
class Line:
    """One line made of styled spans (strings are plain spans)."""

    spans: Tuple[Span, ...]

    def __init__(self, *spans: Union[Span, str]):
        object.__setattr__(self, "spans", tuple(s if isinstance(s, Span) else Span(str(s)) for s in spans))

    def text(self, width: int = TEXT_WIDTH) -> str:
        return "".join(s.text for s in self.spans)

    def html(self) -> str:
        return "<div>" + "".join(_span_html(s.text, s.style) for s in self.spans) + "</div>"


@dataclass(frozen=True)
class Para:
    """A paragraph, wrapped to the text width in terminals (at spaces only: code stays whole)."""

    content: str
    style: str = ""
    indent: str = ""
    hanging: Optional[str] = None  # the indent of the following lines; ``indent`` when None

    def text(self, width: int = TEXT_WIDTH) -> str:
        rest = self.indent if self.hanging is None else self.hanging
        lines = textwrap.wrap(self.content, width, initial_indent=self.indent, subsequent_indent=rest,
                              break_on_hyphens=False, break_long_words=False)
        return "\n".join(lines) if lines else self.indent.rstrip()

    def html(self) -> str:
        css = _SPAN_CSS.get(self.style, self.style)
        style = f' style="white-space:normal;{css}"'
        return f"<div{style}>{esc(self.content)}</div>"


@dataclass(frozen=True)
class Heading:
    """A section title."""

    content: str

    def text(self, width: int = TEXT_WIDTH) -> str:
        return self.content

    def html(self) -> str:
        return f'<div style="font-weight:700;margin-top:6px">{esc(self.content)}</div>'


@dataclass(frozen=True)
class Table:
    """An aligned table; ``left`` are the left-aligned columns, ``classes[r][c]`` style single cells
    (``up``/``down``/``dim``/``err``), ``src_col`` keeps source code's whitespace."""

    headers: Sequence[str]
    rows: Sequence[Sequence[str]]
    left: Sequence[int] = (0,)
    classes: Optional[Sequence[Sequence[str]]] = None
    src_col: Optional[int] = None
    indent: str = ""

    def text(self, width: int = TEXT_WIDTH) -> str:
        block = text_table(self.headers, self.rows, left=self.left)
        return "\n".join(self.indent + line for line in block.splitlines())

    def html(self) -> str:
        return html_table(self.headers, self.rows, left=self.left, classes=self.classes, src_col=self.src_col)


@dataclass(frozen=True)
class Code:
    """Code the user can copy: indented in text, a ``<pre>`` block in HTML."""

    content: str
    indent: str = "    "

    def text(self, width: int = TEXT_WIDTH) -> str:
        return "\n".join(self.indent + line for line in self.content.splitlines())

    def html(self) -> str:
        return ('<pre style="margin:3px 0;padding:4px 6px;background:rgba(128,128,128,0.12);'
                'border:1px solid rgba(128,128,128,0.55);border-radius:3px;white-space:pre;overflow-x:auto;'
                f'color:inherit">{esc(self.content)}</pre>')


@dataclass(frozen=True)
class Details:
    """A section that notebooks show collapsed under its summary line; terminals show it whole."""

    summary: str
    body: Sequence = field(default_factory=tuple)
    open: bool = False
    title: Optional[str] = None  # the text heading; the summary when None

    def text(self, width: int = TEXT_WIDTH) -> str:
        lines = [self.title if self.title is not None else self.summary]
        lines.extend(part.text(width) for part in self.body)
        return "\n".join(line for line in lines if line != "")

    def html(self) -> str:
        body = "".join(part.html() for part in self.body)
        return (f'<details style="margin:2px 0"{" open" if self.open else ""}><summary style="cursor:pointer">'
                f'{esc(self.summary)}</summary><div style="margin:2px 0 4px 14px">{body}</div></details>')


@dataclass(frozen=True)
class Numbered:
    """A numbered list; each item is a sequence of parts (its first part is the item's title)."""

    items: Sequence[Sequence]
    indent: str = "   "

    def text(self, width: int = TEXT_WIDTH) -> str:
        out = []
        for n, item in enumerate(self.items, 1):
            for k, part in enumerate(item):
                rendered = part.text(width - len(self.indent))
                if k == 0:
                    out.append(f"{n}. {rendered}")
                else:
                    out.extend(self.indent + line if line else line for line in rendered.splitlines())
        return "\n".join(out)

    def html(self) -> str:
        items = "".join('<li style="margin:4px 0">' + "".join(p.html() for p in item) + "</li>" for item in self.items)
        return f'<ol style="margin:2px 0;padding-left:22px">{items}</ol>'


@dataclass(frozen=True)
class Raw:
    """Text and HTML given as they are (a bar, an inline SVG); the HTML must already be safe."""

    text_form: str
    html_form: str

    def text(self, width: int = TEXT_WIDTH) -> str:
        return self.text_form

    def html(self) -> str:
        return self.html_form


@dataclass(frozen=True)
class Blank:
    """An empty line between text sections (HTML spaces its blocks by itself)."""

    def text(self, width: int = TEXT_WIDTH) -> str:
        return ""

    def html(self) -> str:
        return ""


@dataclass(frozen=True)
class Block:
    """Parts kept together: separated by ``gap`` in text, inside one styled ``<div>`` in HTML."""

    parts: Sequence
    style: str = ""
    gap: str = "\n"

    def text(self, width: int = TEXT_WIDTH) -> str:
        # Parts with no text (HTML-only pieces such as an inline chart) leave no empty line.
        return self.gap.join(t for p in self.parts for t in (p.text(width),) if t != "" or isinstance(p, Blank))

    def html(self) -> str:
        inner = "".join(p.html() for p in self.parts)
        return f'<div style="{self.style}">{inner}</div>' if self.style else inner


def render(parts: Sequence, gap: str = "\n", style: str = "", width: int = TEXT_WIDTH, data=None) -> View:
    """Both renderings of ``parts``: text sections joined by ``gap``, HTML inside one styled container.

    ``data`` is what the view shows, kept on the ``View`` so callers and tests read numbers, not text.
    """
    block = Block(tuple(p for p in parts if p is not None), style=style, gap=gap)
    return View(block.text(width), wrap_html(block.html()), data)
