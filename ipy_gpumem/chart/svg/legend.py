"""The legend row of a picture, drawn from the layout's legend entries, and the peak mark's glyph.

An entry is a line (solid, dashed or dotted), a cell's exact peak (:func:`peak_mark_path`, the same
glyph as over the cells), a role's box (filled, or outlined for released memory), or words alone.
"""
from __future__ import annotations

from typing import Sequence

from ...display.escape import xml_text
from ..session import PEAK_KIND
from .base import dash_attr, num, paint, text_width

__all__ = ["peak_mark_path", "legend_row", "legend_rows"]


def peak_mark_path(x0: float, x1: float, y: float) -> str:
    """Path data of a peak mark from ``x0`` to ``x1`` at height ``y``: a bar with end ticks (├─┤)."""
    return f"M{x0:.1f},{y - 3:.1f}v6M{x0:.1f},{y:.1f}H{x1:.1f}M{x1:.1f},{y - 3:.1f}v6"


def _swatch(color, kind: str) -> int:
    return 0 if color is None else 20


def legend_row(items: Sequence, x: float, y: float, right: float, note: str = "") -> str:
    """The legend row: ``(label, colour, kind)`` items from the left (a colour of None writes the label
    alone), and ``note`` right-aligned at its end (e.g. an off-scale capacity). A row that would overflow
    the chart is cut, never wrapped over the plot."""
    out = []
    if note:
        out.append(f'<text x="{num(right - 4)}" y="{num(y)}" text-anchor="end" fill="currentColor" '
                   f'fill-opacity="0.6">{xml_text(note)}</text>')
        right -= text_width(note) + 14
    for label, color, kind in items:
        width = _swatch(color, kind) + 2 + text_width(label)
        if x + width > right:
            break
        stroke = paint(color)
        if kind in ("box", "box-out"):  # a role: a filled swatch (outlined for released memory)
            style = (f'fill="{stroke}" fill-opacity="0.85"' if kind == "box" else
                     f'fill="{stroke}" fill-opacity="0.3" stroke="{stroke}" stroke-dasharray="3 2"')
            out.append(f'<rect x="{num(x + 1)}" y="{num(y - 8)}" width="14" height="8" {style}/>')
        elif kind == PEAK_KIND and color is not None:
            out.append(f'<path d="{peak_mark_path(x + 1, x + 15, y - 3.5)}" stroke="{stroke}" stroke-width="2" '
                       'fill="none"/>')
        elif color is not None:
            out.append(f'<line x1="{num(x)}" y1="{num(y - 3.5)}" x2="{num(x + 16)}" y2="{num(y - 3.5)}" '
                       f'stroke="{stroke}" stroke-width="2"{dash_attr(kind)}/>')
        out.append(f'<text x="{num(x + _swatch(color, kind))}" y="{num(y)}" fill="currentColor">{xml_text(label)}</text>')
        x += width + 10
    return "".join(out)


def legend_rows(items: Sequence, x: float, right: float, max_rows: int = 3) -> list:
    """``items`` wrapped into legend rows from ``x`` to ``right`` (the widths :func:`legend_row` uses)."""
    rows, row, used = [], [], 0.0
    for item in items:
        width = _swatch(item[1], item[2]) + 2 + text_width(item[0]) + 10
        if row and x + used + width - 10 > right:
            rows.append(row)
            row, used = [], 0.0
        row.append(item)
        used += width
    if row:
        rows.append(row)
    return rows[:max_rows]
