"""The session timeline as a plotly figure, built as plain JSON-ready dicts (plotly itself is not imported here).

A figure is only data: ``{"data": [...], "layout": {...}, "config": {...}}``. Building it by hand
keeps plotly off every path that does not need a live widget (the MIME type
``application/vnd.plotly.v1+json`` carries the dict as it is, and the front end's plotly draws it),
and gives the same colours, names and hover texts as the SVG chart, from the same helpers.

What the figure has, and why:

- one line per series (allocated solid, reserved dashed, used dotted; host RSS when no CUDA device
  is in use), the unit chosen once per figure so hovers read "1.50 GiB" as torch writes it;
- each cell as a band (the running one amber, failed ones red) with a hover marker at its top that
  names the cell, its first line and what it did (``span_hover``);
- each cell's exact peak where the samples missed it, as its own legend entry with its own symbol;
- one series per rank for a cell that launched processes (their host RSS: start, peak, end);
- the device's capacity as a dash-dot line when it is on the chart's scale;
- ``uirevision``: a zoom, pan or legend toggle survives every update of a live figure;
- a range slider under the time axis for long sessions, and PNG export from the mode bar.

Every text field (names, hovers, labels, titles, notes) goes through ``display.escape.plotly_text``
where it is placed: plotly.js reads them as HTML of its own, and a cell's first line is the user's.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

from ...core.units import GiB, KiB, MiB, format_bytes
from ...display.escape import plotly_text
from ..svg.axes import _capacity_layout
from ..svg.base import DASHES, FAILED_COLOR, IMG_INK, RUNNING_COLOR, device_color
from ..svg.legend import _drawn_keys, series_name, span_hover
from ..timeline import TimelineSnapshot

__all__ = ["timeline_figure", "figure_config", "PLOTLY_MIME", "UIREVISION", "byte_unit", "PLOT_DASH"]

PLOTLY_MIME = "application/vnd.plotly.v1+json"
#: Constant across updates: plotly keeps the user's zoom, pan and legend choices while it is unchanged.
UIREVISION = "ipy_gpumem"
#: SVG dash patterns (``DASHES``) in plotly's words.
PLOT_DASH = {"": "solid", "6 3": "dash", "1.5 2.5": "dot"}
#: Hover texts are one cell each; past this many cells only the newest keep a hover marker (older
#: ones are merged runs already, and the figure stays small).
MAX_HOVER_CELLS = 300


def byte_unit(top: float) -> tuple:
    """``(divisor, name)`` for values up to ``top`` bytes: GiB from 1 GiB, else MiB, else KiB."""
    if top >= GiB:
        return GiB, "GiB"
    if top >= MiB:
        return MiB, "MiB"
    return KiB, "KiB"


def figure_config(filename: str = "ipy_gpumem") -> dict:
    """The mode bar: PNG export named after the chart, no plotly logo, scroll does not zoom the page."""
    # No "responsive": it sizes the plot to its container, and an output area has no height of its own (the
    # figure collapses to 0 px when the notebook is resized); the front ends resize figures themselves.
    return {"displaylogo": False, "scrollZoom": False,
            "toImageButtonOptions": {"format": "png", "filename": filename, "scale": 2}}


def _scaled(values, divisor: float) -> list:
    return [None if v is None else round(v / divisor, 4) for v in values]


def _max(values) -> int:
    return max((v for v in values if v is not None), default=0)


def _span_colour(span, index: int) -> tuple:
    if span.end is None:
        return RUNNING_COLOR, 0.2
    if span.failed:
        return FAILED_COLOR, 0.18
    return IMG_INK, (0.07 if index % 2 else 0.13)  # alternate: back-to-back cells stay apart


def _series_traces(snapshot: TimelineSnapshot, keys, divisor: float, unit: str) -> list:
    traces = []
    several = len({k.device for k in keys}) > 1
    for key in keys:
        dash = PLOT_DASH.get(DASHES.get(key.quantity, ""), "solid")
        name = plotly_text(series_name(key))
        traces.append({
            "type": "scatter", "mode": "lines", "name": name,
            "x": list(snapshot.t), "y": _scaled(snapshot.series[key], divisor),
            "line": {"color": device_color(key.device), "dash": dash, "width": 1.6},
            "legendgroup": key.device.label if several else key.quantity,
            "hovertemplate": f"%{{y:.2f}} {unit}<extra>{name}</extra>",
        })
    return traces


def _peak_trace(snapshot: TimelineSnapshot, keys, divisor: float, unit: str) -> Optional[dict]:
    marks = snapshot.missed_peaks(keys)
    if not marks:
        return None
    return {
        "type": "scatter", "mode": "markers", "name": "cell peak (exact)",
        "x": [round((m.start + m.end) / 2, 3) for m in marks], "y": [round(m.peak / divisor, 4) for m in marks],
        "marker": {"symbol": "line-ew-open", "size": 14, "line": {"width": 2.5},
                   "color": [device_color(m.key.device) for m in marks]},
        "hovertemplate": f"peak %{{y:.2f}} {unit} (exact, from the cell's record)<extra></extra>",
    }


def _span_parts(spans, top: float, now: float) -> list:
    """The cell bands as filled traces (one per colour: a trace with hundreds of rectangles updates in
    a few milliseconds, where hundreds of layout shapes take a tenth of a second in plotly's Python
    side), and one hover marker per cell at the top of the plot. The running cell's band reaches
    ``now``, the latest reading."""
    bands: dict = {}
    for i, span in enumerate(spans):
        colour = _span_colour(span, i)
        end = span.end if span.end is not None else max(now, span.start)
        xs, ys = bands.setdefault(colour, ([], []))
        xs += [span.start, span.start, end, end, span.start, None]
        ys += [0, top, top, 0, 0, None]
    traces = [{"type": "scatter", "mode": "none", "x": xs, "y": ys, "fill": "toself", "fillcolor": _rgba(colour, opacity),
               "hoverinfo": "skip", "showlegend": False, "name": f"cells {n}"}
              for n, ((colour, opacity), (xs, ys)) in enumerate(sorted(bands.items()))]
    hovered = spans[-MAX_HOVER_CELLS:]
    xs, texts, labels = [], [], []
    for span in hovered:
        end = span.end if span.end is not None else max(now, span.start)
        xs.append(round((span.start + end) / 2, 3))
        texts.append(_hover(span))
        labels.append(plotly_text(span.label))  # a snapshot's spans are named by the program's annotations
    traces.append({
        "type": "scatter", "mode": "markers+text" if len(hovered) <= 40 else "markers", "name": "cells",
        "x": xs, "y": [top] * len(xs), "text": labels, "textposition": "bottom center",
        "textfont": {"size": 9, "color": IMG_INK}, "hovertext": texts, "hoverinfo": "text",
        "marker": {"size": 7, "symbol": "triangle-down", "color": [_span_colour(s, 0)[0] if s.end is None or s.failed
                                                                  else IMG_INK for s in hovered]},
        "showlegend": False,
    })
    return traces


@lru_cache(maxsize=2048)
def _hover(span) -> str:
    """A cell's hover as plotly text; cached as ``span_hover`` is: a live figure redraws the same spans each second."""
    return plotly_text(span_hover(span))


def _rgba(colour: str, opacity: float) -> str:
    colour = colour.lstrip("#")
    red, green, blue = (int(colour[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({red},{green},{blue},{opacity})"


#: One colour per rank, apart from the devices' (Okabe-Ito's darker half).
RANK_COLORS = ("#CC79A7", "#0072B2", "#D55E00", "#009E73", "#E69F00", "#56B4E9", "#999933", "#882255")


def _rank_values(spans) -> list:
    return [v for span in spans for r in span.ranks for v in (r.rss_before, r.rss_peak, r.rss_after) if v is not None]


def _rank_traces(spans, divisor: float, unit: str) -> list:
    """One series per rank: its host RSS at the start of the cell that launched it, at its peak (mid-cell:
    the time of a rank's peak is not known) and at its end; cells apart are not joined."""
    series: dict = {}
    for span in spans:
        if not span.ranks or span.end is None:
            continue
        mid = (span.start + span.end) / 2
        for r in span.ranks:
            xs, ys = series.setdefault(r.label, ([], []))
            for t, v in ((span.start, r.rss_before), (mid, r.rss_peak), (span.end, r.rss_after)):
                if v is not None:
                    xs.append(round(t, 3))
                    ys.append(round(v / divisor, 4))
            xs.append(None)
            ys.append(None)
    names = sorted(series, key=lambda name: (not name.startswith("rank"), len(name), name))
    return [{"type": "scatter", "mode": "lines+markers", "name": plotly_text(f"{name} RSS"), "x": series[name][0],
             "y": series[name][1], "connectgaps": False, "legendgroup": "ranks",
             "line": {"color": RANK_COLORS[i % len(RANK_COLORS)], "dash": "dot", "width": 1.4},
             "marker": {"size": 5}, "hovertemplate": f"%{{y:.2f}} {unit}<extra>{plotly_text(name)} host RSS</extra>"}
            for i, name in enumerate(names)]


def _capacity_parts(snapshot: TimelineSnapshot, keys, data_max: int, divisor: float) -> tuple:
    devices = sorted({k.device for k in keys if k.device.is_cuda}, key=lambda d: d.index or 0)
    on_scale, off_scale = _capacity_layout(snapshot.capacities, devices, data_max)
    shapes, notes = [], []
    for device, total in on_scale:
        y = round(total / divisor, 4)
        shapes.append({"type": "line", "xref": "paper", "yref": "y", "x0": 0, "x1": 1, "y0": y, "y1": y,
                       "line": {"color": device_color(device), "dash": "dashdot", "width": 1.2}})
        notes.append({"xref": "paper", "yref": "y", "x": 1, "y": y, "xanchor": "right", "yanchor": "bottom",
                      "text": plotly_text(f"{device.label} {format_bytes(total)} total"), "showarrow": False,
                      "font": {"size": 10, "color": IMG_INK}})
    off = "; ".join(f"{device.label} {format_bytes(total)} total" for device, total in off_scale)
    return shapes, notes, off


def timeline_figure(snapshot: Optional[TimelineSnapshot], *, height: int = 320, title: Optional[str] = None,
                    filename: str = "ipy_gpumem") -> dict:
    """The session chart as a plotly figure dict (``data``, ``layout``, ``config``); never raises on empty data.

    Args:
        snapshot: from ``Timeline.snapshot()``; None or empty gives an empty figure that says so.
        height: pixels; the width follows the output area.
        title: text above the plot (plain text: escaped here, its lines broken at ``\n``), or None.
        filename: the PNG export's file name.
    """
    keys = _drawn_keys(snapshot.series) if snapshot is not None and not snapshot.empty else []
    spans = snapshot.spans if snapshot is not None else ()
    data_max = max(([_max(snapshot.series[k]) for k in keys] + [m.peak for m in snapshot.missed_peaks(keys)]
                    if keys else [0]) + _rank_values(spans))
    divisor, unit = byte_unit(data_max)
    data: list = []
    shapes: list = []
    notes: list = []
    off = ""
    if keys:
        data += _series_traces(snapshot, keys, divisor, unit)
        data += _rank_traces(spans, divisor, unit)
        peaks = _peak_trace(snapshot, keys, divisor, unit)
        if peaks:
            data.append(peaks)
        cap_shapes, notes, off = _capacity_parts(snapshot, keys, data_max, divisor)
        shapes += cap_shapes
    top = round(max(data_max, 1) / divisor, 4)
    for shape in shapes:
        if shape["yref"] == "y":
            top = max(top, shape["y0"])
    if spans:  # drawn first, so the lines lie over the bands
        data = _span_parts(spans, top * 1.04, snapshot.end) + data
    if not keys and not spans:
        notes.append({"xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5, "showarrow": False,
                      "text": "no samples yet", "font": {"color": IMG_INK}})
    if off:
        notes.append({"xref": "paper", "yref": "paper", "x": 1, "y": 1.0, "xanchor": "right", "yanchor": "bottom",
                      "showarrow": False, "text": plotly_text(off), "font": {"size": 10, "color": IMG_INK}})
    axis = {"gridcolor": "rgba(140,140,140,0.2)", "zerolinecolor": "rgba(140,140,140,0.35)",
            "linecolor": "rgba(140,140,140,0.5)", "color": IMG_INK}
    layout = {
        "uirevision": UIREVISION, "height": int(height), "autosize": True,
        "margin": {"l": 56, "r": 12, "t": (44 if "\n" in title else 30) if title else 14, "b": 8},
        "paper_bgcolor": "rgba(0,0,0,0)", "plot_bgcolor": "rgba(0,0,0,0)",
        "font": {"family": "var(--jp-ui-font-family, sans-serif)", "size": 11, "color": IMG_INK},
        "hovermode": "closest", "showlegend": bool(keys),
        # Below the range slider and the axis title (plotly grows the bottom margin to fit it).
        "legend": {"orientation": "h", "x": 0, "y": -0.45, "yanchor": "top", "font": {"size": 10}},
        "xaxis": dict(axis, title={"text": "time (s)", "font": {"size": 10}}, ticksuffix=" s",
                      rangeslider={"visible": bool(keys), "thickness": 0.08}),
        "yaxis": dict(axis, title={"text": unit, "font": {"size": 10}}, rangemode="tozero", fixedrange=False),
        "shapes": shapes, "annotations": notes,
    }
    if title:
        layout["title"] = {"text": plotly_text(title), "x": 0.01, "xanchor": "left", "font": {"size": 12}}
    if keys and all(k.device.is_host for k in keys):
        layout["yaxis"]["title"]["text"] = f"host RSS ({unit})"
    return {"data": data, "layout": layout, "config": figure_config(filename)}
