"""Column charts as plotly figure dicts, drawn from their layout (``chart.columns``): a cell line by line, the history, an estimate.

The same columns as the SVG picture (``svg.bars``): end columns from the floor, a bar per change
(red where memory grew, green where it shrank, grey where it stayed) or stacked by role, the peaks
above them, the reserved levels, the capacity drawn when it is on the scale of the data and written
as a number otherwise. The axis is the layout's (zoomed when the changes are small next to the base).
Hovers are the layout's words (``chart.words.column_hover``), escaped for plotly here.
"""
from __future__ import annotations

from typing import Optional

from ...display.escape import plotly_text
from ..columns import ColumnsLayout
from ..style import DOWN_COLOR, FLAT_COLOR, IMG_INK, PEAK_COLOR, UP_COLOR, role_color
from ..words import column_hover, role_word, segment_hover
from .timeline import UIREVISION, figure_config

__all__ = ["columns_figure", "column_layout", "END_BARS_COLOR"]

#: The end columns (before, after, a predicted peak): neutral, under the coloured ones.
END_BARS_COLOR = "rgba(140,140,140,0.45)"
#: A column that did not move is drawn this tall (in the figure's unit), so it can still be hovered.
_FLAT = 0.0005


def column_layout(title: str, ticks, ytitle: str, height: int, legend_y: float, shapes=(), notes=(),
                  xtitle: Optional[str] = None, yrange=None) -> dict:
    """The layout of a column figure: its columns in ``ticks`` order on a category axis, overlaid bars, a
    legend under the plot, the transparent grey look of every figure here. The titles are plain text
    (escaped here); ``ticks`` are the traces' own x values."""
    axis = {"gridcolor": "rgba(140,140,140,0.2)", "linecolor": "rgba(140,140,140,0.5)", "color": IMG_INK}
    xaxis = dict(axis, type="category", categoryorder="array", categoryarray=list(ticks), tickfont={"size": 9})
    if xtitle:
        xaxis["title"] = {"text": plotly_text(xtitle), "font": {"size": 10}}
    yaxis = dict(axis, title={"text": plotly_text(ytitle), "font": {"size": 10}})
    if yrange is not None:
        yaxis["range"] = list(yrange)
    return {
        "title": {"text": plotly_text(title), "x": 0, "xanchor": "left", "font": {"size": 12}},
        "barmode": "overlay", "height": int(height), "autosize": True, "uirevision": UIREVISION,
        "margin": {"l": 56, "r": 12, "t": 30, "b": 8}, "paper_bgcolor": "rgba(0,0,0,0)", "plot_bgcolor": "rgba(0,0,0,0)",
        "font": {"family": "var(--jp-ui-font-family, sans-serif)", "size": 11, "color": IMG_INK},
        "legend": {"orientation": "h", "x": 0, "y": legend_y, "yanchor": "top", "font": {"size": 10}},
        "xaxis": xaxis, "yaxis": yaxis, "shapes": list(shapes), "annotations": list(notes), "hovermode": "closest",
    }


def _hline(y: float, colour: str, dash: str, text: str, right: bool, width: float = 1.2) -> tuple:
    shape = {"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": y, "y1": y,
             "line": {"dash": dash, "color": colour, "width": width}}
    note = {"xref": "paper", "yref": "y", "x": 1 if right else 0, "y": y, "xanchor": "right" if right else "left",
            "yanchor": "bottom", "showarrow": False, "text": plotly_text(text), "font": {"size": 10, "color": IMG_INK}}
    return shape, note


def columns_figure(layout: Optional[ColumnsLayout], *, height: int = 300, filename: str = "ipy_gpumem",
                   legend_y: float = -0.2) -> Optional[dict]:
    """A column layout as a plotly figure dict, or None without a layout."""
    if layout is None:
        return None
    divisor, unit = layout.unit.divisor, layout.unit.name

    def scale(value):
        return round(value / divisor, 4)

    ticks = [c.tick for c in layout.columns]
    ends = [c for c in layout.columns if c.kind == "end"]
    data: list = []
    if ends:
        data.append({"type": "bar", "name": plotly_text(layout.legend[0].label if layout.legend else "before / after"),
                     "x": [c.tick for c in ends], "base": [scale(layout.floor)] * len(ends),
                     "y": [scale(c.start - layout.floor) for c in ends], "marker": {"color": END_BARS_COLOR},
                     "hovertext": [plotly_text(column_hover(layout, c)) for c in ends], "hoverinfo": "text"})
    names = {"up": "grew", "down": "shrank", "flat": "no change"}
    if layout.kind == "estimate":
        names.update(up="grows", down="shrinks")
    colours = {"up": UP_COLOR, "down": DOWN_COLOR, "flat": FLAT_COLOR}
    plain: dict = {}
    roles: dict = {}
    for column in layout.columns:
        if column.kind == "end":
            continue
        hover = plotly_text(column_hover(layout, column))
        if column.plan is None:
            xs, bases, ys, texts = plain.setdefault(column.kind, ([], [], [], []))
            xs.append(column.tick)
            bases.append(scale(min(column.start, column.end)))
            ys.append(max(scale(abs(column.end - column.start)), _FLAT))
            texts.append(hover)
            continue
        for seg in column.plan.segments:  # stacked by role, as the picture's column is
            xs, bases, ys, texts = roles.setdefault(seg.role, ([], [], [], []))
            xs.append(column.tick)
            bases.append(scale(min(seg.v0, seg.v1)))
            ys.append(scale(abs(seg.v1 - seg.v0)))
            drawn = round(seg.v1 - seg.v0) if column.plan.scaled else None
            texts.append(plotly_text(segment_hover(seg.role, seg.exact, drawn, layout.name, column_hover(layout, column))))
    for kind in ("up", "down", "flat"):
        if kind in plain:
            xs, bases, ys, texts = plain[kind]
            data.append({"type": "bar", "name": names[kind], "x": xs, "base": bases, "y": ys, "hovertext": texts,
                         "hoverinfo": "text", "marker": {"color": colours[kind], "opacity": 0.8}})
    for role, (xs, bases, ys, texts) in roles.items():
        data.append({"type": "bar", "name": plotly_text(role_word(role)), "x": xs, "base": bases, "y": ys,
                     "hovertext": texts, "hoverinfo": "text", "marker": {"color": role_color(role), "opacity": 0.85}})
    peaks = [c for c in layout.columns if c.whisker is not None]
    if peaks:
        words = {"history": "peak (exact)", "estimate": "peak in line"}.get(layout.kind, "peak")
        data.append({"type": "scatter", "mode": "markers", "name": words, "x": [c.tick for c in peaks],
                     "y": [scale(c.whisker) for c in peaks],
                     "marker": {"symbol": "line-ew-open", "size": 16, "line": {"width": 2.5, "color": PEAK_COLOR},
                                "color": PEAK_COLOR},
                     "hovertemplate": f"{words} %{{y:.2f}} {unit}<extra>%{{x}}</extra>"})
    reserved = [c for c in layout.columns if c.reserved is not None]
    if reserved and layout.kind == "history":
        data.append({"type": "scatter", "mode": "lines", "name": plotly_text(f"{layout.key.device.label} reserved after"),
                     "x": [c.tick for c in reserved], "y": [scale(c.reserved) for c in reserved],
                     "line": {"dash": "dash", "color": IMG_INK, "width": 1.4, "shape": "hv"},
                     "hovertemplate": f"reserved %{{y:.2f}} {unit}<extra>%{{x}}</extra>"})
    elif reserved:
        data.append({"type": "scatter", "mode": "markers", "name": "reserved", "x": [c.tick for c in reserved],
                     "y": [scale(c.reserved) for c in reserved],
                     "marker": {"symbol": "line-ew", "size": 28, "line": {"width": 2, "color": IMG_INK}},
                     "hovertemplate": f"reserved %{{y:.2f}} {unit}<extra></extra>"})
    shapes, notes = [], []
    for value, text, kind in layout.lines:
        shape, note = _hline(scale(value), IMG_INK, kind, text, right=False, width=1.0)
        shapes.append(shape)
        notes.append(note)
    capacity = layout.capacity
    if capacity is not None and capacity.on_scale:
        shape, note = _hline(scale(capacity.total), capacity.color, "dashdot", capacity.label, right=True, width=1.4)
        shapes.append(shape)
        notes.append(note)
    elif capacity is not None:  # far above the step: a number, not a line that would squash the columns
        suffix = "" if layout.kind == "estimate" else " (off scale)"
        notes.append({"xref": "paper", "yref": "paper", "x": 1, "y": 1.0, "xanchor": "right", "yanchor": "bottom",
                      "showarrow": False, "text": plotly_text(capacity.label + suffix),
                      "font": {"size": 10, "color": capacity.color}})
    figure_layout = column_layout(layout.title, ticks, f"{layout.name} ({unit})", height, legend_y, shapes, notes,
                                  xtitle=layout.xtitle or None, yrange=(scale(layout.floor), scale(layout.top)))
    return {"data": data, "layout": figure_layout, "config": figure_config(filename)}
