"""The live chart as plotly's own output, moved by two small widgets with no view: fast to show, and a figure wherever it is reopened.

The chart is displayed as a plotly figure (``application/vnd.plotly.v1+json``) under a display id,
with its SVG picture and a line of text beside it. The front end's plotly draws it at once (its
renderer is loaded with the page; no widget bundle travels), and a notebook saved at any moment
holds a figure that any front end draws without the kernel: never "Error displaying widget: model
not found". What moves it is a pair of widget models that are never displayed (:func:`link_classes`):

- ``ChartState``, a plain ipywidgets model (``WidgetModel`` of ``@jupyter-widgets/base``): the figure's
  name (``layout.meta``), the latest figure, the sidebar's layout. ipywidgets applies each update the
  moment it arrives, whatever else the page is doing.
- ``ChartLink``, an anywidget model that carries only the few lines of JavaScript (:data:`LINK_ESM`):
  when the front end has loaded them, they find the state's model (``widget_manager.get_model``), find
  the figure by its name in the page (inline, and in JupyterLab's sidebar), and hand every new figure to
  ``Plotly.react``.

The figure travels in the plain model, not in the anywidget one, because anywidget (0.9.16 and later)
holds every message to its model until the model's JavaScript has run, and drops them all for good
when that took over 2 s (``[anywidget] Failed to initialize model``): on a busy machine, where the
page is loading plotly.js for the figure at that moment, the live chart used to stay as first drawn.

The figure's traces are fixed in number and order (``figures.timeline``), each with a uid plotly.js can
put in a CSS selector, and its ``uirevision`` never changes, so a legend click, a zoom and a hover survive
every update. The link also says what the front end did with the chart, as comm messages
(``placement``): whether the sidebar drew it, whether an inline copy is shown, or whether the front end
drew the picture instead of the figure. For ``%gpumem sidebar`` the inline copy is the chart a reopened
notebook shows; in JupyterLab the link hides it as soon as the sidebar holds the chart, and in Notebook
7, which has no sidebar for it, it stays: the front end decides from what it has drawn, with no timer.
The kernel hears the report when it is next idle and words the line above the chart from it.

plotly itself is never imported here: the figure is a dict. anywidget is imported when the link is
made, after the figure was sent, so the first draw does not wait for it.
"""
from __future__ import annotations

import time
import uuid
from functools import lru_cache
from typing import Callable, Optional

from ..session import session_layout
from ..views import ChartView, chart_html, chart_title, close_widgets, timeline_text
from .timeline import PLOTLY_MIME, session_figure

__all__ = ["PlotlyChartView", "link_classes", "HEIGHT", "SIDEBAR_HEIGHT", "MIN_INTERVAL", "LINK_ESM"]

#: Seconds between two redraws of a live figure (cell ends included; a held-back one is made later).
MIN_INTERVAL = 0.9  # the sampler ticks once a second: one redraw a tick, never more
#: Inline height in pixels; the width follows the output area.
HEIGHT = 330
#: The sidebar's figure: drawn at the sidebar's own width (plotly sizes it to its box from the first draw).
SIDEBAR_HEIGHT = 360

#: The link's front end: find the chart's figures by name, hand them each new figure, keep a hover, hide
#: the inline copy where the sidebar holds the chart, and report what was drawn where.
LINK_ESM = r"""
// plotly's own copies are left alone: toImage draws a clone at the end of <body> to make its PNG.
function figures(chart) {
  return [...document.querySelectorAll('.js-plotly-plot, .jp-RenderedPlotly')].filter(
    (gd) => gd.isConnected && gd.parentElement !== document.body && (!gd.layout || gd.layout.meta === chart)
      && !(gd.parentElement && gd.parentElement.closest('.js-plotly-plot')));
}
function inSidebar(gd) { return !!gd.closest('.jupyterlab-sidecar'); }
function outputOf(gd) { return gd.closest('.jp-OutputArea-child') || gd.parentElement; }
function copy(value) { return JSON.parse(JSON.stringify(value)); }
function follow(state) {
  const chart = state.get('chart');
  const hovers = new WeakMap();
  const given = new WeakMap();  // each figure element -> the figure it was last handed
  const watched = new WeakSet();
  let said = "", looks = 0, timer = null, stopped = false;
  const place = () => {
    const found = figures(chart);
    const ours = found.filter((gd) => gd.layout);  // drawn, and named ours
    const side = found.filter(inSidebar);
    const inline = ours.filter((gd) => !inSidebar(gd));
    const hide = state.get('sidebar') && side.length > 0;
    for (const gd of inline) {
      const box = outputOf(gd);
      if (box && box.style.display !== (hide ? 'none' : '')) box.style.display = hide ? 'none' : '';
    }
    const picture = !ours.length && !!document.querySelector('.ipy-gpumem-chart.' + chart);
    const report = {sidebar: side.filter((gd) => gd.layout).length > 0, inline: hide ? 0 : inline.length, picture,
                    width: Math.round(Math.max(0, ...ours.map((gd) => gd.getBoundingClientRect().width)))};
    const key = JSON.stringify([report.sidebar, report.inline, report.picture]);
    if (key !== said && (ours.length || picture)) { said = key; state.send({placement: report}); }
    return ours;
  };
  const give = (gd, fig) => {
    const plotly = window.Plotly;
    given.set(gd, fig);
    if (!watched.has(gd) && gd.on) {
      watched.add(gd);
      gd.on('plotly_hover', (e) => hovers.set(gd, e.points.map((p) => ({curveNumber: p.curveNumber, pointNumber: p.pointNumber}))));
      gd.on('plotly_unhover', () => hovers.delete(gd));
    }
    const layout = Object.assign(copy(fig.layout), inSidebar(gd) ? state.get('side') : {});
    Promise.resolve(plotly.react(gd, copy(fig.data), layout, fig.config || {})).then(() => {
      const points = hovers.get(gd);  // a hover the redraw took away comes back
      if (points && plotly.Fx) { try { plotly.Fx.hover(gd, points); } catch (e) { hovers.delete(gd); } }
    }).catch(() => {});
  };
  // Every figure of ours that has not had the latest figure gets it (all of them when ``every``): a copy
  // drawn since from the output's data too. One that cannot be drawn never stops the others.
  const draw = (every) => {
    const fig = state.get('figure');
    const drawn = place();
    if (stopped || !window.Plotly || !fig || !fig.data) return;
    for (const gd of drawn) {
      if (every || given.get(gd) !== fig) {
        try { give(gd, fig); } catch (e) { /* a figure plotly cannot redraw keeps what it shows */ }
      }
    }
  };
  const onFigure = () => draw(false);
  const onSide = () => draw(true);
  state.on('change:figure', onFigure);
  state.on('change:side', onSide);
  // Until the front end has drawn the chart, look for it often; then now and then (the sidebar may close).
  const look = () => {
    looks += 1;
    timer = setTimeout(look, looks < 80 ? 100 : 1500);
    try { draw(false); } catch (e) { /* the next look tries again */ }
  };
  const stop = () => {
    stopped = true;
    clearTimeout(timer);
    state.off('change:figure', onFigure);
    state.off('change:side', onSide);
  };
  state.once('comm:close', stop);
  state.once('destroy', stop);
  look();
  return stop;
}
// The state's model may come before or after this runs; nothing here waits on the kernel.
function initialize({ model }) {
  let stop = null, gone = false;
  const manager = model.widget_manager;
  if (manager && manager.get_model) {
    Promise.resolve(manager.get_model(model.get('state'))).then((state) => {
      if (state && !gone) stop = follow(state);
    }).catch(() => {});
  }
  return () => { gone = true; if (stop) stop(); };
}
export default { initialize };
"""


@lru_cache(maxsize=1)
def link_classes() -> tuple:
    """The ``(ChartState, ChartLink)`` widget classes (imports ipywidgets and anywidget, once)."""
    import anywidget
    import ipywidgets
    import traitlets

    class ChartState(ipywidgets.Widget):
        """The live chart's state, in ipywidgets' plain model with no view (see the module docstring).

        Traits: ``chart`` (the figure's name), ``figure`` (the latest figure), ``side`` (layout for the
        sidebar's copy), ``sidebar`` (hide the inline copy once the sidebar holds the chart).
        """

        chart = traitlets.Unicode("").tag(sync=True)
        figure = traitlets.Dict().tag(sync=True)
        side = traitlets.Dict().tag(sync=True)
        sidebar = traitlets.Bool(False).tag(sync=True)

    class ChartLink(anywidget.AnyWidget):
        """The live chart's JavaScript, in a model with no view; ``state`` is its ChartState's model id."""

        _esm = LINK_ESM
        state = traitlets.Unicode("").tag(sync=True)

    return ChartState, ChartLink


def _side_layout(title: str) -> dict:
    """The sidebar copy's layout: its own height, and its title one number a line so it fits the panel."""
    from ...display.escape import plotly_text

    text = title.replace(" · ", "\n")
    return {"height": SIDEBAR_HEIGHT, "title": {"text": plotly_text(text), "x": 0.01, "xanchor": "left",
                                                "font": {"size": 11}},
            "margin": {"l": 48, "r": 8, "t": 20 + 14 * (text.count("\n") + 1), "b": 8}}


class PlotlyChartView(ChartView):
    """The live chart: plotly's output under a display id, moved by its state and link (:func:`link_classes`).

    Args:
        sidebar: also show the figure in a sidebar (``display(target=...)``), the inline copy hidden by
            the front end wherever the sidebar drew it.

    Attributes:
        chart: the figure's name (its ``layout.meta``), unique per view.
        placement: what the front end last reported (``{"sidebar", "inline", "picture", "width"}``), or None.
        on_placement: called with the view when a report arrives (main thread).
        state: the ChartState widget the front end draws from, or None (none made, or closed).
        link_error: why no link could be made (the figure then stays as first drawn), or None.
    """

    tier = "plotly"

    def __init__(self, timeline, note: Optional[str] = None, sidebar: bool = False):
        super().__init__(timeline, note)
        self.chart = "ipy-gpumem-" + uuid.uuid4().hex[:12]
        self.sidebar = sidebar
        self.link = None
        self.state = None
        self.link_error: Optional[str] = None
        self.placement: Optional[dict] = None
        self.on_placement: Optional[Callable] = None
        self.owes = False  # a redraw was held back by MIN_INTERVAL
        self.bundled = -1  # the version the output holds
        self._order: Optional[list] = None  # the trace uids drawn so far, in order
        self._kept: dict = {}
        self._drawn_at = float("-inf")
        self._figure: Optional[dict] = None  # the figure last handed to the front end

    # -- what is drawn --------------------------------------------------------------------------

    def figure(self, snapshot) -> dict:
        """The figure of ``snapshot``: its traces in the order drawn so far (new ones appended)."""
        figure = session_figure(session_layout(snapshot), height=HEIGHT, title=chart_title(snapshot),
                                order=self._order, kept=self._kept, meta=self.chart)
        self._order = [trace["uid"] for trace in figure["data"]]
        self._kept = {trace["uid"]: trace for trace in figure["data"]}
        return figure

    def bundle(self, snapshot, figure: dict) -> dict:
        """The output: the figure first, its picture for viewers without plotly, text for a terminal."""
        return {PLOTLY_MIME: figure, "text/html": chart_html(snapshot, chart=self.chart),
                "text/plain": timeline_text(snapshot)}

    @property
    def widgets(self) -> tuple:
        """The widget models this view made: its state, its link, and the ``Layout`` model an ipywidgets
        DOM widget (the link) makes."""
        made = tuple(w for w in (self.state, self.link) if w is not None)
        layout = getattr(self.link, "_trait_values", {}).get("layout") if self.link is not None else None
        return made + ((layout,) if layout is not None and hasattr(layout, "comm") else ())

    # -- showing it -----------------------------------------------------------------------------

    def display(self, target=None, before: Optional[Callable] = None) -> None:
        """Show the figure inline, and inside ``target`` (an Output-like widget: the sidebar) when given;
        ``before`` runs just before the inline copy is shown (the sidebar's line of numbers)."""
        from IPython.display import display

        if self.note:
            print(f"ipy_gpumem: {self.note}")
        snapshot = self.timeline.snapshot()
        figure = self.figure(snapshot)
        if target is not None:
            # The link first, so its front end is watching when the copies are drawn: JupyterLab hides the
            # inline one as soon as the sidebar's appears.
            self._make_link(snapshot, figure)
            side = dict(figure, layout=dict(figure["layout"], **_side_layout(chart_title(snapshot))))
            with target:
                display({PLOTLY_MIME: side, "text/plain": timeline_text(snapshot)}, raw=True)
        if before is not None:
            before()
        self.handle = display(self.bundle(snapshot, figure), raw=True, display_id=True)
        self.drawn = self.bundled = snapshot.version
        self._drawn_at = time.monotonic()
        if target is None:
            self._make_link(snapshot, figure)  # after the figure: its first draw does not wait for anywidget

    def _make_link(self, snapshot, figure: dict) -> None:
        state = None
        try:
            state_class, link_class = link_classes()
            state = state_class(chart=self.chart, figure=figure, sidebar=self.sidebar,
                                side=_side_layout(chart_title(snapshot)) if self.sidebar else {})
            state.on_msg(self._heard)
            link = link_class(state=state.model_id)
        except Exception as exc:  # noqa: BLE001 - anywidget missing or mismatched: the figure stays as drawn
            self.link_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}".rstrip(": ")
            close_widgets([state] if state is not None else [])
            return
        self.state, self.link = state, link
        self._figure = figure

    def _heard(self, _widget, content, _buffers=None) -> None:
        """A message from the front end (main thread, when the kernel is idle)."""
        placement = content.get("placement") if isinstance(content, dict) else None
        if not isinstance(placement, dict):
            return
        self.placement = {key: placement.get(key) for key in ("sidebar", "inline", "picture", "width")}
        callback = self.on_placement
        if callback is not None:
            try:
                callback(self)
            except Exception:  # noqa: BLE001 - a report must never raise into the kernel
                pass

    # -- redrawing ------------------------------------------------------------------------------

    def draw(self, snapshot) -> None:
        if (self.placement or {}).get("picture"):  # the front end drew the picture, not the figure: move that
            if self.handle is not None:
                self.handle.update({"text/html": chart_html(snapshot, chart=self.chart),
                                    "text/plain": timeline_text(snapshot)}, raw=True)
            return
        figure = self.figure(snapshot)
        state = self.state
        if state is not None and figure != self._figure:
            with state.hold_sync():
                state.figure = figure
                if self.sidebar:
                    state.side = _side_layout(chart_title(snapshot))
            self._figure = figure

    def refresh(self, force: bool = False, final: bool = False) -> bool:
        """The sampler's redraws come at most every :data:`MIN_INTERVAL` seconds (a figure is tens of KiB
        of JSON with a long session). A redraw held back is owed (:attr:`owes`); the live chart's next
        tick makes it. A cell's end (:meth:`finalize`) is drawn at once, within the redraw budget."""
        now = time.monotonic()
        if not (force or final) and now - self._drawn_at < MIN_INTERVAL:
            self.owes = self.live and self.timeline.snapshot().version != self.drawn
            return False
        drew = super().refresh(force)
        if drew:
            self._drawn_at = now
        self.owes = False
        if drew and not self.timeline.running:
            self.write_output()  # an owed redraw after the last cell: the output catches up too
        return drew

    def finalize(self) -> bool:
        """At a cell's end: redraw, and write the figure into the output (what a saved notebook keeps)."""
        drew = self.refresh(final=True)
        self.write_output()
        return drew

    def write_output(self) -> None:
        """The output holds the figure as it is now: a reopened notebook draws it at the output's width
        (the update also drops the PNG plotly's renderer cached at the window's width)."""
        with self.lock:
            snapshot = self.timeline.snapshot()
            if self.live and self.handle is not None and snapshot.version != self.bundled:
                figure = self._figure if self._figure is not None and self.drawn == snapshot.version else \
                    self.figure(snapshot)
                self.handle.update(self.bundle(snapshot, figure), raw=True)
                self.bundled = snapshot.version

    def leave(self, snapshot) -> None:
        if self.handle is not None:
            # The output keeps the figure as it is now, with every series shown, and its picture.
            self.handle.update(self.bundle(snapshot, self.figure(snapshot)), raw=True)
        close_widgets(self.widgets)
        self.state = self.link = None
