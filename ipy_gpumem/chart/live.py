"""The session's live chart: one timeline, the background sampler, and the views that show it.

The extension's hooks report cell starts and ends; ``%gpumem chart`` / ``sidebar`` ask for views.
This controller owns everything in between: the timeline is created (and seeded with the cells
recorded so far) on the first request, the sampler runs only while a live view exists, views are
refreshed from the sampler thread about once a second and finalized on the main thread at each
cell's end. Nothing here imports IPython; views do their own displaying (``chart.py``).
"""
from __future__ import annotations

from typing import Callable, Optional

from .views import StatusLineView, WidgetChartView, choose_tier, make_view
from .sampler import Sampler
from .timeline import Timeline, seed_timeline

__all__ = ["LiveChart"]


class LiveChart:
    """Timeline, sampler and views for one shell.

    Args:
        probe: the ``MemoryProbe`` the sampler reads.
        records: returns the ledger's records (to seed the timeline when it is first needed).
        current_measurement: returns the cell measurement in flight, or None; the sampler folds
            its readings into it (sampled peaks, the ``%%gpumem`` cell chart).
    """

    def __init__(self, probe, records: Callable[[], list], current_measurement: Callable[[], object]):
        self.probe = probe
        self._records = records
        self._current = current_measurement
        self.timeline: Optional[Timeline] = None
        self.sampler: Optional[Sampler] = None
        self.views: list = []
        self.sidecar = None
        self.sample_rate = 4.0
        self.error: Optional[str] = None  # why the sampler stopped, until reported
        self._error_shown = False

    # -- what the hooks report -------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.timeline is not None

    def cell_started(self, sample, source: str) -> None:
        # "[*]" like Jupyter's prompt: IPython 7 and 8+ disagree on the count at this point; the
        # record's label replaces it when the cell ends.
        self.timeline.cell_started(sample.t, "[*]", source)
        self.timeline.add(sample)

    def cell_finished(self, sample, record) -> Optional[str]:
        """Close the cell's span and store static snapshots; returns a message to show, once."""
        self.timeline.add(sample)
        self.timeline.cell_finished(sample.t, record)
        for view in list(self.views):
            view.finalize()
        if self.error and not self._error_shown:
            self._error_shown = True
            self.stop_sampler()
            return (f"ipy_gpumem: the live chart's sampler stopped ({self.error}); the chart now moves at cell "
                    "ends only. %gpumem chart restarts it.")
        return None

    # -- views -----------------------------------------------------------------------------------

    def _ensure_timeline(self) -> Timeline:
        if self.timeline is None:
            timeline = Timeline(max_points=1000, max_spans=300)
            seed_timeline(timeline, self._records())
            self.timeline = timeline
        return self.timeline

    def show(self, shell=None, prefer: Optional[str] = None, note: Optional[str] = None, run: bool = True) -> None:
        """Show the chart inline in the richest tier the front end supports (``prefer`` overrides).

        Raises:
            ValueError: ``prefer`` is not a chart kind.
        """
        tier, why = choose_tier(shell, prefer)
        view = make_view(tier, self._ensure_timeline(), note or why)
        # Asking again re-shows the chart: the previous inline view keeps a static snapshot and
        # stops moving, so live views never pile up.
        for old in [v for v in self.views if v.inline]:
            old.freeze()
            self.views.remove(old)
        view.display()
        if view.live:  # a text chart is printed once: nothing to keep moving
            self.views.append(view)
            self.error, self._error_shown = None, False
            if run:
                self.ensure_sampler()

    def show_sidebar(self, run: bool = True) -> None:
        """The widget chart in JupyterLab's right sidebar, and a live line of numbers inline."""
        from sidecar import Sidecar

        timeline = self._ensure_timeline()
        for old in [v for v in self.views if not v.inline]:
            old.freeze()
            self.views.remove(old)
        if self.sidecar is not None:
            try:
                self.sidecar.close()
            except Exception:  # noqa: BLE001 - a sidebar the user closed already
                pass
        self.sidecar = Sidecar(title="GPU memory", anchor="right")
        view = WidgetChartView(timeline)
        view.inline = False
        view.display(target=self.sidecar)
        # One live line stays inline, so the numbers are never lost where the sidebar cannot show.
        line = StatusLineView(timeline, where="chart in the right sidebar; not there? %gpumem chart shows it here")
        line.inline = False
        line.display()
        self.views += [view, line]
        if run:
            self.ensure_sampler()

    # -- the sampler -----------------------------------------------------------------------------

    def _on_sample(self, sample) -> None:
        # Sampler thread: feed the timeline and the cell in flight; nothing else.
        timeline = self.timeline
        if timeline is not None:
            timeline.add(sample)
        measurement = self._current()
        if measurement is not None:
            measurement.observe(sample)

    def _on_redraw(self) -> None:
        # Sampler thread: views only change widget state or update their display handle.
        for view in list(self.views):
            view.refresh()

    def _on_error(self, message: str) -> None:
        self.error = message  # reported once, from the main thread, at the next cell's end

    def ensure_sampler(self) -> None:
        """Start sampling if a live view exists and the rate allows it."""
        if self.sampler is not None or self.sample_rate <= 0 or not self.views:
            return
        self.sampler = Sampler(self.probe, interval=1.0 / self.sample_rate, on_sample=self._on_sample,
                               redraw_interval=1.0, on_redraw=self._on_redraw, on_error=self._on_error)
        self.sampler.start()

    def stop_sampler(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler = None

    def set_rate(self, rate: float) -> None:
        self.sample_rate = rate
        if self.sampler is not None:
            if rate <= 0:
                self.stop_sampler()
            else:
                self.sampler.interval = 1.0 / rate

    def close(self) -> None:
        """On unload: stop sampling and leave a static snapshot where each view was."""
        self.stop_sampler()
        for view in self.views:
            view.freeze()
        self.views.clear()
