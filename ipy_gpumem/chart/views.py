"""The views of the session chart: plain-text pieces, the HTML chart updated in place, the widget chart, and what a chart leaves behind.

The tier follows what the front end can do (``choose_tier``). In JupyterLab and Notebook 7 the chart
is the live plotly figure (``figures.live``). The ``html`` tier is an HTML output updated in place
through its ``display_id``: it moves while cells run (the sampler thread updates it), a saved notebook
keeps its latest picture with no widget state at all, and it works in JupyterLab, Notebook 7, VS Code
and Colab alike. ``%gpumem chart widget`` puts the same chart in an ``ipywidgets.HTML`` (also what the
JupyterLab sidebar holds where plotly's figure cannot be drawn). Terminal IPython gets text.

The chart's HTML is an ``<img>`` of the SVG (a data URI) with one transparent box per cell carrying
its hover text: JupyterLab's sanitizer strips an inline ``<svg>`` from an untrusted notebook (a
notebook someone else ran, or nbconvert's), but keeps an image and positioned ``<div title>`` boxes,
so a reopened notebook shows the chart and its tooltips wherever it is opened. Inside an image
nothing inherits the page's colours, so the SVG is drawn in a grey that reads on light and dark themes.

ipywidgets is imported here only, and only when a widget view is asked for. Views are created on the
main thread; ``refresh()`` may run on the sampler thread and only changes widget state or updates a
display handle (no print, no new display). A view that stops (a newer chart replaced it, or the
extension is unloaded) leaves a static chart in its output (:func:`static_bundle`) and closes its
widgets.
"""
from __future__ import annotations

import bisect
import sys
import threading
from typing import Optional

from ..core.units import format_bytes
from ..display.escape import esc, script_json
from .figures.timeline import PLOTLY_MIME, timeline_figure
from .session import session_layout
from .style import IMG_INK
from .svg import draw_session
from .timeline import TimelineSnapshot
from .words import cell_summary, span_hover, status_line

__all__ = ["WIDGETS_HINT", "TIERS", "WIDGET_MIME", "choose_tier", "plotly_widget_status", "timeline_text",
           "status_line", "chart_html", "svg_data_uri", "static_bundle", "figure_output", "sidebar_unavailable",
           "widgets_status", "in_kernel", "in_colab", "in_vscode", "ChartView", "HtmlChartView", "WidgetChartView",
           "TextChartView", "StatusLineView", "close_widgets", "CHART_SIZE", "SIDEBAR_SIZE"]

WIDGETS_HINT = "pip install 'ipy_gpumem[widgets]'"
#: Chart kinds for ``%gpumem chart KIND``, richest first.
TIERS = ("plotly", "widget", "html", "text")
#: The MIME type of a widget's view in an output.
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
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
    """None when the live plotly chart can be shown here, else why not (one line).

    The figure is plotly's own output, drawn by the front end's plotly (which comes with the plotly
    package); what moves it is two small widget models with no view: its state in ipywidgets, the
    JavaScript that hands it to plotly in anywidget (``figures.live``).
    """
    import importlib.util

    for module, why in (("plotly", "plotly is not installed (pip install plotly)"),
                        ("ipywidgets", "ipywidgets is not installed (pip install ipywidgets)"),
                        ("anywidget", "the live figure needs anywidget (pip install anywidget)")):
        # Found, not imported: anywidget is imported once the figure is on its way (a second on a busy machine).
        found = sys.modules[module] is not None if module in sys.modules else importlib.util.find_spec(module) is not None
        if not found:
            return why
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
    if prefer == "widget":
        why_not = widgets_status()
        if why_not is not None:
            return "html", f"widget chart unavailable ({why_not}): showing an HTML chart updated in place"
        return "widget", None
    # Found, not imported: the plotly chart shows its picture before ipywidgets is imported for its link
    # (0.2 s of a busy machine's cell), and a broken install leaves the figure as first drawn (``link_error``).
    why_not = plotly_widget_status()
    if why_not is not None:
        return "html", (None if prefer is None else f"plotly chart unavailable ({why_not}): showing an HTML "
                                                     "chart updated in place")
    return "plotly", None


# ---------------------------------------------------------------------------------------------
# Plain-text pieces (terminal tier, headers, text/plain fallbacks)
# ---------------------------------------------------------------------------------------------


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


def timeline_text(snapshot: Optional[TimelineSnapshot], width: int = 60, cells: int = 8) -> str:
    """A terminal rendering of the session layout: one sparkline per series with its range (exact peaks
    included), then the latest cells."""
    if snapshot is None or snapshot.empty:
        return "ipy_gpumem chart: no samples yet"
    layout = session_layout(snapshot)
    lines = [f"ipy_gpumem · {status_line(snapshot)}"]
    name_width = max((len(plan.name) for plan in layout.series), default=8)
    for plan in layout.series:
        values = plan.values
        columns = _columns(layout.t, values, [p for p in layout.peaks if p.key == plan.key], width)
        # The range: the lowest sample (columns hold maxima) up to the highest peak.
        lo = min(min(v for v in values if v is not None), min(v for v in columns if v is not None))
        hi = max(v for v in columns if v is not None)
        lines.append(f"{plan.name.ljust(name_width)}  {_sparkline(columns, lo, hi)}  "
                     f"{format_bytes(lo)} .. {format_bytes(hi)}")
    recent = [cell.span for cell in layout.cells if cell.span.end is not None][-cells:]
    if recent:
        lines.append("cells: " + "  ".join(cell_summary(s) for s in recent))
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
               header: bool = True, hover: bool = True, chart: str = "") -> str:
    """The chart as HTML that survives any notebook sanitizer (see the module docstring).

    Args:
        hover: add the transparent boxes that carry each cell's hover text (the newest
            :data:`MAX_HOVER_BOXES` cells).
        chart: the live chart's name (a class of the ``<div>``), so its front end can tell its picture was
            drawn instead of its figure.

    Returns:
        a ``<div class="ipy-gpumem-chart">``: the status line, then the chart image scaled to the
        output's width (at most its drawn width) with positioned, transparent boxes whose
        ``title`` is each cell's hover text.
    """
    drawing = draw_session(session_layout(snapshot), width, height, ink=IMG_INK, titles=False)
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
    line = status_line(snapshot)
    head = f'<div style="opacity:.8;margin:2px 0">ipy_gpumem · {esc(line)}</div>' if header else ""
    name = f" {esc(chart)}" if chart else ""  # a class: what every sanitizer keeps
    return (f'<div class="ipy-gpumem-chart{name}" style="font:12px var(--jp-ui-font-family,sans-serif)">{head}'
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
    keeps, scaled to the output's width) for viewers without plotly; without a picture they get ``text``."""
    bundle = {PLOTLY_MIME: figure}
    picture = (f'<img alt="memory chart" src=\'{svg_data_uri(svg)}\' style="max-width:100%;display:block">'
               if svg else "")
    if in_colab():
        picture = _colab_html(figure, picture)
    if picture:
        bundle["text/html"] = picture
    bundle["text/plain"] = text or "(memory chart)"
    return bundle


def chart_title(snapshot: Optional[TimelineSnapshot]) -> str:
    """A session chart's title: its numbers now (titled, or plotly's renderer offers "Click to enter
    Plot title" in its place)."""
    return f"ipy_gpumem · {status_line(snapshot)}"


def static_bundle(snapshot: Optional[TimelineSnapshot], figure: Optional[dict] = None, size=CHART_SIZE) -> dict:
    """A chart that no longer moves: plotly's figure first, the SVG picture for viewers without
    plotly (GitHub, nbviewer), text for a terminal. ``figure`` defaults to the snapshot's; both are
    drawn from one layout."""
    if figure is None:
        figure = timeline_figure(snapshot, title=chart_title(snapshot))
    picture = chart_html(snapshot, *size)
    if in_colab():
        picture = _colab_html(figure, picture)
    return {PLOTLY_MIME: figure, "text/html": picture, "text/plain": timeline_text(snapshot)}


# ---------------------------------------------------------------------------------------------
# Views
# ---------------------------------------------------------------------------------------------


class ChartView:
    """A displayed chart of one timeline; subclasses say how to draw it (:meth:`draw`) and what it
    leaves behind when it stops (:meth:`leave`).

    Attributes:
        tier: the chart kind (:data:`TIERS`).
        inline: False for the sidebar's views (a new inline chart does not replace them).
        handle: the display handle of its output, once shown.
        live: False once it stopped.
        drawn: the timeline version it last drew.
    """

    tier = ""
    inline = True

    def __init__(self, timeline, note: Optional[str] = None):
        self.timeline = timeline
        self.note = note
        self.handle = None
        self.live = True
        self.drawn = -1
        self.lock = threading.Lock()  # the sampler thread and the main thread both refresh

    def refresh(self, force: bool = False) -> bool:
        """Redraw if the timeline changed since the last draw; True when it redrew."""
        if not self.live:
            return False
        with self.lock:
            if not self.live:
                return False
            snapshot = self.timeline.snapshot()
            if snapshot.version == self.drawn and not force:
                return False
            self.draw(snapshot)
            self.drawn = snapshot.version
            return True

    def finalize(self) -> bool:
        """At a cell's end: redraw, so the output holds the chart as it is now."""
        return self.refresh()

    def freeze(self) -> None:
        """Stop for good (a newer view replaced this one, or unload): leave a static chart in the
        output and close any widget."""
        with self.lock:
            if not self.live:
                return
            self.live = False
            self.leave(self.timeline.snapshot())

    def leave(self, snapshot: TimelineSnapshot) -> None:
        """What stays in the output once the view stops (main thread)."""

    def draw(self, snapshot: TimelineSnapshot) -> None:  # pragma: no cover - abstract
        """Draw ``snapshot`` (any thread: only widget state or a display handle changes)."""
        raise NotImplementedError


class TextChartView(ChartView):
    """Terminal IPython: the chart as text, printed when asked (a terminal cannot redraw in place)."""

    tier = "text"

    def display(self) -> None:
        """Print the chart (and why it is text, when asked for another kind)."""
        if self.note:
            print(f"ipy_gpumem: {self.note}")
        print(timeline_text(self.timeline.snapshot()))
        self.live = False  # printed once; %gpumem chart prints the latest again

    def draw(self, snapshot) -> None:
        pass


class HtmlChartView(ChartView):
    """An HTML output updated in place through its display id: no widget, and nothing else to save."""

    tier = "html"
    size = CHART_SIZE

    def display(self) -> None:
        """Show the chart as an output with a display id."""
        from IPython.display import display

        if self.note:
            print(f"ipy_gpumem: {self.note}")
        snapshot = self.timeline.snapshot()
        self.handle = display(self.bundle(snapshot), raw=True, display_id=True)
        self.drawn = snapshot.version

    def bundle(self, snapshot) -> dict:
        """The output's MIME bundle for ``snapshot``."""
        return {"text/html": chart_html(snapshot, *self.size), "text/plain": timeline_text(snapshot)}

    def draw(self, snapshot) -> None:
        if self.handle is not None:
            self.handle.update(self.bundle(snapshot), raw=True)

    def leave(self, snapshot) -> None:
        # plotly's renderer does not redraw in place, so the figure comes once the chart stops moving.
        if self.handle is not None:
            self.handle.update(static_bundle(snapshot, size=self.size), raw=True)


class StatusLineView(HtmlChartView):
    """One live line of numbers (shown inline while the chart itself sits in the sidebar); ``where``
    says where the chart is, once the front end has said it."""

    def __init__(self, timeline, note: Optional[str] = None, where: str = ""):
        super().__init__(timeline, note)
        self.where = where

    def bundle(self, snapshot) -> dict:
        text = f"ipy_gpumem · {status_line(snapshot)}" + (f"  ({self.where})" if self.where else "")
        return {"text/html": f'<div style="font:12px var(--jp-code-font-family,monospace);opacity:.85">{esc(text)}</div>',
                "text/plain": text}

    def say(self, where: str) -> None:
        """Say where the chart is (main thread): the line is redrawn with it."""
        with self.lock:
            if where == self.where or not self.live:
                return
            self.where = where
            if self.handle is not None:
                self.handle.update(self.bundle(self.timeline.snapshot()), raw=True)

    def leave(self, snapshot) -> None:  # a line of numbers stays a line of numbers
        if self.handle is not None and self.drawn != snapshot.version:
            self.handle.update(self.bundle(snapshot), raw=True)


class WidgetChartView(ChartView):
    """The chart in an ``ipywidgets.HTML``: inline (``%gpumem chart widget``) or in an Output-like
    container such as the sidebar. Its saved widget state is the chart's HTML (tens of KiB)."""

    tier = "widget"

    def __init__(self, timeline, note: Optional[str] = None, size=CHART_SIZE):
        super().__init__(timeline, note)
        import ipywidgets as widgets

        self.size = size
        self.bundled = -1  # the version whose fallback the output holds
        self.html = widgets.HTML(value=chart_html(None, *size))

    def display(self, target=None) -> None:
        """Show the chart inline (``target`` None) as its bundle (the widget, with the fallbacks an
        untrusted or reopened notebook shows) under a display id, or the bare widget inside
        ``target``, an Output-like widget such as the sidebar."""
        from IPython.display import display

        if self.note:
            print(f"ipy_gpumem: {self.note}")
        snapshot = self.timeline.snapshot()
        self.draw(snapshot)
        self.drawn = snapshot.version
        if target is None:
            self.handle = display(self.bundle(snapshot), raw=True, display_id=True)
            self.bundled = snapshot.version
        else:
            with target:
                display(self.html)

    @property
    def widgets(self) -> tuple:
        """Every widget model this view created (the HTML and the layout and style it made)."""
        html = self.html
        return tuple(w for w in (html, getattr(html, "layout", None), getattr(html, "style", None)) if w is not None)

    def bundle(self, snapshot, live: bool = True) -> dict:
        """The output's bundle: the widget, and what a notebook reopened without the widget's state shows.
        While the widget lives, its state already holds the chart with its hover boxes: the fallback goes
        without them."""
        html = chart_html(snapshot, *self.size, hover=not live)
        bundle = {"text/html": html, "text/plain": timeline_text(snapshot)}
        if live:
            bundle[WIDGET_MIME] = {"version_major": 2, "version_minor": 0, "model_id": self.html.model_id}
        return bundle

    def draw(self, snapshot) -> None:
        self.html.value = chart_html(snapshot, *self.size)

    def finalize(self) -> bool:
        drew = self.refresh()
        with self.lock:
            snapshot = self.timeline.snapshot()
            # Same widget, fresh fallback for an untrusted or reopened notebook: also when the
            # sampler thread drew the widget last, since it never rewrites the output itself.
            if self.live and self.handle is not None and snapshot.version != self.bundled:
                self.handle.update(self.bundle(snapshot), raw=True)
                self.bundled = snapshot.version
        return drew

    def leave(self, snapshot) -> None:
        if self.handle is not None:
            # The output keeps the figure and its picture, and no reference to a widget about to go.
            self.handle.update(static_bundle(snapshot, size=self.size), raw=True)
        close_widgets(self.widgets)


def close_widgets(widgets) -> None:
    """Close widget models (their front-end views go, and they leave the kernel's registry)."""
    for widget in widgets:
        if widget is None:
            continue
        try:
            widget.close()
        except Exception:  # noqa: BLE001 - a widget already gone
            pass
