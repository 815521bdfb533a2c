"""The session chart as an SVG picture, drawn from its layout (``chart.session``).

:func:`draw_session` draws a :class:`~ipy_gpumem.chart.session.SessionLayout`: one line per series
(allocated solid, reserved dashed, device-wide used dotted; host RSS solid when no CUDA device is in
use), the min-max band of merged points, the device capacity, cell spans as light bands labelled
``[7]`` with their hover text as native ``<title>`` tooltips, each cell's exact peak where the
samples missed it, the running cell in amber, failed cells in red, byte ticks in one unit and time
in s/min/h. :func:`timeline_svg` and :func:`draw_timeline` draw a snapshot's layout.
"""
from __future__ import annotations

import bisect
from typing import NamedTuple, Optional, Sequence, Tuple

from ...display.escape import xml_text
from ..scale import byte_labels
from ..session import SessionLayout, session_layout
from ..style import PEAK_COLOR, band
from ..timeline import Span, TimelineSnapshot
from ..words import exact_peak_text, off_scale_note, span_hover
from .axes import Frame, capacity_lines, hline, x_axis, y_axis
from .base import MIN_HEIGHT, MIN_WIDTH, empty_svg, num, paint, svg_open, text_width
from .legend import legend_row, peak_mark_path
from .paths import series_paths

__all__ = ["HoverBox", "Drawing", "draw_session", "draw_timeline", "timeline_svg"]


def _label_order(cells: Sequence) -> list:
    """Indices of cells in labelling priority: running, then by bytes moved, then newest."""
    return sorted(range(len(cells)), key=lambda i: (cells[i].span.end is not None, -cells[i].span.moved, -i))


def _place_labels(cells: Sequence, frame: Frame) -> set:
    """Indices of cells whose label fits without overlapping a more important one."""
    starts: list = []  # left edges of placed labels, sorted; placed labels never overlap
    ends: list = []
    labelled = set()
    for i in _label_order(cells):
        cell = cells[i]
        centre = (frame.x(cell.start) + frame.x(cell.end)) / 2
        half = text_width(cell.span.label, 9) / 2 + 2
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


def _cells(cells: Sequence, frame: Frame, boxes: Optional[list], titles: bool = True) -> str:
    """Cell bands with tooltips; ``[7]`` labels where they do not collide. Appends to ``boxes``.

    Without titles (a chart for an ``<img>``) the bands of one kind are a single path: a few dozen
    bytes a cell instead of a hundred.
    """
    if not cells:
        return ""
    labelled = _place_labels(cells, frame)
    out = ['<g class="spans">']
    groups: dict = {}
    height = frame.py1 - frame.py0
    for i, cell in enumerate(cells):
        x0, x1 = frame.x(cell.start), frame.x(cell.end)
        width = max(x1 - x0, 1.0)
        colour, opacity = band(cell.kind)
        label = ""
        if i in labelled:
            weight = ' font-weight="600"' if cell.kind == "running" else ""
            label = (f'<text x="{num((x0 + x1) / 2)}" y="{num(frame.py0 + 9)}" text-anchor="middle" '
                     f'font-size="9" fill="currentColor" fill-opacity="0.8"{weight}>{xml_text(cell.span.label)}</text>')
        if boxes is not None:
            boxes.append(HoverBox(x0, x0 + width, frame.py0, frame.py1, cell.span))
        if titles:
            out.append(f'<g><title>{xml_text(span_hover(cell.span))}</title><rect x="{num(x0)}" y="{num(frame.py0)}" '
                       f'width="{num(width)}" height="{num(height)}" fill="{paint(colour)}" fill-opacity="{opacity}"/>'
                       f'{label}</g>')
        else:
            groups.setdefault((paint(colour), opacity), []).append(
                f"M{x0:.1f},{frame.py0:.1f}h{width:.1f}v{height:.1f}h{-width:.1f}z")
            out.append(label)
    for (colour, opacity), rects in groups.items():
        out.insert(1, f'<path d="{"".join(rects)}" fill="{colour}" fill-opacity="{opacity}"/>')
    out.append("</g>")
    return "".join(out)


def _peak_marks(peaks: Sequence, frame: Frame) -> str:
    """Each missed peak as a short bar with end ticks over the middle of its cell (the legend's glyph)."""
    lines = []
    for mark in peaks:
        x0, x1, y = frame.x(mark.start), frame.x(mark.end), frame.y(mark.peak)
        width = max((x1 - x0) * 0.6, 3.0)  # the middle: neighbouring cells' marks never join into a line
        lines.append(peak_mark_path((x0 + x1 - width) / 2, (x0 + x1 + width) / 2, y))
    return f'<path d="{"".join(lines)}" stroke="{PEAK_COLOR}" stroke-width="2" fill="none"/>' if lines else ""


def _ranks(ranks: Sequence, frame: Frame) -> str:
    out = []
    for rank in ranks:
        parts, pen = [], "M"
        for x, y in zip(rank.xs, rank.ys):
            if x is None or y is None:
                pen = "M"
                continue
            parts.append(f"{pen}{frame.x(x):.1f},{frame.y(y):.1f}")
            pen = "L"
        if parts:
            out.append(f'<path d="{"".join(parts)}" fill="none" stroke="{rank.color}" stroke-width="1.4" '
                       f'stroke-dasharray="1.5 2.5"/>')
    return "".join(out)


class Drawing(NamedTuple):
    """A drawn chart: the SVG, its size in pixels, and where its spans are (for HTML tooltips)."""

    svg: str
    width: int
    height: int
    boxes: Tuple[HoverBox, ...] = ()


def draw_session(layout: SessionLayout, width: int = 720, height: int = 220, title: Optional[str] = None,
                 ink: Optional[str] = None, titles: bool = True) -> Drawing:
    """The picture of a session layout and where its cells are.

    Args:
        ink: the chart's ``currentColor`` (text, axes, bands); None inherits the page's, which is
            right inline and wrong in an ``<img>`` (use ``chart.style.IMG_INK`` there).
        titles: put hover texts in ``<title>`` elements (inline SVG); an ``<img>`` shows none of
            them, so its HTML carries them instead, from :attr:`Drawing.boxes`.
    """
    width, height = max(int(width), MIN_WIDTH), max(int(height), MIN_HEIGHT)
    if layout.empty:
        return Drawing(empty_svg(layout.empty, width, ink=ink), width, 40)
    left = 8 + max(text_width(label) for label in byte_labels(list(layout.ticks)))
    frame = Frame(width, height, left, 20 if title else 6, 34, layout.x0, layout.x1, layout.top)
    boxes: list = []
    exact = ""
    if layout.exact_peak is not None:
        exact = hline(frame, layout.exact_peak, PEAK_COLOR, "dot", exact_peak_text(layout.exact_peak), "start", 1.0)
    parts = [
        svg_open(width, height, title or "memory timeline", ink),
        _cells(layout.cells, frame, boxes, titles),
        y_axis(frame, layout.ticks),
        x_axis(frame),
        capacity_lines(layout.capacities, frame, layout.several),
        series_paths(layout.t, layout.series, layout.merged, frame, titles) if layout.t else "",
        _ranks(layout.ranks, frame),
        _peak_marks(layout.peaks, frame),
        exact,
        legend_row(layout.legend, frame.px0, height - 5, width - 4, off_scale_note(layout.off_scale, layout.several)),
    ]
    if title:
        parts.append(f'<text x="{num(frame.px0)}" y="13" font-size="11" font-weight="600" fill="currentColor">'
                     f'{xml_text(title)}</text>')
    parts.append("</svg>")
    return Drawing("".join(parts), width, height, tuple(boxes))


def draw_timeline(snapshot: Optional[TimelineSnapshot], width: int = 720, height: int = 220,
                  title: Optional[str] = None, ink: Optional[str] = None, titles: bool = True) -> Drawing:
    """The session chart of a snapshot and where its spans are; see :func:`draw_session`."""
    return draw_session(session_layout(snapshot), width, height, title, ink, titles)


def timeline_svg(snapshot: Optional[TimelineSnapshot], width: int = 720, height: int = 220,
                 title: Optional[str] = None, ink: Optional[str] = None, titles: bool = True) -> str:
    """The session chart of a :class:`~ipy_gpumem.chart.timeline.TimelineSnapshot` as an SVG string.

    Args:
        snapshot: from ``Timeline.snapshot()``; None or empty gives a "no samples yet" chart.
        width: pixels (at least 240 are used).
        height: pixels (at least 120 are used).
        title: optional text above the plot.
        ink: see :func:`draw_session`.
        titles: see :func:`draw_session`.

    Returns:
        ``<svg ...>...</svg>``, self-contained; safe to embed in HTML as is.
    """
    return draw_timeline(snapshot, width, height, title, ink, titles).svg
