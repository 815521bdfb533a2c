"""Measure memory line by line inside one cell: the engine of ``%%gpumem --lines``.

A ``sys.settrace`` hook watches only the cell's own top-level code (found as the first
``<module>`` frame run in the user's namespace, whatever IPython named the file), so library
code runs untraced. At every line boundary it reads the counters, folds the change into the
line that just finished and resets the peak counters, so each line gets its own delta and
peak. Lines of a loop aggregate over their hits, as in line_profiler.
"""
from __future__ import annotations

import inspect
import sys
import time
from typing import Optional, Sequence

from .probes import MemoryProbe
from .records import DeviceRecord, HostRecord, LineRecord

__all__ = ["LineTracer"]

_CO_ASYNC = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


class _LineStats:
    """Running totals for one line (mutable while tracing; frozen into a LineRecord at the end)."""

    __slots__ = ("hits", "seconds", "host", "devices")

    def __init__(self, device_count: int):
        self.hits = 0
        self.seconds = 0.0
        # [before(first hit), after(last hit), peak(max), delta sum, max rise within one hit]
        self.host = [None, None, None, 0, None]
        # per device: [alloc before, after, peak, sum, reserved before, after, peak, sum, max rise]
        self.devices = [[None, None, None, 0, None, None, None, 0, None] for _ in range(device_count)]


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
        user_globals: the namespace the cell's code runs in; identifies the cell's frames.
        devices: CUDA device indices to read; None means every initialized device.
        track_peaks: reset peak counters at each line so each line's peak is its own.
    """

    def __init__(self, probe: MemoryProbe, user_globals: dict, devices: Optional[Sequence[int]] = None,
                 track_peaks: bool = True, include_host: bool = True):
        self.probe = probe
        self._globals = user_globals
        self._device_filter = None if devices is None else tuple(devices)
        self._devices: Optional[tuple] = None  # fixed once CUDA is up
        self._track_peaks = track_peaks
        self._include_host = include_host
        self._filename: Optional[str] = None
        self._stats: dict = {}
        self._current = None  # (lineno, reading) of the line now running
        self._active = False
        self.reason: Optional[str] = None
        self.host_peak = None
        self.device_peaks: dict = {}

    # -- reading -----------------------------------------------------------------------------

    def _resolve_devices(self) -> tuple:
        if self._devices is not None:
            return self._devices
        cuda, _ = self.probe.cuda.status()
        if cuda is None:
            return ()
        found = self.probe.cuda.device_indices(cuda)
        if self._device_filter is not None:
            found = [i for i in found if i in self._device_filter]
        self._devices = tuple(found)
        return self._devices

    def _read(self):
        host = self.probe.host
        rss = host.rss() if self._include_host else None
        host_peak = host.peak_rss() if (self._include_host and self._track_peaks and host.can_reset_peak) else None
        devs = []
        cuda = self.probe.cuda
        for index in self._resolve_devices():
            allocated, reserved, peak_a, peak_r = cuda.counters(index)
            devs.append((allocated, reserved, peak_a, peak_r))
        return time.perf_counter(), rss, host_peak, devs

    def _reset(self) -> None:
        if not self._track_peaks:
            return
        if self._include_host:
            self.probe.host.reset_peak()
        cuda = self.probe.cuda
        for index in self._resolve_devices():
            cuda.reset_peak(index)

    def _fold(self, lineno: int, start, end) -> None:
        stats = self._stats.get(lineno)
        t0, rss0, _, devs0 = start
        t1, rss1, hpeak1, devs1 = end
        if stats is None:
            stats = self._stats[lineno] = _LineStats(len(devs1))
        stats.hits += 1
        stats.seconds += t1 - t0
        h = stats.host
        if h[0] is None:
            h[0] = rss0
        h[1] = rss1
        hit_peak = _mx(hpeak1, _mx(rss0, rss1))
        h[2] = _mx(h[2], hit_peak)
        self.host_peak = _mx(self.host_peak, h[2])
        if rss0 is not None and rss1 is not None:
            h[3] += rss1 - rss0
            h[4] = _mx(h[4], hit_peak - rss0)
        while len(stats.devices) < len(devs1):  # CUDA came up during this line
            stats.devices.append([None, None, None, 0, None, None, None, 0, None])
        for k, (a1, r1, pa1, pr1) in enumerate(devs1):
            a0, r0 = (devs0[k][0], devs0[k][1]) if k < len(devs0) else (0, 0)
            d = stats.devices[k]
            if d[0] is None:
                d[0], d[4] = a0, r0
            d[1], d[5] = a1, r1
            peak_a = _mx(_mx(a0, a1), pa1 if self._track_peaks else None)
            peak_r = _mx(_mx(r0, r1), pr1 if self._track_peaks else None)
            d[2] = _mx(d[2], peak_a)
            d[6] = _mx(d[6], peak_r)
            if a0 is not None and a1 is not None:
                d[3] += a1 - a0
                d[8] = _mx(d[8], peak_a - a0)
            if r0 is not None and r1 is not None:
                d[7] += r1 - r0
            index = self._devices[k]
            old = self.device_peaks.get(index, (None, None))
            self.device_peaks[index] = (_mx(old[0], d[2]), _mx(old[1], d[6]))

    def _boundary(self, next_lineno: Optional[int]) -> None:
        reading = self._read()
        if self._current is not None:
            self._fold(self._current[0], self._current[1], reading)
        if next_lineno is None:
            self._current = None
        else:
            self._reset()
            # Nothing ran between the read and the reset, so the same reading is where the
            # next line starts, and its peaks are its own.
            self._current = (next_lineno, reading)

    # -- tracing -----------------------------------------------------------------------------

    def _global_trace(self, frame, event, arg):
        try:
            code = frame.f_code
            # A cell's top-level code is named "<module>"; IPython 7.34 renames it "<cell line: N>".
            if code.co_name != "<module>" and not code.co_name.startswith("<cell line"):
                return None
            if self._filename is None:
                if frame.f_globals is not self._globals or "run_cell_magic" in code.co_names:
                    # Not the user's namespace, or the one-line trampoline IPython makes of a
                    # leading cell magic (%%capture, %%time); the cell's own code runs inside it.
                    return None
                self._filename = code.co_filename  # the first cell chunk names the cell's file
            elif code.co_filename != self._filename:
                return None
            return self._local_trace
        except Exception as exc:  # noqa: BLE001 - a raising tracer would raise into the cell
            self._fail(exc)
            return None

    def _local_trace(self, frame, event, arg):
        try:
            if not self._active:
                return None
            if event == "line":
                self._boundary(frame.f_lineno)
            elif event == "return" and not (frame.f_code.co_flags & _CO_ASYNC):
                # An awaiting top-level cell "returns" at every suspension: keep its line open.
                self._boundary(None)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            return None
        return self._local_trace

    def _fail(self, exc: BaseException) -> None:
        self._active = False
        self.reason = f"line tracing stopped: {type(exc).__name__}: {exc}"
        if sys.gettrace() == self._global_trace:
            sys.settrace(None)

    def start(self) -> bool:
        """Install the tracer; False (with ``reason``) when another tracer owns ``sys.settrace``."""
        current = sys.gettrace()
        if current is not None and current != self._global_trace:
            self.reason = "line-by-line measurement needs sys.settrace, which a debugger or coverage tool is using"
            return False
        self._active = True
        sys.settrace(self._global_trace)
        return True

    def stop(self) -> None:
        """Remove the tracer and close the line still open (an error or an await left it)."""
        if sys.gettrace() == self._global_trace:
            sys.settrace(None)
        if self._active and self._current is not None:
            try:
                self._boundary(None)
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
        self._active = False

    # -- result ------------------------------------------------------------------------------

    def records(self, source_lines: Sequence[str], offset: int = 0, names=None) -> tuple:
        """Freeze the totals into LineRecords, numbered like ``source_lines`` (1-based).

        ``offset`` maps the traced code's line numbers onto ``source_lines`` (leading magic
        lines that the traced code does not contain).
        """
        out = []
        devices = self._devices or ()
        for lineno in sorted(self._stats):
            stats = self._stats[lineno]
            shown = lineno + offset
            text = source_lines[shown - 1] if 0 < shown <= len(source_lines) else ""
            h = stats.host
            host = HostRecord(h[0], h[1], h[2], h[3], h[4]) if self._include_host else HostRecord()
            devs = []
            for k, d in enumerate(stats.devices):
                if k >= len(devices):
                    break
                index = devices[k]
                devs.append(DeviceRecord(
                    index=index,
                    name=(names or {}).get(index),
                    allocated_before=d[0], allocated_after=d[1], allocated_peak=d[2],
                    reserved_before=d[4], reserved_after=d[5], reserved_peak=d[6],
                    allocated_delta_sum=d[3], reserved_delta_sum=d[7], peak_increase_max=d[8],
                ))
            out.append(LineRecord(shown, text, stats.hits, host, tuple(devs), stats.seconds))
        return tuple(out)
