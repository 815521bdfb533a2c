"""Column charts as SVG pictures, drawn from their layout (``chart.columns``): a cell line by line, the history, an estimate.

A column floats from the level at its start to the level at its end (red where memory grew, green
where it shrank), with a dashed whisker up to a peak above both; ``end`` columns stand from the
floor with their value written over them, and a break mark at their foot when the axis is zoomed.
A cell's lines may be stacked by role. We know before, peak and after but not *when* the peak
happened, so no time axis is invented: the picture shows exactly what was measured (or predicted).
"""
from __future__ import annotations

import math
from typing import Optional

from ...core.units import format_bytes, format_delta
from ...display.escape import xml_text
from ..columns import ColumnsLayout
from ..scale import byte_labels
from ..style import DOWN_COLOR, FLAT_COLOR, PEAK_COLOR, UP_COLOR, role_color
from ..words import column_hover, segment_hover
from .axes import Frame, hline, y_axis
from .base import empty_svg, num, svg_open, text_width
from .legend import legend_row, legend_rows

__all__ = ["draw_columns", "TICKS_NOTE"]

#: The legend note when a waterfall's columns are too narrow for ``line 3``: its ticks are bare numbers.
TICKS_NOTE = "ticks: source lines"
_KIND_COLOURS = {"up": UP_COLOR, "down": DOWN_COLOR, "flat": FLAT_COLOR}


def _bar(x, w, v0, v1, frame, fill, opacity, hover, extra="") -> str:
    y0, y1 = frame.y(max(v0, v1)), frame.y(min(v0, v1))
    return (f'<g><title>{xml_text(hover)}</title><rect x="{num(x)}" y="{num(y0)}" width="{num(w)}" '
            f'height="{num(max(y1 - y0, 1.0))}" fill="{fill}" fill-opacity="{opacity}"/>{extra}</g>')


def _label(x: float, y: float, text: str, extra: str = "") -> str:
    return (f'<text x="{num(x)}" y="{num(y)}" text-anchor="middle" font-size="9" fill="currentColor"{extra}>'
            f'{xml_text(text)}</text>')


def _fits(text: str, width: float, size: float = 9) -> bool:
    return text_width(text, size) <= width


def _whisker(cx: float, w: float, y_from: float, y_top: float) -> str:
    return (f'<line x1="{num(cx)}" y1="{num(y_from)}" x2="{num(cx)}" y2="{num(y_top)}" stroke="{PEAK_COLOR}" '
            f'stroke-width="1.2" stroke-dasharray="2 2"/><line x1="{num(cx - w / 4)}" y1="{num(y_top)}" '
            f'x2="{num(cx + w / 4)}" y2="{num(y_top)}" stroke="{PEAK_COLOR}" stroke-width="1.6"/>')


def _texts(column, cx: float, w: float, room: float, frame: Frame) -> str:
    """The change at its bar and the peak at its whisker, each only where it fits.

    The change is written at the bar it belongs to, never at the whisker's top, where it would read as
    the peak: above a growing bar without a whisker, inside a growing bar tall enough to hold it (under
    the whisker otherwise), below a shrinking one. A column stacked by role keeps its label outside the
    coloured segments.
    """
    out = ""
    start, end, whisker = column.start, column.end, column.whisker
    low = None if column.plan is None else column.plan.low
    delta = end - start
    text = format_delta(int(delta))
    if delta != 0 and _fits(text, room):
        top, bottom = frame.y(max(start, end)), frame.y(min(start, end) if low is None else low)
        if delta < 0:
            out += _label(cx, bottom + 10, text)
        elif whisker is None:
            out += _label(cx, top - 3, text)
        elif low is None and bottom - top >= 13 and _fits(text, w):
            out += _label(cx, top + 10, text, ' fill-opacity="0.95" style="fill:#fff"')
        else:
            out += _label(cx, bottom + 10, text)
    if whisker is not None:
        peak_text = f"peak {format_delta(int(whisker - start))}"
        if _fits(peak_text, room):
            out += _label(cx, frame.y(whisker) - 3, peak_text, ' fill-opacity="0.8"')
    return out


def _role_column(layout, column, x: float, w: float, frame: Frame, hover: str) -> str:
    """The column's role segments, each a ``<g class="role" data-role=...>`` with its own title."""
    out = []
    plan = column.plan
    for seg in plan.segments:
        sx, sw = (x, w / 2) if plan.split and seg.left else (x + w / 2, w / 2) if plan.split else (x, w)
        color = role_color(seg.role)
        style = (f'fill="{color}" fill-opacity="0.3" stroke="{color}" stroke-width="1" stroke-dasharray="3 2"'
                 if seg.exact < 0 else f'fill="{color}" fill-opacity="0.85"')
        y0, y1 = frame.y(max(seg.v0, seg.v1)), frame.y(min(seg.v0, seg.v1))
        drawn = round(seg.v1 - seg.v0) if plan.scaled else None
        title = xml_text(segment_hover(seg.role, seg.exact, drawn, layout.name, hover))
        out.append(f'<g class="role" data-role="{xml_text(seg.role)}"><title>{title}</title>'
                   f'<rect x="{num(sx)}" y="{num(y0)}" width="{num(sw)}" height="{num(max(y1 - y0, 1.0))}" '
                   f'{style}/></g>')
    return "".join(out)


def _end_column(column, i: int, frame: Frame, hover: str) -> str:
    """An end column (before, after, a predicted peak): a neutral bar from the floor with its value, and a
    reserved level as a dashed tick."""
    w = frame.sx * 0.7
    x = frame.x(i) + frame.sx * 0.15
    value = column.start
    extra = (f'<text x="{num(x + w / 2)}" y="{num(frame.y(value) - 3)}" text-anchor="middle" font-size="9" '
             f'fill="currentColor">{xml_text(format_bytes(int(value)))}</text>')
    if column.reserved is not None:
        y = frame.y(column.reserved)
        extra += (f'<line x1="{num(x - 2)}" y1="{num(y)}" x2="{num(x + w + 2)}" y2="{num(y)}" '
                  f'stroke="currentColor" stroke-width="1.2" stroke-dasharray="6 3"/>')
    if frame.ymin > 0:  # the bar is cut: say so with a break mark at its foot
        y = frame.py1 - 5
        extra += (f'<path d="M{num(x - 2)},{num(y + 2)} l{num(w + 4)},-4 m0,4 l{num(-w - 4)},4" '
                  f'stroke="currentColor" stroke-opacity="0.6" fill="none"/>')
    base = max(frame.ymin, 0) if value >= 0 else frame.ymin
    return _bar(x, w, base, value, frame, "currentColor", 0.3, hover, extra)


def _tick_words(layout, slot_w: float) -> bool:
    """True when every line column is wide enough for ``line 3`` / ``lines 3–5`` (else bare numbers,
    explained once in the legend)."""
    return all(_fits(c.tick, slot_w - 4) for c in layout.columns if c.first is not None)


def _short_tick(column) -> str:
    if column.first is None:
        return column.tick
    return str(column.first) if column.first == column.last else f"{column.first}–{column.last}"


def _columns(layout: ColumnsLayout, frame: Frame) -> list:
    out = []
    slot_w = frame.sx
    every = max(1, math.ceil(text_width("00–00", 9) / max(slot_w, 1e-6)))
    words = _tick_words(layout, slot_w)
    middle = 0  # the index among the columns that are not end columns: ticks are thinned out among them
    for i, column in enumerate(layout.columns):
        hover = column_hover(layout, column)
        x = frame.x(i) + slot_w * 0.15
        w = max(slot_w * 0.7, 1.0)
        if column.kind == "end":
            out.append(_end_column(column, i, frame, hover))
        else:
            extra = ""
            if column.whisker is not None:
                extra += _whisker(x + w / 2, w, frame.y(max(column.start, column.end)), frame.y(column.whisker))
            extra += _texts(column, x + w / 2, w, slot_w - 2, frame)
            if column.plan is None:
                out.append(_bar(x, w, column.start, column.end, frame, _KIND_COLOURS[column.kind],
                                0.75 if column.kind != "flat" else 0.3, hover, extra))
            else:
                out.append(f'<g><title>{xml_text(hover)}</title>{extra}</g>')
                out.append(_role_column(layout, column, x, w, frame, hover))
        if layout.connectors and i > 0 and layout.columns[i - 1].end == column.start:
            # where this column starts: the previous one's level
            out.append(f'<line x1="{num(frame.x(i - 0.15))}" y1="{num(frame.y(column.start))}" x2="{num(x)}" '
                       f'y2="{num(frame.y(column.start))}" stroke="currentColor" stroke-opacity="0.35"/>')
        shown = column.kind == "end" or middle % every == 0
        middle += column.kind != "end"
        if shown:
            tick = column.tick if words or column.first is None else _short_tick(column)
            out.append(f'<text x="{num(x + w / 2)}" y="{num(frame.py1 + 13)}" text-anchor="middle" font-size="9" '
                       f'fill="currentColor" fill-opacity="0.75">{xml_text(tick)}</text>')
    return out


def draw_columns(layout: Optional[ColumnsLayout], width: int = 480, height: int = 200, title: Optional[str] = None,
                 ink: Optional[str] = None, empty: str = "no readings") -> str:
    """The picture of a column layout (None gives a placeholder saying ``empty``)."""
    if layout is None:
        return empty_svg(empty, width, ink=ink)
    title = layout.title if title is None else title
    ticks = list(layout.ticks)
    left = 8 + max(text_width(label) for label in byte_labels(ticks))
    legend = list(layout.legend)
    role_rows = legend_rows(list(layout.role_legend), left, width - 4)
    # column i spans x from i to i + 1
    frame = Frame(width, height, left, 20, 34 + 13 * len(role_rows), 0.0, float(len(layout.columns)), layout.top,
                  layout.floor)
    parts = [svg_open(width, height, title, ink), y_axis(frame, ticks)]
    capacity = layout.capacity
    if capacity is not None and capacity.on_scale:
        parts.append(hline(frame, capacity.total, capacity.color, "dashdot", capacity.label))
    for value, words, kind in layout.lines:
        parts.append(hline(frame, value, "currentColor", kind, words, "start", 1.0))
    parts += _columns(layout, frame)
    if layout.line_columns and not _tick_words(layout, frame.sx):
        legend.append((TICKS_NOTE, None, ""))
    note = "" if capacity is None or capacity.on_scale else capacity.label + ("" if layout.kind == "estimate"
                                                                               else " (off scale)")
    y = height - 5 - 13 * len(role_rows)
    parts.append(legend_row(legend, frame.px0, y, width - 4, note))
    for row in role_rows:
        y += 13
        parts.append(legend_row(row, frame.px0, y, width - 4))
    parts.append(f'<text x="{num(frame.px0)}" y="13" font-size="11" font-weight="600" fill="currentColor">'
                 f'{xml_text(title)}</text></svg>')
    return "".join(parts)
