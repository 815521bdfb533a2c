"""The session chart as a plotly figure, drawn from its layout (``chart.session``) as plain JSON-ready dicts (plotly itself is not imported here).

A figure is only data: ``{"data": [...], "layout": {...}, "config": {...}}``. Building it by hand keeps
plotly off every path (the MIME type ``application/vnd.plotly.v1+json`` carries the dict as it is, and
the front end's plotly draws it), and the layout it draws is the one the SVG picture draws.

The traces are a fixed set in a fixed order, each with a ``uid`` naming what it is: the four kinds
of cell band, the cells' hover markers, the cells' exact peaks, then one trace per series and per
process a cell launched. Every trace has its x and y values; a kind with nothing to draw yet is an
empty trace, never a missing one. A live chart (``figures.live``) passes the order it has drawn so
far, so a series that appears later is appended and no trace ever changes its index: a legend click,
a zoom or a hover made in the browser survives every update (``uirevision`` keeps them).

Every text field (names, hovers, labels, titles, notes) goes through ``display.escape.plotly_text``
where it is placed: plotly.js reads them as HTML of its own, and a cell's first line is the user's.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Optional, Sequence

from ...display.escape import plotly_text
from ..scale import byte_unit
from ..session import SessionLayout, session_layout
from ..style import BANDS, FAILED_COLOR, IMG_INK, PEAK_COLOR, RUNNING_COLOR, band, device_color, rgba
from ..timeline import TimelineSnapshot
from ..words import PEAK_LEGEND, capacity_text, exact_peak_text, off_scale_note, series_name, span_hover

__all__ = ["timeline_figure", "session_figure", "figure_config", "trace_order", "trace_uid", "PLOTLY_MIME",
           "UIREVISION", "byte_unit", "PLOT_DASH", "FIXED_TRACES", "MAX_HOVER_CELLS"]

PLOTLY_MIME = "application/vnd.plotly.v1+json"
#: Constant across updates: plotly keeps the user's zoom, pan and legend choices while it is unchanged.
UIREVISION = "ipy_gpumem"
#: Line kinds (``chart.style.LINE_KINDS``) in plotly's words.
PLOT_DASH = {"solid": "solid", "dash": "dash", "dot": "dot", "dashdot": "dashdot"}
#: Past this many cells only the newest keep a hover marker (older ones are merged runs already).
MAX_HOVER_CELLS = 300


def trace_uid(*parts) -> str:
    """A trace's uid from what it is, its parts joined by dashes: letters and digits stay, any other character
    is ``_`` and its code in hex then ``_`` (``cuda:0`` is ``cuda_3a_0``), so two names never share a uid.

    plotly.js puts a trace's uid in a CSS selector (``.cb<uid>``, when a redraw clears colour bars): a ``:``
    there made ``Plotly.react`` throw, and the live figure stopped moving."""
    return "-".join(re.sub(r"[^A-Za-z0-9]", lambda m: f"_{ord(m.group()):x}_", str(part)) for part in parts)


#: The traces every session figure starts with, in this order, whatever it holds.
FIXED_TRACES = tuple(trace_uid("band", kind) for kind in BANDS) + ("cells", "peaks")


def figure_config(filename: str = "ipy_gpumem") -> dict:
    """The mode bar: PNG export named after the chart, no plotly logo, no "double-click to zoom back out"
    toast (it covers the kernel's indicator), scroll does not zoom the page."""
    # No "responsive": it sizes the plot to its container, and an output area has no height of its own (the
    # figure collapses to 0 px when the notebook is resized); the front ends resize figures themselves.
    return {"displaylogo": False, "scrollZoom": False, "showTips": False,
            "toImageButtonOptions": {"format": "png", "filename": filename, "scale": 2}}


def _scaled(values, divisor: float) -> list:
    return [None if v is None else round(v / divisor, 4) for v in values]


@lru_cache(maxsize=2048)
def _hover(span) -> str:
    """A cell's hover as plotly text; cached as ``span_hover`` is: a live figure redraws the same spans each second."""
    return plotly_text(span_hover(span))


def _bands(layout: SessionLayout, top: float) -> dict:
    """One filled trace per kind of band (a trace with hundreds of rectangles updates in a few milliseconds,
    where hundreds of layout shapes take a tenth of a second in plotly's Python side)."""
    out = {}
    for kind in BANDS:
        xs: list = []
        ys: list = []
        for cell in layout.cells:
            if cell.kind == kind:
                xs += [round(cell.start, 3), round(cell.start, 3), round(cell.end, 3), round(cell.end, 3),
                       round(cell.start, 3), None]
                ys += [0, top, top, 0, 0, None]
        colour, opacity = band(kind)
        out[trace_uid("band", kind)] = {"type": "scatter", "mode": "none", "x": xs, "y": ys, "fill": "toself",
                                        "fillcolor": rgba(colour, opacity), "hoverinfo": "skip", "showlegend": False,
                                        "name": f"cells ({kind})"}
    return out


def _cells(layout: SessionLayout, top: float) -> dict:
    """One hover marker per cell at the top of the plot, labelled ``[n]`` while there are few."""
    shown = layout.cells[-MAX_HOVER_CELLS:]
    colours = {"running": RUNNING_COLOR, "failed": FAILED_COLOR}
    return {"type": "scatter", "mode": "markers+text" if len(shown) <= 40 else "markers", "name": "cells",
            "x": [round((cell.start + cell.end) / 2, 3) for cell in shown], "y": [top] * len(shown),
            "text": [plotly_text(cell.span.label) for cell in shown], "textposition": "bottom center",
            "textfont": {"size": 9, "color": IMG_INK}, "hovertext": [_hover(cell.span) for cell in shown],
            "hoverinfo": "text", "showlegend": False,
            "marker": {"size": 7, "symbol": "triangle-down", "color": [colours.get(cell.kind, IMG_INK) for cell in shown]}}


def _peaks(layout: SessionLayout, divisor: float, unit: str) -> dict:
    marks = layout.peaks
    return {"type": "scatter", "mode": "markers", "name": PEAK_LEGEND, "showlegend": bool(marks),
            "x": [round((m.start + m.end) / 2, 3) for m in marks], "y": [round(m.peak / divisor, 4) for m in marks],
            "marker": {"symbol": "line-ew-open", "size": 14, "line": {"width": 2.5, "color": PEAK_COLOR},
                       "color": PEAK_COLOR},
            "hovertext": [plotly_text(f"{series_name(m.key)}: peak %.2f {unit} (exact, from the cell's record)"
                                      % (m.peak / divisor)) for m in marks], "hoverinfo": "text"}


def _series(layout: SessionLayout, divisor: float, unit: str) -> dict:
    out = {}
    for rank, plan in enumerate(layout.series):
        name = plotly_text(plan.name)
        out[trace_uid("series", plan.key.device.label, plan.key.quantity)] = {
            "type": "scatter", "mode": "lines", "name": name, "legendrank": 100 + rank,
            "x": list(layout.t), "y": _scaled(plan.values, divisor),
            "line": {"color": plan.color, "dash": PLOT_DASH.get(plan.kind, "solid"), "width": 1.6},
            "legendgroup": plan.group, "hovertemplate": f"%{{y:.2f}} {unit}<extra>{name}</extra>"}
    for rank in layout.ranks:
        name = plotly_text(f"{rank.label} RSS")
        out[trace_uid("rank", rank.label)] = {
            "type": "scatter", "mode": "lines+markers", "name": name, "x": list(rank.xs), "legendrank": 500,
            "y": [None if v is None else round(v / divisor, 4) for v in rank.ys], "connectgaps": False,
            "legendgroup": "ranks", "line": {"color": rank.color, "dash": "dot", "width": 1.4}, "marker": {"size": 5},
            "hovertemplate": f"%{{y:.2f}} {unit}<extra>{plotly_text(rank.label)} host RSS</extra>"}
    return out


def _empty_like(trace: dict) -> dict:
    """A trace that drew something before and has nothing now: the same kind, no points."""
    return {**trace, "x": [], "y": [], "showlegend": False}


def trace_order(previous: Optional[Sequence[str]], traces: dict) -> list:
    """The uids in drawing order: the fixed traces, then those drawn before in their order, then new ones."""
    order = list(previous) if previous else list(FIXED_TRACES)
    return order + [uid for uid in traces if uid not in order]


def session_figure(layout: SessionLayout, *, height: int = 320, title: Optional[str] = None,
                   filename: str = "ipy_gpumem", order: Optional[Sequence[str]] = None, kept: Optional[dict] = None,
                   meta: Optional[str] = None) -> dict:
    """A session layout as a plotly figure dict (``data``, ``layout``, ``config``).

    Args:
        height: pixels; the width follows the output area.
        title: text above the plot (plain text: escaped here, its lines broken at ``\\n``), or None.
        filename: the PNG export's file name.
        order: the trace uids a live figure drew last (see :func:`trace_order`); ``kept``: their last
            traces (uid -> trace), so one with nothing to draw now stays, empty, in its place.
        meta: a name for the figure (``layout.meta``) that a live chart's front end finds it by.
    """
    unit = layout.unit
    top = round(layout.top / unit.divisor, 4)
    traces = dict(_bands(layout, top))
    traces["cells"] = _cells(layout, top)
    traces["peaks"] = _peaks(layout, unit.divisor, unit.name)
    traces.update(_series(layout, unit.divisor, unit.name))
    data = []
    for uid in trace_order(order, traces):
        trace = traces.get(uid) or _empty_like((kept or {}).get(uid, {"type": "scatter", "mode": "lines"}))
        data.append({**trace, "uid": uid})
    shapes, notes = [], []
    for device, total in layout.capacities:
        y = round(total / unit.divisor, 4)
        shapes.append({"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": y, "y1": y,
                       "line": {"color": device_color(device), "dash": "dashdot", "width": 1.2}})
        notes.append({"xref": "paper", "yref": "y", "x": 1, "y": y, "xanchor": "right", "yanchor": "bottom",
                      "text": plotly_text(capacity_text(device, total)), "showarrow": False,
                      "font": {"size": 10, "color": IMG_INK}})
    if layout.exact_peak is not None:
        y = round(layout.exact_peak / unit.divisor, 4)
        shapes.append({"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": y, "y1": y,
                       "line": {"color": PEAK_COLOR, "dash": "dot", "width": 1.2}})
        notes.append({"xref": "paper", "yref": "y", "x": 0, "y": y, "xanchor": "left", "yanchor": "bottom",
                      "showarrow": False, "text": plotly_text(exact_peak_text(layout.exact_peak)),
                      "font": {"size": 10, "color": IMG_INK}})
    if layout.empty:
        notes.append({"xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5, "showarrow": False,
                      "text": plotly_text(layout.empty), "font": {"color": IMG_INK}})
    off = off_scale_note(layout.off_scale)
    if off:
        notes.append({"xref": "paper", "yref": "paper", "x": 1, "y": 1.0, "xanchor": "right", "yanchor": "bottom",
                      "showarrow": False, "text": plotly_text(off), "font": {"size": 10, "color": IMG_INK}})
    axis = {"gridcolor": "rgba(140,140,140,0.2)", "zerolinecolor": "rgba(140,140,140,0.35)",
            "linecolor": "rgba(140,140,140,0.5)", "color": IMG_INK}
    drawn = bool(layout.series)
    ytitle = unit.name
    if drawn and all(plan.key.device.is_host for plan in layout.series):
        ytitle = f"host RSS ({unit.name})"
    lines = title.count("\n") if title else 0
    figure_layout = {
        "uirevision": UIREVISION, "height": int(height), "autosize": True,
        "margin": {"l": 56, "r": 12, "t": (34 + 15 * lines) if title else 14, "b": 8},
        "paper_bgcolor": "rgba(0,0,0,0)", "plot_bgcolor": "rgba(0,0,0,0)",
        "font": {"family": "var(--jp-ui-font-family, sans-serif)", "size": 11, "color": IMG_INK},
        "hovermode": "closest", "showlegend": drawn,
        # Below the range slider and the axis title (plotly grows the bottom margin to fit it).
        "legend": {"orientation": "h", "x": 0, "y": -0.45, "yanchor": "top", "font": {"size": 10}},
        "xaxis": dict(axis, title={"text": "time (s)", "font": {"size": 10}}, ticksuffix=" s",
                      rangeslider={"visible": drawn, "thickness": 0.08}),
        "yaxis": dict(axis, title={"text": ytitle, "font": {"size": 10}}, rangemode="tozero", fixedrange=False),
        "shapes": shapes, "annotations": notes,
    }
    if title:
        figure_layout["title"] = {"text": plotly_text(title), "x": 0.01, "xanchor": "left", "font": {"size": 12}}
    if meta:
        figure_layout["meta"] = meta
    return {"data": data, "layout": figure_layout, "config": figure_config(filename)}


def timeline_figure(snapshot: Optional[TimelineSnapshot], *, height: int = 320, title: Optional[str] = None,
                    filename: str = "ipy_gpumem") -> dict:
    """The session chart of a snapshot as a plotly figure dict; never raises on empty data (see
    :func:`session_figure`)."""
    return session_figure(session_layout(snapshot), height=height, title=title, filename=filename)
