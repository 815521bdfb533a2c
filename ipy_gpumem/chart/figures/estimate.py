"""A ``%%gpumem --estimate`` as a plotly figure dict: the predicted level line by line, against the GPU it must fit.

The per-line table drawn: the allocated level before the step, one floating bar per line of the
steady-state (second) run going up or down by its predicted change, a mark at each line's peak,
the predicted peak allocated and reserved, and the card's usable memory as a line when the
estimate has a verdict. Hovers name the line and its source. Nothing here reads torch: the
estimate is read by its attributes (``preflight.cell.CellEstimate``).
"""
from __future__ import annotations

from typing import Optional

from ...core.text import clip
from ...core.units import format_bytes, format_delta
from ..svg.base import FAILED_COLOR, IMG_INK
from ...display.escape import plotly_text
from .bars import END_BARS_COLOR, change_bars, column_layout
from .timeline import byte_unit, figure_config

__all__ = ["estimate_figure"]


def estimate_figure(cell, *, height: int = 300) -> Optional[dict]:
    """The predicted per-line levels of ``cell`` (a ``CellEstimate``) as a figure dict; None without lines."""
    est = cell.estimate
    lines = sorted(cell.lines or (), key=lambda ln: ln.lineno)
    if not lines:
        return None
    fit = cell.fit
    level = est.start_allocated
    rows = []
    for line in lines:
        start, end = level, level + line.allocated_delta
        top = start + line.peak_increase if line.peak_increase else None
        rows.append((line, start, end, top if top is not None and top > max(start, end) else None))
        level = end
    values = [est.start_allocated, est.peak_allocated, est.peak_reserved] + [v for _l, s, e, t in rows
                                                                            for v in (s, e, t) if v is not None]
    if fit is not None:
        values.append(fit.capacity)
    divisor, unit = byte_unit(max(values))

    def scale(value):
        return round(value / divisor, 4)

    ticks = ["before"] + [f"line {line.lineno}" for line, *_r in rows] + ["peak"]
    data = [{"type": "bar", "name": "before / predicted peak", "x": [ticks[0], ticks[-1]],
             "y": [scale(est.start_allocated), scale(est.peak_allocated)], "marker": {"color": END_BARS_COLOR},
             "hovertemplate": f"%{{x}}: %{{y:.2f}} {unit} allocated<extra></extra>"}]
    columns = []
    for tick, (line, start, end, _top) in zip(ticks[1:-1], rows):
        source = cell.source_lines[line.lineno - 1] if 0 < line.lineno <= len(cell.source_lines) else ""
        columns.append((tick, start, end, plotly_text(f"line {line.lineno} ×{line.hits}: {clip(source.strip(), 80)}")
                        + f"<br>allocated {format_delta(line.allocated_delta)}, peak in line "
                          f"{format_delta(line.peak_increase)}, reserved {format_delta(line.reserved_delta)}"))
    data += change_bars(columns, scale, words=("grows", "shrinks"))
    peaks = [(tick, top) for tick, (_l, _s, _e, top) in zip(ticks[1:-1], rows) if top is not None]
    if peaks:
        data.append({"type": "scatter", "mode": "markers", "name": "peak in line", "x": [p[0] for p in peaks],
                     "y": [scale(p[1]) for p in peaks], "marker": {"symbol": "line-ew-open", "size": 14,
                                                                   "line": {"width": 2}, "color": IMG_INK},
                     "hovertemplate": f"%{{y:.2f}} {unit}<extra>peak in %{{x}}</extra>"})
    shapes, notes = [], []
    if est.device.startswith("cuda"):
        y = scale(est.peak_reserved)
        shapes.append({"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": y, "y1": y,
                       "line": {"dash": "dash", "color": IMG_INK, "width": 1}})
        notes.append({"xref": "paper", "yref": "y", "x": 0, "y": y, "xanchor": "left", "yanchor": "bottom",
                      "showarrow": False, "text": f"peak reserved {format_bytes(est.peak_reserved)}",
                      "font": {"size": 10}})
    if fit is not None:
        y = scale(fit.capacity)
        colour = IMG_INK if fit.fits else FAILED_COLOR
        shapes.append({"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": y, "y1": y,
                       "line": {"dash": "dashdot", "color": colour, "width": 1.4}})
        notes.append({"xref": "paper", "yref": "y", "x": 1, "y": y, "xanchor": "right", "yanchor": "bottom",
                      "showarrow": False, "font": {"size": 10, "color": colour},
                      "text": plotly_text(f"{fit.gpu}: {format_bytes(fit.capacity)} usable · "
                                          + ("fits" if fit.fits else f"needs {format_bytes(fit.needed)}"))})
    layout = column_layout("predicted allocated memory, line by line (second run)", ticks,
                           f"{est.device} allocated ({unit})", height, -0.2, shapes, notes)
    return {"data": data, "layout": layout, "config": figure_config("ipy_gpumem-estimate")}
