"""Replay one device's events against its segments: torch's allocated and reserved counters at every event, exactly.

A snapshot holds the allocator's state when it was taken (segments and their blocks) and a ring
buffer of the events before that (``alloc``, ``free_requested``, ``free_completed``, segment
events, ``oom``). Events carry the *requested* size, but torch's counters count *blocks*
(``allocated_bytes`` adds ``block->size``), so each allocation's block is worked out the way
``CUDACachingAllocator.cpp`` makes it:

- the request is rounded (``round_size``: 512-byte steps, or ``roundup_power2_divisions``);
- a block is always cut from the start of a free range, and free ranges are merged, so the free
  range an allocation takes runs to the next block still in place (or the segment's end);
- in the large pool of a plain segment the rest is split off only when it is over 1 MiB
  (``should_split``); otherwise the block keeps it. Small pools and expandable segments split
  anything from 512 bytes, so their blocks are the rounded request.

The state before the first event comes from walking the events backward from the snapshot's
state. Walking forward from it again must land on the snapshot's state: :class:`Check` says how
many blocks came out at exactly their real size, which tests every inferred size the capture
can verify.
"""
from __future__ import annotations

import bisect
from array import array
from itertools import compress, islice
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from ..preflight.allocator import LARGE_BUFFER, MIN_BLOCK, SMALL_BUFFER, SMALL_SIZE, round_size as _round_512
from .schema import ALLOCATED, PENDING, Segment
from .trace import NO_TIME, Trace

__all__ = ["Allocation", "Allocations", "Steps", "Fragmentation", "OomState", "Check", "DeviceReplay", "replay_device",
           "rounder", "top_of", "FRAGMENTATION_SAMPLES", "NEVER"]

#: Fragmentation is measured at this many evenly spaced events (and at an OOM and at the end).
FRAGMENTATION_SAMPLES = 96


#: ``Allocations.freed``/``gone`` of a block not freed in the window (above any event index, so that
#: "freed after event i" is one comparison).
NEVER = (1 << 31) - 1


class Allocation:
    """One block's life: born at event ``born`` (-1: before recording began), freed at ``freed``."""

    __slots__ = ("addr", "size", "requested", "born", "freed", "gone", "frames", "allocated", "row")

    def __init__(self, addr: int, size: int, requested: int, born: int, frames, allocated: bool = True):
        self.addr, self.size, self.requested, self.born, self.frames = addr, size, requested, born, frames
        self.freed: Optional[int] = None  # free_requested: leaves ``allocated`` here
        self.gone: Optional[int] = None  # free_completed: its place is free from here
        self.allocated = allocated
        self.row: Optional[int] = None  # its row in :class:`Allocations` (None: in place when recording began)

    def live_at(self, index: int) -> bool:
        """Whether the block counted as allocated just after event ``index``."""
        return self.born <= index and (self.freed is None or self.freed > index)

    def __repr__(self) -> str:
        return f"Allocation(addr={self.addr:#x}, size={self.size}, born={self.born}, freed={self.freed})"


class Allocations(Sequence):
    """Every block of a replay, oldest first, as columns: ``allocations[k]`` builds one :class:`Allocation`.

    The blocks in place when recording began are kept as objects (there are as many as blocks in
    the snapshot's segments); each block allocated by an event costs a row of 21 bytes (``born``,
    ``size``, ``freed`` and ``gone`` as event indices, :data:`NEVER` when not in the window,
    ``held``: still allocated at the end), its address, request and frames read from the event
    that made it. Rows are in the order of ``born``.
    """

    def __init__(self, trace: Trace, before: Sequence[Allocation], born: array, size: array, freed: array,
                 gone: array, held: array):
        self.trace = trace
        self.before: List[Allocation] = list(before)
        self.born, self.size, self.freed, self.gone, self.held = born, size, freed, gone, held

    def __len__(self) -> int:
        return len(self.before) + len(self.born)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if k < 0:
            k += len(self)
        if k < len(self.before):
            return self.before[k]
        row = k - len(self.before)
        born = self.born[row]  # raises IndexError past the end
        _action, addr, req, _t = self.trace.row(born)
        block = Allocation(_as_int(addr), self.size[row], _as_int(req), born, self.trace.frames_at(born),
                           bool(self.held[row]))
        block.freed = None if self.freed[row] == NEVER else self.freed[row]
        block.gone = None if self.gone[row] == NEVER else self.gone[row]
        block.row = row
        return block

    def __iter__(self) -> Iterator[Allocation]:
        yield from self.before
        for k in range(len(self.before), len(self)):
            yield self[k]

    def live_at(self, index: int) -> List[Allocation]:
        out = [a for a in self.before if a.live_at(index)]
        offset = len(self.before)
        out.extend(self[offset + row] for row in self._live_rows(index))
        return out

    def _live_rows(self, index: int) -> Iterator[int]:
        born = bisect.bisect_right(self.born, index)  # rows born up to ``index``
        return compress(range(born), map(index.__lt__, self.freed[:born]))

    def live_stacks(self, index: int) -> Iterator[Tuple[Any, int, bool]]:
        """``(frames, size, born before recording)`` of each block allocated just after event ``index``
        (what :meth:`live_at` gives, without making an :class:`Allocation` of each row)."""
        for a in self.before:
            if a.live_at(index):
                yield a.frames, a.size, True
        born, size, frames_at = self.born, self.size, self.trace.frames_at
        for row in self._live_rows(index):
            yield frames_at(born[row]), size[row], False


class Steps(Sequence):
    """A series that changes at few events (reserved bytes: segment events), kept as its changes.

    ``steps[i]`` is the value after event ``i``; ``max_index(lo, hi)`` is the highest value over
    ``[lo, hi)`` and the first event where it is reached, without making the series."""

    def __init__(self, start: int, at: array, values: array, n: int):
        self.start, self.at, self.values, self.n = start, at, values, n

    def __len__(self) -> int:
        return self.n

    def value(self, i: int) -> int:
        k = bisect.bisect_right(self.at, i) - 1
        return self.values[k] if k >= 0 else self.start

    def __getitem__(self, i):
        if isinstance(i, slice):
            lo, hi, step = i.indices(self.n)
            if step != 1:
                return array("q", (self.value(k) for k in range(lo, hi, step)))
            out = array("q")
            k = bisect.bisect_right(self.at, lo)  # the first change after ``lo``
            at = lo
            current = self.value(lo) if lo < hi else 0
            while at < hi:
                end = self.at[k] if k < len(self.at) and self.at[k] < hi else hi
                out.extend(array("q", [current]) * (end - at))
                if end < hi:
                    current = self.values[k]
                    k += 1
                at = end
            return out
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError("series index out of range")
        return self.value(i)

    def __iter__(self) -> Iterator[int]:
        return iter(self[0:self.n])

    def max_index(self, lo: int = 0, hi: Optional[int] = None) -> Tuple[int, int]:
        hi = self.n if hi is None else min(hi, self.n)
        top, where = self.value(lo), lo
        for k in range(bisect.bisect_right(self.at, lo), bisect.bisect_left(self.at, hi)):
            if self.values[k] > top:
                top, where = self.values[k], self.at[k]
        return top, where


def top_of(series: Sequence[int], lo: int = 0, hi: Optional[int] = None) -> Tuple[int, int]:
    """``(highest value, first index reaching it)`` of ``series[lo:hi]`` (non-empty), without copying a :class:`Steps`."""
    hi = len(series) if hi is None else hi
    if isinstance(series, Steps):
        return series.max_index(lo, hi)
    values = series if lo == 0 and hi == len(series) else series[lo:hi]  # the whole series is not copied
    top = max(values)
    return top, lo + values.index(top)


class Times(Sequence):
    """Seconds from the first event after each event, computed from the trace's time column (nothing copied;
    ``first_us`` is the first event's value in that column)."""

    def __init__(self, column: Optional[array], first_us: int = 0, n: int = 0):
        self.column, self.first_us = column, first_us
        self.n = len(column) if column is not None else n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            if self.column is None:
                return [float(k) for k in range(*i.indices(self.n))]
            first = self.first_us
            return [(t - first) / 1e6 for t in self.column[i]]
        if self.column is None:
            if i < 0:
                i += self.n
            if not 0 <= i < self.n:
                raise IndexError("times index out of range")
            return float(i)
        return (self.column[i] - self.first_us) / 1e6


class Fragmentation(NamedTuple):
    """Free space inside reserved segments after event ``index``: in all, and its largest piece."""

    index: int
    free: int  # reserved minus every block in place (allocated or waiting to be freed)
    largest: Optional[int]  # the largest free range of a plain segment; None when all are expandable


class OomState(NamedTuple):
    """The allocator at an ``oom`` event, from the event and the replay."""

    index: int
    requested: int  # the rounded request (``params.size()``)
    device_free: Optional[int]
    allocated: int
    reserved: int
    frames: tuple
    fragmentation: Fragmentation


class Check(NamedTuple):
    """The replay measured against the snapshot's own state at its end."""

    blocks: int  # blocks in place at the end whose allocation was replayed (their size was inferred)
    exact: int  # of those, how many came out at exactly their real size
    allocated_real: int  # sum of the snapshot's allocated blocks
    allocated_replayed: int
    reserved_real: int
    reserved_replayed: int
    anomalies: int  # events that did not fit the state (a free of an unknown block, ...)

    @property
    def ok(self) -> bool:
        return (self.exact == self.blocks and self.allocated_real == self.allocated_replayed
                and self.reserved_real == self.reserved_replayed)


class DeviceReplay(NamedTuple):
    """One device's counters over the recorded window."""

    device: int
    times: Sequence[float]  # seconds from the first event (event numbers when the capture has no times)
    allocated: array  # torch's allocated_bytes after each event
    reserved: Sequence[int]  # torch's reserved_bytes after each event (a :class:`Steps`: it moves at segment events)
    timed: bool
    start_us: Optional[int]
    initial_allocated: int
    initial_reserved: int
    initial_blocks: int
    allocations: Allocations
    fragmentation: Tuple[Fragmentation, ...]
    ooms: Tuple[OomState, ...]
    check: Check
    expandable: bool
    allocated_top: Optional[Tuple[int, int]] = None  # (highest allocated, first event there), from the replay itself

    @property
    def events(self) -> int:
        return len(self.allocated)

    def peak(self, series: str = "allocated") -> Tuple[int, int]:
        """``(bytes, event index)`` of the highest point of ``series`` (the first such event); (start, -1) without events."""
        values = self.allocated if series == "allocated" else self.reserved
        start = self.initial_allocated if series == "allocated" else self.initial_reserved
        if not len(values):
            return start, -1
        top, at = self.allocated_top if series == "allocated" and self.allocated_top else top_of(values)
        if top <= start:
            return start, -1
        return top, at

    def live_at(self, index: int) -> List[Allocation]:
        """The blocks allocated just after event ``index`` (-1: before the first event)."""
        return self.allocations.live_at(index)


def rounder(settings: Mapping[str, Any]):
    """torch's ``round_size`` under the recorded ``roundup_power2_divisions`` (512-byte steps when unset)."""
    raw = settings.get("roundup_power2_divisions") if isinstance(settings, Mapping) else None
    divisions: List[int] = []
    if isinstance(raw, Mapping):
        try:
            divisions = [int(v) for _, v in sorted(((int(k), v) for k, v in raw.items()), key=lambda kv: kv[0])]
        except (TypeError, ValueError):
            divisions = []
    elif isinstance(raw, (list, tuple)):
        divisions = [int(v) for v in raw]
    if not any(d > 1 for d in divisions):
        return _round_512

    def round_size(size: int) -> int:
        if size < MIN_BLOCK:
            return MIN_BLOCK
        # Intervals start at 1 MiB (2**20); one per power of two up to 64 GiB.
        index = min(max(size.bit_length() - 1 - 20, 0), len(divisions) - 1)
        div = divisions[index]
        if div > 1 and size > MIN_BLOCK * div:
            if size & (size - 1) == 0:
                return size
            floor = 1 << (size.bit_length() - 1)
            step = floor >> (div.bit_length() - 1)
            if step == 0:
                return floor << 1
            low = size & ~(step - 1)
            return size if low == size else low + step
        return _round_512(size)

    return round_size


class _Layout:
    """The plain (non-expandable) segments of one device and the start of every block in place in each."""

    def __init__(self):
        self.starts: List[int] = []  # segment starts, sorted
        self.info: Dict[int, Tuple[int, bool]] = {}  # start -> (end, small)
        self.blocks: Dict[int, List[int]] = {}  # segment start -> sorted starts of blocks in place
        self.largest: Dict[int, int] = {}  # segment start -> its largest free range, when last measured
        self.dirty: set = set()  # segments changed since (a fragmentation sample measures only those)

    def add(self, addr: int, size: int, small: bool) -> None:
        if addr in self.info:
            return
        bisect.insort(self.starts, addr)
        self.info[addr] = (addr + size, small)
        self.blocks[addr] = []
        self.dirty.add(addr)

    def remove(self, addr: int) -> None:
        if self.info.pop(addr, None) is None:
            return
        i = bisect.bisect_left(self.starts, addr)
        del self.starts[i]
        self.blocks.pop(addr, None)
        self.largest.pop(addr, None)
        self.dirty.discard(addr)

    def find(self, addr: int) -> Optional[int]:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i >= 0:
            start = self.starts[i]
            if addr < self.info[start][0]:
                return start
        return None


def _block_size(layout: _Layout, seg: Optional[int], addr: int, rounded: int, max_split: Optional[int]) -> int:
    """The block torch hands out for a rounded request at ``addr`` (see the module docstring)."""
    if seg is None:
        return rounded
    end, small = layout.info[seg]
    if small:
        return rounded
    starts = layout.blocks[seg]
    i = bisect.bisect_right(starts, addr)
    boundary = starts[i] if i < len(starts) else end
    rest = boundary - addr - rounded
    if rest <= 0:
        return rounded
    if max_split is not None and rounded >= max_split:
        return rounded + rest if rest < LARGE_BUFFER else rounded  # oversize blocks are never split
    return rounded + rest if rest <= SMALL_SIZE else rounded


def _max_split(settings: Mapping[str, Any]) -> Optional[int]:
    value = settings.get("max_split_size") if isinstance(settings, Mapping) else None
    try:
        value = int(value)
    except (TypeError, ValueError):
        return None
    return value if 0 < value < (1 << 62) else None


def _as_int(value: Any) -> int:
    """An event's number as the replay counts it (a file's odd event may hold anything: 0 then)."""
    if type(value) is int:
        return value
    if type(value) is float and value == value and abs(value) < 2 ** 63:
        return int(value)
    return 0


def _columns(trace: Trace):
    """The trace's action codes, addresses and sizes as arrays (patched copies where events were kept whole)."""
    names = list(trace.actions)
    acts, addrs, sizes = trace.act, trace.addr, trace.size
    if trace.odd:
        acts, addrs, sizes = array("B", acts), array("q", addrs), array("q", sizes)
        for i in trace.odd:
            action, addr, size, _t = trace.row(i)
            try:
                code = names.index(action)
            except ValueError:
                code = len(names) if len(names) < 255 else 255
                if code < 255:
                    names.append(action)
            acts[i] = code
            addr, size = _as_int(addr), _as_int(size)
            addrs[i] = addr if -(1 << 63) <= addr < (1 << 63) else 0
            sizes[i] = size if -(1 << 63) <= size < (1 << 63) else 0
    return names, acts, addrs, sizes


def replay_device(device: int, segments: Sequence[Segment], trace: Union[Trace, Sequence[Mapping[str, Any]]],
                  settings: Mapping[str, Any]) -> DeviceReplay:
    """Replay ``trace`` (one device's events, oldest first) against ``segments`` (that device's state at the end)."""
    if not isinstance(trace, Trace):
        trace = Trace.from_events(trace)
    round_size = rounder(settings)
    max_split = _max_split(settings)
    expandable = any(s.expandable for s in segments) or bool(settings.get("expandable_segments"))
    if not expandable:
        expandable = any(row[0] in ("segment_map", "segment_unmap") for row in islice(trace.rows(), 2000))
    names, acts, addrs, sizes = _columns(trace)
    code = {name: k for k, name in enumerate(names) if isinstance(name, str)}
    A, FR, FC = code.get("alloc", -1), code.get("free_requested", -1), code.get("free_completed", -1)
    SA, SF, SM, SU, OOM = (code.get(k, -1) for k in ("segment_alloc", "segment_free", "segment_map",
                                                      "segment_unmap", "oom"))

    # The end: blocks in place and plain segments.
    final: Dict[int, Tuple[int, int, bool, Any]] = {}
    plain_end: Dict[int, Tuple[int, bool]] = {}
    reserved_end = 0
    for seg in segments:
        reserved_end += seg.size
        if not seg.expandable:
            plain_end[seg.addr] = (seg.size, seg.small)
        for b in seg.blocks:
            if b.state in (ALLOCATED, PENDING) and b.size > 0:
                final[b.addr] = (b.size, b.requested, b.state == ALLOCATED, b.frames)

    start, plain, reserved, anomalies = _walk_back(acts, addrs, sizes, (A, FR, FC, SA, SF, SM, SU), final,
                                                   plain_end, reserved_end)

    layout = _Layout()
    for addr, (size, small) in plain.items():
        layout.add(addr, size, small)
    for addr in sorted(start):
        seg = layout.find(addr)
        if seg is not None:
            layout.blocks[seg].append(addr)
    live: Dict[int, int] = {}  # address -> its row (>= 0), or ~k for before[k]
    before: List[Allocation] = []
    allocated = 0
    active = 0
    for addr in sorted(start):
        size, req, alloc, frames, known = start[addr]
        if not known:
            size = _block_size(layout, layout.find(addr), addr, round_size(req), max_split) if req > 0 else 0
        live[addr] = ~len(before)
        before.append(Allocation(addr, size, req, -1, frames, alloc))
        active += size
        if alloc:
            allocated += size
    initial_allocated, initial_reserved, initial_blocks = allocated, reserved, len(live)
    final_size = {addr: size for addr, (size, _req, _alloc, _frames) in final.items()}  # what the check needs
    allocated_real = sum(s for s, _r, a, _f in final.values() if a)
    del start, plain, final  # a long capture's blocks: kept once, as rows and ``before``, from here on

    # Walk forward, event by event; each allocation is a row of arrays, not an object.
    n = len(acts)
    rows = acts.count(A) if A >= 0 else 0
    # Unsigned arrays and a bytearray: storing into a signed array parses the int as a function argument would,
    # several times the cost of an unsigned store (event indices, sizes and allocated bytes are never negative).
    born, bsize = array("I", [0]) * rows, array("Q" if _big_blocks(final_size, sizes) else "I", [0]) * rows
    freed, gone, held = array("I", [NEVER]) * rows, array("I", [NEVER]) * rows, bytearray(b"\x01") * rows
    series = array("Q", [0]) * n
    res_at, res_values = array("i"), array("q")
    frag: List[Fragmentation] = []
    ooms: List[OomState] = []
    info, blocks, dirty, seg_of = layout.info, layout.blocks, layout.dirty, {}
    rounded: Dict[int, int] = {}
    missing = object()
    row = 0
    top, top_at = -1, -1  # the highest allocated after an allocation: between two, allocated only goes down
    every = max(1, n // FRAGMENTATION_SAMPLES)
    samples = list(range(0, n, every))
    if n and samples[-1] != n - 1:
        samples.append(n - 1)
    lo = 0
    bisect_left, bisect_right, insort = bisect.bisect_left, bisect.bisect_right, bisect.insort  # locals: per event
    live_get, live_pop, seg_get, size_get, dirty_add = live.get, live.pop, seg_of.get, rounded.get, dirty.add
    for sample in samples:  # events up to each sample, then the sample (no test per event)
        hi = sample + 1
        for i, c, addr, size in zip(range(lo, hi), acts[lo:hi], addrs[lo:hi], sizes[lo:hi]):
            if c == A:
                seg = seg_get(addr, missing)
                if seg is missing:
                    if len(seg_of) > 65536:  # addresses seen: a long capture has millions
                        seg_of.clear()
                    seg = seg_of[addr] = layout.find(addr)
                j = -1  # where the block goes in its segment's list, when known
                if size <= 0:
                    block = 0
                else:
                    block = size_get(size)
                    if block is None:
                        if len(rounded) > 65536:
                            rounded.clear()
                        block = rounded[size] = round_size(size)
                    if seg is not None:
                        end, small = info[seg]
                        if not small:
                            starts = blocks[seg]
                            j = bisect_right(starts, addr)
                            rest = (starts[j] if j < len(starts) else end) - addr - block
                            if rest > 0:
                                if max_split is not None and block >= max_split:
                                    block += rest if rest < LARGE_BUFFER else 0  # oversize blocks are never split
                                elif rest <= SMALL_SIZE:
                                    block += rest
                old = live_get(addr)
                if old is not None:  # a block we thought still in place: its free fell outside the window
                    anomalies += 1
                    gone_size, was = _gone(old, i, before, bsize, gone, held)
                    _unplace(layout, seg_of, addr)
                    j = -1  # the list changed
                    if was:
                        allocated -= gone_size
                    active -= gone_size
                born[row] = i
                bsize[row] = block
                live[addr] = row
                row += 1
                if seg is not None:
                    if j >= 0:
                        starts.insert(j, addr)
                    else:
                        insort(blocks[seg], addr)
                    dirty_add(seg)
                allocated += block
                active += block
                if allocated > top:
                    top, top_at = allocated, i
            elif c == FR:
                k = live_get(addr)
                if k is None:
                    anomalies += 1
                elif k >= 0:
                    if held[k]:
                        held[k] = 0
                        freed[k] = i
                        allocated -= bsize[k]
                else:
                    b = before[~k]
                    if b.allocated:
                        b.allocated = False
                        b.freed = i
                        allocated -= b.size
            elif c == FC:
                k = live_pop(addr, None)
                if k is None:
                    anomalies += 1
                else:
                    if k >= 0:
                        if held[k]:
                            held[k] = 0
                            freed[k] = i
                            allocated -= bsize[k]
                        gone[k] = i
                        active -= bsize[k]
                    else:
                        b = before[~k]
                        if b.allocated:
                            b.allocated = False
                            b.freed = i
                            allocated -= b.size
                        b.gone = i
                        active -= b.size
                    seg = seg_get(addr, missing)
                    if seg is missing:
                        seg = layout.find(addr)  # a freed address: not remembered (allocations look it up first)
                    if seg is not None:
                        starts = blocks[seg]
                        j = bisect_left(starts, addr)
                        if j < len(starts) and starts[j] == addr:
                            del starts[j]
                        dirty_add(seg)
            elif c == SA or c == SF or c == SM or c == SU:
                if c == SA:
                    reserved += size
                    if not expandable:
                        layout.add(addr, size, size == SMALL_BUFFER)
                        seg_of.clear()
                elif c == SF:
                    reserved -= size
                    layout.remove(addr)
                    seg_of.clear()
                else:
                    reserved += size if c == SM else -size
                res_at.append(i)
                res_values.append(reserved)
            elif c == OOM:
                e = trace[i]
                here = Fragmentation(i, reserved - active, _largest_free(layout, live, before, bsize))
                free = e.get("device_free", e.get("addr"))
                stack = e.get("frames")
                ooms.append(OomState(i, _as_int(e.get("size", 0)), None if free is None else _as_int(free), allocated,
                                     reserved, tuple(stack) if isinstance(stack, (list, tuple)) else (), here))
            series[i] = allocated
        frag.append(Fragmentation(sample, reserved - active, _largest_free(layout, live, before, bsize)))
        lo = hi

    check_blocks = exact = 0
    for addr, size in final_size.items():
        k = live.get(addr)
        if k is not None and k >= 0:
            check_blocks += 1
            exact += bsize[k] == size
    check = Check(check_blocks, exact, allocated_real, allocated, reserved_end, reserved, anomalies)
    # The time column holds offsets from ``trace.time_base`` (or absolute times, base 0).
    none, base = trace.time_none, trace.time_base
    first = next((t for t in trace.time if t != none), None)
    first_us = None if first is None else first + base
    timed = first_us is not None
    if timed and (trace.odd or trace.untimed):  # some events without a time: carry the last one
        times: Sequence[float] = array("d")
        last_t = 0.0
        for i, t in enumerate(trace.time):
            if i in trace.odd:
                t = trace.row(i)[3]
                t = t - base if type(t) is int and t != NO_TIME else none
            last_t = (t - first) / 1e6 if t != none else last_t
            times.append(last_t)
    else:
        times = Times(trace.time, first) if timed else Times(None, n=n)
    allocations = Allocations(trace, before, born, bsize, freed, gone, held)
    if n and series[0] >= top:  # the first event's value is the highest (or as high, and first)
        top, top_at = series[0], 0
    return DeviceReplay(device, times, series, Steps(initial_reserved, res_at, res_values, n), timed, first_us,
                        initial_allocated, initial_reserved, initial_blocks, allocations, tuple(frag), tuple(ooms),
                        check, expandable, (top, top_at) if n else None)


def _big_blocks(final_size: Mapping[int, int], sizes: array) -> bool:
    """Whether a block may reach 4 GiB (block sizes then take 8 bytes a row, else 4): a request or a final block of 2 GiB
    or more (a block is at most its request rounded up to the next power of two, plus a rest under 20 MiB)."""
    return max(sizes, default=0) >= 1 << 31 or max(final_size.values(), default=0) >= 1 << 31


def _gone(k: int, i: int, before: List[Allocation], bsize: array, gone: array, held: array) -> Tuple[int, bool]:
    """Mark block ``k`` (a row, or ~index into ``before``) gone at event ``i``: its size and whether it was allocated."""
    if k >= 0:
        gone[k] = i
        return bsize[k], bool(held[k])
    b = before[~k]
    b.gone = i
    return b.size, b.allocated


def _unplace(layout: "_Layout", seg_of: Dict[int, Optional[int]], addr: int) -> None:
    seg = seg_of.get(addr, -1)
    if seg == -1:
        seg = seg_of[addr] = layout.find(addr)
    if seg is not None:
        starts = layout.blocks[seg]
        j = bisect.bisect_left(starts, addr)
        if j < len(starts) and starts[j] == addr:
            del starts[j]
        layout.dirty.add(seg)


def _largest_free(layout: "_Layout", live: Dict[int, int], before: List[Allocation], bsize: array) -> Optional[int]:
    """The largest free range of the plain segments (None without any); only segments changed since the last time are walked."""
    if not layout.starts:
        return None
    for start in layout.dirty:
        end = layout.info[start][0]
        at = start
        best = 0
        for b in layout.blocks[start]:
            if b - at > best:
                best = b - at
            k = live[b]
            b += bsize[k] if k >= 0 else before[~k].size
            if b > at:
                at = b
        layout.largest[start] = max(best, end - at)
    layout.dirty.clear()
    return max(layout.largest.values())


def _walk_back(acts, addrs, sizes, codes, final, plain_end, reserved_end):
    """Walk the events back from the end: the blocks in place at the start (which allocated), the plain segments, reserved."""
    A, FR, FC, SA, SF, SM, SU = codes
    anomalies = 0
    start: Dict[int, list] = {a: [size, req, alloc, frames, True] for a, (size, req, alloc, frames) in final.items()}
    plain = dict(plain_end)
    reserved = reserved_end
    for c, addr, size in zip(reversed(acts), reversed(addrs), reversed(sizes)):
        if c == A:
            if start.pop(addr, None) is None:
                anomalies += 1
        elif c == FR:
            block = start.get(addr)
            if block is None:
                anomalies += 1
                start[addr] = [None, size, True, None, False]
            else:
                block[2] = True
        elif c == FC:
            start[addr] = [None, size, False, None, False]
        elif c == SA:
            reserved -= size
            plain.pop(addr, None)
        elif c == SF:
            reserved += size
            plain[addr] = (size, size == SMALL_BUFFER)
        elif c == SM:
            reserved -= size
        elif c == SU:
            reserved += size
    return start, plain, reserved, anomalies
