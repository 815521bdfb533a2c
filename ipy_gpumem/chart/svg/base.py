"""What every SVG picture shares: sizes, numbers and text in SVG, the ``<svg>`` element, the empty chart, colours as SVG paints.

Text and axes use ``currentColor`` and fills are semi-transparent, so the charts read in light and
dark themes; a chart meant for an ``<img>`` (where nothing is inherited) sets that colour to a mid
grey that reads on both (``ink=IMG_INK``). Every piece of text goes through ``display.escape.xml_text``,
which escapes it and drops what XML 1.0 forbids. The colours themselves are the layout's
(``chart.style``).
"""
from __future__ import annotations

from typing import Optional

from ...display.escape import xml_text
from ..style import INK

__all__ = ["FONT", "CHAR_W", "MIN_WIDTH", "MIN_HEIGHT", "DASH_ARRAYS", "num", "text_width", "svg_open", "empty_svg",
           "paint", "dash_attr"]

FONT = "-apple-system,BlinkMacSystemFont,'Segoe UI',Helvetica,Arial,sans-serif"
CHAR_W = 5.6  # average glyph width at font-size 10, for layout estimates
#: Smaller charts are drawn at this size: axis labels alone need about 70 x 60 pixels.
MIN_WIDTH, MIN_HEIGHT = 240, 120
#: A line kind (``chart.style.LINE_KINDS``) as an SVG dash pattern.
DASH_ARRAYS = {"solid": "", "dash": "6 3", "dot": "1.5 2.5", "dashdot": "8 3 2 3"}


def num(value: float) -> str:
    """A coordinate with one decimal."""
    return f"{value:.1f}"


def text_width(text: str, size: float = 10) -> float:
    """The estimated width of ``text`` in pixels at font size ``size``."""
    return len(text) * CHAR_W * size / 10


def paint(colour: Optional[str]) -> str:
    """A layout colour as an SVG paint: the page's ink is ``currentColor``."""
    return "currentColor" if colour in (None, INK, "currentColor") else colour


def dash_attr(kind: str) -> str:
    """`` stroke-dasharray="..."`` for a line kind (nothing for a solid line)."""
    dash = DASH_ARRAYS.get(kind, kind if kind and kind[0].isdigit() else "")
    return f' stroke-dasharray="{dash}"' if dash else ""


def svg_open(width: int, height: int, label: str, ink: Optional[str] = None) -> str:
    """The ``<svg>`` element's opening tag, its ``currentColor`` set to ``ink`` (None inherits the page's)."""
    color = "inherit" if ink is None else ink
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{int(width)}" height="{int(height)}" '
        f'viewBox="0 0 {int(width)} {int(height)}" font-family="{FONT}" font-size="10" '
        f'role="img" aria-label="{xml_text(label)}" style="color:{color};overflow:visible">'
    )


def empty_svg(message: str = "no samples yet", width: int = 720, height: int = 40, ink: Optional[str] = None) -> str:
    """A small placeholder chart with a centred message."""
    height = max(int(height), 20)
    return (
        svg_open(width, height, message, ink)
        + f'<rect x="0.5" y="0.5" width="{int(width) - 1}" height="{height - 1}" rx="4" fill="none" '
        f'stroke="currentColor" stroke-opacity="0.25"/>'
        + f'<text x="{int(width) / 2:.1f}" y="{height / 2 + 3.5:.1f}" text-anchor="middle" '
        f'fill="currentColor" fill-opacity="0.6">{xml_text(message)}</text></svg>'
    )
