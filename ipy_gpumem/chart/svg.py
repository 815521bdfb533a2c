"""Memory charts as self-contained inline SVG strings: no JavaScript, no external resources.

Two charts, both pure functions from plain data to a string:

* :func:`timeline_svg` draws a :class:`~ipy_gpumem.chart.timeline.TimelineSnapshot`: one line per
  series (allocated solid, reserved dashed, device-wide used dotted; host RSS solid when no CUDA
  device is in use), the min-max band of merged points, the device capacity, cell spans as light
  bands labelled ``[7]`` with their hover text (:func:`span_hover`) as native ``<title>``
  tooltips, each cell's exact peak where the samples missed it, the running cell in amber, failed
  cells in red, byte ticks in torch's spelling and time in s/min/h.
* :func:`cell_svg` draws one cell. With samples taken during the cell it is the same line chart
  over the cell's time, plus the exact peak from the record as a dashed line (samples can miss
  a short spike; the record's peak cannot). Without samples it is a **waterfall**: a ``before``
  bar, one floating bar per executed source line (or one for the whole cell) going up or down
  by the line's delta with a whisker up to its peak, and an ``after`` bar. We know before, peak
  and after but not *when* the peak happened, so we draw no invented time axis; the waterfall
  shows exactly what was measured and points at the line that moved memory. A line whose record
  carries roles (``LineRecord.roles``) for the charted device has its bar stacked by role (see
  :func:`_role_plan`): one Okabe–Ito colour per role, released roles outlined, a legend of the
  roles drawn and a hover per segment with the role, its exact bytes and the line's reason.

Text and axes use ``currentColor`` and fills are semi-transparent, so the charts read in light
and dark themes; a chart meant for an ``<img>`` (where nothing is inherited) sets that colour to
a mid grey that reads on both (``ink=IMG_INK``). Hover texts are written here, from the numbers
the timeline keeps; every piece of text is escaped. Drawing never raises on empty or None data.
"""
from __future__ import annotations

import bisect
import math
import re
from functools import lru_cache
from typing import NamedTuple, Optional, Sequence, Tuple

from ..core.devices import Device, cuda
from ..core.roles import ROLE_WORDS, ROLES, TENSOR_ROLES
from ..core.text import clip, first_line
from ..core.units import GiB, KiB, MiB, format_bytes, format_delta, format_seconds
from ..display.view import esc
from .timeline import HOST_RSS, Change, SeriesKey, Span, Timeline, TimelineSnapshot, missed_peaks

__all__ = ["timeline_svg", "cell_svg", "empty_svg", "byte_ticks", "time_ticks", "format_time", "span_hover",
           "series_name", "change_text", "IMG_INK", "ROLE_COLORS"]

FONT = "-apple-system,BlinkMacSystemFont,'Segoe UI',Helvetica,Arial,sans-serif"
#: Line colours per CUDA device (mid tones: readable on white and on a dark theme).
DEVICE_COLORS = ("#3b82f6", "#a855f7", "#14b8a6", "#f97316", "#ec4899", "#84cc16", "#06b6d4", "#eab308")
HOST_COLOR = "#10b981"
RUNNING_COLOR = "#f59e0b"
FAILED_COLOR = "#ef4444"
UP_COLOR = "#ef4444"
DOWN_COLOR = "#22c55e"
#: One colour per role (``core.roles.ROLES``): the Okabe–Ito palette, told apart with any colour
#: vision and readable on light and dark pages. A role this version does not know is grey.
ROLE_COLORS = {
    "parameters": "#0072B2",       # blue
    "gradients": "#E69F00",        # orange
    "optimizer_state": "#CC79A7",  # reddish purple
    "activations": "#009E73",      # bluish green
    "other_tensors": "#56B4E9",    # sky blue
    "allocator_cache": "#F0E442",  # yellow
    "outside_pytorch": "#D55E00",  # vermillion
}
OTHER_ROLE_COLOR = "#999999"
#: Roles are scaled to a column's change by at most this factor: tensors that make up less than
#: 1/16 of what a line did to host RSS did not make that change, and are not painted over it.
MAX_ROLE_SCALE = 16.0
#: Dash pattern per series kind: allocated solid, reserved dashed, used dotted.
DASHES = {"allocated": "", "reserved": "6 3", "used": "1.5 2.5", "rss": ""}
#: ``currentColor`` of a chart drawn for an ``<img>``: a grey that reads on light and dark pages.
IMG_INK = "#8c8c8c"
#: A capacity line is drawn (and included in the y range) when the data reach this fraction
#: of it; below that, a 80 GiB line would squash a 2 GiB session into the bottom pixels, so
#: the capacity is only written in the corner.
CAPACITY_ON_SCALE = 0.3
CHAR_W = 5.6  # average glyph width at font-size 10, for layout estimates
#: Smaller charts are drawn at this size: axis labels alone need about 70 x 60 pixels.
MIN_WIDTH, MIN_HEIGHT = 240, 120
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")
_TICK_MULTIPLIERS = (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 40, 50, 64, 100, 128, 200, 250, 256, 500, 512)
_TIME_STEPS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300,
               600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _text(value) -> str:
    """Escape for XML text and attributes, dropping characters XML 1.0 forbids."""
    return esc(_CONTROL.sub("", str(value)))


def _num(value: float) -> str:
    return f"{value:.1f}"


def _text_width(text: str, size: float = 10) -> float:
    return len(text) * CHAR_W * size / 10


def _svg_open(width: int, height: int, label: str, ink: Optional[str] = None) -> str:
    color = "inherit" if ink is None else ink
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{int(width)}" height="{int(height)}" '
        f'viewBox="0 0 {int(width)} {int(height)}" font-family="{FONT}" font-size="10" '
        f'role="img" aria-label="{_text(label)}" style="color:{color};overflow:visible">'
    )


def empty_svg(message: str = "no samples yet", width: int = 720, height: int = 40, ink: Optional[str] = None) -> str:
    """A small placeholder chart with a centred message."""
    height = max(int(height), 20)
    return (
        _svg_open(width, height, message, ink)
        + f'<rect x="0.5" y="0.5" width="{int(width) - 1}" height="{height - 1}" rx="4" fill="none" '
        f'stroke="currentColor" stroke-opacity="0.25"/>'
        + f'<text x="{int(width) / 2:.1f}" y="{height / 2 + 3.5:.1f}" text-anchor="middle" '
        f'fill="currentColor" fill-opacity="0.6">{_text(message)}</text></svg>'
    )


def byte_ticks(top: float) -> tuple:
    """``(axis top, [tick values])``: 4-5 ticks from 0 at a binary-friendly step.

    Examples:
        >>> byte_ticks(15.2 * 2**30)[1][-1] / 2**30, len(byte_ticks(15.2 * 2**30)[1])
        (16.0, 5)
    """
    top = max(float(top or 0), 1.0)
    for unit in (1, KiB, MiB, GiB, GiB * 1024):
        for m in _TICK_MULTIPLIERS:
            step = m * unit
            count = math.ceil(top / step - 1e-9)
            if count <= 4:
                return count * step, [i * step for i in range(count + 1)]
    step = 2 ** math.ceil(math.log2(top / 4))
    count = math.ceil(top / step)
    return count * step, [i * step for i in range(count + 1)]


def time_ticks(lo: float, hi: float, max_ticks: int = 6) -> list:
    """Tick positions (seconds) between ``lo`` and ``hi`` at a round step."""
    span = max(hi - lo, 1e-9)
    step = next((s for s in _TIME_STEPS if span / s <= max_ticks), None)
    if step is None:
        step = _TIME_STEPS[-1] * math.ceil(span / max_ticks / _TIME_STEPS[-1])
    first = math.ceil(lo / step - 1e-9) * step
    ticks, value = [], first
    while value <= hi + 1e-9 and len(ticks) < 100:
        ticks.append(value)
        value = first + len(ticks) * step
    return ticks


def format_time(value: float, step: float, hi: Optional[float] = None) -> str:
    """An axis label in one unit for the whole axis (chosen from the step and the axis end).

    Examples:
        >>> [format_time(v, 0.25, 0.75) for v in (0, 0.25)], format_time(1.5, 0.5, 2), format_time(30, 15, 60)
        (['0 ms', '250 ms'], '1.5 s', '30 s')
        >>> format_time(150, 30, 300), format_time(600, 300, 1800), format_time(5400, 1800, 14400)
        ('2:30', '10 min', '1.5 h')
    """
    hi = value if hi is None else hi
    if step >= 3600 or hi >= 3 * 3600:
        return f"{value / 3600:g} h"
    if step >= 60:
        return f"{value / 60:g} min"
    if step >= 1:
        if hi < 120:
            return f"{value:.0f} s"
        minutes, seconds = divmod(int(round(value)), 60)
        return f"{minutes}:{seconds:02d}"
    if hi < 1:
        return f"{value * 1000:.0f} ms"
    decimals = max(1, -math.floor(math.log10(step) + 1e-9))
    return f"{value:.{decimals}f} s"


@lru_cache(maxsize=64)
def _coord_table(origin: float, step: float, count: int, suffix: str) -> tuple:
    """``count`` pre-formatted coordinates ``origin + i * step`` (cached across redraws)."""
    return tuple(_num(origin + i * step) + suffix for i in range(count))


# --------------------------------------------------------------------------------------------
# Series, colours, the legend and hover texts (display text lives here, not in the timeline)
# --------------------------------------------------------------------------------------------

_QUANTITY_ORDER = {"allocated": 0, "reserved": 1, "used": 2, "rss": 3}
_QUANTITY_NAMES = {"used": "used (all processes)"}


def series_name(key: SeriesKey) -> str:
    """``"cuda:0 allocated"``, ``"cuda:0 used (all processes)"``, ``"host RSS"``."""
    if key.device.is_host:
        return "host RSS"
    return f"{key.device.label} {_QUANTITY_NAMES.get(key.quantity, key.quantity)}"


def device_color(device: Device) -> str:
    if not device.is_cuda or device.index is None:
        return HOST_COLOR
    return DEVICE_COLORS[device.index % len(DEVICE_COLORS)]


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
    label alone), and ``note`` right-aligned at its end (e.g. an off-scale capacity)."""
    out = []
    if note:
        out.append(f'<text x="{_num(right - 4)}" y="{_num(y)}" text-anchor="end" fill="currentColor" '
                   f'fill-opacity="0.6">{_text(note)}</text>')
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
        elif color is not None:
            dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
            out.append(f'<line x1="{_num(x)}" y1="{_num(y - 3.5)}" x2="{_num(x + 16)}" y2="{_num(y - 3.5)}" '
                       f'stroke="{color}" stroke-width="2"{dash_attr}/>')
        out.append(f'<text x="{_num(x + swatch)}" y="{_num(y)}" fill="currentColor">{_text(label)}</text>')
        x += width + 10
    return "".join(out)


# --------------------------------------------------------------------------------------------
# The line chart shared by timeline_svg and cell_svg(samples=...)
# --------------------------------------------------------------------------------------------


class _Frame:
    """Plot geometry: the data ranges and the pixel rectangle they map to."""

    def __init__(self, width, height, left, top, bottom, x0, x1, ymax, ymin=0):
        self.width, self.height = width, height
        self.px0, self.px1 = float(left), float(width - 10)
        self.py0, self.py1 = float(top), float(height - bottom)
        self.x0, self.x1 = x0, max(x1, x0 + 1e-6)
        self.ymin, self.ymax = ymin, max(ymax, ymin + 1)
        self.sx = (self.px1 - self.px0) / (self.x1 - self.x0)
        self.sy = (self.py1 - self.py0) / (self.ymax - ymin)

    def x(self, t: float) -> float:
        return self.px0 + (t - self.x0) * self.sx

    def y(self, v: float) -> float:
        return self.py1 - (v - self.ymin) * self.sy


def _y_axis(frame: _Frame, ticks: list) -> str:
    out = []
    for value in ticks:
        y = frame.y(value)
        out.append(
            f'<line x1="{_num(frame.px0)}" y1="{_num(y)}" x2="{_num(frame.px1)}" y2="{_num(y)}" '
            f'stroke="currentColor" stroke-opacity="{0.35 if value == 0 else 0.12}"/>'
            f'<text x="{_num(frame.px0 - 4)}" y="{_num(y + 3.5)}" text-anchor="end" fill="currentColor" '
            f'fill-opacity="0.75">{_text(format_bytes(int(value)))}</text>'
        )
    return "".join(out)


def _x_axis(frame: _Frame) -> str:
    ticks = time_ticks(frame.x0, frame.x1, max_ticks=max(2, int((frame.px1 - frame.px0) / 90)))
    step = ticks[1] - ticks[0] if len(ticks) > 1 else max(frame.x1 - frame.x0, 1e-3)
    y = frame.py1
    out = []
    for value in ticks:
        x = frame.x(value)
        out.append(
            f'<line x1="{_num(x)}" y1="{_num(y)}" x2="{_num(x)}" y2="{_num(y + 3)}" stroke="currentColor" '
            f'stroke-opacity="0.5"/><text x="{_num(x)}" y="{_num(y + 13)}" text-anchor="middle" '
            f'fill="currentColor" fill-opacity="0.75">{_text(format_time(value, step, ticks[-1]))}</text>'
        )
    return "".join(out)


def _max(values: Sequence) -> float:
    try:
        return max(values, default=0)
    except TypeError:  # None among the values (a series that started late)
        return max((v for v in values if v is not None), default=0)


def _runs(values: Sequence) -> list:
    """``[(start, stop)]`` index ranges of consecutive non-None values."""
    if None not in values:
        return [(0, len(values))] if values else []
    runs, start = [], None
    for i, v in enumerate(values):
        if v is None:
            if start is not None:
                runs.append((start, i))
                start = None
        elif start is None:
            start = i
    if start is not None:
        runs.append((start, len(values)))
    return runs


def _y_table(frame: _Frame) -> tuple:
    """``(quantum, table)``: ``table[v // quantum]`` is the pre-formatted y of ``v`` bytes plus a space.

    Integer floor division by a byte quantum (about half a pixel) is one C call per point, and
    the table lookup replaces per-point formatting; together they keep a 2000-point series
    under a quarter of a millisecond.
    """
    height = frame.py1 - frame.py0
    quantum = max(1, int(frame.ymax / (2 * height)))
    return quantum, _coord_table(frame.py1, -quantum * frame.sy, int(frame.ymax // quantum) + 3, " ")


def _interleave(xs: list, ys) -> str:
    """``"x0,y0 x1,y1 ..."`` from ``"x,"`` and ``"y "`` strings (slice assignment: C speed)."""
    out = [""] * (2 * len(xs))
    out[::2] = xs
    out[1::2] = ys
    return "".join(out)


def _path_data(xs: list, values: Sequence, frame: _Frame) -> str:
    """SVG path data through the points (``M x,y x,y ...``); None values break the line.

    This is the hot loop of a redraw (2000 points x 4 series every second), so the common case
    (no None, int bytes) runs in C, mapping bound methods over the values; anything else takes
    the per-run path.
    """
    quantum, ytab = _y_table(frame)
    try:
        return "M" + _interleave(xs, map(ytab.__getitem__, map(quantum.__rfloordiv__, values)))
    except (TypeError, IndexError):  # a None (gap), a float, or an out-of-range value
        pass
    last = len(ytab) - 1
    parts = []
    for a, b in _runs(values):
        ys = [ytab[min(max(int(v) // quantum, 0), last)] for v in values[a:b]]
        parts.append("M" + _interleave(xs[a:b], ys))
    return "".join(parts)


def _x_coords(times: Sequence[float], frame: _Frame) -> list:
    """``"x,"`` strings for each time (half-pixel precision), shared by every series."""
    xtab = _coord_table(frame.px0, 0.5, int(2 * (frame.px1 - frame.px0)) + 3, ",")
    k = 2 * frame.sx
    shifted = times if frame.x0 == 0 else map((-frame.x0).__add__, times)  # t[0] is usually 0
    return list(map(xtab.__getitem__, map(int, map(k.__mul__, shifted))))


def _envelope(xs: list, highs: Sequence, lows: Sequence, n: int, frame: _Frame, color: str) -> str:
    """The min-max band of the first ``n`` (merged) points, when any bucket has a range."""
    hi, lo = tuple(highs[:n]), tuple(lows[:n])
    if n < 2 or hi == lo or None in hi or None in lo:
        return ""
    top = _path_data(xs[:n], hi, frame)
    bottom = _path_data(xs[:n][::-1], lo[::-1], frame)
    return (
        f'<path d="{top}L{bottom[1:]}Z" fill="{color}" fill-opacity="0.18" stroke="none" '
        f'pointer-events="none"/>'
    )


def _series_paths(times, series, lows, keys, merged, frame, titles: bool = True) -> str:
    xs = _x_coords(times, frame)
    out = []
    for key in keys:
        values = series[key]
        color = device_color(key.device)
        if key.quantity in ("allocated", "rss") and key in lows:
            # Saw-tooth memory (training loops) merged into buckets keeps its range visible.
            out.append(_envelope(xs, values, lows[key], merged, frame, color))
        dash = DASHES.get(key.quantity, "")
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        data = _path_data(xs, values, frame)
        if data:
            title = f"<title>{_text(series_name(key))}</title>" if titles else ""
            out.append(
                f'<path d="{data}" fill="none" stroke="{color}" stroke-width="1.6" '
                f'stroke-linejoin="round"{dash_attr} pointer-events="none">{title}</path>'
            )
    return "".join(out)


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
                f'font-size="9" fill="currentColor" fill-opacity="0.8"{weight}>{_text(span.label)}</text>'
            )
        if boxes is not None:
            boxes.append(HoverBox(x0, x0 + width, frame.py0, frame.py1, span))
        if titles:
            out.append(f'<g><title>{_text(span_hover(span))}</title><rect x="{_num(x0)}" y="{_num(frame.py0)}" '
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
    """Each missed peak as a short dashed line over its cell, one path per colour."""
    groups: dict = {}
    for mark in peaks:
        # The middle of the cell, so neighbouring cells' marks never join into a line.
        x0, x1, y = frame.x(mark.start), frame.x(mark.end), frame.y(mark.peak)
        width = max((x1 - x0) * 0.6, 3.0)
        groups.setdefault(mark.key.device, []).append(f"M{(x0 + x1 - width) / 2:.1f},{y:.1f}h{width:.1f}")
    return "".join(f'<path d="{"".join(lines)}" stroke="{device_color(device)}" stroke-width="2" '
                   f'stroke-linecap="round" fill="none"/>' for device, lines in groups.items())


def _capacity_layout(capacities, devices: list, data_max: float) -> tuple:
    """``(on-scale capacities, off-scale capacities)`` as ``[(device, bytes)]`` lists."""
    on, off = [], []
    for device in devices:
        total = capacities.get(device)
        if not total:
            continue
        (on if data_max >= CAPACITY_ON_SCALE * total else off).append((device, total))
    return on, off


def _label_y(y: float, frame: _Frame) -> float:
    """Baseline of a label for a horizontal line at ``y``: above it, or below when near the top."""
    return y - 3 if y - 12 >= frame.py0 else y + 11


def _capacities(on: list, frame: _Frame, several: bool) -> str:
    out = []
    for device, total in on:
        y = frame.y(total)
        text = f"{device.label} {format_bytes(total)} total" if several else f"{format_bytes(total)} total"
        out.append(
            f'<line x1="{_num(frame.px0)}" y1="{_num(y)}" x2="{_num(frame.px1)}" y2="{_num(y)}" '
            f'stroke="{device_color(device)}" stroke-width="1.2" stroke-dasharray="8 3 2 3" stroke-opacity="0.8"/>'
            f'<text x="{_num(frame.px1 - 3)}" y="{_num(_label_y(y, frame))}" text-anchor="end" fill="currentColor" '
            f'fill-opacity="0.8">{_text(text)}</text>'
        )
    return "".join(out)


def _off_scale(off: list, several: bool) -> str:
    """The capacities too far above the data to draw, as a note for the legend row."""
    if not off:
        return ""
    return " · ".join(f"{device.label} {format_bytes(total)} total" if several else f"{format_bytes(total)} total"
                      for device, total in off) + " (off scale)"


def _peak_line(peak: Optional[int], frame: _Frame, color: str) -> str:
    if peak is None:
        return ""
    y = frame.y(peak)
    return (
        f'<line x1="{_num(frame.px0)}" y1="{_num(y)}" x2="{_num(frame.px1)}" y2="{_num(y)}" stroke="{color}" '
        f'stroke-width="1" stroke-dasharray="3 3"/><text x="{_num(frame.px0 + 3)}" y="{_num(y - 3)}" '
        f'fill="currentColor" fill-opacity="0.8">{_text("peak " + format_bytes(peak) + " (exact, from the record)")}</text>'
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
        _legend(_legend_items(keys) + ([("cell peak (exact)", device_color(peaks[0].key.device), "")] if peaks else []),
                frame.px0, height - 5, width - 4, _off_scale(off_scale, several)),
    ]
    if title:
        parts.append(f'<text x="{_num(frame.px0)}" y="13" font-size="11" font-weight="600" fill="currentColor">'
                     f'{_text(title)}</text>')
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


# --------------------------------------------------------------------------------------------
# One cell: the samples it saw, or a waterfall from its record
# --------------------------------------------------------------------------------------------


class _Subject(NamedTuple):
    """What a cell chart shows: the device that moved most (allocated), else host RSS."""

    key: SeriesKey
    before: Optional[int]
    after: Optional[int]
    peak: Optional[int]
    reserved: tuple  # (before, after), None where unknown
    total: Optional[int]


def _subject(record) -> _Subject:
    devices = [d for d in record.devices if d.allocated_before is not None or d.allocated_after is not None]
    if devices:
        dev = max(devices, key=lambda d: max(abs(d.allocated_delta or 0), d.peak_increase or 0))
        return _Subject(SeriesKey(cuda(dev.index), "allocated"), dev.allocated_before, dev.allocated_after,
                        dev.allocated_peak, (dev.reserved_before, dev.reserved_after), dev.total)
    host = record.host
    return _Subject(HOST_RSS, host.rss_before, host.rss_after, host.rss_peak, (None, None), None)


def _line_values(line, key: SeriesKey) -> tuple:
    """``(delta, peak increase)`` of one LineRecord for the subject's series."""
    if key.device.is_host:
        return line.host.rss_delta, line.host.rss_peak_increase
    dev = line.device(key.device.index)
    return (None, None) if dev is None else (dev.allocated_delta, dev.peak_increase)


def _record_title(record) -> str:
    return f"{record.label} {first_line(record.source, 60)}".rstrip()


class _Slot(NamedTuple):
    """One waterfall column: a level change with an optional peak whisker.

    ``first``/``last`` are the source lines it covers (None for the whole cell).
    """

    delta: Optional[int]
    peak_increase: Optional[int]
    hover: str
    first: Optional[int] = None
    last: Optional[int] = None
    #: ``((role, exact signed bytes), ...)`` of the roles that make up the charted quantity
    #: (ROLES order, zeros dropped); empty when the lines carry no roles for the device.
    roles: tuple = ()

    @property
    def tick(self) -> str:
        if self.first is None:
            return "cell"
        return str(self.first) if self.first == self.last else f"{self.first}–{self.last}"


def _role_order(item) -> tuple:
    return (ROLES.index(item[0]) if item[0] in ROLES else len(ROLES), str(item[0]))


def _line_roles(line, device: Device) -> Optional[tuple]:
    """``(in the bar, beside it)`` of a line's roles on ``device``, each ``((role, bytes), ...)``;
    None when the line carries no roles for it.

    Host RSS holds every role of the "cpu" row. A CUDA chart draws allocated memory: the tensor
    roles make it up exactly; the allocator's cache and memory outside PyTorch are beside it.
    """
    table = getattr(line, "roles", None)
    if not isinstance(table, dict) or not isinstance(table.get(device.label), dict):
        return None
    inside, beside = [], []
    for role, value in sorted(table[device.label].items(), key=_role_order):
        try:
            value = int(value)
        except (TypeError, ValueError):
            continue
        if value:
            (inside if device.is_host or role in TENSOR_ROLES else beside).append((role, value))
    return tuple(inside), tuple(beside)


def _role_list(items) -> str:
    return ", ".join(f"{ROLE_WORDS.get(role, role)} {format_delta(value)}" for role, value in items)


def _line_hover(line, key: SeriesKey, name: str, d, p, roles) -> str:
    """A line's part of its column's hover; with roles, what they are and why the line moved."""
    text = (f"line {line.lineno} ×{line.hits}: {clip(line.source.strip(), 80)}\n  {name} {format_delta(d)}"
            f"{'' if p is None else ', peak ' + format_delta(p)} · {format_seconds(line.duration_s)}")
    if roles is None:
        return text
    inside, beside = roles
    if inside:
        text += f"\n  roles (exact tensor bytes): {_role_list(inside)}"
    if beside:
        text += f"\n  beside allocated: {_role_list(beside)}"
    temporaries = getattr(line, "temporaries", None)
    temp = temporaries.get(key.device.label) if isinstance(temporaries, dict) else None
    if isinstance(temp, int) and temp > 0:
        text += f"\n  temporaries: {format_bytes(temp)} came and went"
    if line.reason:
        text += f"\n  {clip(line.reason, 400)}"
    return text


def _line_slots(record, subject: _Subject, max_slots: int) -> list:
    """One slot per executed line (source order), grouped into runs when there are too many.

    A slot carries roles when every line in it has roles for the charted device (their sum).
    """
    lines = sorted(record.lines or (), key=lambda ln: ln.lineno)
    if not lines:
        return []
    name = series_name(subject.key)
    group = max(1, math.ceil(len(lines) / max_slots))
    slots = []
    for i in range(0, len(lines), group):
        chunk = lines[i:i + group]
        delta, peak, level, texts, sums, measured = 0, None, 0, [], {}, True
        for line in chunk:
            d, p = _line_values(line, subject.key)
            if p is not None:
                peak = max(peak if peak is not None else p, level + p)
            level += d or 0
            delta += d or 0
            roles = _line_roles(line, subject.key.device)
            measured = measured and roles is not None
            for role, value in (roles or ((), ()))[0]:
                sums[role] = sums.get(role, 0) + value
            texts.append(_line_hover(line, subject.key, name, d, p, roles))
        drawn = tuple(sorted(((r, v) for r, v in sums.items() if v), key=_role_order)) if measured else ()
        slots.append(_Slot(delta, peak, "\n".join(texts[:12]), chunk[0].lineno, chunk[-1].lineno, drawn))
    return slots


class _Segment(NamedTuple):
    """One role's part of a column: ``v0`` to ``v1`` in chart bytes, ``exact`` the role's bytes."""

    role: str
    exact: int
    v0: float
    v1: float
    left: bool  # released (drawn in the left half when the column also has added roles)


class _RolePlan(NamedTuple):
    segments: tuple
    low: float  # the lowest level the column reaches (released roles hang from its start)
    scale: float  # chart bytes per role byte (1.0: drawn exactly)
    split: bool  # released and added roles side by side, each in half the column


def _role_plan(slot: _Slot, start: int, end: int) -> Optional[_RolePlan]:
    """How a column with roles is stacked; None when it is drawn plainly.

    Released roles (negative) hang down from the line's start level, then added roles (positive)
    rise from there to its end level: the column ends where the line did and never rises above
    the larger of start and end, so it cannot contradict the measured peak (the whisker). We do
    not know in which order the line released and allocated, so when it did both the two stacks
    stand side by side (released left, added right) instead of one on top of the other.

    The roles are exact tensor bytes. When they do not add up to the charted change (always on a
    host RSS chart, where the allocator's pages and non-tensor objects count too) they are scaled
    to add up to it, and the legend says so; when they cannot be (no change, roles netting to the
    other direction, or roles far too small to be what moved it: :data:`MAX_ROLE_SCALE`) the
    column is drawn plainly and the roles are in its hover only.
    """
    if not slot.roles:
        return None
    delta = end - start
    net = sum(value for _role, value in slot.roles)
    if not delta or not net or (delta > 0) != (net > 0):
        return None
    scale = delta / net
    if scale > MAX_ROLE_SCALE:
        return None
    downs = [(role, value) for role, value in slot.roles if value < 0]
    ups = [(role, value) for role, value in slot.roles if value > 0]
    segments, level = [], float(start)
    for role, value in downs + ups:
        top = level + value * scale
        segments.append(_Segment(role, value, level, top, value < 0))
        level = top
    low = start + sum(value for _role, value in downs) * scale
    return _RolePlan(tuple(segments), min(low, start, end), scale, bool(downs and ups))


def _scaled(scale: float) -> bool:
    return abs(scale - 1.0) > 1e-3


def _waterfall_levels(before: int, slots: list) -> list:
    """``[(level at start, level at end, whisker top or None)]`` per slot."""
    out, level = [], before
    for slot in slots:
        start, end = level, level + (slot.delta or 0)
        whisker = None
        if slot.peak_increase is not None and start + slot.peak_increase > max(start, end):
            whisker = start + slot.peak_increase
        out.append((start, end, whisker))
        level = end
    return out


def _waterfall_range(low: float, high: float) -> tuple:
    """``(floor, top, ticks)``: from 0 normally; zoomed when the changes are small next to the base.

    A waterfall is about the changes: +256 MiB on top of 5 GiB would be a hairline on an axis
    from 0. When everything sits above 40% of the top, the axis starts at a round value below
    the lowest level instead (the before/after bars then carry a break mark).
    """
    if 0 <= low <= 0.4 * high:
        top, ticks = byte_ticks(high * 1.08)
        return 0, top, ticks
    # Zoomed, or below zero when the line deltas of an incomplete record undershoot.
    _, span_ticks = byte_ticks((high - low) * 1.15)
    step = span_ticks[1]
    floor = math.floor((low - 0.05 * (high - low)) / step) * step
    floor = max(0, floor) if low >= 0 else floor
    count = max(1, math.ceil((high + 0.08 * (high - low) - floor) / step))
    return floor, floor + count * step, [floor + i * step for i in range(count + 1)]


def _bar(x, w, v0, v1, frame, fill, opacity, hover, extra="") -> str:
    y0, y1 = frame.y(max(v0, v1)), frame.y(min(v0, v1))
    return (
        f'<g><title>{_text(hover)}</title><rect x="{_num(x)}" y="{_num(y0)}" width="{_num(w)}" '
        f'height="{_num(max(y1 - y0, 1.0))}" fill="{fill}" fill-opacity="{opacity}"/>{extra}</g>'
    )


def _waterfall(record, width: int, height: int, title: Optional[str], ink: Optional[str] = None) -> str:
    subject = _subject(record)
    name = series_name(subject.key)
    if subject.before is None and subject.after is None:
        return empty_svg(f"{record.label}: no memory readings for this cell", width, ink=ink)
    before = subject.before if subject.before is not None else 0
    after = subject.after if subject.after is not None else before
    peak = subject.peak
    max_slots = max(1, int((width - 80) / 6) - 2)
    slots = _line_slots(record, subject, max_slots) if record.lines else []
    if not slots:
        delta = after - before
        increase = None if peak is None else peak - before
        hover = (f"{_record_title(record)}\n{name} {format_delta(delta)}"
                 f"{'' if peak is None else f', peak {format_bytes(peak)} ({format_delta(increase)})'}")
        slots = [_Slot(delta, increase, hover)]
    levels = _waterfall_levels(before, slots)
    plans = [_role_plan(slot, start, end) for slot, (start, end, _w) in zip(slots, levels)]
    marks = [before, after] + [v for level in levels for v in level if v is not None]
    marks += [v for v in (peak,) + tuple(subject.reserved) if v is not None]
    marks += [plan.low for plan in plans if plan is not None]
    floor, top, ticks = _waterfall_range(min(marks), max(marks))
    left = 8 + max(_text_width(format_bytes(int(t))) for t in ticks)
    title = title if title is not None else f"{_record_title(record)} · {name}"
    role_rows = _legend_rows(_role_legend(plans, subject.key), left, width - 4)
    frame = _Frame(width, height, left, 20, 34 + 13 * len(role_rows), 0.0, float(len(slots) + 2), top, floor)
    parts = [_svg_open(width, height, title, ink), _y_axis(frame, ticks)]
    capacity = [(subject.key.device, subject.total)] if subject.total else []
    on_scale = subject.total is not None and subject.total <= top
    if capacity and on_scale:
        parts.append(_capacities(capacity, frame, False))
    parts.append(_end_bar(0, before, subject.reserved[0], "before", frame))
    parts += _slot_marks(slots, levels, frame, plans, name)
    parts.append(_end_bar(len(slots) + 1, after, subject.reserved[1], "after", frame))
    plain = any(plan is None and start != end for plan, (start, end, _w) in zip(plans, levels))
    legend = _waterfall_legend(subject.reserved, grew=plain or all(plan is None for plan in plans))
    if slots[0].first is not None and not _tick_words(slots, frame.sx):
        legend.append(("ticks: source lines", None, ""))
    y = height - 5 - 13 * len(role_rows)
    parts.append(_legend(legend, frame.px0, y, width - 4, "" if on_scale else _off_scale(capacity, False)))
    for row in role_rows:
        y += 13
        parts.append(_legend(row, frame.px0, y, width - 4))
    parts.append(f'<text x="{_num(frame.px0)}" y="13" font-size="11" font-weight="600" fill="currentColor">'
                 f'{_text(title)}</text></svg>')
    return "".join(parts)


def _waterfall_legend(reserved, grew: bool = True) -> list:
    """The waterfall's own legend row; ``grew``/``shrank`` only when a column is drawn plainly."""
    items = [("before / after", "currentColor", "")]
    if grew:
        items += [("grew", UP_COLOR, ""), ("shrank", DOWN_COLOR, "")]
    items.append(("peak", "currentColor", "2 2"))
    if any(r is not None for r in reserved):
        items.append(("reserved", "currentColor", "4 2"))
    return items


def role_color(role: str) -> str:
    return ROLE_COLORS.get(role, OTHER_ROLE_COLOR)


def _role_legend(plans: list, key: SeriesKey) -> list:
    """The roles drawn (ROLES order), ``released`` when a role was drawn going down, and a note
    when the roles were scaled to the charted change."""
    segments = [seg for plan in plans if plan is not None for seg in plan.segments]
    if not segments:
        return []
    roles = sorted({seg.role for seg in segments}, key=lambda role: _role_order((role, 0)))
    items = [(ROLE_WORDS.get(role, role), role_color(role), "box") for role in roles]
    if any(seg.exact < 0 for seg in segments):
        items.append(("released", "currentColor", "box-out"))
    if any(_scaled(plan.scale) for plan in plans if plan is not None):
        quantity = "RSS" if key.device.is_host else key.quantity
        items.append((f"roles: exact tensor bytes, scaled to the {quantity} change", None, ""))
    return items


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


def _end_bar(slot: int, value: int, reserved, label: str, frame: _Frame) -> str:
    """The before/after column: a neutral bar with its value, and reserved as a dashed tick."""
    w = frame.sx * 0.7
    x = frame.x(slot) + frame.sx * 0.15
    extra = (f'<text x="{_num(x + w / 2)}" y="{_num(frame.y(value) - 3)}" text-anchor="middle" font-size="9" '
             f'fill="currentColor">{_text(format_bytes(value))}</text>')
    if reserved is not None:
        y = frame.y(reserved)
        extra += (f'<line x1="{_num(x - 2)}" y1="{_num(y)}" x2="{_num(x + w + 2)}" y2="{_num(y)}" '
                  f'stroke="currentColor" stroke-width="1.2" stroke-dasharray="4 2"/>')
    if frame.ymin > 0:  # the bar is cut: say so with a break mark at its foot
        y = frame.py1 - 5
        extra += (f'<path d="M{_num(x - 2)},{_num(y + 2)} l{_num(w + 4)},-4 m0,4 l{_num(-w - 4)},4" '
                  f'stroke="currentColor" stroke-opacity="0.6" fill="none"/>')
    hover = f"{label}: {format_bytes(value)}" + ("" if reserved is None else f" (reserved {format_bytes(reserved)})")
    tick = (f'<text x="{_num(x + w / 2)}" y="{_num(frame.py1 + 13)}" text-anchor="middle" fill="currentColor" '
            f'fill-opacity="0.75">{label}</text>')
    base = max(frame.ymin, 0) if value >= 0 else frame.ymin
    return _bar(x, w, base, value, frame, "currentColor", 0.3, hover, extra) + tick


def _fits(text: str, width: float, size: float = 9) -> bool:
    return _text_width(text, size) <= width


def _whisker(cx: float, w: float, y_from: float, y_top: float) -> str:
    return (f'<line x1="{_num(cx)}" y1="{_num(y_from)}" x2="{_num(cx)}" y2="{_num(y_top)}" stroke="currentColor" '
            f'stroke-width="1.2" stroke-dasharray="2 2"/><line x1="{_num(cx - w / 4)}" y1="{_num(y_top)}" '
            f'x2="{_num(cx + w / 4)}" y2="{_num(y_top)}" stroke="currentColor" stroke-width="1.2"/>')


def _label(x: float, y: float, text: str, extra: str = "") -> str:
    return (f'<text x="{_num(x)}" y="{_num(y)}" text-anchor="middle" font-size="9" fill="currentColor"{extra}>'
            f'{_text(text)}</text>')


def _slot_texts(slot: _Slot, start: int, end: int, whisker, cx: float, w: float, room: float, frame: _Frame,
                low: Optional[float] = None) -> str:
    """The delta at its bar and the peak at its whisker, each only where it fits.

    The delta is written at the bar it belongs to, never at the whisker's top, where it would
    read as the peak: above a growing bar without a whisker, inside a growing bar tall enough to
    hold it (under the whisker otherwise), below a shrinking one. The whisker gets its own
    ``peak +X`` above it. A column stacked by role (``low``: its lowest level) keeps its label
    outside the coloured segments.
    """
    out = ""
    delta = end - start
    text = format_delta(delta)
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
    if whisker is not None and slot.peak_increase is not None:
        peak_text = f"peak {format_delta(slot.peak_increase)}"
        if _fits(peak_text, room):
            out += _label(cx, frame.y(whisker) - 3, peak_text, ' fill-opacity="0.8"')
    return out


def _tick_words(slots: list, slot_w: float) -> bool:
    """True when every column is wide enough for ``line 3`` / ``lines 3–5`` (else bare numbers,
    explained once in the legend)."""
    return all(_fits(f"lines {s.tick}", slot_w - 4) for s in slots if s.first is not None)


def _segment_hover(slot: _Slot, seg: _Segment, plan: _RolePlan, name: str) -> str:
    """A role segment's tooltip: the role and its exact bytes (what it was drawn as when
    scaled), then the column's own hover (the line, its change, its roles and its reason)."""
    text = f"{ROLE_WORDS.get(seg.role, seg.role)} {format_delta(seg.exact)}"
    if _scaled(plan.scale):
        text += f" (exact tensor bytes; drawn as {format_delta(round(seg.v1 - seg.v0))}, scaled to the {name} change)"
    return f"{text}\n{slot.hover}"


def _role_column(slot: _Slot, plan: _RolePlan, x: float, w: float, frame: _Frame, name: str) -> str:
    """The column's role segments, each a ``<g class="role" data-role=...>`` with its own title."""
    out = []
    for seg in plan.segments:
        sx, sw = (x, w / 2) if plan.split and seg.left else (x + w / 2, w / 2) if plan.split else (x, w)
        color = role_color(seg.role)
        style = (f'fill="{color}" fill-opacity="0.3" stroke="{color}" stroke-width="1" stroke-dasharray="3 2"'
                 if seg.exact < 0 else f'fill="{color}" fill-opacity="0.85"')
        y0, y1 = frame.y(max(seg.v0, seg.v1)), frame.y(min(seg.v0, seg.v1))
        hover = _text(_segment_hover(slot, seg, plan, name))
        out.append(f'<g class="role" data-role="{_text(seg.role)}"><title>{hover}</title>'
                   f'<rect x="{_num(sx)}" y="{_num(y0)}" width="{_num(sw)}" height="{_num(max(y1 - y0, 1.0))}" '
                   f'{style}/></g>')
    return "".join(out)


def _slot_marks(slots: list, levels: list, frame: _Frame, plans: Optional[list] = None, name: str = "") -> list:
    """The floating bars (stacked by role where ``plans`` says so), peak whiskers, connectors and
    the line ticks (``line 3``, or bare numbers when the columns are narrow)."""
    out = []
    slot_w = frame.sx
    every = max(1, math.ceil(_text_width("00–00", 9) / max(slot_w, 1e-6)))
    words = _tick_words(slots, slot_w)
    plans = plans or [None] * len(slots)
    for i, (slot, (start, end, whisker), plan) in enumerate(zip(slots, levels, plans)):
        x = frame.x(i + 1) + slot_w * 0.15
        w = max(slot_w * 0.7, 1.0)
        color = UP_COLOR if end > start else DOWN_COLOR if end < start else "currentColor"
        extra = ""
        if whisker is not None:
            extra += _whisker(x + w / 2, w, frame.y(max(start, end)), frame.y(whisker))
        extra += _slot_texts(slot, start, end, whisker, x + w / 2, w, slot_w - 2, frame,
                             None if plan is None else plan.low)
        if plan is None:
            out.append(_bar(x, w, start, end, frame, color, 0.75 if end != start else 0.3, slot.hover, extra))
        else:
            out.append(f'<g><title>{_text(slot.hover)}</title>{extra}</g>')
            out.append(_role_column(slot, plan, x, w, frame, name))
        # A connector from the previous column's level shows where this one starts.
        out.append(f'<line x1="{_num(frame.x(i + 0.85))}" y1="{_num(frame.y(start))}" x2="{_num(x)}" '
                   f'y2="{_num(frame.y(start))}" stroke="currentColor" stroke-opacity="0.35"/>')
        if i % every == 0:
            tick = slot.tick
            if words and slot.first is not None:
                tick = f"line {tick}" if slot.first == slot.last else f"lines {tick}"
            out.append(f'<text x="{_num(x + w / 2)}" y="{_num(frame.py1 + 13)}" text-anchor="middle" font-size="9" '
                       f'fill="currentColor" fill-opacity="0.75">{_text(tick)}</text>')
    if levels:
        last, n = levels[-1][1], len(slots)
        out.append(f'<line x1="{_num(frame.x(n + 0.85))}" y1="{_num(frame.y(last))}" '
                   f'x2="{_num(frame.x(n + 1.15))}" y2="{_num(frame.y(last))}" stroke="currentColor" '
                   f'stroke-opacity="0.35"/>')
    return out


def _samples_series(samples) -> tuple:
    """``(times, series, capacities)`` of probe Samples, times from the first one."""
    timeline = Timeline(max_points=max(8, 2 * len(samples) + 8))
    for sample in samples:
        timeline.add(sample)
    snap = timeline.snapshot()
    return snap.t, dict(snap.series), dict(snap.capacities)


def cell_svg(record, samples=None, width: int = 480, height: int = 200, title: Optional[str] = None,
             ink: Optional[str] = None) -> str:
    """The chart of one cell as an SVG string.

    Args:
        record: the cell's :class:`~ipy_gpumem.core.records.CellRecord` (None gives a placeholder).
        samples: :class:`~ipy_gpumem.core.probes.Sample` objects taken during the cell, or None.
            With two or more, the chart is the line chart over the cell's time with the record's
            exact peak as a dashed line. Otherwise it is the before / per-line / after waterfall
            described in the module doc.
        width: pixels (at least 240 are used).
        height: pixels (at least 120 are used).
        title: text above the plot; defaults to the cell's label and first line.
        ink: the chart's ``currentColor``; None inherits the page's (inline SVG), :data:`IMG_INK`
            for an ``<img>`` (``chart.views.svg_data_uri``), which an untrusted notebook keeps
            where its sanitizer strips inline SVG.
    """
    width, height = max(int(width), MIN_WIDTH), max(int(height), MIN_HEIGHT)
    if record is None:
        return empty_svg("no record", width, ink=ink)
    try:
        points = [s for s in samples if s is not None and hasattr(s, "host")] if samples is not None else []
    except TypeError:
        points = []
    if len(points) >= 2:
        times, series, capacities = _samples_series(points)
        keys = _drawn_keys(series)
        if keys:
            subject = _subject(record)
            # The record's exact peak belongs on the chart only when it is the drawn quantity.
            peak = subject.peak if subject.key.device.is_host == keys[0].device.is_host else None
            if subject.total and subject.key.device.is_cuda:
                capacities.setdefault(subject.key.device, subject.total)
            return _line_chart(times, series, series, keys, capacities=capacities, end=times[-1] if times else 0.0,
                               width=width, height=height, title=title or _record_title(record), peak=peak, ink=ink)
    return _waterfall(record, width, height, title, ink)
