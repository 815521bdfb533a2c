"""Measure memory line by line inside one cell: the engine of ``%%gpumem --lines``.

The cell's syntax tree gets a marker call before each of its own statements (inside loops, ``if``,
``with`` and ``try`` blocks too, never inside functions or classes it defines). A marker reads the
counters, folds the change since the previous marker into the line that just finished and resets
the peak counters, so each line gets its own delta and peak; lines of a loop aggregate over their
hits, as in line_profiler. Unlike ``sys.settrace``, markers cost nothing outside the cell's own
lines (library code runs at full speed: tracing would slow every Python call in a training step)
and they leave debuggers and coverage tools alone. The markers themselves (the AST transformer and
the hook they call) are :mod:`.markers`.

With a census (the roles), each boundary counts what the user's names reach; a line's record keeps
its change by role and, as data, what its first and latest hits were made of
(:class:`~ipy_gpumem.core.why.Why`): the words are made by the views.
"""
from __future__ import annotations

import time
from typing import NamedTuple, Optional, Sequence

from ..core.probes import PEAK_SLACK, MemoryProbe
from ..core.records import DeviceRecord, HostRecord, JoinedLines, LineRecord, LoopSpan
from .markers import HOOK_NAME, LineMarkers, detach_hook, install_hook, remove_hook

__all__ = ["LineTracer", "LineMarkers", "HOOK_NAME", "remove_hook"]

#: The most of a cell's time the roles' census may take (see ``LineTracer._roles``), beyond a grace
#: of :data:`CENSUS_GRACE_S` per cell: a loop of fast lines counts some boundaries and joins the
#: lines in between (said in the record).
CENSUS_SHARE = 0.05
CENSUS_GRACE_S = 0.005
#: Each line's first hit is counted whatever the share says, up to this much census time per cell:
#: a short cell (each line once) gets a count at every boundary, and a loop gets its first
#: iteration line by line; only the repeats are held to the share.
FIRST_HITS_S = 0.2


class _Quantity:
    """Running totals of one quantity (host RSS, or one device's allocated/reserved) over a line's hits."""

    __slots__ = ("before", "after", "peak", "net", "rise")

    def __init__(self):
        self.before = None  # value when the line first started
        self.after = None  # value when it last finished
        self.peak = None  # highest value while it ran
        self.net = 0  # changes summed over its hits
        self.rise = None  # the largest rise above the starting value within one hit

    def fold(self, start, end, hit_peak) -> None:
        # Runs at every marker: plain comparisons, no helper calls.
        if self.before is None:
            self.before = start
        self.after = end
        if hit_peak is not None and (self.peak is None or hit_peak > self.peak):
            self.peak = hit_peak
        if start is not None and end is not None:
            self.net += end - start
            if hit_peak is not None:
                rise = hit_peak - start
                if self.rise is None or rise > self.rise:
                    self.rise = rise


class _DeviceStats:
    __slots__ = ("allocated", "reserved")

    def __init__(self):
        self.allocated = _Quantity()
        self.reserved = _Quantity()


class _LineStats:
    """Running totals for one line (mutable while tracing; frozen into a LineRecord at the end)."""

    __slots__ = ("hits", "seconds", "host", "devices", "temporaries", "change", "first", "last", "joined")

    def __init__(self):
        self.hits = 0
        self.seconds = 0.0
        self.host = _Quantity()
        self.devices: dict = {}  # device index -> _DeviceStats
        self.temporaries: dict = {}  # device label -> the most that came and went within one hit
        # Roles (a census at each boundary): the change summed over hits, and the first and the
        # latest hit's own change with what held memory before it (for the line's sentence).
        self.change = None
        self.first = None  # (Change, seen, before Snapshot, after Snapshot)
        self.last = None
        self.joined = 0  # hits counted together with other lines (a boundary between them was skipped)


class _SpanStats:
    """The roles of lines counted together: the census skipped the boundaries between them."""

    __slots__ = ("hits", "change", "first", "last")

    def __init__(self):
        self.hits = 0
        self.change = None
        self.first = None
        self.last = None


class _Reading(NamedTuple):
    """Counters at one line boundary."""

    t: float
    rss: Optional[int]
    peak_rss: Optional[int]
    #: device index -> (allocated, reserved, peak allocated, peak reserved)
    devices: dict


def _mx(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a if a >= b else b


class LineTracer:
    """Per-line memory for one cell. ``start()`` before the cell runs, ``stop()`` after.

    Args:
        probe: the memory probe (host RSS and torch's counters).
        devices: CUDA device indices to read; None means every initialized device.
        track_peaks: reset peak counters at each line so each line's peak is its own (this also
            resets the peaks the user's own code reads, as the per-cell reset does).
        include_host: measure host RSS too.
    """

    def __init__(self, probe: MemoryProbe, devices: Optional[Sequence[int]] = None, track_peaks: bool = True,
                 include_host: bool = True, census=None):
        self.probe = probe
        #: A callable returning a census ``Snapshot`` (``ipy_gpumem.tensors.census``): the roles of
        #: each line come from the census at its boundaries. None measures no roles.
        self.census = census
        self.first_snapshot = None
        self._snapshot = None
        self._seen: set = set()  # (role, owner) pairs that held memory at some boundary so far
        # The census's cost is kept under CENSUS_SHARE of the cell's time: a boundary that comes
        # sooner is skipped (a tight loop of trivial lines), and the next census's change goes to
        # the line that ends there. The report says how many boundaries were skipped.
        self._census_s = 0.0
        self._first_hits_s = 0.0  # census time spent at lines' first hits (not held to the share)
        self._counted: set = set()  # lines that ended at a census at least once
        self._t0 = None
        self.census_skipped = 0
        self.census_taken = 0
        self._pending: list = []  # lines run since the last census (more than one: a skipped boundary)
        self._spans: dict = {}  # tuple of line numbers -> _SpanStats
        self._device_filter = None if devices is None else tuple(devices)
        self._devices: Optional[tuple] = None  # fixed once a device with a context is found
        self._track_peaks = track_peaks
        self._include_host = include_host
        self._stats: dict = {}
        self._current = None  # (lineno, reading) of the line now running
        host = probe.host
        # With a resettable high-water mark, a boundary reads the finishing line's peak, resets the
        # mark, and reads the RSS back from it (it equals the RSS right after a reset): one /proc
        # access per line instead of two, which is most of a marker's cost on some kernels.
        self._resets = include_host and track_peaks and host.can_reset_peak
        self._rss = host.rss if include_host else None
        self._read_peak_rss = host.peak_rss if self._resets else None
        self._reset_peak = host.reset_peak
        self._rss_after_reset = host.rss_after_reset
        # A CPU-only build never brings CUDA up: no need to ask at every marker.
        self._no_cuda = probe.cuda.device_count() == 0
        self._active = False
        self.reason: Optional[str] = None
        self.peak_rss = None
        self.device_peaks: dict = {}
        self.loops: tuple = ()  # LoopSpans of the marked code (its own line numbers)

    # -- reading -----------------------------------------------------------------------------

    def _resolve_devices(self) -> tuple:
        if self._devices is not None:
            return self._devices
        if self._no_cuda:
            return ()
        cuda, _ = self.probe.cuda.status()
        if cuda is None:
            return ()
        found = self.probe.cuda.device_indices(cuda)
        if self._device_filter is not None:
            found = [i for i in found if i in self._device_filter]
        # CUDA can be up before any device has a context: keep looking until one has, rather
        # than caching "no device" for the rest of the cell.
        if found:
            self._devices = tuple(found)
        return tuple(found)

    def _read(self, next_line: bool = True) -> _Reading:
        if self._resets and next_line:
            peak = self._read_peak_rss()
            rss = self._rss_after_reset() if self._reset_peak() else self._rss()
        else:
            rss = self._rss() if self._rss is not None else None
            peak = self._read_peak_rss() if self._read_peak_rss is not None else None
        indices = self._devices if self._devices is not None else self._resolve_devices()
        devices = {}
        if indices:
            counters = self.probe.cuda.counters
            for index in indices:
                devices[index] = counters(index)
        return _Reading(time.perf_counter(), rss, peak, devices)

    def _reset(self, reading: _Reading) -> None:
        """Reset the peak counters that are above their current value (a peak already at the
        current value measures the next line correctly as it is: one syscall saved per line)."""
        if not self._track_peaks:
            return
        if self._include_host and not self._resets:
            rss, peak = reading.rss, reading.peak_rss
            if peak is None or rss is None or peak - rss > PEAK_SLACK:
                self.probe.host.reset_peak()
        cuda = self.probe.cuda
        for index, (allocated, reserved, peak_a, peak_r) in reading.devices.items():
            if peak_a != allocated or peak_r != reserved:
                cuda.reset_peak(index)

    def _fold(self, lineno: int, start: _Reading, end: _Reading) -> None:
        stats = self._stats.get(lineno)
        if stats is None:
            stats = self._stats[lineno] = _LineStats()
        stats.hits += 1
        stats.seconds += end.t - start.t
        hit_peak = _mx(end.peak_rss, _mx(start.rss, end.rss))
        if hit_peak is not None:
            temporary = hit_peak - _mx(start.rss, end.rss)
            if temporary > stats.temporaries.get("cpu", 0):
                stats.temporaries["cpu"] = temporary
        host = stats.host
        host.fold(start.rss, end.rss, hit_peak)
        if host.peak is not None and (self.peak_rss is None or host.peak > self.peak_rss):
            self.peak_rss = host.peak
        if not end.devices:
            return
        for index, (a1, r1, pa1, pr1) in end.devices.items():
            # A device that CUDA brought up during this line started at zero.
            a0, r0 = start.devices.get(index, (0, 0, 0, 0))[:2]
            dev = stats.devices.get(index)
            if dev is None:
                dev = stats.devices[index] = _DeviceStats()
            alloc_peak = _mx(_mx(a0, a1), pa1 if self._track_peaks else None)
            dev.allocated.fold(a0, a1, alloc_peak)
            dev.reserved.fold(r0, r1, _mx(_mx(r0, r1), pr1 if self._track_peaks else None))
            temporary = alloc_peak - max(a0, a1)
            label = f"cuda:{index}"
            if temporary > stats.temporaries.get(label, 0):
                stats.temporaries[label] = temporary
            old = self.device_peaks.get(index, (None, None))
            self.device_peaks[index] = (_mx(old[0], dev.allocated.peak), _mx(old[1], dev.reserved.peak))

    def _boundary(self, next_lineno: Optional[int]) -> None:
        reading = self._read(next_lineno is not None)
        if self._current is not None:
            self._fold(self._current[0], self._current[1], reading)
        if self.census is not None:
            self._roles(self._current[0] if self._current is not None else None, next_lineno is None)
        if next_lineno is None:
            self._current = None
        else:
            self._reset(reading)
            # Nothing ran between the read and the reset, so the same reading is where the
            # next line starts, and its peaks are its own.
            self._current = (next_lineno, reading)

    def _roles(self, lineno: Optional[int], final: bool = False) -> None:
        """Census now; the change since the previous census belongs to the line that just ran, or,
        when boundaries were skipped since, to the lines run in between, together."""
        now = time.perf_counter()
        if lineno is not None:
            self._pending.append(lineno)
        first = lineno is not None and lineno not in self._counted and self._first_hits_s <= FIRST_HITS_S
        if self._t0 is None:
            self._t0 = now
        elif not (final or first) and self._census_s > CENSUS_SHARE * (now - self._t0) + CENSUS_GRACE_S:
            self.census_skipped += 1
            return
        snap = self.census()
        if first:
            self._first_hits_s += time.perf_counter() - now
        else:
            self._census_s += time.perf_counter() - now
        self.census_taken += 1
        self._counted.update(self._pending)
        before = self._snapshot
        self._snapshot = snap
        pending, self._pending = self._pending, []
        if before is None:
            self.first_snapshot = snap
        elif pending:
            lines = sorted(set(pending))
            change = snap.diff(before)
            hit = (change, frozenset(self._seen), before, snap)
            if len(lines) == 1:
                stats = self._stats.get(lines[0])
            else:
                stats = self._spans.get(tuple(lines))
                if stats is None:
                    stats = self._spans[tuple(lines)] = _SpanStats()
                stats.hits += 1
                for line in lines:
                    line_stats = self._stats.get(line)
                    if line_stats is not None:
                        line_stats.joined += 1
            if stats is not None:
                stats.change = change if stats.change is None else stats.change.add(change)
                if stats.first is None:
                    stats.first = hit
                stats.last = hit
        for (_dev, role, owner), value in snap.parts.items():
            if value > 0:
                self._seen.add((role, owner))

    @property
    def last_snapshot(self):
        """The census at the latest boundary (the cell's end once stopped)."""
        return self._snapshot

    # -- markers -----------------------------------------------------------------------------

    def mark(self, lineno: int) -> None:
        """Called by the marker before each statement of the cell: a line boundary."""
        if not self._active:
            return
        try:
            self._boundary(lineno)
        except Exception as exc:  # noqa: BLE001 - a raising marker would raise into the cell
            self._active = False
            self.reason = f"line measurement stopped: {type(exc).__name__}: {exc}"

    def start(self) -> bool:
        """Make the markers call this tracer (the hook goes into ``builtins`` for the cell)."""
        self._active = True
        install_hook(self.mark)
        return True

    def stop(self) -> None:
        """Close the line still open (the cell ended, raised or awaits); markers become no-ops.

        The hook stays in ``builtins`` until :func:`remove_hook`: code of this cell may still run
        its markers after an unload, and a missing name would raise NameError into it.
        """
        detach_hook(self.mark)
        if self._active and self._current is not None:
            try:
                self._boundary(None)
            except Exception as exc:  # noqa: BLE001
                self.reason = f"line measurement stopped: {type(exc).__name__}: {exc}"
        self._active = False

    # -- result ------------------------------------------------------------------------------

    def records(self, source_lines: Sequence[str], offset: int = 0, names=None) -> tuple:
        """Freeze the totals into LineRecords, numbered like ``source_lines`` (1-based).

        ``offset`` maps the traced code's line numbers onto ``source_lines`` (leading magic
        lines that the traced code does not contain).
        """
        out = []
        for lineno in sorted(self._stats):
            stats = self._stats[lineno]
            shown = lineno + offset
            text = source_lines[shown - 1] if 0 < shown <= len(source_lines) else ""
            h = stats.host
            host = HostRecord(h.before, h.after, h.peak, h.net, h.rise) if self._include_host else HostRecord()
            devs = []
            for index in sorted(stats.devices):
                d = stats.devices[index]
                a, r = d.allocated, d.reserved
                devs.append(DeviceRecord(
                    index=index, type=self.probe.cuda.device_type,
                    name=(names or {}).get(index),
                    allocated_before=a.before, allocated_after=a.after, peak_allocated=a.peak,
                    reserved_before=r.before, reserved_after=r.after, peak_reserved=r.peak,
                    allocated_delta_sum=a.net, reserved_delta_sum=r.net, peak_increase_max=a.rise,
                ))
            roles = first = last = None
            if self.census is not None:
                roles, first, last = _line_roles(stats, devs)
            out.append(LineRecord(shown, text, stats.hits, host, tuple(devs), stats.seconds, roles=roles,
                                  temporaries=dict(stats.temporaries) or None, why=first, why_last=last,
                                  joined=stats.joined))
        return tuple(out)

    def joined(self, offset: int = 0) -> tuple:
        """The lines counted together (a census skipped between them), numbered like :meth:`records`."""
        out = []
        for lines, stats in sorted(self._spans.items()):
            roles, first, last = _line_roles(stats, ())
            out.append(JoinedLines(tuple(line + offset for line in lines), stats.hits, roles, first, last))
        return tuple(out)

    def loop_spans(self, offset: int = 0) -> tuple:
        """The cell's loops in the numbering of :meth:`records`."""
        return tuple(LoopSpan(s.first + offset, s.last + offset, s.kind) for s in self.loops)


def _line_roles(stats, devices) -> tuple:
    """A line's role table (its census change summed over hits, with the GPU-only roles from its
    counters) and what its first hit and its latest hit were made of (``Why``s; the latest only
    for a line run more than once)."""
    from ..anatomy.account import gpu_extras, summed, with_extras
    from ..anatomy.reasons import why_of

    change = stats.change
    parts = change.parts if change is not None else {}
    extras = {dev.label: gpu_extras(dev, parts) for dev in devices}
    roles = with_extras(change.table if change is not None else {}, extras)
    first = last = None
    temporaries_seen = getattr(stats, "temporaries", {})
    if stats.first is not None:
        first_change, seen, before, after = stats.first
        # A single hit's counters are that hit's: its GPU-only roles and temporaries belong to it.
        single = stats.hits == 1
        first = why_of(first_change.parts, before, after, seen=seen,
                       temporaries=max(temporaries_seen.values(), default=None) if single else None,
                       extra=summed(extras) if single else None)
        if stats.hits > 1 and stats.last is not stats.first:
            last_change, seen, before, after = stats.last
            last = why_of(last_change.parts, before, after, seen=seen)
    return roles, first, last
