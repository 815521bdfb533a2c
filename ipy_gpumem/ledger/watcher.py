"""The cell in flight, as data: which cell runs, what it measures, and what there is to show when it ends.

:class:`CellWatcher` owns everything that happens between IPython's ``pre_run_cell`` and
``post_run_cell``: the stack of nested cells (``%%capture``, ``%rerun`` and ``run_cell`` calls
run cells inside cells; only the outermost is "the cell"), the measurement, the ``%%gpumem`` plan
and its line tracer, and torch's out-of-memory capture. ``start(info)`` and ``finish(result)``
take IPython's plain objects and ``finish`` returns a :class:`CellOutcome` (or None when there is
nothing to show); the extension only renders outcomes. Nothing here imports IPython.

Two promises shape it:

* A frame never outlives its cell. A cell whose exception cannot be formatted, or a
  ``BaseException`` escaping ``run_cell_async``, never gets a matching ``post_run_cell``; its frame
  would make every later cell look nested (no records, no OOM panel). The stack is checked
  against the ``run_cell_async`` frames that are really live whenever it is not empty, and
  frames of cells that ended are dropped.
* The hot path is short: a cell that starts within :data:`REUSE_S` of the previous cell's end
  starts from that end's reading (nothing of the user's ran in between), so a cell costs one
  reading, and its record is built only when someone looks at it.
"""
from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Tuple

from ..core.probes import Sample
from ..core.records import DeviceRecord
from ..core.units import MiB
from ..oom import capture as oom_capture
from .header import CellHeader, find_header
from .recorder import Ledger, Measurement
from .reruns import RerunTracker

__all__ = ["Settings", "CellOutcome", "CellWatcher", "REUSE_S", "live_runners"]

#: A cell starting this soon after the previous one ended starts from that end's reading.
REUSE_S = 0.02

# A cell made only of our own line magics (and comments): its memory is ipy_gpumem's (the chart's
# imports when it opens, %gpumem free's collection), not the user's, so it is not recorded.
_OURS = re.compile(r"^[ \t]*(?:%gpumem(?:[ \t].*)?|#.*)?$")


def _only_our_magics(raw: str) -> bool:
    if "%gpumem" not in raw:
        return False
    lines = raw.splitlines()
    return all(_OURS.match(line) for line in lines) and any(line.strip() for line in lines)


@dataclass
class Settings:
    """What the watcher reads on every cell, as plain values (copied from the traitlets)."""

    threshold: int = 16 * MiB
    devices: Optional[Tuple[int, ...]] = None
    track_peaks: bool = True
    quiet: bool = False
    oom_panel: bool = True


class _Frame:
    """One ``run_cell`` in flight."""

    __slots__ = ("info", "raw", "cell_id", "measurement", "header", "tracer", "marker", "reported_inside", "snapshot",
                 "phases")

    def __init__(self, info, raw, measurement=None, header=None, tracer=None, marker=None, cell_id=None):
        self.snapshot = None  # the census when a %%gpumem cell started (its roles' "before")
        self.phases = None  # the PhaseWatcher of a %%gpumem cell
        self.info = info
        self.raw = raw
        self.cell_id = cell_id
        self.measurement = measurement
        self.header = header
        self.tracer = tracer
        self.marker = marker
        self.reported_inside = False


class _End(NamedTuple):
    """The last outermost cell's closing reading, and whether its peaks stood at their values."""

    sample: Sample
    devices: Optional[Tuple[int, ...]]
    host_current: bool


@dataclass(frozen=True)
class CellOutcome:
    """What a finished cell has to show.

    Attributes:
        measurement: the cell's finished measurement (``.record()`` builds the ``CellRecord``).
        outermost: the cell the user ran (not a cell nested inside it).
        header: the ``%%gpumem`` header when the cell asked for a report.
        show_line: the per-cell line is due (moved at least the threshold, not quiet).
        oom: the parsed out-of-memory error (an ``OomReport``) when the cell died of one.
        capture: the allocator's state at the failing allocation (``OomCapture``), if captured.
        note: why per-line measurement stopped early, if it did.
        chart_message: a one-time message from the live chart (its sampler stopped).
    """

    measurement: Measurement
    outermost: bool
    header: Optional[CellHeader] = None
    show_line: bool = False
    oom: Any = None
    capture: Any = None
    note: Optional[str] = None
    chart_message: Optional[str] = None

    @property
    def record(self):
        return self.measurement.record()


def _max2(a, b):
    return b if a is None else a if b is None else max(a, b)


def live_runners(code, skip: int = 1) -> int:
    """How many frames running ``code`` (IPython's ``run_cell_async``) are on the stack now."""
    count, frame = 0, sys._getframe(skip)
    while frame is not None:
        if frame.f_code is code:
            count += 1
        frame = frame.f_back
    return count


def _exception_marker():
    """Something that changes whenever IPython records a new error in ``sys.last_value``.

    Exceptions cannot be weakly referenced and we must not keep one alive, so the marker is the
    object's id and type: a new error replaces the old one while both are alive, so its id differs.
    """
    value = getattr(sys, "last_value", None)
    return None if value is None else (id(value), type(value))


def _cell_error(result, marker) -> Tuple[Optional[str], Optional[str]]:
    """The class name and message of the cell's error, also when ``%%time`` swallowed it."""
    exc = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
    if exc is None and _exception_marker() not in (None, marker):
        exc = getattr(sys, "last_value", None)
    if exc is None:
        return None, None
    try:
        message = str(exc)
    except BaseException:  # noqa: BLE001 - a user __str__ may raise anything
        message = None
    return type(exc).__name__, message


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
    """

    def __init__(self, probe, ledger: Ledger, settings: Optional[Settings] = None, *, runner_code=None,
                 ast_transformers: Optional[list] = None):
        self.probe = probe
        self.ledger = ledger
        self.settings = settings if settings is not None else Settings()
        self.enabled = True
        #: The live chart (``cell_started(sample, source)``, ``cell_finished(sample, record)``,
        #: ``.sampler``), once one is open.
        self.listener = None
        #: The allocator at the last CUDA out-of-memory (torch's observer calls :meth:`on_oom`).
        self.last_capture = None
        self._runner_code = runner_code
        self._transformers = ast_transformers if ast_transformers is not None else []
        self._stack: List[_Frame] = []
        self._armed: Optional[CellHeader] = None
        self._markers = None
        self._last_end: Optional[_End] = None
        self._watching_oom = False
        #: Raises HeaderError for a %%gpumem plan that cannot run here (a device that does not
        #: exist); such a header is not measured, the magic itself reports the error.
        self.check_plan = None
        #: A callable returning the user's namespace (the extension's shell.user_ns): what the
        #: anatomy's census counts. None: no roles.
        self.namespace = None
        # -- re-runs (issue 12; ipy_gpumem.ledger.reruns) --
        #: Recognises re-runs of a cell and names what keeps an earlier run's memory; the
        #: extension sets its ``context`` (namespace and IPython's refs). Without it, no tensors
        #: are measured and only ``rerun["of"]``/``["runs"]`` are filled.
        self.reruns = RerunTracker()
        # The census at the end of the last analysed cell: an ordinary cell that moved more than
        # the threshold is explained by what changed since (cells under it pay nothing).
        self._last_snapshot = None

    # -- what the hooks call -----------------------------------------------------------------------

    def arm(self, header: CellHeader) -> None:
        """Apply ``header`` to the next cell that starts (``%%gpumem`` called programmatically)."""
        self._armed = header

    def start(self, info) -> None:
        """``pre_run_cell``: open a frame for the cell, and a measurement if it is to be measured."""
        raw = getattr(info, "raw_cell", "") or ""
        cell_id = getattr(info, "cell_id", None)
        stack = self._stack
        if stack:
            live = self._live_runners()
            if live is not None and live - 1 < len(stack):
                self._truncate(max(0, live - 1))  # frames of cells that ended without post_run_cell
                if not stack:
                    self._remove_hook()  # their marked code cannot run any more
        header = None
        if self._armed is not None or "%%gpumem" in raw:
            if not any(frame.header is not None for frame in stack):
                header = self._armed or find_header(raw, self.check_plan)
            self._armed = None
        if header is None and (stack or not self.enabled or _only_our_magics(raw)):
            self._stack.append(_Frame(info, raw, cell_id=cell_id))
            return
        settings = self.settings
        devices = settings.devices
        if header is not None and "torch" in sys.modules:
            # What a %%gpumem cell uses is imported before its measurement starts: the memory of
            # our modules is not the user's cell's (a first import takes a few MiB).
            from ..anatomy import census, phases  # noqa: F401
            from . import lines  # noqa: F401
        if header is not None and header.plan.device is not None:
            devices = header.plan.cuda_indices  # () for -d host: the host is always measured
        measurement = self._begin(devices, settings.track_peaks, cell_id=cell_id, source=raw,
                                  detailed=header is not None, outermost=not stack)
        tracer = self._start_lines(devices, settings.track_peaks) if header is not None and header.plan.lines else None
        snapshot = phases = None
        if header is not None and tracer is None:
            # A whole-cell %%gpumem: the census around it, and the training phases of whatever it
            # calls (a --lines cell has its rows instead: its phases would tax every step of a
            # loop written in the cell for what its rows already say).
            snapshot = self.census()
            phases = self._start_phases(measurement)
        if not self._watching_oom and "torch" in sys.modules:
            # Attached now if CUDA is up; else torch runs our attach when it initializes, so the
            # first CUDA cell's out-of-memory (model.to("cuda") on a full device) is captured too.
            self._watching_oom = oom_capture.watch(self.on_oom)
        listener = self.listener
        if listener is not None:
            if header is not None and getattr(listener, "sampler", None) is not None:
                measurement.samples = []  # the sampler's readings make the report's cell chart
            if not stack:
                listener.cell_started(measurement.start._replace(t=time.perf_counter()), raw)
        frame = _Frame(info, raw, measurement, header, tracer, _exception_marker(), cell_id)
        frame.snapshot, frame.phases = snapshot, phases
        stack.append(frame)

    def finish(self, result) -> Optional[CellOutcome]:
        """``post_run_cell``: close the cell's frame; what to show, or None."""
        frame = self._pop(result)
        if frame is None:
            return None
        note = None
        if frame.phases is not None:
            frame.phases.stop()
        if frame.tracer is not None:
            self._stop_lines(frame.tracer)
            self._remove_hook()  # the marked cell is over
            note = frame.tracer.reason
            skipped, taken = frame.tracer.census_skipped, frame.tracer.census_taken
            if skipped:
                roles = (f"Roles were counted at {taken:,} of {taken + skipped:,} line boundaries (lines faster than a "
                         "count are joined to the next line counted).")
                note = f"{note} {roles}" if note else roles
        measurement = frame.measurement
        outermost = not self._stack
        if measurement is None:
            if outermost:
                self._last_end = None  # something ran unmeasured: the next cell reads afresh
            return None
        error, message = _cell_error(result, frame.marker)
        header = frame.header
        if frame.tracer is not None:
            tracer = frame.tracer
            measurement.observe_peaks(tracer.host_peak, tracer.device_peaks)
            names = {}
            for index in tracer.device_peaks:
                try:
                    names[index] = self.probe.cuda.properties(index)[0]
                except Exception:  # noqa: BLE001 - a name is a nicety
                    pass
            measurement.lines = tracer.records(header.source_lines, header.offset, names)
            measurement.loops = tracer.loop_spans(header.offset)
        count = getattr(result, "execution_count", None) if outermost else None
        measurement.finish(error, message, execution_count=count)
        settings = self.settings
        if outermost:
            self.ledger.append(measurement)
            self._last_end = _End(measurement.end, measurement.devices, self.probe.host.peak_is_current)
        if header is not None:
            for parent in self._stack:
                parent.reported_inside = True
        show_line = (outermost and header is None and not frame.reported_inside and not settings.quiet
                     and measurement.moved(settings.threshold))
        # -- re-runs (issue 12): a dict lookup per cell; a walk only after a run that kept memory --
        if outermost and self.reruns.after_cell(measurement, settings.threshold, self.ledger):
            show_line = show_line or (header is None and not frame.reported_inside and not settings.quiet)
        if header is not None or show_line:
            self._anatomy(frame, measurement)
        oom = capture = None
        if error is not None and settings.oom_panel and (outermost or header is not None):
            from ..oom.parse import parse_oom  # only when a cell failed

            oom = parse_oom(f"{error}: {message}" if message else error)
            if oom is not None:
                capture = self.take_capture(measurement.t0)
        chart_message = None
        if outermost and self.listener is not None:
            chart_message = self.listener.cell_finished(measurement.end, measurement.record())
        if not (show_line or oom is not None or header is not None or chart_message):
            return None
        return CellOutcome(measurement, outermost, header, show_line, oom, capture, note, chart_message)

    def no_line_for_running_cells(self) -> None:
        """The cells in flight show no per-cell line (their memory is ours: ``--estimate``'s imports)."""
        for frame in self._stack:
            frame.reported_inside = True

    def in_flight(self) -> Optional[Measurement]:
        """The measurement of the cell running now (read from the sampler thread)."""
        try:
            frame = self._stack[-1] if self._stack else None
        except IndexError:  # the main thread popped it meanwhile
            return None
        return None if frame is None else frame.measurement

    @property
    def depth(self) -> int:
        """Cells in flight (1 inside an ordinary cell, 0 between cells)."""
        return len(self._stack)

    def reset(self) -> None:
        """Forget every cell in flight (``%gpumem on``, unload, after an internal error)."""
        self._truncate(0)
        self._armed = None
        self._last_end = None

    def close(self) -> bool:
        """On unload: stop what runs and stop forwarding out-of-memory captures.

        Returns True when a ``--lines`` cell is still running (the cell unloads the extension):
        its remaining markers must keep finding their (now idle) hook in ``builtins``, so the
        caller removes it once the cell is over (:func:`ipy_gpumem.ledger.lines.remove_hook`).
        """
        lines_running = any(frame.tracer is not None for frame in self._stack)
        self.reset()
        oom_capture.unwatch(self.on_oom)
        if not lines_running:
            self._remove_hook()
        return lines_running

    # -- the anatomy ----------------------------------------------------------------------------------

    def census(self):
        """A census of the user's namespace now (an empty one without a namespace or torch)."""
        from ..anatomy.census import EMPTY, take

        if self.namespace is None or "torch" not in sys.modules:
            return EMPTY
        try:
            return take(self.namespace())
        except Exception:  # noqa: BLE001 - no namespace to read: no roles, never an error in a cell
            return EMPTY

    def baseline(self) -> None:
        """Census now, as the reference the next cell that moves memory is compared with."""
        from ..anatomy.census import EMPTY

        # Without torch nothing holds a tensor: the empty census is exact.
        self._last_snapshot = self.census() if "torch" in sys.modules else EMPTY

    def _anatomy(self, frame: _Frame, measurement: Measurement) -> None:
        """Fill the measurement's roles, reason and phases (a %%gpumem cell, or a cell that moved
        at least the threshold). Never raises: the anatomy is an explanation, not the record."""
        try:
            from ..anatomy.account import gpu_extras, with_extras
            from ..anatomy.reasons import describe

            tracer = frame.tracer
            if tracer is not None and tracer.census is not None and tracer.first_snapshot is not None:
                before, after = tracer.first_snapshot, tracer.last_snapshot
            else:
                before = frame.snapshot if frame.header is not None else self._last_snapshot
                after = self.census()
            self._last_snapshot = after
            if frame.phases is not None:
                measurement.phases = tuple(frame.phases.phases) or None
                measurement.layers = tuple(frame.phases.layers) or None
            if before is None:
                return
            change = after.diff(before)
            extras, temporaries = {}, 0
            base = {d.index: d for d in measurement.start.devices}
            for dev in measurement.end.devices:
                b = base.get(dev.index)
                rec = DeviceRecord(dev.index, allocated_before=0 if b is None else b.allocated,
                                   allocated_after=dev.allocated, reserved_before=0 if b is None else b.reserved,
                                   reserved_after=dev.reserved, used_before=None if b is None else b.used,
                                   used_after=dev.used)
                extras[rec.label] = gpu_extras(rec, change.parts)
                peak = measurement._device_peak(dev, b)
                if peak is not None:
                    temporaries = max(temporaries, peak - max(rec.allocated_before, dev.allocated))
            if not measurement.end.devices:
                rss0, rss1, peak = measurement.start.host.rss, measurement.end.host.rss, measurement._host_peak()
                if None not in (rss0, rss1, peak):
                    temporaries = max(0, peak - max(rss0, rss1))
            measurement.roles = with_extras(change.table, extras)
            seen = {(role, owner) for (_d, role, owner), v in before.parts.items() if v > 0}
            merged: dict = {}
            for row in extras.values():
                for role, value in row.items():
                    merged[role] = merged.get(role, 0) + value
            measurement.reason = describe(change.parts, before, after, seen=seen, temporaries=temporaries or None,
                                          extra=merged or None)
        except Exception:  # noqa: BLE001
            return

    def _start_phases(self, measurement: Measurement):
        """Watch the training phases of a %%gpumem cell (None until torch is imported)."""
        if "torch" not in sys.modules:
            return None
        try:
            from ..anatomy.phases import PhaseWatcher
        except Exception:  # noqa: BLE001 - the phases are an addition, never a reason to fail
            return None
        read = self._phase_reader(measurement)
        try:
            from ..anatomy.census import take

            namespace = self.namespace

            def census(modules=(), optimizers=(), tensors=()):
                return take(namespace() if namespace is not None else None, modules=modules,
                            optimizers=optimizers, tensors=tensors)

            # Roles on the first two steps only (the first and the steady one, which the report
            # shows); later steps get their peaks, without a census.
            watcher = PhaseWatcher(read, census, every=0)
            watcher.start()
            return watcher
        except Exception:  # noqa: BLE001
            return None

    def _phase_reader(self, measurement: Measurement):
        """A phase boundary's reading when no line tracer runs: current and peak per device, the
        peaks folded into the cell's own and reset (so each phase gets its own). On Linux the host
        part is the line tracer's trick: read the peak, reset the mark, read the RSS back from it
        (one ``/proc`` access per boundary)."""
        probe = self.probe
        host = probe.host
        resets = measurement.host_peak_reset and host.can_reset_peak
        counters = probe.cuda.counters
        indices = [d.index for d in measurement.start.devices]
        # No device at the start: on a machine with CUDA one may come up during the cell (read the
        # devices each time then); a CPU-only build never has one.
        look = not indices and probe.cuda.device_count() > 0

        def read():
            t = time.perf_counter()
            out, device_peaks, host_peak = {}, {}, None
            if resets:
                peak = host.peak_rss()
                rss = host.rss_after_reset() if host.reset_peak() else host.rss()
                host_peak = _max2(peak, rss)
            else:
                rss = host.rss()
                host_peak = rss
            if rss is not None:
                out["cpu"] = (rss, host_peak)
            for index in ([d.index for d in probe.sample(measurement.devices).devices] if look else indices):
                try:
                    allocated, reserved, peak_a, peak_r = counters(index)
                except Exception:  # noqa: BLE001 - a device that went away: no reading
                    continue
                own = index in measurement.reset_devices
                peak = _max2(peak_a, allocated) if own else allocated
                out[f"cuda:{index}"] = (allocated, peak)
                device_peaks[index] = (peak, _max2(peak_r, reserved) if own else reserved)
                if own and (peak_a != allocated or peak_r != reserved):
                    try:
                        probe.cuda.reset_peak(index)
                    except Exception:  # noqa: BLE001
                        pass
            measurement.observe_peaks(host_peak, device_peaks)
            return t, out

        return read

    # -- out-of-memory capture ------------------------------------------------------------------------

    def on_oom(self, capture) -> None:
        # Runs inside torch's allocator (GIL held, allocator lock released): store, nothing more.
        self.last_capture = capture

    def take_capture(self, since: float):
        """The capture of an out-of-memory that happened after ``since`` (perf_counter), once."""
        capture, self.last_capture = self.last_capture, None
        return capture if capture is not None and capture.t >= since else None

    # -- internals ----------------------------------------------------------------------------------------

    def _begin(self, devices, track_peaks: bool, outermost: bool, **kwargs) -> Measurement:
        probe = self.probe
        previous, self._last_end = self._last_end, None
        if (outermost and previous is not None and previous.devices == devices
                and time.perf_counter() - previous.sample.t < REUSE_S):
            # The previous cell ended a moment ago: its closing reading is this cell's opening one.
            # A peak counter that stood at its value then already measures from here; any other
            # is reset now (resetting needs no reading).
            sample = previous.sample
            host_reset = False
            if track_peaks:
                host_reset = previous.host_current or probe.host.reset_peak()
            reset = []
            if track_peaks:
                for dev in sample.devices:
                    try:
                        if dev.peak_allocated != dev.allocated or dev.peak_reserved != dev.reserved:
                            probe.cuda.reset_peak(dev.index)
                        reset.append(dev.index)
                    except Exception:  # noqa: BLE001 - peaks then come from samples
                        pass
            # The reading itself is the start (its peak fields are not read for a start).
            return Measurement(probe, sample, host_reset, frozenset(reset) if reset else frozenset(), devices=devices,
                               track_peaks=track_peaks, **kwargs)
        return Measurement.begin(probe, devices=devices, track_peaks=track_peaks, **kwargs)

    def _live_runners(self) -> Optional[int]:
        """How many of IPython's ``run_cell_async`` frames are running now, or None (unknown)."""
        code = self._runner_code
        return None if code is None else live_runners(code, 2)

    def _truncate(self, keep: int) -> None:
        stack = self._stack
        if len(stack) <= keep:
            return
        stale = stack[keep:]
        del stack[keep:]
        for frame in stale:
            if frame.phases is not None:
                frame.phases.stop()  # its global hooks must not outlive the cell
            if frame.tracer is not None:
                self._stop_lines(frame.tracer)

    def _pop(self, result) -> Optional[_Frame]:
        stack = self._stack
        if not stack:
            return None  # an empty cell, or the cell that loaded the extension
        info = getattr(result, "info", None)
        if info is not None and stack[-1].info is info:
            return stack.pop()
        live = self._live_runners()
        if live is None:  # no IPython frames to go by: the innermost frame with this info, if any
            for k in range(len(stack) - 1, -1, -1):
                if stack[k].info is info or info is None:
                    self._truncate(k + 1)
                    return stack.pop()
            return None
        # post_run_cell fires after the cell's run_cell_async returned: the live ones are its parents.
        if live >= len(stack):
            return None  # a post_run_cell without pre_run_cell (an empty cell)
        frame = stack[live]
        self._truncate(live)
        if result is not None and info is not None and not (
                frame.raw == getattr(info, "raw_cell", None) and frame.cell_id == getattr(info, "cell_id", None)):
            # A frame left by a cell that ended without post_run_cell, and this post belongs to
            # a cell we never saw start: drop the stale frame, report nothing.
            if frame.phases is not None:
                frame.phases.stop()
            if frame.tracer is not None:
                self._stop_lines(frame.tracer)
            return None
        return frame

    def _start_lines(self, devices, track_peaks: bool):
        from .lines import LineMarkers, LineTracer

        if self._markers is None:
            self._markers = LineMarkers()
        census = self.census if self.namespace is not None and "torch" in sys.modules else None
        tracer = LineTracer(self.probe, devices, track_peaks=track_peaks, census=census)
        tracer.start()
        # Markers go into the cell's syntax tree, which IPython builds after this hook.
        self._markers.tracer = tracer
        self._markers.armed = True
        if self._markers not in self._transformers:
            self._transformers.append(self._markers)
        return tracer

    def _stop_lines(self, tracer) -> None:
        """Stop measuring lines; the markers' hook stays until no marked code can run."""
        tracer.stop()
        if not any(frame.tracer is not None and frame.tracer is not tracer for frame in self._stack):
            markers = self._markers
            if markers is not None:
                markers.armed = False
                markers.tracer = None
                if markers in self._transformers:
                    self._transformers.remove(markers)

    def _remove_hook(self) -> None:
        if self._markers is not None or "ipy_gpumem.ledger.lines" in sys.modules:
            from .lines import remove_hook

            remove_hook()
