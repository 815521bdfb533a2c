"""The session's memory over time: sampled series and cell spans, bounded however long it runs.

A :class:`Timeline` is fed :class:`~ipy_gpumem.core.probes.Sample` objects (from the sampler thread and
from the cell hooks) and cell start/finish events, and hands out immutable
:class:`TimelineSnapshot` copies for drawing. It keeps numbers and short strings only (a cell's
label, its first line, an error's class name): never a sample, a record, an exception or a
tensor, and never display text. Series are keyed by :class:`SeriesKey` (a device and a
quantity) and spans carry their numbers as fields; the views write hover texts from them.

Downsampling keeps the newest ``max_points // 2`` samples at full resolution. Older samples are
folded into buckets of ``stride`` consecutive samples; when the old part is full, neighbouring
buckets are merged pairwise and ``stride`` doubles, so the old part always has one uniform
resolution and the cost is amortised O(1) per sample. A bucket keeps, for every series, the
**maximum** (a memory chart must never hide a spike) and the **minimum** (so a chart can draw the
band a saw-tooth training loop sweeps instead of a misleading flat line at its peak), stamped
with the time of its first sample.
"""
from __future__ import annotations

import bisect
import threading
from collections import deque
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, NamedTuple, Optional, Tuple

from ..core.devices import HOST, Device, device
from ..core.text import cell_name

__all__ = ["SeriesKey", "QUANTITIES", "HOST_RSS", "Change", "Span", "MissedPeak", "TimelineSnapshot", "Timeline",
           "missed_peaks", "seed_timeline"]

#: What a series measures: allocated / reserved by torch's caching allocator, device-wide used
#: (every process), and the process's resident set size (host).
QUANTITIES = ("allocated", "reserved", "used", "rss")
#: Spans keep a cell's first source line up to this many characters.
FIRST_LINE_CHARS = 80


class SeriesKey(NamedTuple):
    """One series of the chart: a device (``cuda(0)``, ``HOST``) and a quantity from :data:`QUANTITIES`."""

    device: Device
    quantity: str


#: The process's resident set size.
HOST_RSS = SeriesKey(HOST, "rss")


class Change(NamedTuple):
    """What a cell did on one device, in bytes (None where unknown).

    For a CUDA device the numbers are torch's allocated memory (``reserved_delta`` beside it);
    for the host (recorded when no CUDA device was in use) they are the process's RSS.
    """

    device: Device
    delta: Optional[int]
    peak: Optional[int]
    peak_increase: Optional[int]
    reserved_delta: Optional[int] = None


class Span(NamedTuple):
    """One cell (or, once merged, a run of old cells) on the timeline.

    Times are seconds relative to the session start in a snapshot; ``end`` is None while the cell
    runs. ``moved`` is the largest change the cell made (``CellRecord.moved_bytes``), which a
    chart uses to decide which labels to keep when they crowd.

    Attributes:
        label: ``"[7]"``; ``"[*]"`` while running; ``"[3]–[6]"`` for merged cells.
        first_line: the cell's first non-blank source line (clipped); "" for merged cells.
        error: the class name of the error the cell raised, or None.
        duration: the cell's duration from its record (None without one).
        changes: per device, what the cell did (:class:`Change`).
        recorded: False when the cell was closed without a record (or is still running).
        largest: for merged spans, the one cell among them that moved most.
    """

    start: float
    end: Optional[float]
    label: str
    first_line: str = ""
    moved: int = 0
    cells: int = 1
    failed: bool = False
    error: Optional[str] = None
    duration: Optional[float] = None
    changes: Tuple[Change, ...] = ()
    recorded: bool = False
    largest: Optional["Span"] = None
    #: the processes the cell launched (:class:`RankChange`), empty for most cells
    ranks: Tuple[RankChange, ...] = ()


class RankChange(NamedTuple):
    """A process the cell launched (a rank): its host RSS at its start, at its peak and at its end."""

    rank: Optional[int]
    pid: int
    rss_before: Optional[int]
    peak_rss: Optional[int]
    rss_after: Optional[int]

    @property
    def label(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else f"pid {self.pid}"


class MissedPeak(NamedTuple):
    """A cell's exact peak (from its record) above every sample taken while it ran."""

    key: SeriesKey
    start: float
    end: float
    peak: int


def missed_peaks(spans, times, series, keys) -> Tuple[MissedPeak, ...]:
    """The peaks of closed cells that the samples of the series ``keys`` missed.

    A short spike between two samples never shows in a sampled line; the record's peak is exact.
    Charts draw these as marks over their cells (and include them in their range), the text
    sparkline raises its columns to them. Only allocated (CUDA) and RSS (host) have per-cell peaks.
    """
    drawn = {key.device: key for key in keys if key.quantity in ("allocated", "rss")}
    if not drawn or not spans:
        return ()
    out = []
    for span in spans:
        if span.end is None:
            continue
        for change in span.changes:
            key = drawn.get(change.device)
            if key is None or change.peak is None:
                continue
            values = series.get(key, ())
            lo, hi = bisect.bisect_left(times, span.start), bisect.bisect_right(times, span.end)
            sampled = max((v for v in values[lo:hi] if v is not None), default=None)
            if sampled is None or change.peak > sampled:
                out.append(MissedPeak(key, span.start, span.end, int(change.peak)))
    return tuple(out)


def _empty_mapping() -> Mapping:
    return MappingProxyType({})


@dataclass(frozen=True, eq=False)
class TimelineSnapshot:
    """An immutable copy of a :class:`Timeline` for drawing.

    Attributes:
        t: sample times, seconds since the session start (the first timestamp the timeline saw).
        series: per :class:`SeriesKey`, the value at each ``t``: the bucket's maximum for merged
            points; None where the value was unknown.
        lows: the same keys, the bucket's minimum (equal to ``series`` for full-resolution points).
        spans: closed spans oldest first, then the running one if any.
        running: the running cell's span, or None.
        capacities: per device, its total bytes; ``HOST`` maps to None (physical RAM is not
            something the probe reads, and drawing it would flatten the RSS line).
        version: the timeline's version when the copy was taken.
        origin: ``time.perf_counter()`` value of t = 0 (None before anything was added).
        end: the latest time the timeline knows of (relative), for the right edge of a chart.
        merged: how many leading points are merged buckets (the rest are single samples).
        stride: how many samples each fully merged bucket holds.
        added: how many samples were ever added.
    """

    t: Tuple[float, ...] = ()
    series: Mapping[SeriesKey, tuple] = field(default_factory=_empty_mapping)
    lows: Mapping[SeriesKey, tuple] = field(default_factory=_empty_mapping)
    spans: Tuple[Span, ...] = ()
    running: Optional[Span] = None
    capacities: Mapping[Device, Optional[int]] = field(default_factory=_empty_mapping)
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
    def keys(self) -> Tuple[SeriesKey, ...]:
        return tuple(self.series)

    def missed_peaks(self, keys=None) -> Tuple[MissedPeak, ...]:
        """:func:`missed_peaks` of this snapshot's spans (for ``keys``, default every series); worked
        out once per snapshot, since every view of it asks."""
        every = self.__dict__.get("_missed")
        if every is None:
            every = missed_peaks(self.spans, self.t, self.series, tuple(self.series))
            self.__dict__["_missed"] = every  # a cache on a frozen snapshot: the same answer every time
        if keys is None:
            return every
        wanted = set(keys)
        return tuple(mark for mark in every if mark.key in wanted)

    def devices(self) -> Tuple[Device, ...]:
        """The accelerator devices (CUDA, ROCm, MPS, XPU...) with at least one reading, in index order."""
        found = {key.device for key, values in self.series.items()
                 if not key.device.is_host and any(v is not None for v in values)}
        return tuple(sorted(found, key=lambda d: d.index if d.index is not None else -1))


# --------------------------------------------------------------------------------------------
# Spans from records
# --------------------------------------------------------------------------------------------


def _changes(record) -> Tuple[Change, ...]:
    """Per device what ``record`` did: allocated (and reserved) per CUDA device, else host RSS."""
    if record.devices:
        return tuple(Change(device(getattr(d, "type", "cuda"), d.index), d.allocated_delta, d.peak_allocated,
                            d.peak_increase, d.reserved_delta) for d in record.devices)
    host = record.host
    if host.rss_before is None and host.rss_after is None:
        return ()
    return (Change(HOST, host.rss_delta, host.peak_rss, host.rss_peak_increase),)


def _rank_changes(record) -> Tuple[RankChange, ...]:
    """The ranks ``record``'s cell launched, as the chart draws them (host RSS; never raises)."""
    out = []
    for rank in getattr(record, "ranks", None) or ():
        host = rank.host
        if host.rss_before is None and host.peak_rss is None and host.rss_after is None:
            continue
        out.append(RankChange(rank.rank, rank.pid, host.rss_before, host.peak_rss, host.rss_after))
    return tuple(out)


def _first(source: str) -> str:
    """The line that names a cell (past a ``%%magic`` header line), at the chart's width."""
    return cell_name(source, FIRST_LINE_CHARS)


# --------------------------------------------------------------------------------------------
# Bucket arithmetic: rows are tuples of values aligned with Timeline._keys (shorter = None tail)
# --------------------------------------------------------------------------------------------


class _Bucket(NamedTuple):
    """Merged points: the first one's time, and per series the maxima and minima."""

    t: float
    highs: tuple
    lows: tuple


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


def _merge_buckets(a: _Bucket, b: _Bucket) -> _Bucket:
    """Merge two buckets into one stamped with the first one's time."""
    highs, lows = list(a.highs), list(a.lows)
    _fold(highs, lows, b.highs)  # b's maxima may raise the maxima (and lower the minima)
    _fold(highs, lows, b.lows)  # b's minima may lower the minima
    return _Bucket(a.t, tuple(highs), tuple(lows))


def _merge_pairwise(items: list, merge) -> list:
    """Merge neighbours pairwise; an odd last item stays as it is."""
    out = [merge(items[i], items[i + 1]) for i in range(0, len(items) - 1, 2)]
    if len(items) % 2:
        out.append(items[-1])
    return out


class _Run(NamedTuple):
    """Closed spans as stored: one cell (``top`` is its span) or a run of merged neighbours.

    Times are absolute (``perf_counter`` seconds); ``top`` keeps absolute times too and is made
    relative when a snapshot is taken.
    """

    start: float
    end: float
    first_label: str
    last_label: str
    moved: int
    cells: int
    failed: bool
    top: Span  # the single cell that moved most


def _merge_runs(a: _Run, b: _Run) -> _Run:
    """Merge two neighbouring closed runs; the bigger mover stays ``top``."""
    top = a.top if a.moved >= b.moved else b.top
    return _Run(a.start, b.end, a.first_label, b.last_label, max(a.moved, b.moved), a.cells + b.cells,
                a.failed or b.failed, top)


def _shift(span: Span, origin: float) -> Span:
    return span._replace(start=span.start - origin, end=None if span.end is None else span.end - origin)


def _public_span(run: _Run, origin: float) -> Span:
    if run.cells == 1:
        return _shift(run.top, origin)
    return Span(run.start - origin, run.end - origin, f"{run.first_label}–{run.last_label}", "", run.moved,
                run.cells, run.failed, largest=_shift(run.top, origin))


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
    """Samples ``(t, values)``; buckets are :class:`_Bucket`."""

    @staticmethod
    def _fold(bucket, item):
        t, values = item
        if bucket is None:
            return [t, list(values), list(values)]  # mutable while being filled
        _fold(bucket[1], bucket[2], values)
        return bucket

    @staticmethod
    def _seal(bucket) -> _Bucket:
        return _Bucket(bucket[0], tuple(bucket[1]), tuple(bucket[2]))

    _merge = staticmethod(_merge_buckets)


class _Spans(_Bounded):
    """Closed spans (:class:`_Run`); a bucket is the run of ``stride`` neighbouring cells."""

    @staticmethod
    def _fold(bucket, item):
        return item if bucket is None else _merge_runs(bucket, item)

    @staticmethod
    def _seal(bucket) -> _Run:
        return bucket

    _merge = staticmethod(_merge_runs)


#: A change in a series smaller than this (and than 1/500 of the value) does not count as moved.
MOVE = 1 << 20


def _moved(before: tuple, after: tuple) -> bool:
    """True when ``after`` differs from ``before`` by more than noise (see ``Timeline.moved``)."""
    if len(before) != len(after):
        return True
    for a, b in zip(before, after):
        if a != b and (a is None or b is None or abs(a - b) > max(MOVE, abs(a) >> 9)):
            return True
    return False


class _Running(NamedTuple):
    start: float
    label: str
    first_line: str
    source: str  # until the cell ends: a record of the same source needs no second look


class Timeline:
    """The session's sampled memory and cell spans, bounded in size; thread-safe.

    Args:
        max_points: most points a snapshot holds (>= 8). Half are the newest samples at full
            resolution, the rest merged buckets of older ones.
        max_spans: most spans kept (>= 4). Half are the newest cells; older ones are merged,
            like points, into spans of an equal number of neighbouring cells (label
            ``"[3]–[6]"``, ``largest`` naming the biggest mover), so the old part of the chart
            still shows where cells ran, as coarsely as its points. Nothing is dropped.
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
        self._moved = 0
        self._reset()

    def _reset(self) -> None:
        self._keys: list = []
        self._key_index: dict = {}
        self._device_keys: dict = {}  # (device type, index) -> (allocated, reserved, used) keys
        self._points = _Points(self.max_points)
        self._capacities: dict = {}
        self._spans = _Spans(self.max_spans)  # closed runs, oldest first
        self._running: Optional[_Running] = None
        self._origin: Optional[float] = None
        self._last_t: Optional[float] = None
        self._added = 0
        self._last_row: tuple = ()
        self._cached = None

    # -- public API ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Increments on every change; a view redraws only when it differs from the last one."""
        return self._version

    @property
    def moved(self) -> int:
        """Increments when something worth a redraw happened: a cell started or ended, or a value
        moved by more than :data:`MOVE` (or 1/500 of itself) since the sample before. Samples that
        only repeat the same numbers change ``version`` but not this; an idle chart need not be
        redrawn for them."""
        return self._moved

    @property
    def running(self) -> bool:
        """True while a cell is marked as running."""
        return self._running is not None

    def add(self, sample) -> None:
        """Append one :class:`~ipy_gpumem.core.probes.Sample` (any thread)."""
        with self._lock:
            t = self._clock(float(sample.t))
            row = self._row(sample)
            if _moved(self._last_row, row):
                self._moved += 1
            self._last_row = row
            self._points.append((t, row))
            self._added += 1
            self._version += 1

    def cell_started(self, t: float, label: str, source: str) -> None:
        """Mark the start of a cell at ``t`` (``time.perf_counter()`` seconds).

        A cell still marked as running (its finish was never reported) is closed at ``t``.
        """
        first = _first(source or "")
        with self._lock:
            t = self._clock(float(t), monotonic=False)
            if self._running is not None:
                self._close(t, None)
            self._running = _Running(t, str(label), first, source or "")
            self._version += 1
            self._moved += 1

    def cell_finished(self, t: float, record=None) -> None:
        """Close the running cell at ``t`` with the numbers of ``record`` (a ``CellRecord``) if given.

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
                self._running = _Running(start, record.label, _first(record.source or ""), record.source or "")
            self._close(t, record)
            self._version += 1
            self._moved += 1

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
            self._version += 1
            self._moved += 1

    def __len__(self) -> int:
        """Points a snapshot would hold now."""
        return len(self._points)

    # -- internals (called with the lock held) -------------------------------------------------

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

    def _slot(self, key: SeriesKey) -> int:
        index = self._key_index.get(key)
        if index is None:
            index = len(self._keys)
            self._keys.append(key)
            self._key_index[key] = index
        return index

    def _dev_keys(self, index: int, kind: str = "cuda") -> tuple:
        keys = self._device_keys.get((kind, index))
        if keys is None:
            dev = device(kind, index)  # torch's name: cuda:0 (ROCm too), mps, xpu:1
            keys = (SeriesKey(dev, "allocated"), SeriesKey(dev, "reserved"), SeriesKey(dev, "used"))
            self._device_keys[(kind, index)] = keys
        return keys

    def _put(self, values: list, key: SeriesKey, value) -> None:
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
            self._put(values, HOST_RSS, host.rss)
        for dev in sample.devices:
            k_alloc, k_res, k_used = self._dev_keys(dev.index, getattr(dev, "type", "cuda"))
            if dev.allocated is not None:
                self._put(values, k_alloc, dev.allocated)
            if dev.reserved is not None:
                self._put(values, k_res, dev.reserved)
            if dev.used is not None:
                self._put(values, k_used, dev.used)
            if dev.total is not None:
                self._capacities[k_alloc.device] = int(dev.total)
        return tuple(values)

    def _close(self, t: float, record) -> None:
        running = self._running
        self._running = None
        end = max(t, running.start)
        if record is None:
            span = Span(running.start, end, running.label, running.first_line)
        else:
            # The record's execution count is the reliable one (IPython 7 increments it after
            # the cell, 8+ before), so its label wins over the one guessed at the start.
            label = record.label if record.execution_count is not None else running.label
            source = record.source
            first = running.first_line if not source or source == running.source else _first(source)
            span = Span(running.start, end, label, first, record.moved_bytes, 1, record.error is not None,
                        record.error, record.duration_s, _changes(record), True, ranks=_rank_changes(record))
            for dev in record.devices:
                if dev.total is not None:
                    self._capacities[device(getattr(dev, "type", "cuda"), dev.index)] = int(dev.total)
        self._spans.append(_Run(span.start, end, span.label, span.label, span.moved, 1, span.failed, span))

    def _all_points(self) -> list:
        """Every point as a :class:`_Bucket`, oldest first (single samples are buckets of one)."""
        points = self._points.buckets()
        points.extend(_Bucket(t, row, row) for t, row in self._points.recent)
        return points

    @staticmethod
    def _columns(rows: list, n_keys: int) -> list:
        padded = [r if len(r) == n_keys else r + (None,) * (n_keys - len(r)) for r in rows]
        return list(zip(*padded)) if padded else [()] * n_keys

    def _build_snapshot(self) -> TimelineSnapshot:
        origin = self._origin if self._origin is not None else 0.0
        points = self._all_points()
        merged = len(points) - len(self._points.recent)
        n_keys = len(self._keys)
        times = tuple(p.t - origin for p in points)
        highs = self._columns([p.highs for p in points], n_keys)
        lows = self._columns([p.lows for p in points], n_keys)
        spans = [_public_span(r, origin) for r in self._spans.buckets()]
        spans += [_public_span(r, origin) for r in self._spans.recent]
        running = None
        if self._running is not None:
            start, label, first, _ = self._running
            running = Span(start - origin, None, label, first)
            spans.append(running)
        capacities = dict(self._capacities)
        capacities.setdefault(HOST, None)
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
    moment is unknown, so it stays a number on the span, not an invented point).
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
            timeline.add(Sample(t, HostSample(getattr(rec.host, f"rss_{which}"), None), devices, rec.devices_note))
        timeline.cell_started(start, rec.label, rec.source)
        timeline.cell_finished(end, rec)
