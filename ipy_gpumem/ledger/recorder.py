"""Turn the samples taken around a cell into a CellRecord, and keep a bounded ledger of them.

Knows nothing about IPython: the extension hands it plain values (execution count, cell id,
source, the error's class name). A :class:`Measurement` is one cell in flight; the
:class:`Ledger` keeps the finished records, oldest first, up to ``maxlen``.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Optional, Sequence

from ..core.probes import MemoryProbe, Sample
from ..core.records import CellRecord, DeviceRecord, HostRecord

__all__ = ["Measurement", "Ledger", "MAX_SOURCE_CHARS", "MAX_MESSAGE_CHARS"]

#: Sources and error messages are truncated so a pasted data blob cannot bloat the history.
MAX_SOURCE_CHARS = 20_000
MAX_MESSAGE_CHARS = 2_000


def _max(*values):
    present = [v for v in values if v is not None]
    return max(present) if present else None


class Measurement:
    """One cell in flight: the "before" sample, peak tracking, and the record at the end.

    Args:
        probe: where numbers come from.
        devices: CUDA device indices to measure; None means every device torch has initialized.
        track_peaks: reset the peak counters (host high-water mark and torch's peaks) at the start
            so the record's peaks are this cell's. Without it, peaks are the highest values seen
            by any sample taken during the cell (start, end, line boundaries, the sampler).
    """

    __slots__ = ("probe", "execution_count", "cell_id", "source", "devices", "detailed", "include_host",
                 "lines", "started_at", "start", "end", "samples", "track_peaks", "host_peak_reset",
                 "_reset_devices", "_seen_host", "_seen_alloc", "_seen_reserved", "_lock", "t0")

    #: Most sampler readings a detailed cell keeps for its chart (every other one is dropped
    #: when full, so a long cell keeps its whole span at a coarser step).
    MAX_SAMPLES = 2000

    def __init__(
        self,
        probe: MemoryProbe,
        *,
        execution_count: Optional[int] = None,
        cell_id: Optional[str] = None,
        source: str = "",
        devices: Optional[Sequence[int]] = None,
        track_peaks: bool = True,
        detailed: bool = False,
        include_host: bool = True,
    ):
        # This runs before every cell: keep it to the reads and resets it needs.
        self.probe = probe
        self.execution_count = execution_count
        self.cell_id = cell_id
        self.source = source if len(source) <= MAX_SOURCE_CHARS else source[:MAX_SOURCE_CHARS] + "\n# ... (truncated)"
        self.devices = None if devices is None else tuple(devices)
        self.detailed = detailed
        self.include_host = include_host
        self.lines = None  # set by the line tracer when --lines is on
        self.samples = None  # a list when the cell's chart wants the sampler's readings
        self.end = None
        self.started_at = time.time()
        self.track_peaks = track_peaks
        self.start, self.host_peak_reset, self._reset_devices = probe.start(self.devices, track_peaks)
        # Highest values seen by any sample during the cell (sampler thread, line boundaries).
        self._seen_host = None
        self._seen_alloc: dict = {}
        self._seen_reserved: dict = {}
        self._lock = threading.Lock()
        self.t0 = time.perf_counter()

    def observe(self, sample: Sample) -> None:
        """Fold a sample taken during the cell into the peaks (thread-safe, cheap)."""
        with self._lock:
            if self.samples is not None:
                self.samples.append(sample)
                if len(self.samples) > self.MAX_SAMPLES:
                    del self.samples[1::2]
            self._seen_host = _max(self._seen_host, sample.host.rss)
            for dev in sample.devices:
                self._seen_alloc[dev.index] = _max(self._seen_alloc.get(dev.index), dev.allocated, dev.peak_allocated if dev.index in self._reset_devices else None)
                self._seen_reserved[dev.index] = _max(self._seen_reserved.get(dev.index), dev.reserved, dev.peak_reserved if dev.index in self._reset_devices else None)

    def observe_peaks(self, host_peak=None, device_peaks=None) -> None:
        """Fold peaks measured elsewhere (per-line peaks) into the cell's peaks."""
        with self._lock:
            self._seen_host = _max(self._seen_host, host_peak)
            for index, (alloc_peak, reserved_peak) in (device_peaks or {}).items():
                self._seen_alloc[index] = _max(self._seen_alloc.get(index), alloc_peak)
                self._seen_reserved[index] = _max(self._seen_reserved.get(index), reserved_peak)

    def finish(self, error: Optional[str] = None, error_message: Optional[str] = None, end: Optional[Sample] = None,
               execution_count: Optional[int] = None) -> CellRecord:
        """Take the "after" sample and build the record.

        ``execution_count`` is known only at the end: IPython 7 increments it after the cell,
        IPython 8+ before, so the reliable value is the one on the cell's ``ExecutionResult``.
        """
        duration = time.perf_counter() - self.t0
        end = self.end = end if end is not None else self.probe.sample(self.devices)
        start = self.start
        host_peak = None
        if self.include_host:
            host_peak = _max(start.host.rss, end.host.rss, self._seen_host,
                             end.host.peak_rss if self.host_peak_reset else None)
        host = HostRecord(start.host.rss, end.host.rss, host_peak) if self.include_host else HostRecord()
        before = {d.index: d for d in start.devices}
        devices = []
        for dev in end.devices:
            b = before.get(dev.index)
            # A device that CUDA initialized during the cell started at zero: torch had
            # allocated nothing on it, and its peak counters start with it.
            fresh = b is None
            per_cell_peak = fresh or dev.index in self._reset_devices
            alloc_before = 0 if fresh else b.allocated
            reserved_before = 0 if fresh else b.reserved
            alloc_peak = _max(alloc_before, dev.allocated, self._seen_alloc.get(dev.index),
                              dev.peak_allocated if per_cell_peak else None)
            reserved_peak = _max(reserved_before, dev.reserved, self._seen_reserved.get(dev.index),
                                 dev.peak_reserved if per_cell_peak else None)
            name = None
            try:
                name = self.probe.cuda.properties(dev.index)[0]
            except Exception:  # noqa: BLE001
                pass
            devices.append(DeviceRecord(
                index=dev.index,
                name=name,
                allocated_before=alloc_before,
                allocated_after=dev.allocated,
                allocated_peak=alloc_peak,
                reserved_before=reserved_before,
                reserved_after=dev.reserved,
                reserved_peak=reserved_peak,
                used_before=None if fresh else b.used,
                used_after=dev.used,
                total=dev.total,
            ))
        if error_message is not None and len(error_message) > MAX_MESSAGE_CHARS:
            error_message = error_message[:MAX_MESSAGE_CHARS] + " ..."
        peaks = "per cell" if (self.track_peaks and (self.host_peak_reset or self._reset_devices)) else "sampled"
        return CellRecord(
            execution_count=execution_count if execution_count is not None else self.execution_count,
            cell_id=self.cell_id,
            source=self.source,
            started_at=self.started_at,
            duration_s=duration,
            error=error,
            error_message=error_message,
            host=host,
            devices=tuple(devices),
            reason=end.reason if not devices else None,
            lines=self.lines,
            detailed=self.detailed,
            peaks=peaks,
        )


class Ledger:
    """The session's records, oldest first, bounded to ``maxlen`` (the oldest are dropped)."""

    def __init__(self, maxlen: int = 10_000):
        self._records: deque = deque(maxlen=max(1, int(maxlen)))
        self._listeners: list = []

    def append(self, record: CellRecord) -> None:
        self._records.append(record)
        for listener in list(self._listeners):
            listener(record)

    def records(self) -> list:
        return list(self._records)

    def last(self) -> Optional[CellRecord]:
        return self._records[-1] if self._records else None

    def clear(self) -> None:
        self._records.clear()

    def resize(self, maxlen: int) -> None:
        self._records = deque(self._records, maxlen=max(1, int(maxlen)))

    def subscribe(self, listener: Callable[[CellRecord], None]) -> None:
        """Call ``listener(record)`` after each append (the live chart uses this)."""
        self._listeners.append(listener)

    def unsubscribe(self, listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def __len__(self) -> int:
        return len(self._records)
