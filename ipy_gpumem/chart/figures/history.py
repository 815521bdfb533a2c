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
from ..svg.base import DOWN_COLOR, IMG_INK, UP_COLOR, device_color
from ..svg.legend import series_name
from ..timeline import HOST_RSS, SeriesKey
from ...core.devices import cuda
from .timeline import UIREVISION, byte_unit, figure_config

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


def _html(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


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
    bars = {"grew": ([], [], [], []), "shrank": ([], [], [], []), "no change": ([], [], [], [])}
    for label, (rec, before, after, peak, reserved) in zip(labels, rows):
        kind = "grew" if after > before else "shrank" if after < before else "no change"
        xs, bases, ys, texts = bars[kind]
        xs.append(label)
        bases.append(scale(min(before, after)))
        ys.append(max(scale(abs(after - before)), 0.0005))
        hover = (f"{rec.label} {clip(rec.first_line, 80)}<br>{name} {format_delta(after - before)} "
                 f"→ {format_bytes(after)}" + ("" if peak is None else f", peak {format_bytes(peak)}")
                 + ("" if reserved is None else f"<br>reserved {format_bytes(reserved)}")
                 + f"<br>{format_seconds(rec.duration_s)}" + (f" · {rec.error}" if rec.error else ""))
        texts.append(_html(hover).replace("&lt;br&gt;", "<br>"))
    colours = {"grew": UP_COLOR, "shrank": DOWN_COLOR, "no change": IMG_INK}
    data = [{"type": "bar", "name": kind, "x": xs, "base": bases, "y": ys, "hovertext": texts, "hoverinfo": "text",
             "marker": {"color": colours[kind], "opacity": 0.8}}
            for kind, (xs, bases, ys, texts) in bars.items() if xs]
    peaks = [(label, peak) for label, (_r, _b, _a, peak, _res) in zip(labels, rows) if peak is not None]
    if peaks:
        data.append({"type": "scatter", "mode": "markers", "name": "peak (exact)", "x": [p[0] for p in peaks],
                     "y": [scale(p[1]) for p in peaks],
                     "marker": {"symbol": "line-ew-open", "size": 14, "line": {"width": 2.5},
                                "color": device_color(key.device)},
                     "hovertemplate": f"peak %{{y:.2f}} {unit}<extra>%{{x}}</extra>"})
    reserved = [(label, res) for label, (_r, _b, _a, _p, res) in zip(labels, rows) if res is not None]
    if reserved:
        data.append({"type": "scatter", "mode": "lines", "name": f"{key.device.label} reserved after",
                     "x": [r[0] for r in reserved], "y": [scale(r[1]) for r in reserved],
                     "line": {"dash": "dash", "color": device_color(key.device), "width": 1.4, "shape": "hv"},
                     "hovertemplate": f"reserved %{{y:.2f}} {unit}<extra>%{{x}}</extra>"})
    errors = [label for label, (rec, *_v) in zip(labels, rows) if rec.error]
    axis = {"gridcolor": "rgba(140,140,140,0.2)", "linecolor": "rgba(140,140,140,0.5)", "color": IMG_INK}
    layout = {
        "title": {"text": f"recorded cells · {name}", "x": 0, "xanchor": "left", "font": {"size": 12}},
        "barmode": "overlay", "height": int(height), "autosize": True, "uirevision": UIREVISION,
        "margin": {"l": 56, "r": 12, "t": 30, "b": 8}, "paper_bgcolor": "rgba(0,0,0,0)", "plot_bgcolor": "rgba(0,0,0,0)",
        "font": {"family": "var(--jp-ui-font-family, sans-serif)", "size": 11, "color": IMG_INK},
        "legend": {"orientation": "h", "x": 0, "y": -0.22, "yanchor": "top", "font": {"size": 10}},
        "xaxis": dict(axis, type="category", categoryorder="array", categoryarray=labels, tickfont={"size": 9},
                      title={"text": "cell" + (f" (failed: {', '.join(errors[:6])})" if errors else ""),
                             "font": {"size": 10}}),
        "yaxis": dict(axis, title={"text": f"{name} ({unit})", "font": {"size": 10}}),
        "hovermode": "closest",
    }
    return {"data": data, "layout": layout, "config": figure_config("ipy_gpumem-history")}
