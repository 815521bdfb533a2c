"""Live views of the session timeline: an HTML output updated in place, an ipywidgets.HTML, or text.

The tier follows what the front end can do (``choose_tier``). In a kernel the chart is an HTML
output updated in place through its ``display_id``: it moves while cells run (the sampler thread
updates it), a saved notebook keeps its latest picture with no widget state at all, and it works
in JupyterLab, Notebook 7, VS Code and Colab alike. ``%gpumem chart widget`` puts the same chart
in an ``ipywidgets.HTML`` (also what the JupyterLab sidebar holds, since an Output widget cannot be
updated through a display id); its saved state is the chart's HTML, tens of KiB. Terminal IPython
gets text.

The chart's HTML is an ``<img>`` of the SVG (a data URI) with one transparent box per cell
carrying its hover text: JupyterLab's sanitizer strips an inline ``<svg>`` from an untrusted
notebook (a notebook someone else ran, or nbconvert's), but keeps an image and positioned
``<div title>`` boxes, so a reopened notebook shows the chart and its tooltips wherever it is
opened. Inside an image nothing inherits the page's colours, so the SVG is drawn in a grey that
reads on light and dark themes.

ipywidgets is imported here only, and only when a widget view is asked for. Views are created
on the main thread; ``refresh()`` may run on the sampler thread and only changes widget state or
updates a display handle (no print, no new display). A view that stops (a newer chart replaced
it, or the extension is unloaded) leaves a static picture in its output and closes its widgets.
"""
from __future__ import annotations

import bisect
import sys
import threading
from typing import Optional

from ..core.units import format_bytes, format_delta
from ..display.escape import esc, script_json
from .svg import IMG_INK, draw_timeline, span_hover
from .timeline import HOST_RSS, SeriesKey, TimelineSnapshot

__all__ = ["WIDGETS_HINT", "TIERS", "choose_tier", "plotly_widget_status", "timeline_text", "status_line", "chart_html", "svg_data_uri",
           "static_bundle", "figure_output",
           "sidebar_unavailable", "widgets_status", "HtmlChartView", "WidgetChartView", "TextChartView",
           "StatusLineView"]

WIDGETS_HINT = "pip install 'ipy_gpumem[widgets]'"
#: Chart kinds for ``%gpumem chart KIND``, richest first.
TIERS = ("plotly", "widget", "html", "text")
_WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
_SPARK = "▁▂▃▄▅▆▇█"
#: Inline chart size, and the narrower one the sidebar gets (an image scales down, never up).
CHART_SIZE = (760, 240)
SIDEBAR_SIZE = (300, 230)


def in_kernel(shell=None) -> bool:
    """True inside a Jupyter kernel (outputs can be rich and updated in place)."""
    if "ipykernel" not in sys.modules:
        return False
    if shell is None:
        return True
    return type(shell).__name__ == "ZMQInteractiveShell" or hasattr(shell, "kernel")


def in_colab() -> bool:
    return "google.colab" in sys.modules


def in_vscode(environ=None) -> bool:
    """True in a kernel VS Code started (it sets these in the kernel's environment)."""
    import os

    environ = os.environ if environ is None else environ
    return any(key in environ for key in ("VSCODE_PID", "VSCODE_CWD", "VSCODE_IPC_HOOK_CLI"))


def widgets_status() -> Optional[str]:
    """None when ipywidgets can be imported here, else why not."""
    try:
        import ipywidgets  # noqa: F401
    except ImportError as exc:
        return f"{exc.name or 'ipywidgets'} is not installed ({WIDGETS_HINT})"
    return None


def plotly_widget_status() -> Optional[str]:
    """None when a plotly ``FigureWidget`` (the live chart) can be built here, else why not (one line)."""
    try:
        import plotly  # noqa: F401
    except ImportError:
        return "plotly is not installed (pip install plotly)"
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return "ipywidgets is not installed (pip install ipywidgets)"
    major = int(plotly.__version__.split(".")[0])
    if major >= 6:
        try:  # plotly 6 draws its FigureWidget through anywidget
            import anywidget  # noqa: F401
        except ImportError:
            return "plotly's FigureWidget needs anywidget (pip install anywidget)"
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
    if in_vscode(environ):
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
    """``(tier, note)``: the tier to show, and a one-line reason when it is not the one asked for.

    In a kernel the default is ``plotly``, a live plotly ``FigureWidget`` (zoom, pan, legend and
    range slider that survive updates), where one can be built; Colab, or a kernel without plotly's
    widget, gets ``html``, the SVG chart updated in place. A chart that stops being live leaves a
    static plotly figure with the SVG picture beside it in either case.

    Raises:
        ValueError: ``prefer`` is not one of :data:`TIERS`.
    """
    if prefer is not None and prefer not in TIERS:
        raise ValueError(f"unknown chart kind {prefer!r}: use one of {', '.join(TIERS)}")
    if not in_kernel(shell):
        if prefer not in (None, "text"):
            return "text", f"no notebook front end here (terminal IPython): showing text instead of {prefer}"
        return "text", None
    if prefer in ("html", "text"):
        return prefer, None
    if in_colab():
        # Colab draws third-party widgets only after enable_custom_widget_manager(), a setting of the
        # user's that we do not change; its HTML outputs update in place.
        note = None if prefer is None else (f"Colab gets the HTML chart updated in place ({prefer} charts need "
                                             "Colab's custom widget manager)")
        return "html", note
    if prefer is None and in_vscode():
        # VS Code loads a third-party widget's front end from a CDN only where the user allowed it;
        # its HTML outputs update in place everywhere. `%gpumem chart plotly` asks for the figure.
        return "html", None
    why_not = widgets_status()
    if prefer == "widget":
        if why_not is not None:
            return "html", f"widget chart unavailable ({why_not}): showing an HTML chart updated in place"
        return "widget", None
    why_not = why_not or plotly_widget_status()
    if why_not is not None:
        return "html", (None if prefer is None else f"plotly chart unavailable ({why_not}): showing an HTML "
                                                     "chart updated in place")
    return "plotly", None


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
    for device in snapshot.devices():
        alloc = _last(snapshot.series.get(SeriesKey(device, "allocated"), ()))
        reserved = _last(snapshot.series.get(SeriesKey(device, "reserved"), ()))
        used = _last(snapshot.series.get(SeriesKey(device, "used"), ()))
        total = snapshot.capacities.get(device)
        text = f"{device.label} {format_bytes(alloc)} allocated · {format_bytes(reserved)} reserved"
        if used is not None and total:
            text += f" · {format_bytes(used)} used of {format_bytes(total)}"
        elif total:
            text += f" of {format_bytes(total)}"
        parts.append(text)
    if not parts:
        rss = _last(snapshot.series.get(HOST_RSS, ()))
        parts.append(f"host {format_bytes(rss)} resident" if rss is not None else "no readings yet")
    if snapshot.running is not None:
        parts.append(f"running {snapshot.running.label} for {snapshot.end - snapshot.running.start:.0f} s")
    return " · ".join(parts)


def _columns(times, values, peaks, width: int) -> list:
    """Each column's highest value: samples, raised to the exact peaks of cells that ran there.

    A memory chart must never hide a spike, not even one that fell between two samples.
    """
    n = len(values)
    if n == 0:
        return []
    if n <= width:
        columns, edges = list(values), list(times)
    else:
        step = n / width
        columns = [max((v for v in values[int(i * step):int((i + 1) * step)] if v is not None), default=None)
                   for i in range(width)]
        edges = [times[int(i * step)] for i in range(width)]
    for mark in peaks:
        lo, hi = bisect.bisect_left(edges, mark.start), bisect.bisect_right(edges, mark.end)
        if lo >= hi:  # a cell shorter than a column: the column it started in
            lo, hi = max(0, lo - 1), max(1, lo)
        for i in range(lo, min(hi, len(columns))):
            if columns[i] is None or columns[i] < mark.peak:
                columns[i] = mark.peak
    return columns


def _sparkline(columns: list, lo: int, hi: int) -> str:
    span = (hi - lo) or 1
    return "".join(" " if v is None else _SPARK[min(len(_SPARK) - 1, int((v - lo) / span * (len(_SPARK) - 1) + 0.5))]
                   for v in columns)


def _series_label(key: SeriesKey) -> str:
    return "host rss" if key.device.is_host else f"{key.device.label} {key.quantity}"


def _cell_summary(span) -> str:
    """``[3] cuda:0 +1.00 GiB (peak +2.00 GiB)``: a cell in a few words, from its numbers."""
    if not span.changes:
        return span.label
    change = max(span.changes, key=lambda c: max(abs(c.delta or 0), c.peak_increase or 0))
    text = f"{span.label} {'host' if change.device.is_host else change.device.label} {format_delta(change.delta)}"
    if change.peak_increase is not None and change.peak_increase > max(change.delta or 0, 0):
        text += f" (peak {format_delta(change.peak_increase)})"
    return text


def timeline_text(snapshot: TimelineSnapshot, width: int = 60, cells: int = 8) -> str:
    """A terminal rendering: one sparkline per series with its range (exact peaks included), then
    the latest cells."""
    if snapshot is None or snapshot.empty:
        return "ipy_gpumem chart: no samples yet"
    lines = [f"ipy_gpumem · {status_line(snapshot)}"]
    keys = [k for k in snapshot.series if any(v is not None for v in snapshot.series[k])]
    cuda_keys = [k for k in keys if k.device.is_cuda]
    shown = cuda_keys or keys
    peaks = snapshot.missed_peaks(shown)
    name_width = max((len(_series_label(k)) for k in shown), default=8)
    for key in shown:
        values = snapshot.series[key]
        columns = _columns(snapshot.t, values, [p for p in peaks if p.key == key], width)
        # The range: the lowest sample (columns hold maxima) up to the highest peak.
        lo = min(min(v for v in values if v is not None), min(v for v in columns if v is not None))
        hi = max(v for v in columns if v is not None)
        lines.append(f"{_series_label(key).ljust(name_width)}  {_sparkline(columns, lo, hi)}  "
                     f"{format_bytes(lo)} .. {format_bytes(hi)}")
    recent = [s for s in snapshot.spans if s.end is not None][-cells:]
    if recent:
        lines.append("cells: " + "  ".join(_cell_summary(s) for s in recent))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The chart as HTML: an image of the SVG and a hover box per cell
# ---------------------------------------------------------------------------------------------


#: Cells with a hover box in the chart's HTML: the newest ones (older cells are merged runs anyway).
MAX_HOVER_BOXES = 120
#: What a data URI must not contain raw (``'`` delimits the attribute it sits in); ``%`` first.
_URI_ESCAPES = (("%", "%25"), ("#", "%23"), ("'", "%27"), ("&", "%26"), ("<", "%3C"), (">", "%3E"), ("\n", "%0A"))


def svg_data_uri(svg: str) -> str:
    """``data:image/svg+xml,...`` with the few characters that matter percent-encoded (for a
    single-quoted attribute): a quarter smaller than base64, and as fast (a few ``str.replace``)."""
    for char, code in _URI_ESCAPES:
        svg = svg.replace(char, code)
    return "data:image/svg+xml," + svg


def _pct(value: float, whole: float) -> str:
    return f"{100.0 * value / whole:.2f}".rstrip("0").rstrip(".") + "%"


def chart_html(snapshot: Optional[TimelineSnapshot], width: int = CHART_SIZE[0], height: int = CHART_SIZE[1],
               header: bool = True, hover: bool = True) -> str:
    """The chart as HTML that survives any notebook sanitizer (see the module docstring).

    Args:
        hover: add the transparent boxes that carry each cell's hover text (the newest
            :data:`MAX_HOVER_BOXES` cells).

    Returns:
        a ``<div class="ipy-gpumem-chart">``: the status line, then the chart image scaled to the
        output's width (at most its drawn width) with positioned, transparent boxes whose
        ``title`` is each cell's hover text.
    """
    drawing = draw_timeline(snapshot, width, height, ink=IMG_INK, titles=False)
    w, h = drawing.width, drawing.height
    boxes = ""
    if hover and drawing.boxes:
        first = drawing.boxes[0]
        # One strip over the plot's height; each box is a slice of it.
        boxes = (f'<div style="position:absolute;left:0;width:100%;top:{_pct(first.y0, h)};'
                 f'height:{_pct(first.y1 - first.y0, h)}">' + "".join(
                     f'<div title="{esc(span_hover(box.span))}" style="position:absolute;left:{_pct(box.x0, w)};'
                     f'width:{_pct(box.x1 - box.x0, w)};height:100%"></div>'
                     for box in drawing.boxes[-MAX_HOVER_BOXES:]) + "</div>")
    line = status_line(snapshot) if snapshot is not None and not snapshot.empty else "no samples yet"
    head = f'<div style="opacity:.8;margin:2px 0">ipy_gpumem · {esc(line)}</div>' if header else ""
    return (f'<div class="ipy-gpumem-chart" style="font:12px var(--jp-ui-font-family,sans-serif)">{head}'
            f'<div style="position:relative;max-width:{w}px">'
            f'<img alt="{esc("memory chart: " + line)}" src=\'{svg_data_uri(drawing.svg)}\' '
            f'style="width:100%;display:block">{boxes}</div></div>')


def _colab_html(figure: dict, picture: str) -> str:
    """Colab draws no plotly MIME output: plotly.js from its CDN draws the figure over the picture,
    which stays where scripts do not run (GitHub, nbviewer)."""
    import uuid

    try:
        from plotly.offline import get_plotlyjs_version

        version = get_plotlyjs_version()
    except Exception:  # noqa: BLE001 - plotly missing or changed: the picture alone
        return picture
    div = "ipy-gpumem-" + uuid.uuid4().hex[:12]
    spec = script_json(figure)  # its texts are the user's: no "</script>" or "<!--" may end the element
    return (f'<div id="{div}">{picture}</div><script src="https://cdn.plot.ly/plotly-{version}.min.js"></script>'
            f'<script>(function(){{var d=document.getElementById("{div}"),f={spec};'
            f'if(!window.Plotly||!d)return;d.innerHTML="";Plotly.newPlot(d,f.data,f.layout,f.config);}})();</script>')


def figure_output(figure: dict, svg: Optional[str], text: str = "") -> dict:
    """An output holding one plotly figure, with its SVG picture (as an image, which every sanitizer
    keeps) for viewers without plotly; without a picture they get ``text``."""
    from .figures.timeline import PLOTLY_MIME

    bundle = {PLOTLY_MIME: figure}
    picture = (f'<img alt="memory chart" src=\'{svg_data_uri(svg)}\' style="max-width:100%;display:block">'
               if svg else "")
    if in_colab():
        picture = _colab_html(figure, picture)
    if picture:
        bundle["text/html"] = picture
    bundle["text/plain"] = text or "(memory chart)"
    return bundle


def static_bundle(snapshot: Optional[TimelineSnapshot], figure: Optional[dict] = None, size=CHART_SIZE) -> dict:
    """A chart that no longer moves: plotly's figure first, the SVG picture for viewers without
    plotly (GitHub, nbviewer), text for a terminal. ``figure`` defaults to the snapshot's."""
    from .figures.timeline import PLOTLY_MIME, timeline_figure

    if figure is None:  # titled, or plotly's renderer offers "Click to enter Plot title" in its place
        line = status_line(snapshot) if snapshot is not None and not snapshot.empty else "no samples yet"
        figure = timeline_figure(snapshot, title=f"ipy_gpumem · {line}")
    picture = chart_html(snapshot, *size)
    if in_colab():
        picture = _colab_html(figure, picture)
    return {PLOTLY_MIME: figure, "text/html": picture, "text/plain": timeline_text(snapshot)}


# ---------------------------------------------------------------------------------------------
# Views
# ---------------------------------------------------------------------------------------------


class _View:
    """A displayed chart of one timeline; subclasses know how to draw it."""

    tier = ""
    inline = True  # False for the sidebar's views (a new inline chart does not replace them)

    def __init__(self, timeline, note: Optional[str] = None):
        self.timeline = timeline
        self.note = note
        self.handle = None
        self.live = True
        self._drawn = -1
        self._bundled = -1  # the version whose fallback the output holds (widget views)
        self._lock = threading.Lock()  # the sampler thread and the main thread both refresh

    def refresh(self, force: bool = False) -> bool:
        """Redraw if the timeline changed since the last draw; True when it redrew."""
        if not self.live:
            return False
        with self._lock:
            if not self.live:
                return False
            snapshot = self.timeline.snapshot()
            if snapshot.version == self._drawn and not force:
                return False
            self._draw(snapshot)
            self._drawn = snapshot.version
            return True

    def finalize(self) -> bool:
        """At a cell's end: redraw, so the output holds the chart as it is now."""
        return self.refresh()

    def freeze(self) -> None:
        """Stop for good (a newer view replaced this one, or unload): leave a static picture in
        the output and close any widget."""
        with self._lock:
            if not self.live:
                return
            self.live = False
            self._leave(self.timeline.snapshot())

    def _leave(self, snapshot: TimelineSnapshot) -> None:
        """What stays in the output once the view stops (main thread)."""

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
    """An HTML output updated in place through its display id: no widget, and nothing else to save."""

    tier = "html"
    size = CHART_SIZE

    def display(self) -> None:
        from IPython.display import display

        if self.note:
            print(f"ipy_gpumem: {self.note}")
        snapshot = self.timeline.snapshot()
        self.handle = display(self._bundle(snapshot), raw=True, display_id=True)
        self._drawn = snapshot.version

    def _bundle(self, snapshot) -> dict:
        return {"text/html": chart_html(snapshot, *self.size), "text/plain": timeline_text(snapshot)}

    def _draw(self, snapshot) -> None:
        if self.handle is not None:
            self.handle.update(self._bundle(snapshot), raw=True)

    def _leave(self, snapshot) -> None:
        # plotly's renderer does not redraw in place, so the figure comes once the chart stops moving.
        if self.handle is not None:
            self.handle.update(static_bundle(snapshot, size=self.size), raw=True)


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

    def _leave(self, snapshot) -> None:  # a line of numbers stays a line of numbers
        if self.handle is not None and self._drawn != snapshot.version:
            self.handle.update(self._bundle(snapshot), raw=True)


class WidgetChartView(_View):
    """The chart in an ``ipywidgets.HTML``: inline (``%gpumem chart widget``) or in an Output-like
    container such as the sidebar. Its saved widget state is the chart's HTML (tens of KiB)."""

    tier = "widget"

    def __init__(self, timeline, note: Optional[str] = None, size=CHART_SIZE):
        super().__init__(timeline, note)
        import ipywidgets as widgets

        self.size = size
        self.html = widgets.HTML(value=chart_html(None, *size))

    def display(self, target=None) -> None:
        """Show the chart inline (``target`` None) or inside an Output-like widget (the sidebar)."""
        show_widget_view(self, self.html, target)

    @property
    def widgets(self) -> tuple:
        """Every widget model this view created (the HTML and the layout and style it made)."""
        html = self.html
        return tuple(w for w in (html, getattr(html, "layout", None), getattr(html, "style", None)) if w is not None)

    def _bundle(self, snapshot, live: bool = True) -> dict:
        # What a notebook reopened without the widget's state shows. While the widget lives, its
        # state already holds the chart with its hover boxes: the fallback goes without them.
        html = chart_html(snapshot, *self.size, hover=not live)
        bundle = {"text/html": html, "text/plain": timeline_text(snapshot)}
        if live:
            bundle[_WIDGET_MIME] = {"version_major": 2, "version_minor": 0, "model_id": self.html.model_id}
        return bundle

    def _draw(self, snapshot) -> None:
        self.html.value = chart_html(snapshot, *self.size)

    def finalize(self) -> bool:
        drew = self.refresh()
        with self._lock:
            snapshot = self.timeline.snapshot()
            # Same widget, fresh fallback for an untrusted or reopened notebook: also when the
            # sampler thread drew the widget last, since it never rewrites the output itself.
            if self.live and self.handle is not None and snapshot.version != self._bundled:
                self.handle.update(self._bundle(snapshot), raw=True)
                self._bundled = snapshot.version
        return drew

    def _leave(self, snapshot) -> None:
        if self.handle is not None:
            # The output keeps the figure and its picture, and no reference to a widget about to go.
            self.handle.update(static_bundle(snapshot, size=self.size), raw=True)
        close_widgets(self.widgets)


def show_widget_view(view, widget, target=None) -> None:
    """Draw a widget view and show it: inline as its bundle (the widget, with the fallbacks an
    untrusted or reopened notebook shows) under a display id, or the bare widget inside ``target``,
    an Output-like widget such as the sidebar."""
    from IPython.display import display

    if view.note:
        print(f"ipy_gpumem: {view.note}")
    snapshot = view.timeline.snapshot()
    view._draw(snapshot)
    view._drawn = snapshot.version
    if target is None:
        view.handle = display(view._bundle(snapshot), raw=True, display_id=True)
        view._bundled = snapshot.version
    else:
        with target:
            display(widget)


def close_widgets(widgets) -> None:
    """Close widget models (their front-end views go, and they leave the kernel's registry)."""
    for widget in widgets:
        try:
            widget.close()
        except Exception:  # noqa: BLE001 - a widget already gone
            pass
