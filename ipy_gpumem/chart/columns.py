"""The column charts' layout: a cell line by line, the recorded cells, an estimate's step; computed once for both renderers.

A column goes from one level to the next (red where memory grew, green where it shrank), with a
whisker up to a peak above both ends; ``end`` columns (before, after, a predicted peak) stand from
the floor. A cell's ``--lines`` columns are stacked by role where every line in them counted roles
(:class:`RolePlan`). A :class:`ColumnsLayout` holds the columns, the byte range (from 0, or zoomed
when the changes are small next to the base), the unit, the capacity (drawn when on the scale of the
data, else written as a number) and the legend: numbers and references, no sentences. The words of
a column's hover come from :mod:`.words` (``column_hover``), where a renderer places them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence, Tuple

from ..core.devices import HOST, Device, cuda, parse_device
from ..core.roles import ROLES, TENSOR_ROLES
from . import words
from .scale import ByteUnit, byte_ticks, byte_unit
from .session import CAPACITY_ON_SCALE, LegendItem, session_layout
from .style import DOWN_COLOR, FAILED_COLOR, INK, PEAK_COLOR, UP_COLOR, device_color, role_color
from .timeline import HOST_RSS, SeriesKey, Timeline

__all__ = ["LineBar", "Segment", "RolePlan", "Column", "Capacity", "ColumnsLayout", "record_columns",
           "history_columns", "estimate_columns", "role_plan", "column_range", "subject_key", "MAX_ROLE_SCALE", "MAX_COLUMNS",
           "MAX_CELLS", "cell_layout", "sample_points"]

#: Roles are scaled to a column's change by at most this factor: tensors that make up less than
#: 1/16 of what a line did to host RSS did not make that change, and are not painted over it.
MAX_ROLE_SCALE = 16.0
#: More lines than this share columns (a picture passes fewer, from its width).
MAX_COLUMNS = 80
#: The newest cells a history chart draws (the table itself has ``history N``).
MAX_CELLS = 500


class LineBar(NamedTuple):
    """One source line inside a column: the line's record, what it did to the charted quantity, its roles
    (``(in the bar, beside it)``, each ``((role, bytes), ...)``; None when it counted none) and temporaries."""

    line: object
    delta: Optional[int]
    peak: Optional[int]
    roles: Optional[tuple]
    temporaries: Optional[int]


class Segment(NamedTuple):
    """One role's part of a column: ``v0`` to ``v1`` in chart bytes, ``exact`` the role's bytes."""

    role: str
    exact: int
    v0: float
    v1: float
    left: bool  # released (drawn in the left half when the column also has added roles)


class RolePlan(NamedTuple):
    """How a column is stacked by role (see :func:`role_plan`)."""

    segments: tuple
    low: float  # the lowest level the column reaches (released roles hang from its start)
    scale: float  # chart bytes per role byte (1.0: drawn exactly)
    split: bool  # released and added roles side by side, each in half the column

    @property
    def scaled(self) -> bool:
        return abs(self.scale - 1.0) > 1e-3


class Column(NamedTuple):
    """One column: its tick, the level at its start and end (bytes), a whisker to a peak above both (or
    None), its kind (``end``, ``up``, ``down``, ``flat``), its role plan, and what it stands for: the
    source lines it covers (``lines``, ``first``..``last``), a record (a cell of the history, a whole
    cell) or an estimate's line (``source``), a reserved level (``reserved``)."""

    tick: str
    start: float
    end: float
    whisker: Optional[float] = None
    kind: str = "flat"
    plan: Optional[RolePlan] = None
    lines: Tuple[LineBar, ...] = ()
    first: Optional[int] = None
    last: Optional[int] = None
    source: object = None
    reserved: Optional[int] = None
    peak: Optional[int] = None  # the exact peak a whisker reaches, as recorded (bytes)

    @property
    def delta(self) -> float:
        return self.end - self.start

    @property
    def peak_increase(self) -> Optional[float]:
        return None if self.whisker is None else self.whisker - self.start


class Capacity(NamedTuple):
    """The memory the data is measured against: its bytes, what it is (words), its colour, and whether it
    is on the chart's scale (drawn as a line) or only written."""

    total: int
    label: str
    color: str
    on_scale: bool


@dataclass(frozen=True)
class ColumnsLayout:
    """A column chart, ready to draw (see the module docstring).

    Attributes:
        kind: ``cell``, ``history`` or ``estimate``.
        title: the chart's title (plain text). ``xtitle``: the x axis's title, or "".
        key, name: the quantity charted and its name (``cuda:0 allocated``, ``host RSS``).
        columns: in order; ``connectors``: a waterfall (each column starts where the previous ended).
        floor, top, ticks: the byte axis; ``unit``: the values' unit.
        capacity: the memory to fit in, or None; ``lines``: reference levels ``(bytes, words, kind)``.
        legend, role_legend: the legend rows.
    """

    kind: str
    title: str
    key: SeriesKey
    name: str
    columns: Tuple[Column, ...]
    floor: float
    top: float
    ticks: tuple
    unit: ByteUnit
    capacity: Optional[Capacity] = None
    lines: tuple = ()
    legend: Tuple[LegendItem, ...] = ()
    role_legend: Tuple[LegendItem, ...] = ()
    connectors: bool = True
    xtitle: str = ""

    @property
    def line_columns(self) -> bool:
        """True when the columns are source lines (their ticks read ``line 3``)."""
        return any(column.first is not None for column in self.columns)


def column_range(low: float, high: float) -> tuple:
    """``(floor, top, ticks)``: from 0 normally; zoomed when the changes are small next to the base.

    A waterfall is about the changes: +256 MiB on top of 5 GiB would be a hairline on an axis from 0.
    When everything sits above 40% of the top, the axis starts at a round value below the lowest level
    instead (the end columns then carry a break mark).
    """
    if 0 <= low <= 0.4 * high:
        top, ticks = byte_ticks(high * 1.08)
        return 0, top, tuple(ticks)
    # Zoomed, or below zero when the line deltas of an incomplete record undershoot.
    _, span_ticks = byte_ticks((high - low) * 1.15)
    step = span_ticks[1]
    floor = math.floor((low - 0.05 * (high - low)) / step) * step
    floor = max(0, floor) if low >= 0 else floor
    count = max(1, math.ceil((high + 0.08 * (high - low) - floor) / step))
    return floor, floor + count * step, tuple(floor + i * step for i in range(count + 1))


def _kind(start, end) -> str:
    return "up" if end > start else "down" if end < start else "flat"


def _whisker(start, end, increase) -> Optional[float]:
    if increase is None or start + increase <= max(start, end):
        return None
    return start + increase


def _role_order(item) -> tuple:
    return (ROLES.index(item[0]) if item[0] in ROLES else len(ROLES), str(item[0]))


def role_plan(roles: tuple, start: float, end: float) -> Optional[RolePlan]:
    """How a column with ``roles`` (``((role, exact bytes), ...)``) is stacked; None when it is drawn plainly.

    Released roles (negative) hang down from the line's start level, then added roles (positive) rise
    from there to its end level: the column ends where the line did and never rises above the larger
    of start and end, so it cannot contradict the measured peak (the whisker). We do not know in which
    order the line released and allocated, so when it did both the two stacks stand side by side
    (released left, added right) instead of one on top of the other.

    The roles are exact tensor bytes. When they do not add up to the charted change (always on a host
    RSS chart, where the allocator's pages and non-tensor objects count too) they are scaled to add up
    to it, and the legend says so; when they cannot be (no change, roles netting to the other
    direction, or roles far too small to be what moved it: :data:`MAX_ROLE_SCALE`) the column is drawn
    plainly and the roles are in its hover only.
    """
    if not roles:
        return None
    delta = end - start
    net = sum(value for _role, value in roles)
    if not delta or not net or (delta > 0) != (net > 0):
        return None
    scale = delta / net
    if scale > MAX_ROLE_SCALE:
        return None
    downs = [(role, value) for role, value in roles if value < 0]
    ups = [(role, value) for role, value in roles if value > 0]
    segments, level = [], float(start)
    for role, value in downs + ups:
        top = level + value * scale
        segments.append(Segment(role, value, level, top, value < 0))
        level = top
    low = start + sum(value for _role, value in downs) * scale
    return RolePlan(tuple(segments), min(low, start, end), scale, bool(downs and ups))


# ---------------------------------------------------------------------------------------------
# A cell: before, its lines (or the whole cell), after
# ---------------------------------------------------------------------------------------------


class _Subject(NamedTuple):
    key: SeriesKey
    before: Optional[int]
    after: Optional[int]
    peak: Optional[int]
    reserved: tuple  # (before, after), None where unknown
    total: Optional[int]


def _subject(record) -> _Subject:
    """What a cell chart shows: the device that moved most (allocated), else host RSS."""
    devices = [d for d in record.devices if d.allocated_before is not None or d.allocated_after is not None]
    if devices:
        dev = max(devices, key=lambda d: max(abs(d.allocated_delta or 0), d.peak_increase or 0))
        return _Subject(SeriesKey(cuda(dev.index), "allocated"), dev.allocated_before, dev.allocated_after,
                        dev.peak_allocated, (dev.reserved_before, dev.reserved_after), dev.total)
    host = record.host
    return _Subject(HOST_RSS, host.rss_before, host.rss_after, host.peak_rss, (None, None), None)


def subject_key(record) -> SeriesKey:
    """The series a cell's chart draws: the device that moved most (allocated), else host RSS."""
    return _subject(record).key


def _line_values(line, key: SeriesKey) -> tuple:
    if key.device.is_host:
        return line.host.rss_delta, line.host.rss_peak_increase
    dev = line.device(key.device.index)
    return (None, None) if dev is None else (dev.allocated_delta, dev.peak_increase)


def _line_roles(line, device: Device) -> Optional[tuple]:
    """``(in the bar, beside it)`` of a line's roles on ``device``; None when it counted none there.

    Host RSS holds every role of the "cpu" row. A CUDA chart draws allocated memory: the tensor roles
    make it up exactly; the allocator's cache and memory outside PyTorch are beside it.
    """
    table = getattr(line, "roles", None)
    if not isinstance(table, dict) or not isinstance(table.get(device.label), dict):
        return None
    inside, beside = [], []
    for role, value in sorted(table[device.label].items(), key=_role_order):
        try:
            value = int(value)
        except (TypeError, ValueError):
            continue
        if value:
            (inside if device.is_host or role in TENSOR_ROLES else beside).append((role, value))
    return tuple(inside), tuple(beside)


def _line_bar(line, key: SeriesKey) -> LineBar:
    delta, peak = _line_values(line, key)
    temporaries = getattr(line, "temporaries", None)
    temp = temporaries.get(key.device.label) if isinstance(temporaries, dict) else None
    return LineBar(line, delta, peak, _line_roles(line, key.device), temp if isinstance(temp, int) else None)


def _line_tick(first: int, last: int) -> str:
    return f"line {first}" if first == last else f"lines {first}–{last}"


def _line_columns(record, key: SeriesKey, before: int, max_columns: int) -> list:
    """One column per executed line (source order), grouped into runs when there are too many; a column
    is stacked by role when every line in it counted roles for the charted device (their sum)."""
    lines = sorted(record.lines or (), key=lambda ln: ln.lineno)
    group = max(1, math.ceil(len(lines) / max(1, max_columns)))
    columns, level = [], before
    for i in range(0, len(lines), group):
        bars = tuple(_line_bar(line, key) for line in lines[i:i + group])
        delta, peak, inner = 0, None, 0
        for bar in bars:
            if bar.peak is not None:
                peak = max(peak if peak is not None else bar.peak, inner + bar.peak)
            inner += bar.delta or 0
            delta += bar.delta or 0
        sums: dict = {}
        measured = all(bar.roles is not None for bar in bars)
        for bar in bars:
            for role, value in (bar.roles or ((), ()))[0]:
                sums[role] = sums.get(role, 0) + value
        roles = tuple(sorted(((r, v) for r, v in sums.items() if v), key=_role_order)) if measured else ()
        start, end = level, level + delta
        columns.append(Column(_line_tick(bars[0].line.lineno, bars[-1].line.lineno), start, end,
                              _whisker(start, end, peak), _kind(start, end), role_plan(roles, start, end), bars,
                              bars[0].line.lineno, bars[-1].line.lineno))
        level = end
    return columns


def _role_legend(plans: Sequence, key: SeriesKey) -> Tuple[LegendItem, ...]:
    """The roles drawn (ROLES order), ``released`` when one was drawn going down, and a note when the
    roles were scaled to the charted change."""
    segments = [seg for plan in plans if plan is not None for seg in plan.segments]
    if not segments:
        return ()
    roles = sorted({seg.role for seg in segments}, key=lambda role: _role_order((role, 0)))
    items = [LegendItem(words.role_word(role), role_color(role), "box") for role in roles]
    if any(seg.exact < 0 for seg in segments):
        items.append(LegendItem("released", INK, "box-out"))
    if any(plan.scaled for plan in plans if plan is not None):
        quantity = "RSS" if key.device.is_host else key.quantity
        items.append(LegendItem(words.ROLES_SCALED.format(quantity=quantity), None, ""))
    return tuple(items)


def _legend(columns: Sequence, reserved: bool, peak_words: str = "peak", ends: str = "before / after",
            grew: Sequence[str] = ("grew", "shrank")) -> Tuple[LegendItem, ...]:
    items = [LegendItem(ends, INK, "solid")] if any(c.kind == "end" for c in columns) else []
    if any(c.plan is None and c.kind in ("up", "down") for c in columns):
        items += [LegendItem(grew[0], UP_COLOR, "solid"), LegendItem(grew[1], DOWN_COLOR, "solid")]
    if any(c.whisker is not None for c in columns):
        items.append(LegendItem(peak_words, PEAK_COLOR, "peak"))
    if reserved:
        items.append(LegendItem("reserved", INK, "dash"))
    return tuple(items)


def record_columns(record, max_columns: int = MAX_COLUMNS) -> Optional[ColumnsLayout]:
    """A cell's waterfall: before, one column per executed line (or one for the whole cell), after;
    None without a record or any reading of the charted quantity."""
    if record is None:
        return None
    subject = _subject(record)
    if subject.before is None and subject.after is None:
        return None
    name = words.series_name(subject.key)
    before = subject.before if subject.before is not None else 0
    after = subject.after if subject.after is not None else before
    middle = _line_columns(record, subject.key, before, max_columns) if record.lines else []
    if not middle:
        increase = None if subject.peak is None else subject.peak - before
        middle = [Column("cell", before, after, _whisker(before, after, increase), _kind(before, after),
                         source=record, peak=subject.peak)]
    columns = ([Column("before", before, before, kind="end", reserved=subject.reserved[0])] + middle
               + [Column("after", after, after, kind="end", reserved=subject.reserved[1])])
    marks = [before, after] + [v for c in middle for v in (c.start, c.end, c.whisker) if v is not None]
    marks += [v for v in (subject.peak,) + tuple(subject.reserved) if v is not None]
    marks += [c.plan.low for c in middle if c.plan is not None]
    floor, top, ticks = column_range(min(marks), max(marks))
    capacity = None
    if subject.total:
        capacity = Capacity(subject.total, words.capacity_text(subject.key.device, subject.total, False),
                            device_color(subject.key.device), subject.total <= top)
    return ColumnsLayout(
        "cell", f"{words.record_title(record)} · {name}", subject.key, name, tuple(columns), floor, top, ticks,
        byte_unit(max(marks)), capacity, legend=_legend(columns, any(r is not None for r in subject.reserved)),
        role_legend=_role_legend([c.plan for c in middle], subject.key))


def sample_points(samples) -> list:
    """The probe samples among ``samples`` (anything else, or a non-iterable, gives none)."""
    try:
        return [s for s in samples if s is not None and hasattr(s, "host")] if samples is not None else []
    except TypeError:
        return []


def _record_peak(record, key: SeriesKey) -> Optional[int]:
    if key.device.is_host:
        return record.host.peak_rss
    for dev in record.devices:
        if dev.index == key.device.index:
            return dev.peak_allocated
    return None


def cell_layout(record, samples=None, max_columns: int = MAX_COLUMNS):
    """The chart one cell gets, for both renderers: with two or more samples and no line-by-line record,
    the session layout of its samples (its record's exact peak where that quantity is drawn, its device's
    capacity); otherwise its waterfall (:func:`record_columns`). None without a record or any reading."""
    if record is None:
        return None
    points = sample_points(samples)
    if len(points) >= 2 and not record.lines:
        timeline = Timeline(max_points=max(8, 2 * len(points) + 8))
        for sample in points:
            timeline.add(sample)
        snapshot = timeline.snapshot()
        key = subject_key(record)
        plain = session_layout(snapshot)
        if plain.series:
            peak = _record_peak(record, key) if plain.series[0].key.device.is_host == key.device.is_host else None
            capacities = {key.device: dev.total for dev in record.devices
                          if dev.total and key.device.is_cuda and dev.index == key.device.index}
            return session_layout(snapshot, exact_peak=peak, capacities=capacities)
    return record_columns(record, max_columns)


# ---------------------------------------------------------------------------------------------
# The recorded cells
# ---------------------------------------------------------------------------------------------


def _history_key(records) -> SeriesKey:
    moved: dict = {}
    for rec in records:
        for dev in rec.devices:
            moved[dev.index] = moved.get(dev.index, 0) + abs(dev.allocated_delta or 0) + (dev.peak_increase or 0)
    if not moved:
        return HOST_RSS
    return SeriesKey(cuda(max(moved, key=moved.get)), "allocated")


def _history_values(rec, key: SeriesKey) -> tuple:
    """``(before, after, peak, reserved after)`` of one record for the charted series (None where unknown)."""
    if key.device.is_host:
        host = rec.host
        return host.rss_before, host.rss_after, host.peak_rss, None
    for dev in rec.devices:
        if dev.index == key.device.index:
            return dev.allocated_before, dev.allocated_after, dev.peak_allocated, dev.reserved_after
    return None, None, None, None


def history_columns(records: Sequence) -> Optional[ColumnsLayout]:
    """The recorded cells, one column each from its level before to its level after, a whisker at its
    exact peak and its reserved level after; None when no cell has a reading."""
    records = list(records)[-MAX_CELLS:]
    if not records:
        return None
    key = _history_key(records)
    name = words.series_name(key)
    columns = []
    for i, rec in enumerate(records):
        before, after, peak, reserved = _history_values(rec, key)
        if before is None and after is None:
            continue
        before = before if before is not None else after
        after = after if after is not None else before
        tick = rec.label if rec.execution_count is not None else f"[ ] #{i}"
        columns.append(Column(tick, before, after, _whisker(before, after, None if peak is None else peak - before),
                              _kind(before, after), source=rec, reserved=reserved, peak=peak))
    if not columns:
        return None
    marks = [v for c in columns for v in (c.start, c.end, c.whisker, c.reserved) if v is not None]
    floor, top, ticks = column_range(min(marks), max(marks))
    failed = [c.tick for c in columns if getattr(c.source, "error", None)]
    return ColumnsLayout(
        "history", f"recorded cells · {name}", key, name, tuple(columns), floor, top, ticks, byte_unit(max(marks)),
        legend=_legend(columns, any(c.reserved is not None for c in columns), peak_words="peak (exact)"),
        connectors=False, xtitle="cell" + (f" (failed: {', '.join(failed[:6])})" if failed else ""))


# ---------------------------------------------------------------------------------------------
# An estimate's step
# ---------------------------------------------------------------------------------------------


def estimate_columns(cell) -> Optional[ColumnsLayout]:
    """A ``%%gpumem --estimate``'s predicted levels line by line (the steady-state call), scaled to the
    step: before, one column per line, the predicted peak; the GPU's usable memory is drawn when the step
    reaches :data:`~.session.CAPACITY_ON_SCALE` of it and written as a number otherwise. None without lines."""
    est = cell.estimate
    lines = sorted(cell.lines or (), key=lambda ln: ln.lineno)
    if not lines:
        return None
    try:
        device = parse_device(est.device)
    except Exception:  # noqa: BLE001 - an estimate names its device; an odd one is charted as the host's
        device = HOST
    key = SeriesKey(device, "allocated")
    name = f"{est.device} allocated"
    columns, level = [Column("before", est.start_allocated, est.start_allocated, kind="end")], est.start_allocated
    for line in lines:
        start, end = level, level + line.allocated_delta
        source = cell.source_lines[line.lineno - 1] if 0 < line.lineno <= len(cell.source_lines) else ""
        columns.append(Column(f"line {line.lineno}", start, end, _whisker(start, end, line.peak_increase or None),
                              _kind(start, end), first=line.lineno, last=line.lineno, source=(line, source)))
        level = end
    columns.append(Column("peak", est.peak_allocated, est.peak_allocated, kind="end"))
    marks = [v for c in columns for v in (c.start, c.end, c.whisker) if v is not None]
    refs = []
    if device.is_cuda:
        refs.append((est.peak_reserved, words.level_text("peak reserved", est.peak_reserved), "dash"))
        marks.append(est.peak_reserved)
    fit = cell.fit
    capacity = None
    if fit is not None:
        on_scale = max(marks) >= CAPACITY_ON_SCALE * fit.capacity
        capacity = Capacity(fit.capacity, words.fit_text(fit), FAILED_COLOR if not fit.fits else DOWN_COLOR, on_scale)
        if on_scale:
            marks.append(fit.capacity)
    floor, top, ticks = column_range(min(marks), max(marks))
    return ColumnsLayout(
        "estimate", "predicted allocated memory, line by line (second run)", key, name, tuple(columns), floor, top,
        ticks, byte_unit(max(marks)), capacity, tuple(refs),
        legend=_legend(columns, False, peak_words="peak in line", ends="before / predicted peak",
                       grew=("grows", "shrinks")))
