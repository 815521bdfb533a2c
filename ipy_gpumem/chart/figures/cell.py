"""One cell as a plotly figure dict: the samples it saw over time, or the waterfall of its lines from its record.

The same choice and the same numbers as ``chart.svg.cell_svg`` (both read the record through
``chart.svg.slots``): with two or more samples, the session's line figure over the cell's time
plus the record's exact peak; otherwise before, one floating bar per executed line (stacked by
role where the line counted roles: parameters, gradients, optimizer state, activations), a
dashed whisker up to each line's peak, and after. Every bar's hover names its line and source.
"""
from __future__ import annotations

from typing import Optional

from ...core.roles import ROLE_WORDS
from ...core.units import format_bytes, format_delta
from ...display.escape import plotly_text
from ..svg.base import IMG_INK, role_color
from ..svg.legend import series_name
from ..svg.roles import _role_plan
from ..svg.slots import _line_slots, _record_title, _Slot, _subject
from ..svg.waterfall import _waterfall_levels
from ..timeline import Timeline
from .bars import END_BARS_COLOR, change_bars, column_layout
from .timeline import byte_unit, figure_config, timeline_figure

__all__ = ["cell_figure", "MAX_COLUMNS"]

#: More lines than this share columns (as the SVG does when it runs out of width).
MAX_COLUMNS = 80


def _samples_figure(record, points, height: int) -> dict:
    timeline = Timeline(max_points=max(8, 2 * len(points) + 8))
    for sample in points:
        timeline.add(sample)
    figure = timeline_figure(timeline.snapshot(), height=height, title=_record_title(record),
                             filename=f"ipy_gpumem-cell-{record.execution_count or 'x'}")
    subject = _subject(record)
    drawn = [trace for trace in figure["data"] if trace.get("mode") == "lines"]
    if subject.peak is not None and drawn and drawn[0]["name"] == plotly_text(series_name(subject.key)):
        divisor, _unit = byte_unit(max([subject.peak] + [v for t in drawn for v in t["y"] if v is not None]))
        y = round(subject.peak / divisor, 4)
        figure["layout"]["shapes"].append({"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": y,
                                           "y1": y, "line": {"color": drawn[0]["line"]["color"], "dash": "dot"}})
        figure["layout"]["annotations"].append({
            "xref": "paper", "yref": "y", "x": 0, "y": y, "xanchor": "left", "yanchor": "bottom", "showarrow": False,
            "text": f"peak {format_bytes(subject.peak)} (exact, from the record)", "font": {"size": 10}})
    figure["layout"]["xaxis"]["rangeslider"]["visible"] = False  # a cell is short: the slider only takes room
    return figure


def _columns(record, subject) -> list:
    slots = _line_slots(record, subject, MAX_COLUMNS) if record.lines else []
    if slots:
        return slots
    before = subject.before or 0
    after = subject.after if subject.after is not None else before
    increase = None if subject.peak is None else subject.peak - before
    hover = (f"{_record_title(record)}\n{series_name(subject.key)} {format_delta(after - before)}"
             f"{'' if subject.peak is None else f', peak {format_bytes(subject.peak)} ({format_delta(increase)})'}")
    return [_Slot(after - before, increase, hover)]


def _tick(slot) -> str:
    if slot.first is None:
        return "cell"
    return f"line {slot.tick}" if slot.first == slot.last else f"lines {slot.tick}"


def _waterfall_figure(record, height: int) -> dict:
    subject = _subject(record)
    name = series_name(subject.key)
    before = subject.before if subject.before is not None else 0
    after = subject.after if subject.after is not None else before
    slots = _columns(record, subject)
    levels = _waterfall_levels(before, slots)
    plans = [_role_plan(slot, start, end) for slot, (start, end, _w) in zip(slots, levels)]
    top = max([before, after] + [v for level in levels for v in level if v is not None]
              + [v for v in (subject.peak,) + tuple(subject.reserved) if v is not None])
    divisor, unit = byte_unit(top)

    def scale(value):
        return round(value / divisor, 4)

    ticks = ["before"] + [_tick(slot) for slot in slots] + ["after"]
    data: list = [{
        "type": "bar", "name": "before / after", "x": [ticks[0], ticks[-1]], "y": [scale(before), scale(after)],
        "marker": {"color": END_BARS_COLOR}, "hovertemplate": f"%{{x}}: %{{y:.2f}} {unit}<extra></extra>",
    }]
    plain: list = []  # (tick, start, end, hover) of the columns drawn without roles
    roles: dict = {}
    for tick, slot, (start, end, _whisker), plan in zip(ticks[1:-1], slots, levels, plans):
        hover = plotly_text(slot.hover)
        if plan is None:
            plain.append((tick, start, end, hover))
            continue
        for segment in plan.segments:  # stacked by role, as the SVG column is
            xs, bases, ys, texts = roles.setdefault(segment.role, ([], [], [], []))
            xs.append(tick)
            bases.append(scale(min(segment.v0, segment.v1)))
            ys.append(scale(abs(segment.v1 - segment.v0)))
            role = plotly_text(ROLE_WORDS.get(segment.role, segment.role))
            texts.append(f"{role} {format_delta(segment.exact)}<br>{hover}")
    data += change_bars(plain, scale)
    for role, (xs, bases, ys, texts) in roles.items():
        data.append({"type": "bar", "name": plotly_text(ROLE_WORDS.get(role, role)), "x": xs, "base": bases, "y": ys,
                     "hovertext": texts, "hoverinfo": "text", "marker": {"color": role_color(role), "opacity": 0.85}})
    peaks = [(tick, whisker, slot) for tick, slot, (_s, _e, whisker) in zip(ticks[1:-1], slots, levels)
             if whisker is not None]
    if peaks:
        data.append({
            "type": "scatter", "mode": "markers", "name": "peak", "x": [tick for tick, _w, _s in peaks],
            "y": [scale(whisker) for _t, whisker, _s in peaks],
            "marker": {"symbol": "line-ew-open", "size": 16, "line": {"width": 2}, "color": IMG_INK},
            "hovertext": [f"peak {format_delta(slot.peak_increase)} within the line" for _t, _w, slot in peaks],
            "hoverinfo": "text",
        })
    reserved = [(tick, value) for tick, value in zip((ticks[0], ticks[-1]), subject.reserved) if value is not None]
    if reserved:
        data.append({"type": "scatter", "mode": "markers", "name": "reserved", "x": [t for t, _v in reserved],
                     "y": [scale(v) for _t, v in reserved], "marker": {"symbol": "line-ew", "size": 28,
                                                                       "line": {"width": 2, "color": IMG_INK}},
                     "hovertemplate": f"reserved %{{y:.2f}} {unit}<extra></extra>"})
    shapes, notes = [], []
    if subject.total and subject.total <= top * 1.3:
        y = scale(subject.total)
        shapes.append({"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": y, "y1": y,
                       "line": {"dash": "dashdot", "color": IMG_INK}})
        notes.append({"xref": "paper", "yref": "y", "x": 1, "y": y, "xanchor": "right", "yanchor": "bottom",
                      "showarrow": False, "text": f"{format_bytes(subject.total)} total", "font": {"size": 10}})
    layout = column_layout(f"{_record_title(record)} · {name}", ticks, f"{name} ({unit})", height, -0.18,
                           shapes, notes)
    return {"data": data, "layout": layout,
            "config": figure_config(f"ipy_gpumem-cell-{record.execution_count or 'x'}")}


def cell_figure(record, samples=None, *, height: int = 300) -> Optional[dict]:
    """The chart of one cell as a plotly figure dict, or None without a record or any reading.

    Args:
        record: the cell's :class:`~ipy_gpumem.core.records.CellRecord`.
        samples: :class:`~ipy_gpumem.core.probes.Sample` objects taken during the cell, or None.
        height: pixels; the width follows the output area.
    """
    if record is None:
        return None
    try:
        points = [s for s in samples if s is not None and hasattr(s, "host")] if samples is not None else []
    except TypeError:
        points = []
    if len(points) >= 2:
        return _samples_figure(record, points, height)
    subject = _subject(record)
    if subject.before is None and subject.after is None:
        return None
    return _waterfall_figure(record, height)
