"""The live chart as a plotly ``FigureWidget``: it moves while cells run and keeps the user's zoom across updates.

plotly's own renderer does not redraw a figure that is updated in place through a ``display_id``,
so a figure that moves needs a widget. The widget is shown in one output bundle with the figure's
JSON and the SVG picture beside it: an untrusted or reopened notebook, where no widget can be
drawn, shows the plotly figure (plotly's renderer is trusted to run) or the picture.

Updates touch only what the data owns: each trace's points, the cell bands and the capacity notes.
The axes' ranges are never set from here, and the layout's ``uirevision`` stays constant, so a
zoom, a pan or a legend toggle that the user made survives every update (the widget writes the
user's ranges back into the figure, and an update that does not mention them leaves them be).

plotly is imported here only, when a live figure is asked for (about a second the first time, on
the main thread, never inside a cell's measurement). A view that stops leaves the figure as it is
now, with the user's zoom, as static JSON, and closes its widget: saved widget state then holds at
most the one live figure's plotly bundle (about 5 MB), never one per chart shown.
"""
from __future__ import annotations

import time
from typing import Optional

from .timeline import PLOTLY_MIME, figure_config, timeline_figure
from ..views import (_View, chart_html, close_widgets, plotly_widget_status, show_widget_view, static_bundle,  # noqa: F401
                     status_line, timeline_text)

__all__ = ["FigureChartView", "plotly_widget_status", "figure_json", "WIDGET_MIME"]

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
#: Seconds between two redraws of a live figure (cell ends included; a held-back one is made later).
MIN_INTERVAL = 0.9  # the sampler ticks once a second: one redraw a tick, never more
#: Inline height in pixels; the width follows the output area.
HEIGHT = 330
#: The sidebar's figure: drawn at the sidebar's own width, so its labels keep their size.
SIDEBAR_HEIGHT = 360


def _same_traces(widget_data, specs) -> bool:
    return len(widget_data) == len(specs) and all(
        trace.name == spec.get("name") and trace.type == spec.get("type") for trace, spec in zip(widget_data, specs))


class FigureChartView(_View):
    """The live chart as a plotly ``FigureWidget``, inline or inside an Output-like widget (the sidebar)."""

    tier = "plotly"

    def __init__(self, timeline, note: Optional[str] = None, height: int = HEIGHT, narrow: bool = False):
        super().__init__(timeline, note)
        import plotly.graph_objects as go

        self.height = height
        self.narrow = narrow  # drawn in the sidebar: its title is broken into lines
        self.rendered = False  # True once a front end drew the widget (it sends its first deltas back)
        self.owes = False  # a redraw was held back by MIN_INTERVAL
        self._drawn_at = float("-inf")
        self._last = None  # the figure spec last drawn: updates send only what changed
        self._note = ""  # said in the title before the numbers (why the chart is where it is)
        spec = self._spec(timeline.snapshot())
        self.figure = go.FigureWidget(data=spec["data"], layout=spec["layout"])
        try:
            self.figure._config = figure_config()
        except Exception:  # noqa: BLE001 - an older plotly without a synced config: the default mode bar
            pass
        try:  # plotly.js answers its first draw with the trace and layout deltas it computed
            self.figure.observe(self._drawn_somewhere, names=["_js2py_traceDeltas", "_js2py_layoutDelta"])
        except Exception:  # noqa: BLE001 - no such traits in this plotly: assume it is drawn
            self.rendered = True

    def _drawn_somewhere(self, _change) -> None:
        self.rendered = True

    def adopt(self, handle, note: str) -> None:
        """Show this (sidebar) figure in another output, ``handle``'s, with ``note`` as its title."""
        with self._lock:
            if not self.live:
                return
            self._note = note
            self.narrow = False
            self.height = HEIGHT
            self.figure.layout.height = HEIGHT
            self.handle = handle
            snapshot = self.timeline.snapshot()
            self._draw(snapshot)
            handle.update(self._bundle(snapshot), raw=True)
            self._bundled = snapshot.version

    @property
    def widgets(self) -> tuple:
        """Every widget model this view created: the figure, and the ipywidgets ``Layout`` a
        DOMWidget-based FigureWidget (plotly 5) makes behind plotly's own ``layout`` property."""
        made = getattr(self.figure, "_trait_values", {}).get("layout")
        try:
            import ipywidgets

            extra = (made,) if isinstance(made, ipywidgets.Widget) else ()
        except ImportError:
            extra = ()
        return (self.figure,) + extra

    def display(self, target=None) -> None:
        """Show the figure inline (``target`` None) or inside an Output-like widget (the sidebar)."""
        show_widget_view(self, self.figure, target)

    def _bundle(self, snapshot, live: bool = True) -> dict:
        text = timeline_text(snapshot)
        if not live:
            return static_bundle(snapshot, figure_json(self.figure))
        # The widget's own state holds the live figure; the JSON and picture beside it are what an
        # untrusted or reopened notebook shows.
        return {WIDGET_MIME: {"version_major": 2, "version_minor": 0, "model_id": self.figure.model_id},
                PLOTLY_MIME: figure_json(self.figure), "text/html": chart_html(snapshot),
                "text/plain": text}

    def _spec(self, snapshot) -> dict:
        """The figure, titled with the current numbers as the SVG chart's header line is."""
        line = status_line(snapshot) if not snapshot.empty else "no samples yet"
        if self.narrow:  # the sidebar: one number per line, so the title fits its width
            line = line.replace(" · ", "\n")
        # Plain text, lines apart at "\n": the figure escapes it for plotly and breaks its lines.
        title = f"{self._note}\nipy_gpumem · {line}" if self._note else f"ipy_gpumem · {line}"
        spec = timeline_figure(snapshot, height=self.height, title=title)
        spec["layout"]["margin"]["t"] = 18 + 15 * title.count("\n") + 16
        return spec

    def _draw(self, snapshot) -> None:
        spec = self._spec(snapshot)
        last, self._last = self._last, spec
        figure = self.figure
        with figure.batch_update():
            if last is not None and _same_traces(figure.data, spec["data"]):
                # Only what changed goes through plotly's validation (a list compare is C speed; a
                # validated assignment of the same points costs milliseconds).
                for trace, new, old in zip(figure.data, spec["data"], last["data"]):
                    changed = {key: new[key] for key in _MOVING if key in new and new[key] != old.get(key)}
                    if changed:
                        trace.update(changed)
            else:  # the first draw, or a device or the cells appeared: the set of traces changed
                figure.data = ()
                figure.add_traces(spec["data"])
            layout, before = spec["layout"], (last or {}).get("layout", {})
            # Assigned, not updated: an update with an empty list would leave the old items.
            for key in ("shapes", "annotations", "showlegend", "title", "margin"):
                if layout.get(key) != before.get(key):
                    figure.layout[key] = layout.get(key)
            if layout["yaxis"]["title"] != before.get("yaxis", {}).get("title"):
                figure.layout.yaxis.title.text = layout["yaxis"]["title"]["text"]
            if layout["xaxis"]["rangeslider"] != before.get("xaxis", {}).get("rangeslider"):
                figure.layout.xaxis.rangeslider.visible = layout["xaxis"]["rangeslider"]["visible"]

    def refresh(self, force: bool = False, final: bool = False) -> bool:
        """The sampler's redraws come at most every :data:`MIN_INTERVAL` seconds: a figure update
        sends every changed trace whole (tens of KiB of JSON with a long session), where the SVG view
        sends one picture. A redraw held back is owed (:attr:`owes`); the live chart's next tick
        makes it. A cell's end (:meth:`finalize`) is drawn at once, within the redraw budget."""
        now = time.monotonic()
        if not (force or final) and now - self._drawn_at < MIN_INTERVAL:
            self.owes = self.live and self.timeline.snapshot().version != self._drawn
            return False
        drew = super().refresh(force)
        if drew:
            self._drawn_at = now
        self.owes = False
        if drew and not self.timeline.running:
            self._write_fallback()  # an owed redraw after the last cell: the output catches up too
        return drew

    def finalize(self) -> bool:
        drew = self.refresh(final=True)
        self._write_fallback()
        return drew

    def _write_fallback(self) -> None:
        with self._lock:
            snapshot = self.timeline.snapshot()
            # Same widget, fresh fallback for an untrusted or reopened notebook.
            if self.live and self.handle is not None and snapshot.version != self._bundled:
                self.handle.update(self._bundle(snapshot), raw=True)
                self._bundled = snapshot.version

    def _leave(self, snapshot) -> None:
        if self.handle is not None:
            # The output keeps the figure as it is now, as the user left it (zoom included, which the
            # widget wrote back), and no widget reference.
            if snapshot.version != self._drawn:
                self._draw(snapshot)
            self.handle.update(self._bundle(snapshot, live=False), raw=True)
        close_widgets(self.widgets)


#: Trace properties that change as the session goes on (the rest is fixed per trace).
_MOVING = ("x", "y", "text", "hovertext", "marker", "mode")


def figure_json(figure) -> dict:
    """The figure as it is now, the user's zoom included, as the plotly MIME type's JSON."""
    spec = figure.to_plotly_json()
    return {"data": spec.get("data", []), "layout": spec.get("layout", {}), "config": figure_config()}


