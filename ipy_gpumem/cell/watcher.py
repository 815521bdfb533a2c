"""The cell in flight, as data: which cell runs, what it measures, and what there is to show when it ends.

:class:`CellWatcher` is what happens between IPython's ``pre_run_cell`` and ``post_run_cell``:
``start(info)`` and ``finish(result)`` take IPython's plain objects and ``finish`` returns a
:class:`CellOutcome` (or None when there is nothing to show); the extension only renders outcomes.
Nothing here imports IPython. It is built with its collaborators and delegates each concern to
one of them:

    stack.py        the cells in flight (nested cells, frames of cells that ended unannounced)
    recorder.py     the measurement of a cell and the ledger of finished ones
    header.py       what a ``%%gpumem`` header asks for
    linetracer.py   a ``--lines`` cell's tracer and markers
    phasing.py      a whole-cell ``%%gpumem``'s training phases
    explain.py      the baseline census and the anatomy of a finished cell
    oomwatch.py     torch's out-of-memory captures
    ../reruns/      re-runs of a cell and what keeps an earlier run's memory
    ../ranks/       the processes a cell launches (the ranks of a distributed launch)

The hot path is short: a cell that starts within :data:`REUSE_S` of the previous cell's end starts
from that end's reading (nothing of the user's ran in between), so a cell costs one reading, plus,
once torch is imported, the baseline census at its end (:mod:`.explain`: a cell's explanation
covers what that cell did, never what earlier cells did); its record is built only when someone
looks at it.
"""
from __future__ import annotations

import re
import sys
import time
from typing import Any, Callable, NamedTuple, Optional, Tuple

from ..core.probes import Sample
from ..core.units import MiB
from .explain import CellAnatomy
from .allocator_trace import CellTrace
from .budget import CellBudget
from .header import CellHeader, find_header
from .oomwatch import OomWatch
from .phasing import start_phases
from ..ranks.watch import RankWatch, launcher_failure
from .recorder import Ledger, Measurement
from ..reruns.tracker import RerunTracker
from .stack import CellStack, Frame, cell_error, live_runners
from .linetracer import LineTracing

__all__ = ["Settings", "CellOutcome", "CellWatcher", "REUSE_S", "live_runners"]

#: A cell starting this soon after the previous one ended starts from that end's reading.
REUSE_S = 0.02

_SYS = sys.__dict__  # sys's attributes, read without an exception for a missing one
_new = tuple.__new__  # a NamedTuple made without its Python __new__ (once a cell)

# A cell made only of our own line magics (and comments): its memory is ipy_gpumem's (the chart's
# imports when it opens, %gpumem free's collection), not the user's, so it is not recorded.
_OURS = re.compile(r"^[ \t]*(?:%gpumem(?:[ \t].*)?|#.*)?$")


def _only_our_magics(raw: str) -> bool:
    lines = raw.splitlines()
    return all(_OURS.match(line) for line in lines) and any(line.strip() for line in lines)


class Settings:
    """What the watcher reads on every cell, as plain values (copied from the traitlets)."""

    # A plain class, not a dataclass: a dataclass costs a millisecond to define, at every %load_ext.
    __slots__ = ("threshold", "devices", "track_peaks", "quiet", "oom_panel")

    def __init__(self, threshold: int = 16 * MiB, devices: Optional[Tuple[int, ...]] = None, track_peaks: bool = True,
                 quiet: bool = False, oom_panel: bool = True):
        self.threshold = threshold
        self.devices = devices
        self.track_peaks = track_peaks
        self.quiet = quiet
        self.oom_panel = oom_panel

    def __repr__(self) -> str:
        return "Settings(" + ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__) + ")"


class _End(NamedTuple):
    """The last outermost cell's closing reading, and whether its peaks stood at their values."""

    sample: Sample
    devices: Optional[Tuple[int, ...]]
    host_current: bool


class CellOutcome(NamedTuple):
    """What a finished cell has to show.

    Attributes:
        measurement: the cell's finished measurement (``.record()`` builds the ``CellRecord``).
        outermost: the cell the user ran (not a cell nested inside it).
        header: the ``%%gpumem`` header when the cell asked for a report.
        show_line: the per-cell line is due (moved at least the threshold, not quiet).
        oom: the parsed out-of-memory error (an ``OomReport``) when the cell died of one.
        capture: the allocator's state at the failing allocation (``OomCapture``), if captured.
        stopped: why per-line measurement stopped early (the error it met), if it did.
        counted: ``(taken, boundaries)``: the line boundaries whose roles were counted, when some
            were skipped to keep the count under its share of the cell's time.
        chart_message: a one-time message from the live chart (its sampler stopped).
        trace: ``--trace``: the allocator's snapshot of the cell (plain data), or None.
        trace_note: what to say about the trace (why there is none, what was cut or kept).
    """

    measurement: Measurement
    outermost: bool
    header: Optional[CellHeader] = None
    show_line: bool = False
    oom: Any = None
    capture: Any = None
    stopped: Optional[str] = None
    counted: Optional[Tuple[int, int]] = None
    chart_message: Optional[str] = None
    trace: Any = None
    trace_note: Optional[str] = None

    @property
    def record(self):
        return self.measurement.record()


def _exception(result):
    """The cell's exception object (only asked for a cell that failed)."""
    return (getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
            or getattr(sys, "last_value", None))


def _ranks_moved(ranks, threshold: int) -> bool:
    """A rank rose by the threshold, or one was killed or failed: its line is shown whatever it
    moved (a rank killed in its first moments has no numbers at all)."""
    return any((r.rise is not None and r.rise >= threshold) or r.signal or r.exit_code for r in ranks or ())


class CellWatcher:
    """Measures cells between ``start(info)`` and ``finish(result)``.

    Args:
        probe: the ``MemoryProbe``.
        ledger: where finished cells go.
        settings: the values read on every cell (the extension keeps them current).
        runner_code: the code object of IPython's ``InteractiveShell.run_cell_async`` (the frame
            that triggers ``pre_run_cell``), used to tell nested cells from stale frames; None
            (tests without IPython) trusts the hooks to pair up.
        ast_transformers: the shell's AST transformer list, where the ``--lines`` markers go
            while a ``--lines`` cell compiles.
        names: returns ``(namespace, refs)``, the user's namespace and IPython's own names in it
            (``attribution.holders.ipython_refs``): what the anatomy's census counts. None: no roles.
        reruns: the :class:`RerunTracker` (default: one reading ``names``).
        check_plan: raises ``HeaderError`` for a ``%%gpumem`` plan that cannot run here (a device
            that does not exist); such a header is not measured, the magic itself reports the error.
        listener: returns the live chart (``cell_started(sample, source)``, ``cell_finished(sample,
            record)``, ``.sampler``) when one is open, else None.
        schedule: ``schedule(fn)`` runs ``fn`` when the process is next idle (a kernel's event loop);
            the baseline census of the next cell is taken then instead of at the end of this one.
        ranks: the :class:`RankWatch` (default: one reading with ``probe``'s CUDA adapter and NVML).
    """

    def __init__(self, probe, ledger: Ledger, settings: Optional[Settings] = None, *, runner_code=None,
                 ast_transformers: Optional[list] = None, names: Optional[Callable[[], tuple]] = None,
                 reruns: Optional[RerunTracker] = None, check_plan: Optional[Callable] = None,
                 listener: Optional[Callable[[], Any]] = None, schedule: Optional[Callable] = None,
                 ranks: Optional[RankWatch] = None):
        self.probe = probe
        self.ledger = ledger
        self.settings = settings if settings is not None else Settings()
        self.enabled = True
        self.reruns = reruns if reruns is not None else RerunTracker(names)
        self.anatomy = CellAnatomy(names, schedule)
        self.oom = OomWatch()
        cuda = getattr(probe, "cuda", None)
        self.ranks = ranks if ranks is not None else RankWatch(getattr(cuda, "internals", None),
                                                               getattr(cuda, "nvml", None))
        self._check_plan = check_plan
        self._listener = listener or (lambda: None)
        self._lines = LineTracing(ast_transformers)
        self._stack = CellStack(runner_code, on_drop=self._stop_frame)
        self._armed: Optional[CellHeader] = None
        self._last_end: Optional[_End] = None
        self.anatomy.refresh()  # the first cell is explained against the names as they are now

    # -- what the hooks call -----------------------------------------------------------------------

    def arm(self, header: CellHeader) -> None:
        """Apply ``header`` to the next cell that starts (``%%gpumem`` called programmatically)."""
        self._armed = header

    def start(self, info) -> None:
        """``pre_run_cell``: open a frame for the cell, and a measurement if it is to be measured."""
        raw = getattr(info, "raw_cell", "") or ""
        cell_id = getattr(info, "cell_id", None)
        stack = self._stack
        frames = stack.frames  # empty between cells: most of what follows is skipped then
        if frames and stack.prune():
            self._lines.remove_hook()  # the frames of cells that ended: their marked code cannot run any more
        header = None
        if self._armed is not None or "%%gpumem" in raw:
            if not any(frame.header is not None for frame in stack):
                header = self._armed or find_header(raw, self._check_plan)
            self._armed = None
        if header is None and (frames or not self.enabled or ("%gpumem" in raw and _only_our_magics(raw))):
            frames.append(Frame(info, raw, cell_id=cell_id))
            return
        outermost = not frames
        if outermost:
            # The baseline is the names as the previous cell left them: taken now, before any of this
            # cell's code runs, if the idle time after that cell did not take it.
            self.anatomy.before_cell()
        settings = self.settings
        devices = settings.devices
        if header is not None and "torch" in sys.modules:
            # What a %%gpumem cell uses is imported before its measurement starts: the memory of
            # our modules is not the user's cell's (a first import takes a few MiB).
            from ..anatomy import phases as _phases  # noqa: F401
            from ..tensors import census as _census  # noqa: F401
            from . import lines as _lines  # noqa: F401
        if header is not None and header.plan.device is not None:
            devices = header.plan.device_indices  # () for -d host: the host is always measured
        measurement = self._begin(devices, settings.track_peaks, outermost, cell_id, raw, header is not None)
        if outermost:
            self.ranks.cell_started()
        tracer = snapshot = phases = None
        if header is not None and header.plan.lines:
            census = self.anatomy.census if self.anatomy.names is not None and "torch" in sys.modules else None
            tracer = self._lines.start(self.probe, devices, settings.track_peaks, census)
        elif header is not None:
            # A whole-cell %%gpumem: the census around it, and the training phases of whatever it
            # calls (a --lines cell has its rows instead: its phases would tax every step of a
            # loop written in the cell for what its rows already say).
            snapshot = self.anatomy.census()
            phases = start_phases(self.probe, measurement, self.anatomy.census)
        oom = self.oom
        if not oom.watching:
            oom.ensure()
        listener = self._listener()
        if listener is not None:
            if header is not None and getattr(listener, "sampler", None) is not None:
                measurement.samples = []  # the sampler's readings make the report's cell chart
            if outermost:
                listener.cell_started(measurement.start._replace(t=time.perf_counter()), raw)
        error = _SYS.get("last_value")  # exception_marker(), inlined: it runs before every cell
        marker = None if error is None else (id(error), type(error))
        frame = Frame(info, raw, measurement, header, tracer, marker, cell_id)
        if header is not None:
            frame.snapshot, frame.phases = snapshot, phases
            if header.plan.trace is not None:
                # Last before the cell's code: our own work above is not among its events.
                frame.trace = CellTrace.begin(header.plan.trace or None)
        frames.append(frame)

    def finish(self, result) -> Optional[CellOutcome]:
        """``post_run_cell``: close the cell's frame; what to show, or None."""
        frame = self._stack.pop(result)
        if frame is None:
            return None
        stopped = counted = None
        trace = trace_note = None
        if frame.trace is not None:
            recorder, trace_note = frame.trace
            if recorder is not None:
                try:
                    trace, trace_note = recorder.end()  # first: our own work below is not the cell's
                except Exception as exc:  # noqa: BLE001 - a failed snapshot costs the trace, not the recording
                    trace, trace_note = None, f"--trace: the allocator's snapshot failed ({type(exc).__name__}: {exc})"
        if frame.phases is not None:
            frame.phases.stop()
        tracer = frame.tracer
        if tracer is not None:
            self._stop_lines(tracer)
            self._lines.remove_hook()  # the marked cell is over
            stopped = tracer.reason
            if tracer.census_skipped:
                counted = (tracer.census_taken, tracer.census_taken + tracer.census_skipped)
        measurement = frame.measurement
        outermost = not self._stack.frames
        if measurement is None:
            if outermost:
                self._last_end = None  # something ran unmeasured: the next cell reads afresh
                if self.enabled:
                    self.anatomy.refresh(recount=True)  # our own magics (%gpumem free) may have freed the user's tensors
            return None
        error, message = cell_error(result, frame.marker)
        if outermost:
            failure = launcher_failure(_exception(result)) if error is not None else None
            ranks = self.ranks.cell_finished(failure)
            if ranks is not None or failure is not None:
                measurement.ranks, measurement.rank_failure = ranks, failure
        header = frame.header
        if tracer is not None:
            self._line_records(measurement, tracer, header)
        count = getattr(result, "execution_count", None) if outermost else None
        measurement.finish(error, message, execution_count=count)
        settings = self.settings
        if outermost:
            self._last_end = _new(_End, (measurement.end, measurement.devices, self.probe.host.peak_is_current))
        if header is not None:
            for parent in self._stack:
                parent.reported_inside = True
        show_line = (outermost and header is None and not frame.reported_inside and not settings.quiet
                     and (measurement.moved(settings.threshold)
                          or (measurement.ranks is not None and _ranks_moved(measurement.ranks, settings.threshold))))
        # One budget for everything this cell's end walks (the re-run snapshot, the census): a share of
        # the cell's own time, so no namespace makes a cell slower than a fraction of itself. It
        # starts at the closing reading.
        budget = CellBudget(measurement)
        # -- re-runs: a dict lookup per cell; a walk only after a run that kept memory --
        if outermost and self.reruns.after_cell(measurement, settings.threshold, self.ledger, budget=budget):
            show_line = show_line or (header is None and not frame.reported_inside and not settings.quiet)
        after = None
        if header is not None or show_line:
            after = self.anatomy.explain(frame, measurement, outermost, budget_s=budget.left(at_least=0.005))
        if outermost:
            # Into the ledger once its data is complete: its record is built on first use, and
            # frozen then (the re-run tracker reads the ledger's earlier cells).
            self.ledger.append(measurement)
            # The next cell is explained against this cell's end, whatever this cell showed.
            if after is not None:
                self.anatomy.adopt(after, measurement.end)
            else:
                self.anatomy.refresh(measurement.end)
        oom = capture = None
        if error is not None and settings.oom_panel and (outermost or header is not None):
            failure = measurement.rank_failure
            if failure is not None:  # a rank's message, explained as the kernel's would be (its allocator is not ours)
                oom, capture = self.oom.failure(failure.error or error, failure.message, measurement.t0)[0], None
            else:
                oom, capture = self.oom.failure(error, message, measurement.t0)
        chart_message = None
        listener = self._listener()
        if outermost and listener is not None:
            chart_message = listener.cell_finished(measurement.end, measurement.record())
        if not (show_line or oom is not None or header is not None or chart_message):
            return None
        return CellOutcome(measurement, outermost, header, show_line, oom, capture, stopped, counted, chart_message,
                           trace, trace_note)

    def no_line_for_running_cells(self) -> None:
        """The cells in flight show no per-cell line (their memory is ours: ``--estimate``'s imports)."""
        for frame in self._stack:
            frame.reported_inside = True

    def in_flight(self) -> Optional[Measurement]:
        """The measurement of the cell running now (read from the sampler thread)."""
        frame = self._stack.top
        return None if frame is None else frame.measurement

    @property
    def depth(self) -> int:
        """Cells in flight (1 inside an ordinary cell, 0 between cells)."""
        return len(self._stack)

    def reset(self) -> None:
        """Forget every cell in flight (``%gpumem on``, unload, after an internal error)."""
        self._stack.truncate(0)
        self._armed = None
        self._last_end = None
        self.anatomy.forget()

    def close(self) -> bool:
        """On unload: stop what runs and stop forwarding out-of-memory captures.

        Returns True when a ``--lines`` cell is still running (the cell unloads the extension):
        its remaining markers must keep finding their (now idle) hook in ``builtins``, so the
        caller removes it once the cell is over (:func:`ipy_gpumem.cell.markers.remove_hook`).
        """
        lines_running = any(frame.tracer is not None for frame in self._stack)
        self.reset()
        self.oom.close()
        self.ranks.close()
        if not lines_running:
            self._lines.remove_hook()
        return lines_running

    # -- internals ----------------------------------------------------------------------------------------

    def _line_records(self, measurement: Measurement, tracer, header: CellHeader) -> None:
        """A ``--lines`` cell's rows, loops and lines counted together, numbered as the user typed them."""
        measurement.observe_peaks(tracer.peak_rss, tracer.device_peaks)
        names = {}
        for index in tracer.device_peaks:
            try:
                names[index] = self.probe.cuda.properties(index)[0]
            except Exception:  # noqa: BLE001 - a name is a nicety
                pass
        measurement.lines = tracer.records(header.source_lines, header.offset, names)
        measurement.loops = tracer.loop_spans(header.offset)
        measurement.joined = tracer.joined(header.offset)

    def _begin(self, devices, track_peaks: bool, outermost: bool, cell_id, source: str, detailed: bool) -> Measurement:
        probe = self.probe
        previous, self._last_end = self._last_end, None
        if (outermost and previous is not None and previous.devices == devices
                and time.perf_counter() - previous.sample.t < REUSE_S):
            # The previous cell ended a moment ago: its closing reading is this cell's opening one.
            # A peak counter that stood at its value then already measures from here; any other
            # is reset now (resetting needs no reading).
            sample = previous.sample
            host_reset = False
            reset = frozenset()
            if track_peaks:
                host_reset = previous.host_current or probe.host.reset_peak()
                if sample.devices:
                    reset = self._reset_device_peaks(sample.devices)
            # The reading itself is the start (its peak fields are not read for a start).
            return Measurement(probe, sample, host_reset, reset, cell_id=cell_id, source=source, devices=devices,
                               track_peaks=track_peaks, detailed=detailed)
        return Measurement.begin(probe, devices=devices, track_peaks=track_peaks, cell_id=cell_id, source=source,
                                 detailed=detailed)

    def _reset_device_peaks(self, devices) -> frozenset:
        """Reset the peak counters that moved since ``devices`` were read; the devices whose peaks
        now measure from that reading."""
        reset = []
        for dev in devices:
            try:
                if dev.peak_allocated != dev.allocated or dev.peak_reserved != dev.reserved:
                    self.probe.cuda.reset_peak(dev.index)
                reset.append(dev.index)
            except Exception:  # noqa: BLE001 - peaks then come from samples
                pass
        return frozenset(reset) if reset else frozenset()

    def _stop_frame(self, frame: Frame) -> None:
        """A frame dropped without its ``post_run_cell``: what it runs must not outlive its cell."""
        if frame.phases is not None:
            frame.phases.stop()  # its global hooks
        if frame.tracer is not None:
            self._stop_lines(frame.tracer)

    def _stop_lines(self, tracer) -> None:
        others = any(frame.tracer is not None and frame.tracer is not tracer for frame in self._stack)
        self._lines.stop(tracer, others)
