"""The session's memory over time: sampled series and cell spans, bounded however long it runs.

A :class:`Timeline` is fed :class:`~ipy_gpumem.core.probes.Sample` objects (from the sampler thread and
from the cell hooks) and cell start/finish events, and hands out immutable
:class:`TimelineSnapshot` copies for drawing. It keeps numbers and strings only: never a sample,
a record, an exception or a tensor.

Downsampling keeps the newest ``max_points // 2`` samples at full resolution. Older samples are
folded into buckets of ``stride`` consecutive samples; when the old part is full, neighbouring
buckets are merged pairwise and ``stride`` doubles, so the old part always has one uniform
resolution and the cost is amortised O(1) per sample. A bucket keeps, for every series, the
**maximum** (a memory chart must never hide a spike) and the **minimum** (so a chart can draw the
band a saw-tooth training loop sweeps instead of a misleading flat line at its peak), stamped
with the time of its first sample.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, NamedTuple, Optional, Tuple

from ..core.units import format_bytes, format_delta

__all__ = ["Span", "TimelineSnapshot", "Timeline", "hover_text", "moved_bytes", "seed_timeline", "HOST_KEY"]

#: Series key of the process's resident set size.
HOST_KEY = "host rss"
#: Hover texts show the cell's first source line up to this many characters.
FIRST_LINE_CHARS = 80


def _empty_mapping() -> Mapping:
    return MappingProxyType({})


class Span(NamedTuple):
    """One cell (or, once merged, a run of old cells) on the timeline.

    Times are seconds relative to the session start in a snapshot. ``end`` is None while the cell
    runs. ``moved`` is the largest change the cell made (delta or peak increase, bytes), which a
    chart can use to decide which labels to keep when they crowd.
    """

    start: float
    end: Optional[float]
    label: str
    hover: str
    moved: int = 0
    cells: int = 1
    failed: bool = False


@dataclass(frozen=True, eq=False)
class TimelineSnapshot:
    """An immutable copy of a :class:`Timeline` for drawing.

    Attributes:
        t: sample times, seconds since the session start (the first timestamp the timeline saw).
        series: per key (``"host rss"``, ``"cuda:0 allocated"``, ...), the value at each ``t``:
            the bucket's maximum for merged points; None where the value was unknown.
        lows: the same keys, the bucket's minimum (equal to ``series`` for full-resolution points).
        spans: closed spans oldest first, then the running one if any.
        running: the running cell's span, or None.
        capacities: ``{"cuda:0": total bytes, ...}``; ``"host"`` maps to None (physical RAM is
            not something the probe reads, and drawing it would flatten the RSS line).
        version: the timeline's version when the copy was taken.
        origin: ``time.perf_counter()`` value of t = 0 (None before anything was added).
        end: the latest time the timeline knows of (relative), for the right edge of a chart.
        merged: how many leading points are merged buckets (the rest are single samples).
        stride: how many samples each fully merged bucket holds.
        added: how many samples were ever added.
    """

    t: Tuple[float, ...] = ()
    series: Mapping[str, tuple] = field(default_factory=_empty_mapping)
    lows: Mapping[str, tuple] = field(default_factory=_empty_mapping)
    spans: Tuple[Span, ...] = ()
    running: Optional[Span] = None
    capacities: Mapping[str, Optional[int]] = field(default_factory=_empty_mapping)
    version: int = 0
    origin: Optional[float] = None
    end: float = 0.0
    merged: int = 0
    stride: int = 1
    added: int = 0

    @property
    def empty(self) -> bool:
        """True when there is nothing to draw (no samples and no spans)."""
        return not self.t and not self.spans

    @property
    def keys(self) -> Tuple[str, ...]:
        return tuple(self.series)


# --------------------------------------------------------------------------------------------
# Hover text from a CellRecord (numbers in torch's spelling)
# --------------------------------------------------------------------------------------------


def _first_line(source: str) -> str:
    for line in (source or "").splitlines():
        if line.strip():
            line = line.strip()
            return line if len(line) <= FIRST_LINE_CHARS else line[: FIRST_LINE_CHARS - 1] + "…"
    return ""


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "n/a"
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms" if seconds >= 0.001 else f"{seconds * 1e3:.2f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes} min {rest} s"


def _peak_part(peak: Optional[int], increase: Optional[int]) -> str:
    if peak is None:
        return ""
    if increase is None:
        return f", peak {format_bytes(peak)}"
    return f", peak {format_bytes(peak)} ({format_delta(increase)})"


def moved_bytes(record) -> int:
    """The largest change a cell made, in bytes: |delta| or peak increase of allocated/reserved
    on any device, or of host RSS when no CUDA device was in use (0 when unknown)."""
    values = []
    for dev in record.devices:
        values += [dev.allocated_delta, dev.reserved_delta, dev.peak_increase]
    if not record.devices:
        values += [record.host.rss_delta, record.host.rss_peak_increase]
    return max((abs(int(v)) for v in values if v is not None), default=0)


def hover_text(record, label: Optional[str] = None) -> str:
    """The tooltip of a cell's span: first line, per-device deltas and peaks, duration, error.

    Args:
        record: a :class:`~ipy_gpumem.core.records.CellRecord`.
        label: the span's label; defaults to the record's (``"[7]"``).

    Example::

        [7] y = model(x)
        cuda:0 allocated +1.00 GiB, peak 3.50 GiB (+2.00 GiB) · reserved +2.00 GiB
        1.2 s · OutOfMemoryError
    """
    label = label or record.label
    lines = [f"{label} {_first_line(record.source)}".rstrip()]
    for dev in record.devices:
        lines.append(
            f"{dev.label} allocated {format_delta(dev.allocated_delta)}"
            f"{_peak_part(dev.allocated_peak, dev.peak_increase)}"
            f" · reserved {format_delta(dev.reserved_delta)}"
        )
    if not record.devices:
        host = record.host
        lines.append(f"host RSS {format_delta(host.rss_delta)}{_peak_part(host.rss_peak, host.rss_peak_increase)}")
    tail = _duration(record.duration_s)
    if record.error:
        tail += f" · {record.error}"
    lines.append(tail)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Bucket arithmetic: rows are tuples of values aligned with Timeline._keys (shorter = None tail)
# --------------------------------------------------------------------------------------------


def _fold(highs: list, lows: list, values) -> None:
    """Fold one row of values into a bucket's running maxima and minima (in place)."""
    if len(values) > len(highs):
        pad = [None] * (len(values) - len(highs))
        highs.extend(pad)
        lows.extend(pad)
    for i, v in enumerate(values):
        if v is None:
            continue
        h = highs[i]
        if h is None or v > h:
            highs[i] = v
        lo = lows[i]
        if lo is None or v < lo:
            lows[i] = v


def _merge_pair(a: tuple, b: tuple) -> tuple:
    """Merge two buckets ``(t, highs, lows)`` into one stamped with the first one's time."""
    highs, lows = list(a[1]), list(a[2])
    _fold(highs, lows, b[1])  # b's maxima may raise the maxima (and lower the minima)
    _fold(highs, lows, b[2])  # b's minima may lower the minima
    return (a[0], tuple(highs), tuple(lows))


def _merge_pairwise(items: list, merge) -> list:
    """Merge neighbours pairwise; an odd last item stays as it is."""
    out = [merge(items[i], items[i + 1]) for i in range(0, len(items) - 1, 2)]
    if len(items) % 2:
        out.append(items[-1])
    return out


# --------------------------------------------------------------------------------------------
# Spans: internal tuples (start, end, first_label, last_label, hover, moved, cells, failed, top)
# --------------------------------------------------------------------------------------------


def _merge_spans(a: tuple, b: tuple) -> tuple:
    """Merge two neighbouring closed spans; the hover keeps the bigger mover's text."""
    top = a[8] if a[5] >= b[5] else b[8]
    cells = a[6] + b[6]
    hover = f"{cells} cells {a[2]}–{b[3]} (merged to keep the timeline bounded)\nlargest: {top}"
    return (a[0], b[1], a[2], b[3], hover, max(a[5], b[5]), cells, a[7] or b[7], top)


def _public_span(s: tuple, origin: float) -> Span:
    label = s[2] if s[6] == 1 else f"{s[2]}–{s[3]}"
    end = None if s[1] is None else s[1] - origin
    return Span(s[0] - origin, end, label, s[4], s[5], s[6], s[7])


# --------------------------------------------------------------------------------------------
# The bounded store: newest items as they are, older ones in buckets of one uniform size
# --------------------------------------------------------------------------------------------


class _Bounded:
    """At most ``capacity`` items: the newest half as added, older ones folded into buckets.

    An item leaving the newest half is folded into the bucket being filled; a bucket is sealed
    after ``stride`` items. When the sealed buckets fill their half, neighbours are merged
    pairwise and ``stride`` doubles, so every old bucket covers the same number of items (the
    chart's old part has one resolution) and each add costs amortised O(1). Subclasses say how
    to fold and merge; instances hold data only (no callables), so the timeline stays a tree
    of numbers and strings.
    """

    def __init__(self, capacity: int):
        self.recent_max = capacity // 2
        # One slot is the partial bucket; keep the old part even so pairwise merges are clean.
        self.old_max = max(2, (capacity - self.recent_max - 1) // 2 * 2)
        self.recent: deque = deque()
        self.old: list = []
        self.partial = None  # the bucket being filled
        self.partial_count = 0
        self.stride = 1

    def append(self, item) -> None:
        recent = self.recent
        recent.append(item)
        if len(recent) > self.recent_max:
            self._age(recent.popleft())

    def _age(self, item) -> None:
        self.partial = self._fold(self.partial, item)
        self.partial_count += 1
        if self.partial_count >= self.stride:
            self.old.append(self._seal(self.partial))
            self.partial, self.partial_count = None, 0
            if len(self.old) >= self.old_max:
                self.old = _merge_pairwise(self.old, self._merge)
                self.stride *= 2

    def buckets(self) -> list:
        """The old part, oldest first, including the partial bucket."""
        return self.old + ([self._seal(self.partial)] if self.partial is not None else [])

    def __len__(self) -> int:
        return len(self.old) + (self.partial is not None) + len(self.recent)


class _Points(_Bounded):
    """Samples ``(t, values)``; buckets ``(t of the first, maxima, minima)``."""

    @staticmethod
    def _fold(bucket, item):
        t, values = item
        if bucket is None:
            return [t, list(values), list(values)]
        _fold(bucket[1], bucket[2], values)
        return bucket

    @staticmethod
    def _seal(bucket) -> tuple:
        return (bucket[0], tuple(bucket[1]), tuple(bucket[2]))

    _merge = staticmethod(_merge_pair)


class _Spans(_Bounded):
    """Closed spans; a bucket is the merged span of ``stride`` neighbouring cells."""

    @staticmethod
    def _fold(bucket, item):
        return item if bucket is None else _merge_spans(bucket, item)

    @staticmethod
    def _seal(bucket) -> tuple:
        return bucket

    _merge = staticmethod(_merge_spans)


class Timeline:
    """The session's sampled memory and cell spans, bounded in size; thread-safe.

    Args:
        max_points: most points a snapshot holds (>= 8). Half are the newest samples at full
            resolution, the rest merged buckets of older ones.
        max_spans: most spans kept (>= 4). Half are the newest cells; older ones are merged,
            like points, into spans of an equal number of neighbouring cells (label
            ``"[3]–[6]"``, hover naming the biggest mover), so the old part of the chart still
            shows where cells ran, as coarsely as its points. Nothing is dropped.
    """

    def __init__(self, max_points: int = 2000, max_spans: int = 500):
        if max_points < 8:
            raise ValueError("max_points must be at least 8")
        if max_spans < 4:
            raise ValueError("max_spans must be at least 4")
        self.max_points = int(max_points)
        self.max_spans = int(max_spans)
        self._lock = threading.Lock()
        self._version = 0
        self._reset()

    def _reset(self) -> None:
        self._keys: list = []
        self._key_index: dict = {}
        self._device_keys: dict = {}  # index -> (allocated, reserved, used, capacity) keys
        self._points = _Points(self.max_points)
        self._capacities: dict = {}
        self._spans = _Spans(self.max_spans)  # closed spans, oldest first
        self._running = None  # (start, label, first line)
        self._origin: Optional[float] = None
        self._last_t: Optional[float] = None
        self._added = 0
        self._cached = None

    # -- public API ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Increments on every change; a view redraws only when it differs from the last one."""
        return self._version

    def add(self, sample) -> None:
        """Append one :class:`~ipy_gpumem.core.probes.Sample` (any thread)."""
        with self._lock:
            t = self._clock(float(sample.t))
            self._points.append((t, self._row(sample)))
            self._added += 1
            self._changed()

    def cell_started(self, t: float, label: str, source: str) -> None:
        """Mark the start of a cell at ``t`` (``time.perf_counter()`` seconds).

        A cell still marked as running (its finish was never reported) is closed at ``t``.
        """
        with self._lock:
            t = self._clock(float(t), monotonic=False)
            if self._running is not None:
                self._close(t, None)
            self._running = (t, str(label), _first_line(source))
            self._changed()

    def cell_finished(self, t: float, record=None) -> None:
        """Close the running cell at ``t``, with the hover text built from ``record`` if given.

        Without a running cell, a record still gets a span (``t - duration_s`` to ``t``); without
        either, nothing happens.
        """
        with self._lock:
            t = self._clock(float(t), monotonic=False)
            if self._running is None:
                if record is None:
                    return
                start = t - float(record.duration_s or 0.0)
                # A cell that was already running when the timeline began (the one that opened the
                # chart): start the time axis at its start rather than draw it at negative times.
                self._origin = min(self._origin, start) if self._origin is not None else start
                self._running = (start, record.label, _first_line(record.source))
            self._close(t, record)
            self._changed()

    def snapshot(self) -> TimelineSnapshot:
        """An immutable copy for drawing (the same object while the version is unchanged)."""
        with self._lock:
            cached = self._cached
            if cached is not None and cached.version == self._version:
                return cached
            snap = self._build_snapshot()
            self._cached = snap
            return snap

    def clear(self) -> None:
        """Forget every sample and span (the version keeps counting up)."""
        with self._lock:
            self._reset()
            self._changed()

    def __len__(self) -> int:
        """Points a snapshot would hold now."""
        return len(self._points)

    # -- internals (called with the lock held) -------------------------------------------------

    def _changed(self) -> None:
        self._version += 1

    def _clock(self, t: float, monotonic: bool = True) -> float:
        if self._origin is None:
            self._origin = t
        if monotonic and self._last_t is not None and t < self._last_t:
            # Two threads add samples; the lock can order them a few microseconds out of time
            # order. Clamping keeps the series sorted, which every chart relies on.
            t = self._last_t
        if monotonic:
            self._last_t = t
        return t

    def _slot(self, key: str) -> int:
        index = self._key_index.get(key)
        if index is None:
            index = len(self._keys)
            self._keys.append(key)
            self._key_index[key] = index
        return index

    def _dev_keys(self, index: int) -> tuple:
        keys = self._device_keys.get(index)
        if keys is None:
            name = f"cuda:{index}"
            keys = (f"{name} allocated", f"{name} reserved", f"{name} used", name)
            self._device_keys[index] = keys
        return keys

    def _put(self, values: list, key: str, value) -> None:
        index = self._key_index.get(key)
        if index is None:
            index = self._slot(key)
            values.extend([None] * (index + 1 - len(values)))
        values[index] = int(value)

    def _row(self, sample) -> tuple:
        """The sample's values as a tuple aligned with ``_keys`` (new keys are appended)."""
        values = [None] * len(self._keys)
        host = sample.host
        if host is not None and host.rss is not None:
            self._put(values, HOST_KEY, host.rss)
        for dev in sample.devices:
            k_alloc, k_res, k_used, name = self._dev_keys(dev.index)
            if dev.allocated is not None:
                self._put(values, k_alloc, dev.allocated)
            if dev.reserved is not None:
                self._put(values, k_res, dev.reserved)
            if dev.used is not None:
                self._put(values, k_used, dev.used)
            if dev.total is not None:
                self._capacities[name] = int(dev.total)
        return tuple(values)

    def _close(self, t: float, record) -> None:
        start, label, first = self._running
        self._running = None
        if record is not None:
            # The record's execution count is the reliable one (IPython 7 increments it after
            # the cell, 8+ before), so its label wins over the one guessed at the start.
            label = record.label if record.execution_count is not None else label
            hover, moved, failed = hover_text(record, label), moved_bytes(record), record.error is not None
            for dev in record.devices:
                if dev.total is not None:
                    self._capacities[f"cuda:{dev.index}"] = int(dev.total)
        else:
            hover, moved, failed = f"{label} {first}".rstrip() + "\n(no record)", 0, False
        self._spans.append((start, max(t, start), label, label, hover, moved, 1, failed, hover))

    def _all_points(self) -> list:
        """Every point as ``(t, highs, lows)``, oldest first."""
        points = self._points.buckets()
        points.extend((t, row, row) for t, row in self._points.recent)
        return points

    def _columns(self, rows: list, n_keys: int) -> list:
        padded = [r if len(r) == n_keys else r + (None,) * (n_keys - len(r)) for r in rows]
        return list(zip(*padded)) if padded else [()] * n_keys

    def _build_snapshot(self) -> TimelineSnapshot:
        origin = self._origin if self._origin is not None else 0.0
        points = self._all_points()
        merged = len(points) - len(self._points.recent)
        n_keys = len(self._keys)
        times = tuple(p[0] - origin for p in points)
        highs = self._columns([p[1] for p in points], n_keys)
        lows = self._columns([p[2] for p in points], n_keys)
        spans = [_public_span(s, origin) for s in self._spans.buckets()]
        spans += [_public_span(s, origin) for s in self._spans.recent]
        running = None
        if self._running is not None:
            start, label, first = self._running
            running = Span(start - origin, None, label, f"{label} {first}".rstrip() + "\nrunning…")
            spans.append(running)
        capacities = dict(self._capacities)
        capacities.setdefault("host", None)
        candidates = [times[-1] if times else 0.0] + [s.end if s.end is not None else s.start for s in spans]
        return TimelineSnapshot(
            t=times,
            series=MappingProxyType({k: tuple(highs[i]) for i, k in enumerate(self._keys)}),
            lows=MappingProxyType({k: tuple(lows[i]) for i, k in enumerate(self._keys)}),
            spans=tuple(spans),
            running=running,
            capacities=MappingProxyType(capacities),
            version=self._version,
            origin=self._origin,
            end=max(candidates),
            merged=merged,
            stride=self._points.stride,
            added=self._added,
        )


def seed_timeline(timeline: Timeline, records, now_epoch: Optional[float] = None) -> None:
    """Replay recorded cells into ``timeline``: their before/after readings and their spans.

    The chart can be opened at any time and still show the session so far. Records carry
    wall-clock start times; they are mapped onto ``time.perf_counter()`` seconds, the timeline's
    clock. Only what was measured is drawn: a point at each cell's start and end (the peak's
    moment is unknown, so it lives in the span's hover text, not as an invented point).
    """
    import time

    from ..core.probes import DeviceSample, HostSample, Sample

    offset = time.perf_counter() - (time.time() if now_epoch is None else now_epoch)
    for rec in records:
        start = rec.started_at + offset
        end = start + (rec.duration_s or 0.0)
        for t, which in ((start, "before"), (end, "after")):
            devices = tuple(
                DeviceSample(d.index, getattr(d, f"allocated_{which}"), getattr(d, f"reserved_{which}"), None, None,
                             getattr(d, f"used_{which}"), d.total)
                for d in rec.devices
            )
            timeline.add(Sample(t, HostSample(getattr(rec.host, f"rss_{which}"), None), devices, rec.reason))
        timeline.cell_started(start, rec.label, rec.source)
        timeline.cell_finished(end, rec)
