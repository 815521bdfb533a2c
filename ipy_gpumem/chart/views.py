"""Live views of the session timeline: a plotly FigureWidget, an HTML display updated in place, or text.

The tier follows what the front end can do (``choose_tier``): a plotly ``FigureWidget`` where
a kernel and the widget packages are there; in Colab, where FigureWidget does not render, and
wherever widgets are missing, an HTML display (inline SVG) updated in place through its
``display_id``; text in terminal IPython. plotly and ipywidgets are imported here only, and only
when a chart is asked for. Views are created on the main thread; ``refresh()`` may run on the
sampler thread and only changes widget state or updates a display handle (no print, no new
display). ``finalize()`` (main thread, at each cell's end) rewrites the output with a static
SVG snapshot, so a saved or exported notebook shows the chart as it was, not an empty widget.
"""
from __future__ import annotations

import sys
import threading
from typing import Optional

from ..display.view import esc
from .svg import DEVICE_COLORS, FAILED_COLOR, HOST_COLOR, RUNNING_COLOR, byte_ticks, timeline_svg
from .timeline import HOST_KEY, TimelineSnapshot
from ..core.units import format_bytes

__all__ = ["WIDGETS_HINT", "TIERS", "choose_tier", "make_view", "timeline_text", "status_line", "sidebar_unavailable",
           "HtmlChartView", "WidgetChartView", "TextChartView"]

WIDGETS_HINT = "pip install 'ipy_gpumem[widgets]'"
TIERS = ("widget", "html", "text")
_WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
_MAX_SHAPES = 120  # cell bands drawn in the widget; older ones are merged by the timeline anyway
_SPARK = "▁▂▃▄▅▆▇█"


def in_kernel(shell=None) -> bool:
    """True inside a Jupyter kernel (outputs can be rich and updated in place)."""
    if "ipykernel" not in sys.modules:
        return False
    if shell is None:
        return True
    return type(shell).__name__ == "ZMQInteractiveShell" or hasattr(shell, "kernel")


def in_colab() -> bool:
    return "google.colab" in sys.modules


def widgets_status() -> Optional[str]:
    """None when ipywidgets and plotly's FigureWidget look usable here, else why not.

    Only imports are checked (building a FigureWidget takes seconds the first time); a view that
    still fails to build falls back to HTML where it is created.
    """
    try:
        import ipywidgets  # noqa: F401
        import plotly
        import plotly.graph_objects  # noqa: F401
    except ImportError as exc:
        return f"{exc.name or 'ipywidgets/plotly'} is not installed ({WIDGETS_HINT})"
    try:
        major = int(str(plotly.__version__).split(".")[0])
    except ValueError:
        major = 0
    if major >= 6:
        try:
            import anywidget  # noqa: F401 - plotly >= 6 builds FigureWidget on it
        except ImportError:
            return f"plotly {plotly.__version__}'s FigureWidget needs anywidget ({WIDGETS_HINT})"
    return None


def sidebar_unavailable(shell=None, environ=None) -> Optional[str]:
    """None where a JupyterLab sidebar (``sidecar``) can be tried, else the one-line reason why not.

    The kernel cannot see which front end draws its outputs; what it can see is Colab's module,
    VS Code's environment, a terminal, and missing packages. Notebook 7 looks like JupyterLab
    from here, which is why the sidebar always keeps a live line of numbers inline as well.
    """
    import os

    environ = os.environ if environ is None else environ
    if not in_kernel(shell):
        return "the sidebar needs JupyterLab (this is terminal IPython)"
    if in_colab():
        return "Colab has no side panel for notebook outputs"
    if any(key in environ for key in ("VSCODE_PID", "VSCODE_CWD", "VSCODE_IPC_HOOK_CLI")):
        return "VS Code cannot show JupyterLab sidebar widgets"
    try:
        import sidecar  # noqa: F401
    except ImportError:
        return "the sidebar needs the sidecar package (pip install 'ipy_gpumem[sidebar]')"
    why_not = widgets_status()
    if why_not is not None:
        return f"the sidebar needs widgets: {why_not}"
    return None


def choose_tier(shell=None, prefer: Optional[str] = None):
    """``(tier, note)``: the richest tier this front end can show, and a one-line reason when lower."""
    if prefer is not None and prefer not in TIERS:
        raise ValueError(f"unknown chart kind {prefer!r}: use one of {', '.join(TIERS)}")
    if not in_kernel(shell):
        if prefer not in (None, "text"):
            return "text", f"no notebook front end here (terminal IPython): showing text instead of {prefer}"
        return "text", None
    if prefer == "text" or prefer == "html":
        return prefer, None
    if in_colab():
        note = "Colab does not render plotly FigureWidgets: showing an HTML chart updated in place"
        return "html", note if prefer == "widget" else None
    why_not = widgets_status()
    if why_not is not None:
        return "html", f"live widget chart unavailable ({why_not}): showing an HTML chart updated in place"
    return "widget", None


# ---------------------------------------------------------------------------------------------
# Plain-text pieces (terminal tier, headers, text/plain fallbacks)
# ---------------------------------------------------------------------------------------------


def _last(values) -> Optional[int]:
    for value in reversed(values):
        if value is not None:
            return value
    return None


def status_line(snapshot: TimelineSnapshot) -> str:
    """The current numbers in one line: per device allocated / reserved / capacity, else RSS."""
    parts = []
    devices = sorted({k.split(" ")[0] for k in snapshot.series if k.startswith("cuda:")})
    for dev in devices:
        alloc = _last(snapshot.series.get(f"{dev} allocated", ()))
        reserved = _last(snapshot.series.get(f"{dev} reserved", ()))
        used = _last(snapshot.series.get(f"{dev} used", ()))
        total = snapshot.capacities.get(dev)
        text = f"{dev} {format_bytes(alloc)} allocated · {format_bytes(reserved)} reserved"
        if used is not None and total:
            text += f" · {format_bytes(used)} used of {format_bytes(total)}"
        elif total:
            text += f" of {format_bytes(total)}"
        parts.append(text)
    if not parts:
        rss = _last(snapshot.series.get(HOST_KEY, ()))
        parts.append(f"host {format_bytes(rss)} resident" if rss is not None else "no readings yet")
    if snapshot.running is not None:
        parts.append(f"running {snapshot.running.label} for {snapshot.end - snapshot.running.start:.0f} s")
    return " · ".join(parts)


def _sparkline(values, width: int = 60) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return ""
    if len(values) > width:  # keep each bucket's maximum: a chart must not hide a spike
        step = len(values) / width
        values = [max((v for v in values[int(i * step):int((i + 1) * step)] if v is not None), default=None)
                  for i in range(width)]
    lo, hi = min(present), max(present)
    span = (hi - lo) or 1
    return "".join(" " if v is None else _SPARK[min(len(_SPARK) - 1, int((v - lo) / span * (len(_SPARK) - 1) + 0.5))]
                   for v in values)


def timeline_text(snapshot: TimelineSnapshot, width: int = 60, cells: int = 8) -> str:
    """A terminal rendering: one sparkline per series with its range, then the latest cells."""
    if snapshot is None or snapshot.empty:
        return "ipy_gpumem chart: no samples yet"
    lines = [f"ipy_gpumem · {status_line(snapshot)}"]
    keys = [k for k in snapshot.series if any(v is not None for v in snapshot.series[k])]
    cuda = [k for k in keys if k.startswith("cuda:")]
    name_width = max((len(k) for k in (cuda or keys)), default=8)
    for key in cuda or keys:
        values = snapshot.series[key]
        present = [v for v in values if v is not None]
        lines.append(f"{key.ljust(name_width)}  {_sparkline(list(values), width)}  "
                     f"{format_bytes(min(present))} .. {format_bytes(max(present))}")
    recent = [s for s in snapshot.spans if s.end is not None][-cells:]
    if recent:
        lines.append("cells: " + "  ".join(f"{s.label} {s.hover.splitlines()[1] if len(s.hover.splitlines()) > 1 else ''}".strip()
                                            for s in recent))
    return "\n".join(lines)


def _html_block(snapshot: TimelineSnapshot, width: int = 760, height: int = 240) -> str:
    svg = timeline_svg(snapshot, width=width, height=height)
    header = esc(status_line(snapshot)) if snapshot is not None and not snapshot.empty else "no samples yet"
    return (f'<div class="ipy-gpumem-chart" style="font:12px var(--jp-ui-font-family,sans-serif)">'
            f'<div style="opacity:.8;margin:2px 0">ipy_gpumem · {header}</div>{svg}</div>')


# ---------------------------------------------------------------------------------------------
# Views
# ---------------------------------------------------------------------------------------------


class _View:
    """A displayed chart of one timeline; subclasses know how to draw it."""

    tier = ""
    inline = True  # False for the sidebar's views (a new inline chart does not freeze them)

    def __init__(self, timeline, note: Optional[str] = None):
        self.timeline = timeline
        self.note = note
        self.handle = None
        self.live = True
        self._drawn = -1
        self._lock = threading.Lock()  # the sampler thread and the main thread both refresh

    def refresh(self, force: bool = False) -> bool:
        """Redraw if the timeline changed since the last draw; True when it redrew."""
        if not self.live:
            return False
        with self._lock:
            snapshot = self.timeline.snapshot()
            if snapshot.version == self._drawn and not force:
                return False
            self._draw(snapshot)
            self._drawn = snapshot.version
            return True

    def finalize(self) -> None:
        """At a cell's end: redraw and store a static snapshot in the output (main thread)."""
        self.refresh()

    def freeze(self) -> None:
        """Stop updating (a newer view of the same chart took over); leaves a static snapshot."""
        self.finalize()
        self.live = False

    def _draw(self, snapshot: TimelineSnapshot) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class TextChartView(_View):
    """Terminal IPython: the chart as text, printed when asked (a terminal cannot redraw in place)."""

    tier = "text"

    def display(self) -> None:
        if self.note:
            print(f"ipy_gpumem: {self.note}")
        print(timeline_text(self.timeline.snapshot()))
        self.live = False  # printed once; %gpumem chart prints the latest again

    def _draw(self, snapshot) -> None:
        pass


class HtmlChartView(_View):
    """An HTML output (inline SVG) updated in place through its display id: works without widgets."""

    tier = "html"

    def display(self) -> None:
        from IPython.display import display

        if self.note:
            print(f"ipy_gpumem: {self.note}")
        snapshot = self.timeline.snapshot()
        self.handle = display(self._bundle(snapshot), raw=True, display_id=True)
        self._drawn = snapshot.version

    def _bundle(self, snapshot) -> dict:
        return {"text/html": _html_block(snapshot), "text/plain": timeline_text(snapshot)}

    def _draw(self, snapshot) -> None:
        if self.handle is not None:
            self.handle.update(self._bundle(snapshot), raw=True)


class StatusLineView(HtmlChartView):
    """One live line of numbers (shown inline while the chart itself sits in the sidebar)."""

    def __init__(self, timeline, note: Optional[str] = None, where: str = ""):
        super().__init__(timeline, note)
        self.where = where

    def _bundle(self, snapshot) -> dict:
        line = status_line(snapshot) if not snapshot.empty else "no samples yet"
        text = f"ipy_gpumem · {line}" + (f"  ({self.where})" if self.where else "")
        return {"text/html": f'<div style="font:12px var(--jp-code-font-family,monospace);opacity:.85">{esc(text)}</div>',
                "text/plain": text}


class WidgetChartView(_View):
    """A plotly FigureWidget with a header line, in an ipywidgets VBox."""

    tier = "widget"

    def __init__(self, timeline, note: Optional[str] = None):
        super().__init__(timeline, note)
        import ipywidgets as widgets
        import plotly.graph_objects as go

        self._go = go
        self.figure = go.FigureWidget(layout=dict(
            height=300, autosize=True, margin=dict(l=70, r=20, t=10, b=40), showlegend=True,
            legend=dict(orientation="h", y=-0.2), hovermode="x unified",
            xaxis=dict(title="seconds", zeroline=False),
            yaxis=dict(title="", rangemode="tozero"),
        ))
        self.header = widgets.HTML(value="ipy_gpumem · no samples yet")
        self.box = widgets.VBox([self.header, self.figure], layout=widgets.Layout(width="100%"))
        self._keys = None  # None: the first draw always builds the traces, even with no samples yet

    def display(self, target=None) -> None:
        """Show the chart inline (``target`` None) or inside an Output-like widget (the sidebar)."""
        from IPython.display import display

        if self.note:
            print(f"ipy_gpumem: {self.note}")
        snapshot = self.timeline.snapshot()
        self._draw(snapshot)
        self._drawn = snapshot.version
        if target is None:
            self.handle = display(self._bundle(snapshot), raw=True, display_id=True)
        else:
            with target:
                display(self.box)

    def _bundle(self, snapshot) -> dict:
        return {
            _WIDGET_MIME: {"version_major": 2, "version_minor": 0, "model_id": self.box.model_id},
            "text/html": _html_block(snapshot),  # what a saved or exported notebook shows
            "text/plain": timeline_text(snapshot),
        }

    def finalize(self) -> None:
        self.refresh()
        if self.handle is not None and self.live:
            # Same widget, fresh static fallback: the saved notebook keeps this snapshot.
            self.handle.update(self._bundle(self.timeline.snapshot()), raw=True)

    def _draw(self, snapshot) -> None:
        go = self._go
        keys = [k for k in snapshot.series if any(v is not None for v in snapshot.series[k])]
        cuda = [k for k in keys if k.startswith("cuda:")]
        keys = cuda or [k for k in keys if k == HOST_KEY]
        times = list(snapshot.t)
        top = max([max((v for v in snapshot.series[k] if v is not None), default=0) for k in keys] or [0])
        capacities = [(dev, cap) for dev, cap in snapshot.capacities.items() if cap and dev.startswith("cuda:")]
        if capacities and top >= 0.3 * max(c for _, c in capacities):
            top = max(top, max(c for _, c in capacities))
        axis_top, tick_values = byte_ticks(top * 1.05 if top else 1)
        fig = self.figure
        with fig.batch_update():
            if keys != self._keys:
                fig.data = ()
                for key in keys:
                    fig.add_trace(go.Scatter(name=_series_name(key), mode="lines", line=_line_style(key),
                                             hovertemplate="%{customdata}<extra>" + esc(_series_name(key)) + "</extra>"))
                fig.add_trace(go.Scatter(name="cells", mode="text", showlegend=False, textposition="bottom center",
                                         hovertemplate="%{hovertext}<extra></extra>", textfont=dict(size=10)))
                self._keys = keys
            for trace, key in zip(fig.data, keys):
                values = list(snapshot.series[key])
                trace.x, trace.y = times, values
                trace.customdata = [format_bytes(v) if v is not None else "n/a" for v in values]
            spans = list(snapshot.spans)[-_MAX_SHAPES:]
            label_trace = fig.data[len(keys)]
            label_trace.x = [(s.start + (s.end if s.end is not None else snapshot.end)) / 2 for s in spans]
            label_trace.y = [axis_top] * len(spans)
            label_trace.text = [s.label for s in spans]
            label_trace.hovertext = [s.hover.replace("\n", "<br>") for s in spans]
            shapes = [_span_shape(s, snapshot.end, i) for i, s in enumerate(spans)]
            annotations = []
            for dev, cap in capacities:
                if cap <= axis_top * 1.01:
                    shapes.append(dict(type="line", xref="paper", x0=0, x1=1, y0=cap, y1=cap,
                                       line=dict(color="#888", dash="dashdot", width=1)))
                    annotations.append(dict(xref="paper", x=1, y=cap, xanchor="right", yanchor="bottom",
                                            text=f"{dev} {format_bytes(cap)} total", showarrow=False,
                                            font=dict(size=10, color="#888")))
            fig.layout.shapes = shapes
            fig.layout.annotations = annotations
            fig.layout.yaxis.tickvals = tick_values
            fig.layout.yaxis.ticktext = [format_bytes(v) for v in tick_values]
            fig.layout.yaxis.range = [0, axis_top]
        self.header.value = f'<span style="font-size:12px">ipy_gpumem · {esc(status_line(snapshot))}</span>'


def _series_name(key: str) -> str:
    return "host RSS" if key == HOST_KEY else key.replace(" used", " used (all processes)")


def _line_style(key: str) -> dict:
    if key == HOST_KEY:
        return dict(color=HOST_COLOR, width=2)
    device, kind = key.split(" ", 1)
    index = int(device.split(":")[1])
    dash = {"allocated": "solid", "reserved": "dash", "used": "dot"}.get(kind, "solid")
    return dict(color=DEVICE_COLORS[index % len(DEVICE_COLORS)], width=2 if kind == "allocated" else 1.5, dash=dash)


def _span_shape(span, end: float, index: int) -> dict:
    if span.end is None:
        color, opacity = RUNNING_COLOR, 0.25
    elif span.failed:
        color, opacity = FAILED_COLOR, 0.15
    else:
        color, opacity = "#888888", 0.10 if index % 2 else 0.18
    return dict(type="rect", xref="x", yref="paper", x0=span.start, x1=span.end if span.end is not None else end,
                y0=0, y1=1, fillcolor=color, opacity=opacity, line=dict(width=0), layer="below")


def make_view(tier: str, timeline, note: Optional[str] = None):
    """A view of ``timeline`` in ``tier`` (see :func:`choose_tier`); HTML if a widget cannot be built."""
    if tier == "widget":
        try:
            return WidgetChartView(timeline, note)
        except Exception as exc:  # noqa: BLE001 - e.g. a plotly/ipywidgets version mismatch
            return HtmlChartView(timeline, f"live widget chart unavailable ({type(exc).__name__}: {exc}): "
                                           "showing an HTML chart updated in place")
    if tier == "html":
        return HtmlChartView(timeline, note)
    return TextChartView(timeline, note)

