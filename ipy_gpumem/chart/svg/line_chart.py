"""The line chart shared by :func:`timeline_svg` and ``cell_svg(samples=...)``, and the session chart.

:func:`timeline_svg` draws a :class:`~ipy_gpumem.chart.timeline.TimelineSnapshot`: one line per
series (allocated solid, reserved dashed, device-wide used dotted; host RSS solid when no CUDA
device is in use), the min-max band of merged points, the device capacity, cell spans as light
bands labelled ``[7]`` with their hover text (:func:`span_hover`) as native ``<title>``
tooltips, each cell's exact peak where the samples missed it, the running cell in amber, failed
cells in red, byte ticks in torch's spelling and time in s/min/h.
"""
from __future__ import annotations

import bisect
from typing import NamedTuple, Optional, Sequence, Tuple

from ...core.units import MiB, format_bytes
from ...display.escape import xml_text
from ..timeline import Span, TimelineSnapshot, missed_peaks
from .axes import _capacities, _capacity_layout, _Frame, _off_scale, _x_axis, _y_axis, byte_ticks
from .base import (FAILED_COLOR, HOST_COLOR, MIN_HEIGHT, MIN_WIDTH, RUNNING_COLOR, _num, _svg_open, _text_width,
                   device_color, empty_svg)
from .legend import _drawn_keys, _legend, line_legend, peak_mark_path, span_hover
from .paths import _series_paths


def _max(values: Sequence) -> float:
    try:
        return max(values, default=0)
    except TypeError:  # None among the values (a series that started late)
        return max((v for v in values if v is not None), default=0)


def _span_fill(span, index: int) -> tuple:
    if span.end is None:
        return RUNNING_COLOR, 0.28
    if span.failed:
        return FAILED_COLOR, 0.18
    return "currentColor", (0.06 if index % 2 else 0.11)  # alternate: back-to-back cells stay apart


def _label_order(spans: Sequence) -> list:
    """Indices of spans in labelling priority: running, then by bytes moved, then newest."""
    return sorted(range(len(spans)), key=lambda i: (spans[i].end is not None, -spans[i].moved, -i))


def _place_labels(spans: Sequence, frame: _Frame) -> set:
    """Indices of spans whose label fits without overlapping a more important one."""
    starts: list = []  # left edges of placed labels, sorted; placed labels never overlap
    ends: list = []
    labelled = set()
    for i in _label_order(spans):
        span = spans[i]
        end = span.end if span.end is not None else frame.x1
        centre = (frame.x(span.start) + frame.x(end)) / 2
        half = _text_width(span.label, 9) / 2 + 2
        lo, hi = centre - half, centre + half
        if lo < frame.px0 or hi > frame.px1:
            continue
        at = bisect.bisect_left(starts, lo)
        if (at < len(starts) and starts[at] < hi) or (at > 0 and ends[at - 1] > lo):
            continue
        starts.insert(at, lo)
        ends.insert(at, hi)
        labelled.add(i)
    return labelled


class HoverBox(NamedTuple):
    """Where a span sits in a drawn chart (pixels): what an HTML overlay needs to give an
    ``<img>`` of the chart the tooltips an inline SVG has (its text is ``span_hover(span)``)."""

    x0: float
    x1: float
    y0: float
    y1: float
    span: Span


def _spans(spans: Sequence, frame: _Frame, boxes: Optional[list], titles: bool = True) -> str:
    """Span bands with tooltips; ``[7]`` labels where they do not collide. Appends to ``boxes``.

    Without titles (a chart for an ``<img>``) the bands of one colour are a single path: a few
    dozen bytes a cell instead of a hundred.
    """
    if not spans:
        return ""
    labelled = _place_labels(spans, frame)
    out = ['<g class="spans">']
    groups: dict = {}
    height = frame.py1 - frame.py0
    for i, span in enumerate(spans):
        end = span.end if span.end is not None else frame.x1
        x0, x1 = frame.x(span.start), frame.x(end)
        width = max(x1 - x0, 1.0)
        color, opacity = _span_fill(span, i)
        label = ""
        if i in labelled:
            weight = ' font-weight="600"' if span.end is None else ""
            label = (
                f'<text x="{_num((x0 + x1) / 2)}" y="{_num(frame.py0 + 9)}" text-anchor="middle" '
                f'font-size="9" fill="currentColor" fill-opacity="0.8"{weight}>{xml_text(span.label)}</text>'
            )
        if boxes is not None:
            boxes.append(HoverBox(x0, x0 + width, frame.py0, frame.py1, span))
        if titles:
            out.append(f'<g><title>{xml_text(span_hover(span))}</title><rect x="{_num(x0)}" y="{_num(frame.py0)}" '
                       f'width="{_num(width)}" height="{_num(height)}" fill="{color}" fill-opacity="{opacity}"/>'
                       f'{label}</g>')
        else:
            groups.setdefault((color, opacity), []).append(f"M{x0:.1f},{frame.py0:.1f}h{width:.1f}v{height:.1f}h{-width:.1f}z")
            out.append(label)
    for (color, opacity), rects in groups.items():
        out.insert(1, f'<path d="{"".join(rects)}" fill="{color}" fill-opacity="{opacity}"/>')
    out.append("</g>")
    return "".join(out)


def _peak_marks(peaks: list, frame: _Frame) -> str:
    """Each missed peak as a short bar with end ticks over its cell (the legend's glyph), one path per colour."""
    groups: dict = {}
    for mark in peaks:
        # The middle of the cell, so neighbouring cells' marks never join into a line.
        x0, x1, y = frame.x(mark.start), frame.x(mark.end), frame.y(mark.peak)
        width = max((x1 - x0) * 0.6, 3.0)
        groups.setdefault(mark.key.device, []).append(peak_mark_path((x0 + x1 - width) / 2, (x0 + x1 + width) / 2, y))
    return "".join(f'<path d="{"".join(lines)}" stroke="{device_color(device)}" stroke-width="2" fill="none"/>'
                   for device, lines in groups.items())


def _peak_line(peak: Optional[int], frame: _Frame, color: str) -> str:
    if peak is None:
        return ""
    y = frame.y(peak)
    return (
        f'<line x1="{_num(frame.px0)}" y1="{_num(y)}" x2="{_num(frame.px1)}" y2="{_num(y)}" stroke="{color}" '
        f'stroke-width="1" stroke-dasharray="3 3"/><text x="{_num(frame.px0 + 3)}" y="{_num(y - 3)}" '
        f'fill="currentColor" fill-opacity="0.8">{xml_text(f"peak {format_bytes(peak)} (exact, from the record)")}</text>'
    )


class Drawing(NamedTuple):
    """A drawn chart: the SVG, its size in pixels, and where its spans are (for HTML tooltips)."""

    svg: str
    width: int
    height: int
    boxes: Tuple[HoverBox, ...] = ()


def _line_chart(times, series, lows, keys, *, spans=(), capacities=None, end=None, merged=0, width=720,
                height=220, title=None, peak=None, ink=None, titles=True, boxes=None, snapshot=None) -> str:
    """The shared line chart; ``keys`` are the series to draw (already chosen)."""
    capacities = capacities or {}
    data_max = max((_max(series[k]) for k in keys), default=0)
    devices = sorted({k.device for k in keys if k.device.is_cuda}, key=lambda d: d.index or 0)
    on_scale, off_scale = _capacity_layout(capacities, devices, data_max)
    if not times:
        peaks = ()
    elif snapshot is not None:
        peaks = snapshot.missed_peaks(keys)
    else:
        peaks = missed_peaks(spans, times, series, keys)
    top_value = max([data_max, peak or 0] + [p.peak for p in peaks] + [total for _, total in on_scale])
    axis_top, ticks = byte_ticks(max(top_value * 1.04, MiB))  # all zeros still get a sane axis
    starts = [times[0]] if times else []
    starts += [s.start for s in spans]
    x0 = min(starts, default=0.0)
    x1 = max([end if end is not None else x0] + list(times[-1:]))
    left = 8 + max(_text_width(format_bytes(int(t))) for t in ticks)
    top = 20 if title else 6
    frame = _Frame(width, height, left, top, 34, x0, x1, axis_top)
    several = len(devices) > 1
    parts = [
        _svg_open(width, height, title or "memory timeline", ink),
        _spans(spans, frame, boxes, titles),
        _y_axis(frame, ticks),
        _x_axis(frame),
        _capacities(on_scale, frame, several),
        _series_paths(times, series, lows, keys, merged, frame, titles) if times else "",
        _peak_marks(peaks, frame),
        _peak_line(peak, frame, device_color(keys[0].device) if keys else HOST_COLOR),
        _legend(line_legend(keys, peaks),
                frame.px0, height - 5, width - 4, _off_scale(off_scale, several)),
    ]
    if title:
        parts.append(f'<text x="{_num(frame.px0)}" y="13" font-size="11" font-weight="600" fill="currentColor">'
                     f'{xml_text(title)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def draw_timeline(snapshot: Optional[TimelineSnapshot], width: int = 720, height: int = 220,
                  title: Optional[str] = None, ink: Optional[str] = None, titles: bool = True) -> Drawing:
    """The session chart and where its spans are; see :func:`timeline_svg`.

    Args:
        ink: the chart's ``currentColor`` (text, axes, bands); None inherits the page's, which is
            right inline and wrong in an ``<img>`` (use :data:`IMG_INK` there).
        titles: put hover texts in ``<title>`` elements (inline SVG); an ``<img>`` shows none of
            them, so its HTML carries them instead, from :attr:`Drawing.boxes`.
    """
    width, height = max(int(width), MIN_WIDTH), max(int(height), MIN_HEIGHT)
    if snapshot is None or snapshot.empty:
        return Drawing(empty_svg("no samples yet", width, ink=ink), width, 40)
    keys = _drawn_keys(snapshot.series)
    if not keys and not snapshot.spans:
        return Drawing(empty_svg("no memory readings yet", width, ink=ink), width, 40)
    boxes: list = []
    svg = _line_chart(
        snapshot.t, snapshot.series, snapshot.lows, keys, spans=snapshot.spans, capacities=snapshot.capacities,
        end=snapshot.end, merged=snapshot.merged, width=width, height=height, title=title, ink=ink,
        titles=titles, boxes=boxes, snapshot=snapshot,
    )
    return Drawing(svg, width, height, tuple(boxes))


def timeline_svg(snapshot: Optional[TimelineSnapshot], width: int = 720, height: int = 220,
                 title: Optional[str] = None, ink: Optional[str] = None, titles: bool = True) -> str:
    """The session chart of a :class:`~ipy_gpumem.chart.timeline.TimelineSnapshot` as an SVG string.

    Args:
        snapshot: from ``Timeline.snapshot()``; None or empty gives a "no samples yet" chart.
        width: pixels (at least 240 are used).
        height: pixels (at least 120 are used).
        title: optional text above the plot.
        ink: see :func:`draw_timeline`.
        titles: see :func:`draw_timeline`.

    Returns:
        ``<svg ...>...</svg>``, self-contained; safe to embed in HTML as is.
    """
    return draw_timeline(snapshot, width, height, title, ink, titles).svg
