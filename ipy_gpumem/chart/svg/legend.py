"""What the charts say in words: the series drawn and their names, the legend row, the hover texts.

Display text lives here, not in the timeline: hover texts are written from the numbers the timeline
keeps, and cached per span, since a redraw every second asks for the same spans again.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

from ...core.units import format_bytes, format_delta, format_seconds
from ...display.escape import xml_text
from ..timeline import HOST_RSS, Change, SeriesKey, Span
from .base import DASHES, HOST_COLOR, _num, _text_width, device_color

#: The legend kind of a cell's exact peak: the glyph of :func:`peak_mark_path`, a short bar with
#: end ticks, in the chart and in the legend alike. A series is a line (solid, dashed or dotted by
#: quantity), so a peak in the same colour never reads as one.
PEAK_MARK = "peak"

_QUANTITY_ORDER = {"allocated": 0, "reserved": 1, "used": 2, "rss": 3}
_QUANTITY_NAMES = {"used": "used (all processes)"}


def series_name(key: SeriesKey) -> str:
    """``"cuda:0 allocated"``, ``"cuda:0 used (all processes)"``, ``"host RSS"``."""
    if key.device.is_host:
        return "host RSS"
    return f"{key.device.label} {_QUANTITY_NAMES.get(key.quantity, key.quantity)}"


def _drawn_keys(series) -> list:
    """CUDA series when any device has data (device order, then allocated/reserved/used), else RSS."""
    cuda_keys = [k for k, v in series.items() if k.device.is_cuda and any(x is not None for x in v)]
    if cuda_keys:
        return sorted(cuda_keys, key=lambda k: (k.device.index or 0, _QUANTITY_ORDER.get(k.quantity, 9)))
    return [k for k in series if k == HOST_RSS and any(x is not None for x in series[k])]


def _legend_items(keys: list) -> list:
    """``[(label, colour, dash)]``: one entry per series for one device, compact for several."""
    devices = sorted({k.device for k in keys if k.device.is_cuda}, key=lambda d: d.index or 0)
    if not devices:
        return [(series_name(HOST_RSS), HOST_COLOR, "")] if keys else []
    quantities = sorted({k.quantity for k in keys}, key=lambda q: _QUANTITY_ORDER.get(q, 9))
    if len(devices) == 1:
        return [(series_name(SeriesKey(devices[0], q)), device_color(devices[0]), DASHES.get(q, "")) for q in quantities]
    items = [(_QUANTITY_NAMES.get(q, q), "currentColor", DASHES.get(q, "")) for q in quantities]
    return items + [(d.label, device_color(d), "") for d in devices]


def line_legend(keys: list, peaks=()) -> list:
    """The line chart's legend items: its series, then the cells' exact peaks when any is drawn (in
    the device's colour, or the ink's where several devices each draw theirs)."""
    items = _legend_items(keys)
    if peaks:
        colors = {device_color(mark.key.device) for mark in peaks}
        items.append(("cell peak (exact)", colors.pop() if len(colors) == 1 else "currentColor", PEAK_MARK))
    return items


def peak_mark_path(x0: float, x1: float, y: float) -> str:
    """Path data of a peak mark from ``x0`` to ``x1`` at height ``y``: a bar with end ticks (├─┤)."""
    return f"M{x0:.1f},{y - 3:.1f}v6M{x0:.1f},{y:.1f}H{x1:.1f}M{x1:.1f},{y - 3:.1f}v6"


def _peak_part(peak: Optional[int], increase: Optional[int]) -> str:
    if peak is None:
        return ""
    if increase is None:
        return f", peak {format_bytes(peak)}"
    return f", peak {format_bytes(peak)} ({format_delta(increase)})"


def change_text(change: Change) -> str:
    """One device's line of a hover: ``cuda:0 allocated +1.00 GiB, peak 3.50 GiB (+2.00 GiB) · reserved +2.00 GiB``."""
    if change.device.is_host:
        return f"host RSS {format_delta(change.delta)}{_peak_part(change.peak, change.peak_increase)}"
    return (f"{change.device.label} allocated {format_delta(change.delta)}"
            f"{_peak_part(change.peak, change.peak_increase)} · reserved {format_delta(change.reserved_delta)}")


@lru_cache(maxsize=2048)
def span_hover(span: Span) -> str:
    """The tooltip of a span: label and first line, per-device deltas and peaks, duration, error.

    Example::

        [7] y = model(x)
        cuda:0 allocated +1.00 GiB, peak 3.50 GiB (+2.00 GiB) · reserved +2.00 GiB
        1.2 s · OutOfMemoryError
    """
    if span.cells > 1:
        text = f"{span.cells} cells {span.label} (merged to keep the timeline bounded)"
        if span.largest is not None and span.largest.recorded:
            text += "\nlargest: " + span_hover(span.largest)
        return text
    lines = [f"{span.label} {span.first_line}".rstrip()]
    if span.end is None:
        lines.append("running…")
    elif not span.recorded:
        lines.append("(no record)")
    else:
        lines += [change_text(change) for change in span.changes]
        lines.append(format_seconds(span.duration) + (f" · {span.error}" if span.error else ""))
    return "\n".join(lines)


def _legend(items: list, x: float, y: float, right: float, note: str = "") -> str:
    """The legend row: ``(label, colour, dash)`` items from the left (a colour of None writes the
    label alone), and ``note`` right-aligned at its end (e.g. an off-scale capacity). ``dash`` is
    a line's dash pattern, or a kind drawn as its own glyph: ``box``/``box-out`` (a role) and
    :data:`PEAK_MARK` (a cell's exact peak)."""
    out = []
    if note:
        out.append(f'<text x="{_num(right - 4)}" y="{_num(y)}" text-anchor="end" fill="currentColor" '
                   f'fill-opacity="0.6">{xml_text(note)}</text>')
        right -= _text_width(note) + 14
    for label, color, dash in items:
        swatch = 0 if color is None else 20
        width = swatch + 2 + _text_width(label)
        if x + width > right:
            break  # a legend that would overflow the chart is cut, never wrapped over the plot
        if dash in ("box", "box-out"):  # a role: a filled swatch (outlined for released memory)
            style = (f'fill="{color}" fill-opacity="0.85"' if dash == "box" else
                     f'fill="{color}" fill-opacity="0.3" stroke="{color}" stroke-dasharray="3 2"')
            out.append(f'<rect x="{_num(x + 1)}" y="{_num(y - 8)}" width="14" height="8" {style}/>')
        elif dash == PEAK_MARK and color is not None:
            out.append(f'<path d="{peak_mark_path(x + 1, x + 15, y - 3.5)}" stroke="{color}" stroke-width="2" '
                       'fill="none"/>')
        elif color is not None:
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            out.append(f'<line x1="{_num(x)}" y1="{_num(y - 3.5)}" x2="{_num(x + 16)}" y2="{_num(y - 3.5)}" '
                       f'stroke="{color}" stroke-width="2"{dash_attr}/>')
        out.append(f'<text x="{_num(x + swatch)}" y="{_num(y)}" fill="currentColor">{xml_text(label)}</text>')
        x += width + 10
    return "".join(out)


def _legend_rows(items: list, x: float, right: float, max_rows: int = 3) -> list:
    """``items`` wrapped into legend rows from ``x`` to ``right`` (the widths :func:`_legend` uses)."""
    rows, row, used = [], [], 0.0
    for item in items:
        width = (0 if item[1] is None else 20) + 2 + _text_width(item[0]) + 10
        if row and x + used + width - 10 > right:
            rows.append(row)
            row, used = [], 0.0
        row.append(item)
        used += width
    if row:
        rows.append(row)
    return rows[:max_rows]
