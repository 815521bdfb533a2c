"""The live chart as plotly's own output, moved by two small widgets with no view: fast to show, and a figure wherever it is reopened.

The chart is displayed as a plotly figure (``application/vnd.plotly.v1+json``) under a display id,
with its SVG picture and a line of text beside it, after its picture (below). The front end's plotly draws
it (its renderer comes with the page; no widget bundle travels), and a notebook saved at any moment
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
notebook shows; in JupyterLab it is hidden while the sidebar shows the chart (a rule of the sidebar's
picture, below; the link hides it too, where a browser lacks CSS ``:has()``), and in Notebook 7, which has
no sidebar for it, it stays: the front end decides from what it has drawn, with no timer. The kernel hears
the report when it is next idle and words the line above the chart from it.

The chart's picture comes first (:meth:`PlotlyChartView.display`): a page's first plotly figure makes
plotly.js evaluate, which holds the page's main thread for seconds on a busy machine (2.5-7 s measured on
two busy cores, in JupyterLab 4.6 and Notebook 7.6), and a picture sent with the figure waited for it too.
So the output first holds the SVG picture (an ``<img>``, drawn at once) and a placeholder; the figure
replaces the placeholder at the sampler's next tick (:data:`FIGURE_AFTER`), once the page has drawn the
picture, and a rule in the picture's own ``<style>`` hides the picture as soon as the figure beside it is
drawn. Once the figure was drawn (the front end said so, or a later cell ended), the picture is emptied:
a saved notebook holds the figure once. In the sidebar the same happens, and the sidebar's picture carries
the rule that hides the inline copy: JupyterLab never shows it (no flash before the link could hide it),
Notebook 7, which draws no sidebar, never loads the rule, and a reopened notebook, whose sidebar is gone,
shows the inline copy.

plotly itself is never imported here: the figure is a dict. anywidget is imported when the link is
made, after the picture was sent, so the first draw does not wait for it.
"""
from __future__ import annotations

import time
import uuid
from functools import lru_cache
from typing import Callable, Optional

from ..session import session_layout
from ..views import (CHART_SIZE, SIDEBAR_SIZE, ChartView, chart_html, chart_title, close_widgets, in_vscode,
                     timeline_text)
from .timeline import PLOTLY_MIME, session_figure

__all__ = ["PlotlyChartView", "link_classes", "HEIGHT", "SIDEBAR_HEIGHT", "MIN_INTERVAL", "FIGURE_AFTER", "LINK_ESM"]

#: Seconds between two redraws of a live figure (cell ends included; a held-back one is made later).
MIN_INTERVAL = 0.9  # the sampler ticks once a second: one redraw a tick, never more
#: Inline height in pixels; the width follows the output area.
HEIGHT = 330
#: The sidebar's figure: drawn at the sidebar's own width (plotly sizes it to its box from the first draw).
SIDEBAR_HEIGHT = 360
#: Seconds between the picture and the figure that replaces it (sent at the sampler's first tick after): the
#: page draws the picture before plotly.js, evaluated for a page's first figure, holds its main thread.
FIGURE_AFTER = 0.3

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
        figure_after: seconds from the picture to the figure (:data:`FIGURE_AFTER`; 0: both at once, for a
            chart no sampler redraws).
        picture: the display handle of the picture shown until the figure is drawn, once shown.
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
        self.figure_after = FIGURE_AFTER
        self.picture = None
        self._due: Optional[float] = None  # when the figure is to replace its placeholder; None once sent
        self._target = None  # the sidebar (an Output-like widget), and the picture its outputs start with
        self._side_picture: Optional[dict] = None
        self._picture_held = False  # the picture still shows a chart (not emptied yet)

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

    def first_picture(self, snapshot, side: bool = False) -> dict:
        """The picture shown until the figure beside it is drawn (see the module docstring), or once drawn
        (``snapshot`` None) only its ``<style>`` and an empty mark.

        Its rule hides its own output as soon as the next output holds a drawn plotly figure; the sidebar's
        picture (``side``) also hides the inline copy of a sidebar chart (marked ``-inline``), for as long as
        the sidebar shows it.
        """
        mark = f"{self.chart}-picture"
        rules = f".jp-OutputArea-child:has(.{mark}):has(+ .jp-OutputArea-child .js-plotly-plot .main-svg){{display:none}}"
        if side:
            inline = f".jp-OutputArea-child:has(.{self.chart}-inline)"
            rules += f"{inline},{inline} + .jp-OutputArea-child{{display:none}}"
        classes = mark + (" " + self.chart + ("-side" if side else "-inline") if self.sidebar else "")
        width, height = SIDEBAR_SIZE if side else CHART_SIZE
        body = "" if snapshot is None else chart_html(snapshot, width, (SIDEBAR_HEIGHT if side else HEIGHT) - 30)
        return {"text/html": f'<style>{rules}</style><div class="{classes}">{body}</div>', "text/plain": ""}

    def _side_figure(self, snapshot, figure: dict) -> dict:
        """The sidebar's copy: the figure at the sidebar's height, its title one number a line."""
        side = dict(figure, layout=dict(figure["layout"], **_side_layout(chart_title(snapshot))))
        return _output({PLOTLY_MIME: side, "text/plain": timeline_text(snapshot)})

    @property
    def widgets(self) -> tuple:
        """The widget models this view made: its state, its link, and the ``Layout`` model an ipywidgets
        DOM widget (the link) makes."""
        made = tuple(w for w in (self.state, self.link) if w is not None)
        layout = getattr(self.link, "_trait_values", {}).get("layout") if self.link is not None else None
        return made + ((layout,) if layout is not None and hasattr(layout, "comm") else ())

    # -- showing it -----------------------------------------------------------------------------

    def display(self, target=None, before: Optional[Callable] = None) -> None:
        """Show the chart inline, and inside ``target`` (an Output-like widget: the sidebar) when given;
        ``before`` runs just before the inline copy is shown (the sidebar's line of numbers).

        Each copy is its picture, then the figure: at once when :attr:`figure_after` is 0, else at the
        sampler's first tick after that many seconds (:meth:`refresh`), once the page drew the picture.
        """
        from IPython.display import display

        if self.note:
            print(f"ipy_gpumem: {self.note}")
        snapshot = self.timeline.snapshot()
        figure = self.figure(snapshot)
        # VS Code draws outputs its own way (none of JupyterLab's output classes for the rule that hides the
        # picture): the figure alone there, as before.
        first = not in_vscode()
        later = first and self.figure_after > 0
        if target is not None:
            # The link first, so its front end is watching when the copies are drawn.
            self._make_link(snapshot, figure)
            self._target = target
            self._side_picture = _output(self.first_picture(snapshot, side=True))
            # The sidebar's outputs are set from here (not captured with ``with target:``), so a later
            # thread can add the figure after the picture.
            target.outputs = (self._side_picture,) + (() if later else (self._side_figure(snapshot, figure),))
        if before is not None:
            before()
        if first:
            self.picture = display(self.first_picture(snapshot), raw=True, display_id=True)
            self._picture_held = True
        self.handle = display({"text/plain": ""} if later else self.bundle(snapshot, figure), raw=True,
                              display_id=True)
        self.drawn = snapshot.version
        self.bundled = -1 if later else snapshot.version
        self._drawn_at = time.monotonic()
        self._due = self._drawn_at + self.figure_after if later else None
        self.owes = later
        if target is None:
            self._make_link(snapshot, figure)  # after the picture: its first draw does not wait for anywidget

    def _send_figure(self) -> None:
        """The figure replaces its placeholder (and joins the sidebar's picture): any thread, under the lock."""
        snapshot = self.timeline.snapshot()
        figure = self.figure(snapshot)
        self._due = None
        if self._target is not None:
            self._target.outputs = (self._side_picture, self._side_figure(snapshot, figure))
        if self.handle is not None:
            self.handle.update(self.bundle(snapshot, figure), raw=True)
        self.bundled = snapshot.version
        self._push(snapshot, figure)
        self.drawn = snapshot.version

    def drop_picture(self) -> None:
        """Empty the picture once the figure was drawn: a saved notebook then holds the chart once. Its
        ``<style>`` and mark stay, for the rules that find the copies."""
        with self.lock:
            if self._picture_held and self._due is None and self.picture is not None:
                self._picture_held = False
                self.picture.update(self.first_picture(None), raw=True)

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
        if self.live and (placement.get("sidebar") or placement.get("inline") or placement.get("picture")):
            self.drop_picture()  # the figure (or its own picture) is drawn: the first picture is done
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
        self._push(snapshot, self.figure(snapshot))

    def _push(self, snapshot, figure: dict) -> None:
        """Hand ``figure`` to the front end through the state (nothing is sent when it did not change)."""
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
        tick makes it. A cell's end (:meth:`finalize`) is drawn at once, within the redraw budget; ``force``
        draws now, also while the picture waits for its figure."""
        now = time.monotonic()
        if self._due is not None:  # the picture is showing: the figure replaces its placeholder when due
            if now < self._due and not force:  # (a forced redraw is asked for now: the figure goes now)
                self.owes = True
                return False
            with self.lock:
                if not self.live or self._due is None:
                    return False
                self._send_figure()
            self._drawn_at, self.owes = now, False
            return True
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
        """At a cell's end: redraw, and write the figure into the output (what a saved notebook keeps); the
        picture goes once a cell ended after the figure was sent (the page drew it since)."""
        sent = self._due is None
        drew = self.refresh(final=True)
        self.write_output()
        if sent:
            self.drop_picture()
        return drew

    def write_output(self) -> None:
        """The output holds the figure as it is now: a reopened notebook draws it at the output's width
        (the update also drops the PNG plotly's renderer cached at the window's width)."""
        with self.lock:
            snapshot = self.timeline.snapshot()
            if self.live and self.handle is not None and self._due is None and snapshot.version != self.bundled:
                figure = self._figure if self._figure is not None and self.drawn == snapshot.version else \
                    self.figure(snapshot)
                self.handle.update(self.bundle(snapshot, figure), raw=True)
                self.bundled = snapshot.version

    def leave(self, snapshot) -> None:
        self._due = None
        if self.handle is not None:
            # The output keeps the figure as it is now, with every series shown, and its picture.
            self.handle.update(self.bundle(snapshot, self.figure(snapshot)), raw=True)
        if self._picture_held and self.picture is not None:
            self._picture_held = False
            self.picture.update(self.first_picture(None), raw=True)
        close_widgets(self.widgets)
        self.state = self.link = None
        self._target = None


def _output(bundle: dict) -> dict:
    """``bundle`` as an output of an Output widget's ``outputs``."""
    return {"output_type": "display_data", "data": bundle, "metadata": {}}
