"""The session's recorded cells as a plotly figure dict: one column per cell, from where it started to where it ended.

What ``%gpumem history`` lists as a table, drawn: per cell a floating bar from its level before to
its level after (red where it grew, green where it shrank), a mark at its exact peak, and reserved
memory after it as a dashed line; one device (the one that moved most over the session, else host
RSS). The hover names the cell, its first line and its numbers. Idle time between cells takes no
room, unlike the timeline, so a long session's cells stay readable; zoom, pan and PNG export are
plotly's.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ...core.text import clip
from ...core.units import format_bytes, format_delta, format_seconds
from ..svg.base import device_color
from ..svg.legend import series_name
from ..timeline import HOST_RSS, SeriesKey
from ...core.devices import cuda
from ...display.escape import plotly_text
from .bars import change_bars, column_layout
from .timeline import byte_unit, figure_config

__all__ = ["history_figure", "MAX_CELLS"]

#: The newest cells drawn (the table itself has ``history N``); older ones are in the record.
MAX_CELLS = 500


def _subject(records) -> SeriesKey:
    moved: dict = {}
    for rec in records:
        for dev in rec.devices:
            moved[dev.index] = moved.get(dev.index, 0) + abs(dev.allocated_delta or 0) + (dev.peak_increase or 0)
    if not moved:
        return HOST_RSS
    return SeriesKey(cuda(max(moved, key=moved.get)), "allocated")


def _values(rec, key: SeriesKey) -> tuple:
    """``(before, after, peak, reserved after)`` of one record for the charted series (None where unknown)."""
    if key.device.is_host:
        host = rec.host
        return host.rss_before, host.rss_after, host.rss_peak, None
    for dev in rec.devices:
        if dev.index == key.device.index:
            return dev.allocated_before, dev.allocated_after, dev.allocated_peak, dev.reserved_after
    return None, None, None, None


def history_figure(records: Sequence, *, height: int = 320) -> Optional[dict]:
    """The recorded cells as a plotly figure dict, or None when no cell has a reading."""
    records = [rec for rec in list(records)[-MAX_CELLS:]]
    if not records:
        return None
    key = _subject(records)
    name = series_name(key)
    rows = []
    for rec in records:
        before, after, peak, reserved = _values(rec, key)
        if before is None and after is None:
            continue
        before = before if before is not None else after
        after = after if after is not None else before
        rows.append((rec, before, after, peak, reserved))
    if not rows:
        return None
    top = max(max(before, after, peak or 0, reserved or 0) for _rec, before, after, peak, reserved in rows)
    divisor, unit = byte_unit(top)

    def scale(value):
        return round(value / divisor, 4)

    labels = [f"{rec.label}" if rec.execution_count is not None else f"[ ] #{i}" for i, (rec, *_v) in enumerate(rows)]
    columns = []
    for label, (rec, before, after, peak, reserved) in zip(labels, rows):
        hover = (f"{rec.label} {clip(rec.first_line, 80)}\n{name} {format_delta(after - before)} "
                 f"→ {format_bytes(after)}" + ("" if peak is None else f", peak {format_bytes(peak)}")
                 + ("" if reserved is None else f"\nreserved {format_bytes(reserved)}")
                 + f"\n{format_seconds(rec.duration_s)}" + (f" · {rec.error}" if rec.error else ""))
        columns.append((label, before, after, plotly_text(hover)))
    data = change_bars(columns, scale)
    peaks = [(label, peak) for label, (_r, _b, _a, peak, _res) in zip(labels, rows) if peak is not None]
    if peaks:
        data.append({"type": "scatter", "mode": "markers", "name": "peak (exact)", "x": [p[0] for p in peaks],
                     "y": [scale(p[1]) for p in peaks],
                     "marker": {"symbol": "line-ew-open", "size": 14, "line": {"width": 2.5},
                                "color": device_color(key.device)},
                     "hovertemplate": f"peak %{{y:.2f}} {unit}<extra>%{{x}}</extra>"})
    reserved = [(label, res) for label, (_r, _b, _a, _p, res) in zip(labels, rows) if res is not None]
    if reserved:
        data.append({"type": "scatter", "mode": "lines", "name": plotly_text(f"{key.device.label} reserved after"),
                     "x": [r[0] for r in reserved], "y": [scale(r[1]) for r in reserved],
                     "line": {"dash": "dash", "color": device_color(key.device), "width": 1.4, "shape": "hv"},
                     "hovertemplate": f"reserved %{{y:.2f}} {unit}<extra>%{{x}}</extra>"})
    errors = [label for label, (rec, *_v) in zip(labels, rows) if rec.error]
    layout = column_layout(f"recorded cells · {name}", labels, f"{name} ({unit})", height, -0.22,
                           xtitle="cell" + (f" (failed: {', '.join(errors[:6])})" if errors else ""))
    return {"data": data, "layout": layout, "config": figure_config("ipy_gpumem-history")}
