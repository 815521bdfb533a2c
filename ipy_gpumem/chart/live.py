"""The session's live chart: one timeline, the background sampler, and the views that show it.

The extension's hooks report cell starts and ends; ``%gpumem chart`` / ``sidebar`` ask for views.
This controller owns everything in between: the timeline is created (and seeded with the cells
recorded so far) on the first request, the sampler runs only while a live view exists, and views
are redrawn from the sampler thread about once a second and at cell ends.

Redrawing is the expensive part (a snapshot, an SVG, a message to the front end: about a
millisecond or two each), so it draws from a CPU budget (:class:`RedrawBudget`): a cell's end
redraws at once while the budget lasts, which covers every cell of a normal session, and cells
that run back to back faster than the budget allows are drawn together by the sampler's next
redraw. While no cell runs and no value moves, the sampler does not redraw at all (the time axis
would only stretch). Sampling and drawing together stay under 1% of a core however fast
cells run. Nothing here imports IPython; views do their own displaying (``views.py``).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

from .figures.live import PlotlyChartView
from .sampler import Sampler
from .timeline import Timeline, seed_timeline
from .views import (SIDEBAR_SIZE, HtmlChartView, StatusLineView, TextChartView, WidgetChartView, choose_tier,
                    close_widgets, plotly_widget_status)
from .words import placement_text

__all__ = ["LiveChart", "RedrawBudget", "MAX_RATE", "MIN_RATE", "check_rate", "make_view"]

#: Fastest sampling the chart accepts (samples per second); the sampler costs about 2% of a
#: core there.
MAX_RATE = 100.0
#: Slowest sampling other than 0: one sample every 1000 s. Below it the interval stops meaning
#: anything (1e-10 would be a sample every 300 years).
MIN_RATE = 0.001


def check_rate(rate) -> float:
    """``rate`` as a float if it is 0 or within ``[MIN_RATE, MAX_RATE]`` samples per second.

    Raises:
        ValueError: NaN, infinite, negative, or outside that range; the message gives the range.
    """
    try:
        value = float(rate)
    except (TypeError, ValueError):
        raise ValueError(f"sample_rate must be a number, got {rate!r}") from None
    if value == 0:
        return 0.0
    if not (MIN_RATE <= value <= MAX_RATE):  # also refuses NaN
        raise ValueError(f"sample_rate must be 0 (cell ends only) or between {MIN_RATE:g} and {MAX_RATE:g} "
                         f"samples per second, got {rate!r}")
    return value


class RedrawBudget:
    """A CPU budget for redraws: it refills at ``share`` of a core and holds at most ``burst`` seconds.

    ``allows()`` says whether a redraw may happen now; ``spend(cpu_seconds)`` charges what it
    cost. Long-run redraw CPU is therefore at most ``share`` of one core, whatever the number of
    cells or views, while a quiet session keeps a full bucket and redraws every cell end at once.

    Args:
        share: the long-run CPU share allowed (0.003 is 0.3% of one core).
        burst: the most CPU seconds saved up for a flurry of redraws.
        clock: seconds, monotonic (injectable for tests).
    """

    def __init__(self, share: float = 0.003, burst: float = 0.02, clock: Callable[[], float] = time.perf_counter):
        self.share = share
        self.burst = burst
        self.clock = clock
        self._tokens = burst
        self._at = clock()
        self._lock = threading.Lock()

    def _refill(self) -> None:
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.share)
        self._at = now

    def allows(self) -> bool:
        with self._lock:
            self._refill()
            return self._tokens > 0

    def spend(self, seconds: float) -> None:
        with self._lock:
            self._refill()
            self._tokens -= max(0.0, seconds)


def make_view(tier: str, timeline, note: Optional[str] = None):
    """A view of ``timeline`` in ``tier`` (see :func:`~.views.choose_tier`); HTML if a widget cannot be built."""
    if tier in ("plotly", "widget"):
        try:
            return PlotlyChartView(timeline, note) if tier == "plotly" else WidgetChartView(timeline, note)
        except Exception as exc:  # noqa: BLE001 - e.g. an ipywidgets version mismatch
            return HtmlChartView(timeline, f"{tier} chart unavailable ({type(exc).__name__}: {exc}): "
                                           "showing an HTML chart updated in place")
    if tier == "html":
        return HtmlChartView(timeline, note)
    return TextChartView(timeline, note)


class LiveChart:
    """Timeline, sampler and views for one shell.

    Args:
        probe: the ``MemoryProbe`` the sampler reads.
        records: returns the ledger's records (to seed the timeline when it is first needed).
        current_measurement: returns the cell measurement in flight, or None; the sampler folds
            its readings into it (sampled peaks, the ``%%gpumem`` cell chart).

    Attributes:
        sample_rate: samples per second while a live view exists (0: cell ends only); setting it
            is :meth:`set_rate`.
        error: why the sampler stopped, until reported at a cell's end.
    """

    def __init__(self, probe, records: Callable[[], list], current_measurement: Callable[[], object]):
        self.probe = probe
        self._records = records
        self._current = current_measurement
        self.timeline: Optional[Timeline] = None
        self.sampler: Optional[Sampler] = None
        self.views: list = []
        self.sidecar = None
        self._rate = 4.0
        # Whether sampling is wanted when a live view exists: False after stop_sampler() (``%gpumem
        # off``, a sampler error) until show() / ensure_sampler() asks again.
        self._wanted = True
        self.budget = RedrawBudget()
        self._drawn_moved = -1  # Timeline.moved at the last redraw
        self._drawn_at = float("-inf")
        self._pending = False  # a cell ended without its redraw (budget spent): the sampler owes one
        self._line = None  # the sidebar's line of numbers: says where the front end drew the chart
        self._view_error: Optional[str] = None  # a view that failed to draw, until reported
        self.error: Optional[str] = None  # why the sampler stopped, until reported
        self._error_shown = False

    # -- what the hooks report -------------------------------------------------------------------

    def cell_started(self, sample, source: str) -> None:
        # "[*]" like Jupyter's prompt: IPython 7 and 8+ disagree on the count at this point; the
        # record's label replaces it when the cell ends.
        timeline = self._ensure_timeline()
        timeline.cell_started(sample.t, "[*]", source)
        timeline.add(sample)

    def cell_finished(self, sample, record) -> Optional[str]:
        """Close the cell's span and redraw (now, or at the sampler's next redraw when cells come
        faster than the redraw budget); returns a message to show, once."""
        timeline = self._ensure_timeline()
        timeline.add(sample)
        timeline.cell_finished(sample.t, record)
        sampler = self.sampler
        if self.views:
            if sampler is None or not sampler.running or self.budget.allows():
                # Without a running sampler nobody would redraw later: draw now, whatever it costs.
                self._redraw(final=True)
            else:
                self._pending = True
        if self._view_error is not None:
            error, self._view_error = self._view_error, None
            return (f"ipy_gpumem: the live chart stopped drawing ({error}); it keeps what it showed, recording "
                    "goes on. %gpumem chart html shows it again.")
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
        """Show the chart inline in the tier the front end supports (``prefer`` overrides).

        Raises:
            ValueError: ``prefer`` is not a chart kind.
        """
        tier, why = choose_tier(shell, prefer)
        view = make_view(tier, self._ensure_timeline(), note or why)
        # One live chart at a time: asking again re-shows it here, and every earlier view (the
        # sidebar's too) keeps a static figure, closes its widgets and stops moving, so live views
        # and widgets never pile up.
        for old in list(self.views):
            self._retire(old)
        self._close_sidecar()
        self._line = None
        if isinstance(view, PlotlyChartView) and not (run and self._rate > 0):
            view.figure_after = 0  # no sampler to send the figure after its picture: both at once
        view.display()
        if view.live:  # a text chart is printed once: nothing to keep moving
            self.views.append(view)
            self.error, self._error_shown = None, False
            if run:
                self.ensure_sampler()

    def show_sidebar(self, run: bool = True) -> None:
        """The chart in JupyterLab's right sidebar, and a live line of numbers inline.

        The chart is also shown inline, under the line: it is what a reopened notebook shows, and what a
        front end without a right sidebar (Notebook 7) shows live. The front end decides (``figures.live``):
        while the sidebar shows the chart, a rule the sidebar's copy carries hides the inline copy. When the
        front end says where it drew the chart, the line says it.
        """
        from sidecar import Sidecar

        timeline = self._ensure_timeline()
        for old in list(self.views):  # one live chart at a time: an inline one keeps a static figure
            self._retire(old)
        self._close_sidecar()
        self.sidecar = Sidecar(title="GPU memory", anchor="right")
        # One live line stays inline, so the numbers are never lost where the sidebar cannot show.
        line = StatusLineView(timeline)
        line.inline = False
        view = None
        if plotly_widget_status() is None:
            try:
                view = PlotlyChartView(timeline, sidebar=True)
            except Exception:  # noqa: BLE001 - the picture still works
                view = None
        if view is not None:
            view.inline = False
            view.on_placement = self._placed
            if not (run and self._rate > 0):
                view.figure_after = 0  # no sampler to send the figure after its picture: both at once
            view.display(target=self.sidecar, before=line.display)
        else:  # no plotly here: the picture in an HTML widget, which says nothing back
            view = WidgetChartView(timeline, size=SIDEBAR_SIZE)
            view.inline = False
            view.display(target=self.sidecar)
            line.where = "chart in the right sidebar; not there? %gpumem chart shows it here"
            line.display()
        self.views += [view, line]
        self._line = line
        self.error, self._error_shown = None, False
        if run:
            self.ensure_sampler()

    def _placed(self, view) -> None:
        """The front end said where it drew the chart (main thread): the line says it."""
        line = self._line
        if line is not None and view in self.views:
            words = placement_text(view.placement)
            if words:
                line.say(words)

    def _retire(self, view) -> None:
        view.freeze()
        if view in self.views:
            self.views.remove(view)

    def _close_sidecar(self) -> None:
        self._line = None
        sidecar, self.sidecar = self.sidecar, None
        if sidecar is not None:
            close_widgets([sidecar, getattr(sidecar, "layout", None)])

    # -- redrawing -------------------------------------------------------------------------------

    def _redraw(self, final: bool) -> None:
        """Redraw every live view that is out of date and charge the budget (any thread)."""
        self._pending = False
        timeline = self.timeline
        self._drawn_moved = timeline.moved if timeline is not None else -1
        self._drawn_at = self.budget.clock()
        cpu0 = time.thread_time()
        for view in list(self.views):
            try:
                if final:
                    view.finalize()
                else:
                    view.refresh()
            except Exception as exc:  # noqa: BLE001 - a view that fails stops; recording goes on
                self._drop(view, exc)
        self.budget.spend(time.thread_time() - cpu0)

    def _drop(self, view, exc: BaseException) -> None:
        """Stop a view that failed to draw (any thread): it leaves the chart as it last drew it, and
        the next cell's end says so once. The recording and the other views go on."""
        view.live = False
        if view in self.views:
            self.views.remove(view)
        try:
            close_widgets(getattr(view, "widgets", ()))
        except Exception:  # noqa: BLE001
            pass
        self._view_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}".rstrip(": ")

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
        # Sampler thread, at most once a redraw interval: views only change widget state or update
        # their display handle. The budget applies here too, so a flurry of cells cannot make the
        # sampler redraw past it; a redraw owed by a cell end is made as a final one.
        timeline = self.timeline
        if not self.views or timeline is None:
            return
        owed = any(getattr(view, "owes", False) for view in self.views)
        if not self._pending and not owed and not timeline.running and timeline.moved == self._drawn_moved:
            # Idle and nothing moved: a redraw would only stretch the time axis, in the live chart
            # and in the picture a saved notebook keeps. The next cell's start draws the idle time.
            return
        if self.budget.allows():
            self._redraw(final=self._pending)

    def _on_error(self, message: str) -> None:
        self.error = message  # reported once, from the main thread, at the next cell's end

    def ensure_sampler(self) -> None:
        """Start sampling if a live view exists and the rate allows it."""
        self._wanted = True
        if self._rate <= 0 or not self.views:
            return
        if self.sampler is not None and self.sampler.running:
            return
        self.sampler = Sampler(self.probe, interval=1.0 / self._rate, on_sample=self._on_sample,
                               redraw_interval=1.0, on_redraw=self._on_redraw, on_error=self._on_error)
        self.sampler.start()

    def stop_sampler(self) -> None:
        """Stop sampling (``%gpumem off``, unload, a sampler error) until asked to start again."""
        self._wanted = False
        sampler, self.sampler = self.sampler, None
        if sampler is not None:
            sampler.stop()

    @property
    def sample_rate(self) -> float:
        return self._rate

    @sample_rate.setter
    def sample_rate(self, rate: float) -> None:
        self.set_rate(rate)

    def set_rate(self, rate: float) -> None:
        """Sample ``rate`` times a second: 0 stops the sampler (cell ends only), another valid rate
        changes it at once, or starts it again if a live view is waiting for it.

        Raises:
            ValueError: see :func:`check_rate` (0, or ``MIN_RATE`` to ``MAX_RATE``).
        """
        rate = check_rate(rate)
        self._rate = rate
        sampler = self.sampler
        if rate == 0:
            if sampler is not None:
                self.sampler = None
                sampler.stop()  # stopped by the rate, not by the user: a later rate restarts it
            return
        if sampler is not None and sampler.running:
            sampler.interval = 1.0 / rate
        elif self._wanted and self.views:
            self.sampler = None
            self.ensure_sampler()

    def close(self) -> None:
        """On unload: stop sampling, leave a static picture where each view was, close every widget."""
        self.stop_sampler()
        for view in list(self.views):
            view.freeze()
        self.views.clear()
        self._close_sidecar()

