"""Frozen records of what a cell (and each of its lines) did to memory: numbers, names and typed explanations only.

A record never holds the exception, the ``ExecutionResult``, a frame or a tensor: holding an OOM
exception would pin the very tensors being explained. Nor does it hold or make a sentence: why
memory moved is kept as data (:class:`~.why.Why`, :class:`~.why.Rerun`), and the views make the
words from it when they draw (``ipy_gpumem.display.words``). ``to_dict()`` is the stable,
JSON-ready form that ``export`` writes and other tools read: data only, versioned by
:data:`SCHEMA` (docs/api.md has a table per record).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Optional, Tuple

from .devices import Device, device as _device
from .text import first_line as _first_line
from .why import Rerun, Why

__all__ = ["SCHEMA", "HostRecord", "DeviceRecord", "LineRecord", "JoinedLines", "LoopSpan", "RankRecord", "RankFailure",
           "CellRecord", "largest_change", "worst_rank", "ROW_FIELDS", "record_rows", "records_frame", "write_csv"]

#: The version of ``CellRecord.to_dict()``'s keys and of the rows of ``history_frame()`` and the CSV
#: export (their ``"schema"``): raised when a key is renamed, removed or changes its meaning.
SCHEMA = 1


def _delta(after, before):
    return None if after is None or before is None else after - before


def largest_change(devices: Iterable[Tuple[Optional[int], ...]], host_delta: Optional[int],
                   host_rise: Optional[int]) -> int:
    """How much a cell moved memory, in bytes: the one rule every view and the per-cell line use.

    The largest |Δallocated|, |Δreserved| or peak increase over the CUDA devices in use
    (``devices`` gives those three per device); with no CUDA device, host RSS's |Δ| or peak
    increase. 0 when nothing is known.
    """
    values = [v for changes in devices for v in changes]
    if not values:
        values = [host_delta, host_rise]
    return max((abs(int(v)) for v in values if v is not None), default=0)


@dataclass(frozen=True)
class HostRecord:
    """Process RSS around a cell or line, in bytes (None where unknown)."""

    rss_before: Optional[int] = None
    rss_after: Optional[int] = None
    #: Highest RSS during the span: the kernel's high-water mark when it can be reset per
    #: cell (Linux), else the highest value sampled.
    peak_rss: Optional[int] = None
    #: Lines only: the changes summed over every execution of the line, and the largest rise
    #: above the starting value within any single execution.
    rss_delta_sum: Optional[int] = None
    rss_peak_increase_max: Optional[int] = None

    @property
    def rss_delta(self) -> Optional[int]:
        if self.rss_delta_sum is not None:
            return self.rss_delta_sum
        return _delta(self.rss_after, self.rss_before)

    @property
    def rss_peak_increase(self) -> Optional[int]:
        """How far RSS rose above its starting value at the worst moment."""
        if self.rss_peak_increase_max is not None:
            return self.rss_peak_increase_max
        return _delta(self.peak_rss, self.rss_before)

    def to_dict(self) -> dict:
        return {
            "rss_before": self.rss_before,
            "rss_after": self.rss_after,
            "peak_rss": self.peak_rss,
            "rss_delta": self.rss_delta,
            "rss_peak_increase": self.rss_peak_increase,
        }


@dataclass(frozen=True)
class DeviceRecord:
    """One accelerator device around a cell or line, in bytes; torch's words for torch's counters.

    ``allocated`` is memory held by live tensors, ``reserved`` what torch's caching allocator
    holds from the driver (allocated plus "reserved but unallocated"), ``used`` what the whole
    device has in use (this process's CUDA context and other processes included). ``type`` is
    torch's device type (``"cuda"``, also on ROCm; ``"mps"``, ``"xpu"``): on MPS ``reserved`` and
    ``used`` are the Metal driver's allocations for the process and ``total`` its out-of-memory
    limit (``ipy_gpumem.core.backends``).
    """

    index: int
    name: Optional[str] = None
    allocated_before: Optional[int] = None
    allocated_after: Optional[int] = None
    peak_allocated: Optional[int] = None
    reserved_before: Optional[int] = None
    reserved_after: Optional[int] = None
    peak_reserved: Optional[int] = None
    used_before: Optional[int] = None
    used_after: Optional[int] = None
    total: Optional[int] = None
    #: Lines only: the changes summed over every execution of the line, and the largest rise of
    #: allocated memory above its starting value within any single execution.
    allocated_delta_sum: Optional[int] = None
    reserved_delta_sum: Optional[int] = None
    peak_increase_max: Optional[int] = None
    type: str = "cuda"

    @property
    def device(self) -> Device:
        return _device(self.type, self.index)

    @property
    def label(self) -> str:
        return self.device.label

    @property
    def allocated_delta(self) -> Optional[int]:
        if self.allocated_delta_sum is not None:
            return self.allocated_delta_sum
        return _delta(self.allocated_after, self.allocated_before)

    @property
    def reserved_delta(self) -> Optional[int]:
        if self.reserved_delta_sum is not None:
            return self.reserved_delta_sum
        return _delta(self.reserved_after, self.reserved_before)

    @property
    def peak_increase(self) -> Optional[int]:
        """How far allocated memory rose above its starting value at the worst moment."""
        if self.peak_increase_max is not None:
            return self.peak_increase_max
        return _delta(self.peak_allocated, self.allocated_before)

    @property
    def used_delta(self) -> Optional[int]:
        return _delta(self.used_after, self.used_before)

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "device": self.label,
            "name": self.name,
            "allocated_before": self.allocated_before,
            "allocated_after": self.allocated_after,
            "peak_allocated": self.peak_allocated,
            "reserved_before": self.reserved_before,
            "reserved_after": self.reserved_after,
            "peak_reserved": self.peak_reserved,
            "used_before": self.used_before,
            "used_after": self.used_after,
            "total": self.total,
            "allocated_delta": self.allocated_delta,
            "reserved_delta": self.reserved_delta,
            "peak_increase": self.peak_increase,
        }


@dataclass(frozen=True)
class LineRecord:
    """One source line of a ``%%gpumem --lines`` cell, aggregated over all its executions.

    ``*_before`` is the value when the line first started, ``*_after`` when it last finished,
    ``peak_*`` the highest value while it ran, and the deltas are summed over its ``hits``, so a
    loop body line that keeps 10 MiB per iteration shows ``+100.00 MiB`` after ten iterations.
    The peak increase is the worst single execution: how much more the line needed, at its
    highest, than it started with.
    """

    lineno: int
    source: str
    hits: int
    host: HostRecord
    devices: tuple = ()
    duration_s: float = 0.0
    #: The line's change by role, summed over its hits: ``{device: {role: signed bytes}}``
    #: (``ipy_gpumem.core.roles``); None when roles were not measured.
    roles: Optional[dict] = None
    #: What came and went within the line at its worst hit, per device: the peak above the
    #: larger of the line's start and end (temporaries); None when unknown.
    temporaries: Optional[dict] = None
    #: What the line's first hit changed, as data (:class:`~.why.Why`); None when roles were not measured.
    why: Optional[Why] = None
    #: The latest hit's change, for a line run more than once (the first and the steady one may differ).
    why_last: Optional[Why] = None
    #: Hits whose roles were counted together with other lines (the count between them was skipped
    #: to keep its cost under its share of the cell): their change is in the record's ``joined``.
    joined: int = 0

    def device(self, index: int) -> Optional[DeviceRecord]:
        for dev in self.devices:
            if dev.index == index:
                return dev
        return None

    def to_dict(self) -> dict:
        return {
            "lineno": self.lineno,
            "source": self.source,
            "hits": self.hits,
            "duration_s": self.duration_s,
            "host": self.host.to_dict(),
            "devices": [d.to_dict() for d in self.devices],
            "roles": self.roles,
            "temporaries": self.temporaries,
            "why": None if self.why is None else self.why.to_dict(),
            "why_last": None if self.why_last is None else self.why_last.to_dict(),
            "joined": self.joined,
        }


class JoinedLines(NamedTuple):
    """Lines of a ``--lines`` cell whose roles were counted together (the count at the boundaries
    between them was skipped): their change by role over ``hits`` such runs, and what it was made
    of at the first and the latest of them."""

    lines: tuple
    hits: int
    roles: Optional[dict] = None
    why: Optional[Why] = None
    why_last: Optional[Why] = None

    def to_dict(self) -> dict:
        return {"lines": list(self.lines), "hits": self.hits, "roles": self.roles,
                "why": None if self.why is None else self.why.to_dict(),
                "why_last": None if self.why_last is None else self.why_last.to_dict()}


class LoopSpan(NamedTuple):
    """A loop of a ``--lines`` cell: its header line, its last line, ``"for"`` or ``"while"``.

    The lines of a loop sum their changes over every iteration; what the loop as a whole kept is
    the sum over all of its lines, and the rest was allocated and released within the loop.
    """

    first: int
    last: int
    kind: str = "for"


@dataclass(frozen=True)
class RankRecord:
    """One process a cell launched (a rank of a distributed launch), with the cell's own fields.

    ``host`` and ``devices`` mean what they mean on the cell: ``rss_before`` is the process's RSS
    when it started (a forked rank: right after the fork; a rank seen from outside: its first
    reading), ``peak_rss`` its high-water mark (``VmHWM``: exact when recorded inside, the highest
    of the readings taken from outside otherwise). ``devices`` is None when they cannot be seen.
    """

    rank: Optional[int]
    pid: int
    host: HostRecord = field(default_factory=HostRecord)
    #: ``DeviceRecord``s: torch's counters when recorded inside; from outside, NVML's per-process
    #: use as ``used_before``/``used_after`` (the first and last readings). None: not visible.
    devices: Optional[tuple] = None
    local_rank: Optional[int] = None
    world_size: Optional[int] = None
    #: ``"inside"``: recorded by the process itself (a fork of the kernel, where ipy_gpumem is
    #: loaded: its start, and its end unless it was killed); ``"outside"``: read from the kernel
    #: (/proc, NVML) while the cell ran (a spawned process, ``!torchrun``'s workers).
    seen: str = "outside"
    #: Where ``rank`` comes from: ``"torch.distributed"``, ``"env"`` (RANK), ``"launcher"`` (the
    #: process index torch.multiprocessing passed to the function), ``"start order"``.
    rank_from: Optional[str] = None
    #: ``"exited"`` (its end was recorded), ``"running"`` (alive when the cell ended), ``"gone"``
    #: (it ended unrecorded: killed, terminated, or only ever seen from outside).
    end: str = "exited"
    #: How the launcher said it ended, when it did (the failing rank): exit code, signal name.
    exit_code: Optional[int] = None
    signal: Optional[str] = None
    #: Why ``devices`` is empty when recorded inside ("this torch build has no CUDA ...").
    devices_note: Optional[str] = None
    #: Readings taken from outside (0 when only the process's own record is known).
    readings: int = 0

    @property
    def rise(self) -> Optional[int]:
        """How far the rank rose above its start at its worst: the largest device peak increase,
        else its RSS peak increase (what names the worst rank)."""
        peaks = [d.peak_increase for d in self.devices or () if d.peak_increase is not None]
        if peaks:
            return max(peaks)
        return self.host.rss_peak_increase

    @property
    def label(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else f"pid {self.pid}"

    def to_dict(self) -> dict:
        return {
            "rank": self.rank, "pid": self.pid, "local_rank": self.local_rank, "world_size": self.world_size,
            "seen": self.seen, "rank_from": self.rank_from, "end": self.end, "exit_code": self.exit_code,
            "signal": self.signal, "readings": self.readings,
            "host": self.host.to_dict(),
            "devices": None if self.devices is None else [d.to_dict() for d in self.devices],
            "devices_note": self.devices_note,
        }


def worst_rank(ranks) -> Optional[RankRecord]:
    """The rank that rose most above its start (:attr:`RankRecord.rise`); None without ranks."""
    known = [r for r in ranks or () if r.rise is not None]
    return max(known, key=lambda r: r.rise) if known else None


class RankFailure(NamedTuple):
    """A launched process that failed, as the launcher's exception told the cell.

    ``launcher`` is ``"torch.multiprocessing"`` or ``"torch.distributed.elastic"``; ``exception``
    the launcher's exception class (``ProcessRaisedException``, ``ProcessExitedException``,
    ``ChildFailedError``); ``error`` the child's own error class when its traceback came back, and
    ``message`` the end of that traceback (the child's message, for the out-of-memory parser).
    """

    rank: Optional[int]
    pid: Optional[int]
    launcher: str
    exception: str
    error: Optional[str] = None
    message: Optional[str] = None
    exit_code: Optional[int] = None
    signal: Optional[str] = None

    def to_dict(self) -> dict:
        return self._asdict()


@dataclass(frozen=True)
class CellRecord:
    """What one cell did to memory: host RSS and each initialized CUDA device, before/after/peak."""

    execution_count: Optional[int]
    cell_id: Optional[str]
    source: str
    started_at: float  # seconds since the epoch
    duration_s: float
    #: Class name of the error the cell raised (also when ``%%time`` swallowed it), else None.
    error: Optional[str] = None
    #: The error's message (first 2000 characters), kept as text so OOM messages can be parsed.
    error_message: Optional[str] = None
    host: HostRecord = field(default_factory=HostRecord)
    devices: tuple = ()
    #: Why ``devices`` is empty: "torch is not imported", "CUDA not initialized yet", ...
    devices_note: Optional[str] = None
    #: Per-line records, for ``%%gpumem --lines`` cells; None otherwise.
    lines: Optional[tuple] = None
    #: The loops of a ``--lines`` cell (``LoopSpan``s, numbered like ``lines``).
    loops: tuple = ()
    #: Lines of a ``--lines`` cell counted together (``JoinedLines``), numbered like ``lines``.
    joined: tuple = ()
    #: True when ``%%gpumem`` measured this cell (it then shows its own report).
    detailed: bool = False
    #: Whether the peaks are per cell (peak counters reset before it) or only sampled.
    peaks: str = "sampled"
    #: The cell's change by role (``{device: {role: signed bytes}}``), when it was measured.
    roles: Optional[dict] = None
    #: What the cell's change is made of, as data (:class:`~.why.Why`): the census's change by
    #: owner, the owners' classes, temporaries, the GPU-only roles; None when it was not analysed.
    why: Optional[Why] = None
    #: Training phases recognised in the cell (``%%gpumem``): dicts with ``phase``, ``step``,
    #: ``roles``, ``peak`` (see ``ipy_gpumem.anatomy.phases``); None when none were watched.
    phases: Optional[tuple] = None
    #: Per phase kind, exact at any length (``phases`` keeps the first few hundred): ``{kind: {count,
    #: peak, first, steady}}`` (``PhaseWatcher.summary()``); None when none were watched.
    phase_summary: Optional[dict] = None
    #: The submodules whose activations weigh most in the cell's first forward:
    #: ``((qualified name, bytes), ...)``, heaviest first; None when no forward was watched.
    layers: Optional[tuple] = None
    #: For a re-run of an earlier cell, who keeps the earlier run's memory and the fix, as data
    #: (:class:`~.why.Rerun`); None for a first run (see ``ipy_gpumem.reruns.tracker``).
    rerun: Optional[Rerun] = None
    #: The processes the cell launched (``RankRecord``s, by rank); None for a cell that launched none.
    ranks: Optional[tuple] = None
    #: The launched process whose failure reached the cell through its launcher (``RankFailure``).
    rank_failure: Optional[RankFailure] = None

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def moved_bytes(self) -> int:
        """The largest change the cell made (see :func:`largest_change`)."""
        return largest_change(((d.allocated_delta, d.reserved_delta, d.peak_increase) for d in self.devices),
                              self.host.rss_delta, self.host.rss_peak_increase)

    @property
    def label(self) -> str:
        return f"[{self.execution_count}]" if self.execution_count is not None else "[ ]"

    def device(self, index: int) -> Optional[DeviceRecord]:
        for dev in self.devices:
            if dev.index == index:
                return dev
        return None

    @property
    def first_line(self) -> str:
        return _first_line(self.source)

    def to_dict(self) -> dict:
        """The record as JSON-ready data (numbers, names, the cell's source and error), keyed as
        docs/api.md's tables say; ``"schema"`` is :data:`SCHEMA`."""
        out = {
            "schema": SCHEMA,
            "execution_count": self.execution_count,
            "cell_id": self.cell_id,
            "source": self.source,
            "started_at": self.started_at,
            "duration_s": self.duration_s,
            "error": self.error,
            "error_message": self.error_message,
            "devices_note": self.devices_note,
            "peaks": self.peaks,
            "host": self.host.to_dict(),
            "devices": [d.to_dict() for d in self.devices],
            "roles": self.roles,
            "why": None if self.why is None else self.why.to_dict(),
            "phases": None if self.phases is None else [dict(p) for p in self.phases],
            "phase_summary": self.phase_summary,
            "layers": None if self.layers is None else [{"module": m, "activations": b} for m, b in self.layers],
            "rerun": _rerun_dict(self.rerun),
            "ranks": None if self.ranks is None else [r.to_dict() for r in self.ranks],
            "rank_failure": None if self.rank_failure is None else self.rank_failure.to_dict(),
        }
        if self.lines is not None:
            out["lines"] = [line.to_dict() for line in self.lines]
            out["loops"] = [loop._asdict() for loop in self.loops]
            out["joined"] = [span.to_dict() for span in self.joined]
        return out


def _rerun_dict(rerun: Optional[Rerun]) -> Optional[dict]:
    """The documented ``rerun`` keys: the counts, the suspects' names and each suspect as data (``holders``)."""
    if rerun is None:
        return None
    return {"of": rerun.of, "runs": rerun.runs, "previous": rerun.previous, "growth": rerun.growth,
            "suspects": rerun.names, "holders": [s.to_dict() for s in rerun.suspects]}


#: The flat form of a record, shared by ``history_frame()`` (pandas) and ``%gpumem export x.csv``:
#: one row per cell and device, a ``host`` row for every cell. ``before``/``after``/``peak``/
#: ``delta``/``peak_increase`` are allocated bytes on a CUDA row and RSS on the host row, so one
#: column can be plotted across both; the other columns keep their ``to_dict()`` names (``schema``
#: on every row, so a CSV file says its version). A cell that launched processes adds the same rows
#: for each of them, with its ``rank`` and ``pid`` (the kernel's own rows have both empty).
ROW_FIELDS = (
    "schema", "execution_count", "cell_id", "first_line", "started_at", "duration_s", "error", "device", "name",
    "before", "after", "peak", "delta", "peak_increase",
    "reserved_before", "reserved_after", "peak_reserved", "reserved_delta", "used_before", "used_after", "total",
    "rss_before", "rss_after", "peak_rss", "rss_delta", "source", "rank", "pid",
)
_BYTE_FIELDS = tuple(f for f in ROW_FIELDS if f.startswith(("before", "after", "peak", "delta", "reserved", "used",
                                                               "total", "rss")))


def record_rows(records):
    """The records as flat dicts with the keys of :data:`ROW_FIELDS`, oldest first."""
    for rec in records:
        yield from _rows(rec, rec.host, rec.devices)
        for rank in rec.ranks or ():
            yield from _rows(rec, rank.host, rank.devices or (), rank=rank.rank, pid=rank.pid)


def _rows(rec, host, devices, **who):
    base = {
        "schema": SCHEMA, "execution_count": rec.execution_count, "cell_id": rec.cell_id, "first_line": rec.first_line,
        "started_at": rec.started_at, "duration_s": rec.duration_s, "error": rec.error,
        "rss_before": host.rss_before, "rss_after": host.rss_after, "peak_rss": host.peak_rss,
        "rss_delta": host.rss_delta, "source": rec.source, **who,
    }
    empty = dict.fromkeys(ROW_FIELDS)
    yield {**empty, **base, "device": "host", "before": host.rss_before, "after": host.rss_after,
           "peak": host.peak_rss, "delta": host.rss_delta, "peak_increase": host.rss_peak_increase}
    for dev in devices:
        yield {**empty, **base, "device": dev.label, "name": dev.name,
               "before": dev.allocated_before, "after": dev.allocated_after, "peak": dev.peak_allocated,
               "delta": dev.allocated_delta, "peak_increase": dev.peak_increase,
               "reserved_before": dev.reserved_before, "reserved_after": dev.reserved_after,
               "peak_reserved": dev.peak_reserved, "reserved_delta": dev.reserved_delta,
               "used_before": dev.used_before, "used_after": dev.used_after, "total": dev.total}


def records_frame(records):
    """A pandas DataFrame of :func:`record_rows` (one row per cell and device; ``host`` rows for RSS).

    Raises:
        ImportError: pandas is not installed (``pip install pandas``).
    """
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover - exercised only without pandas
        raise ImportError("history_frame() needs pandas: pip install pandas") from None
    frame = pd.DataFrame(list(record_rows(records)), columns=list(ROW_FIELDS))
    frame["started_at"] = pd.to_datetime(frame["started_at"], unit="s")
    for col in _BYTE_FIELDS + ("schema", "rank", "pid"):
        frame[col] = frame[col].astype("Int64")  # nullable: None stays missing, bytes stay exact
    return frame


def write_csv(path: str, records) -> None:
    """Write :func:`record_rows` as CSV (the same columns as ``history_frame()``)."""
    import csv

    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(ROW_FIELDS))
        writer.writeheader()
        writer.writerows(record_rows(records))
