"""Turn the readings taken around a cell into a CellRecord, and keep a bounded ledger of them.

Knows nothing about IPython: the watcher hands it plain values (execution count, cell id, source,
the error's class name). A :class:`Measurement` is one cell in flight; once finished it keeps only
numbers, and builds its :class:`~ipy_gpumem.core.records.CellRecord` the first time someone asks
(most cells are never looked at: the per-cell cost is two readings and a deque append). The
:class:`Ledger` keeps the finished cells, oldest first, up to ``maxlen``.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Optional, Sequence

from ..core.probes import MemoryProbe, Sample

if TYPE_CHECKING:  # built on first use (loading the extension imports no record)
    from ..core.records import CellRecord

__all__ = ["Measurement", "Ledger", "MAX_SOURCE_CHARS", "MAX_MESSAGE_CHARS"]

#: Sources and error messages are truncated so a pasted data blob cannot bloat the history.
MAX_SOURCE_CHARS = 20_000
MAX_MESSAGE_CHARS = 2_000


def _sub(a, b):
    return None if a is None or b is None else a - b


def _max(*values):
    present = [v for v in values if v is not None]
    return max(present) if present else None


class Measurement:
    """One cell in flight: the starting readings, the peaks folded in while it runs, and its end.

    Args:
        probe: where the end reading comes from (and device names).
        start: the reading that opens the cell (see ``MemoryProbe.start``).
        peak_rss_reset: the kernel's RSS high-water mark measures from ``start`` (it was reset,
            or it already stood at the RSS), so the end's peak RSS is this cell's peak.
        reset_devices: CUDA devices whose peak counters measure from ``start``.
        devices: CUDA device indices to read at the end; None means every initialized device.
        track_peaks: whether peaks were asked to be per cell (recorded as ``peaks``).
        detailed: ``%%gpumem`` measured this cell.
    """

    # No __slots__: what most cells never set (lines, roles, an error...) is a class default, so
    # the constructor, which runs before every cell, stores only what every cell has.
    lines = None  # LineRecords, when --lines measured the cell
    loops = ()
    joined = ()  # JoinedLines of a --lines cell
    samples = None  # a list when the cell's chart wants the sampler's readings
    end = None
    # Highest values seen by any reading during the cell (sampler thread, line boundaries).
    _seen_host = None
    _seen_alloc = None
    _seen_reserved = None
    duration = None
    error = None
    message = None
    execution_count = None
    # The anatomy (set by the watcher when the cell was analysed) and the re-run comparison, as data
    # (the words are made by the views).
    roles = None
    why = None
    phases = None
    phase_summary = None
    layers = None
    _rerun = None  # a ``core.why.Rerun``, or the numbers one is made of (built when read)
    # The processes the cell launched (RankRecords) and the one whose failure reached it (ranks/watch.py).
    ranks = None
    rank_failure = None
    _record = None
    #: The sampler thread observes while the main thread folds; one lock for every cell (one is in
    #: flight at a time, and a lock made per cell would cost every cell).
    _lock = threading.Lock()

    #: Most sampler readings a detailed cell keeps for its chart (every other one is dropped
    #: when full, so a long cell keeps its whole span at a coarser step).
    MAX_SAMPLES = 2000

    def __init__(self, probe: MemoryProbe, start: Sample, peak_rss_reset: bool = False,
                 reset_devices: frozenset = frozenset(), *, cell_id: Optional[str] = None, source: str = "",
                 devices: Optional[Sequence[int]] = None, track_peaks: bool = True, detailed: bool = False,
                 include_host: bool = True):
        # This runs before every cell: plain attribute stores only.
        self.probe = probe
        self.cell_id = cell_id
        self.source = source if len(source) <= MAX_SOURCE_CHARS else source[:MAX_SOURCE_CHARS] + "\n# ... (truncated)"
        self.devices = None if devices is None else tuple(devices)
        self.detailed = detailed
        self.include_host = include_host
        self.start = start
        self.track_peaks = track_peaks
        self.peak_rss_reset = peak_rss_reset
        self.reset_devices = reset_devices
        self.started_at = time.time()
        self.t0 = time.perf_counter()  # not start.t: a start reading may be the previous cell's end

    @property
    def rerun(self):
        """The re-run comparison (``core.why.Rerun``), or None when the cell had not run before."""
        rerun = self._rerun
        if type(rerun) is tuple:
            from ..core.why import Rerun  # noqa: PLC0415 - loaded with the first re-run that is read

            rerun = self._rerun = Rerun(*rerun)
        return rerun

    @rerun.setter
    def rerun(self, value) -> None:
        self._rerun = value

    def rerun_of(self, first: Optional[int], runs: int, previous: Optional[int]) -> None:
        """This cell ran before (``Rerun(first, runs, previous)``), kept as numbers until read: most
        re-runs keep nothing and are never looked at."""
        self._rerun = (first, runs, previous)

    @classmethod
    def begin(cls, probe: MemoryProbe, *, devices: Optional[Sequence[int]] = None, track_peaks: bool = True,
              **kwargs) -> "Measurement":
        """Take the opening reading now (resetting the peak counters when ``track_peaks``)."""
        devices = None if devices is None else tuple(devices)
        start, host_reset, reset_devices = probe.start(devices, track_peaks)
        return cls(probe, start, host_reset, reset_devices, devices=devices, track_peaks=track_peaks, **kwargs)

    # -- while the cell runs ---------------------------------------------------------------------

    def observe(self, sample: Sample) -> None:
        """Fold a reading taken during the cell into the peaks (any thread; cheap)."""
        with self._lock:
            if self.samples is not None:
                self.samples.append(sample)
                if len(self.samples) > self.MAX_SAMPLES:
                    del self.samples[1::2]
            self._seen_host = _max(self._seen_host, sample.host.rss)
            if sample.devices:
                alloc = self._seen_alloc = self._seen_alloc or {}
                reserved = self._seen_reserved = self._seen_reserved or {}
                for dev in sample.devices:
                    own = dev.index in self.reset_devices
                    alloc[dev.index] = _max(alloc.get(dev.index), dev.allocated, dev.peak_allocated if own else None)
                    reserved[dev.index] = _max(reserved.get(dev.index), dev.reserved, dev.peak_reserved if own else None)

    def observe_peaks(self, peak_rss=None, device_peaks=None) -> None:
        """Fold peaks measured elsewhere (per-line peaks) into the cell's peaks."""
        with self._lock:
            self._seen_host = _max(self._seen_host, peak_rss)
            if device_peaks:
                alloc = self._seen_alloc = self._seen_alloc or {}
                reserved = self._seen_reserved = self._seen_reserved or {}
                for index, (peak_alloc, peak_reserved) in device_peaks.items():
                    alloc[index] = _max(alloc.get(index), peak_alloc)
                    reserved[index] = _max(reserved.get(index), peak_reserved)

    # -- at the end ------------------------------------------------------------------------------

    def finish(self, error: Optional[str] = None, error_message: Optional[str] = None, end: Optional[Sample] = None,
               execution_count: Optional[int] = None) -> "Measurement":
        """Take the closing reading (or use ``end``) and keep what the record needs; build nothing.

        ``execution_count`` is known only at the end: IPython 7 increments it after the cell,
        IPython 8+ before, so the reliable value is the one on the cell's ``ExecutionResult``.
        """
        self.end = end if end is not None else self.probe.sample(self.devices)
        self.duration = time.perf_counter() - self.t0
        self.error = error
        if error_message is not None and len(error_message) > MAX_MESSAGE_CHARS:
            error_message = error_message[:MAX_MESSAGE_CHARS] + " ..."
        self.message = error_message
        self.execution_count = execution_count
        return self

    def moved(self, threshold: int) -> bool:
        """Whether the cell moved memory by at least ``threshold`` bytes (:func:`largest_change`),
        computed from the readings: the per-cell line's test builds no record."""
        start, end = self.start, self.end
        if not end.devices:
            # The common case, kept short (it runs after every cell): largest_change over host RSS.
            rss0, rss1 = start.host.rss, end.host.rss
            if rss0 is None or rss1 is None:
                return False
            if rss1 - rss0 >= threshold or rss0 - rss1 >= threshold:
                return True
            peak = self.peak_rss()
            return peak is not None and peak - rss0 >= threshold
        before = {d.index: d for d in start.devices}
        changes = []
        for dev in end.devices:
            b = before.get(dev.index)
            a0, r0 = (0, 0) if b is None else (b.allocated, b.reserved)
            peak = self.peak_allocated(dev, b)
            changes.append((_sub(dev.allocated, a0), _sub(dev.reserved, r0), _sub(peak, a0)))
        rss0 = start.host.rss
        from ..core.records import largest_change  # noqa: PLC0415 - records load with the first GPU cell, not at load

        return largest_change(changes, _sub(end.host.rss, rss0), _sub(self.peak_rss(), rss0)) >= threshold

    def peak_rss(self):
        """The host's peak RSS during the cell: the highest of the readings, what was sampled, and the
        kernel's high-water mark when it was reset at the start."""
        peak = self.start.host.rss
        for value in (self.end.host.rss, self._seen_host, self.end.host.peak_rss if self.peak_rss_reset else None):
            if value is not None and (peak is None or value > peak):
                peak = value
        return peak

    def peak_allocated(self, dev, before):
        """Device ``dev``'s peak allocated bytes during the cell (``before``: its reading at the start, None
        for a device CUDA initialized during the cell)."""
        # A device that CUDA initialized during the cell started at zero: torch had allocated
        # nothing on it, and its peak counters start with it.
        fresh = before is None
        own = fresh or dev.index in self.reset_devices
        a0 = 0 if fresh else before.allocated
        return _max(a0, dev.allocated, (self._seen_alloc or {}).get(dev.index), dev.peak_allocated if own else None)

    def record(self) -> CellRecord:
        """The frozen record (built once, on first use)."""
        rec = self._record
        if rec is None:
            rec = self._record = self._build()
        return rec

    def _build(self) -> CellRecord:
        from ..core.records import CellRecord, DeviceRecord, HostRecord  # noqa: PLC0415 - built on first use

        start, end = self.start, self.end
        if self.include_host:
            host = HostRecord(start.host.rss, end.host.rss, self.peak_rss())
        else:
            host = HostRecord()
        before = {d.index: d for d in start.devices}
        devices = []
        for dev in end.devices:
            b = before.get(dev.index)
            fresh = b is None
            own = fresh or dev.index in self.reset_devices
            alloc_before = 0 if fresh else b.allocated
            reserved_before = 0 if fresh else b.reserved
            peak_reserved = _max(reserved_before, dev.reserved, (self._seen_reserved or {}).get(dev.index),
                                 dev.peak_reserved if own else None)
            name = None
            try:
                name = self.probe.cuda.properties(dev.index)[0]
            except Exception:  # noqa: BLE001 - a name is a nicety
                pass
            devices.append(DeviceRecord(
                index=dev.index, name=name, type=dev.type,
                allocated_before=alloc_before, allocated_after=dev.allocated, peak_allocated=self.peak_allocated(dev, b),
                reserved_before=reserved_before, reserved_after=dev.reserved, peak_reserved=peak_reserved,
                used_before=None if fresh else b.used, used_after=dev.used, total=dev.total,
            ))
        peaks = "per cell" if (self.track_peaks and (self.peak_rss_reset or self.reset_devices)) else "sampled"
        return CellRecord(
            execution_count=self.execution_count, cell_id=self.cell_id, source=self.source,
            started_at=self.started_at, duration_s=self.duration or 0.0, error=self.error,
            error_message=self.message, host=host, devices=tuple(devices),
            devices_note=end.reason if not devices else None, lines=self.lines, loops=self.loops, joined=self.joined,
            detailed=self.detailed, peaks=peaks, roles=self.roles, why=self.why,
            phases=self.phases, phase_summary=self.phase_summary, layers=self.layers, rerun=self.rerun,
            ranks=self.ranks, rank_failure=self.rank_failure,
        )


class Ledger:
    """The session's cells, oldest first, bounded to ``maxlen`` (the oldest are dropped).

    Holds finished :class:`Measurement`s (or ready records) and hands out ``CellRecord``s.
    """

    def __init__(self, maxlen: int = 10_000):
        self._entries: deque = deque(maxlen=max(1, int(maxlen)))

    def append(self, entry) -> None:
        """Add a finished ``Measurement`` or a ``CellRecord``."""
        self._entries.append(entry)

    def records(self) -> list:
        return [_record(entry) for entry in list(self._entries)]

    def last(self) -> Optional[CellRecord]:
        return _record(self._entries[-1]) if self._entries else None

    def tail(self, count: int) -> list:
        """The last ``count`` records, oldest first (without building the others)."""
        entries = list(self._entries)[-count:] if count > 0 else []
        return [_record(entry) for entry in entries]

    def clear(self) -> None:
        self._entries.clear()

    def resize(self, maxlen: int) -> None:
        self._entries = deque(self._entries, maxlen=max(1, int(maxlen)))

    @property
    def maxlen(self) -> int:
        return self._entries.maxlen

    def __len__(self) -> int:
        return len(self._entries)


def _record(entry) -> CellRecord:
    return entry.record() if isinstance(entry, Measurement) else entry
