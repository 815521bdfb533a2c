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
from itertools import islice
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

from ..preflight.allocator import LARGE_BUFFER, MIN_BLOCK, SMALL_BUFFER, SMALL_SIZE, round_size as _round_512
from .schema import ALLOCATED, PENDING, Segment
from .trace import NO_TIME, Trace

__all__ = ["Allocation", "Allocations", "Fragmentation", "OomState", "Check", "DeviceReplay", "replay_device", "rounder",
           "FRAGMENTATION_SAMPLES"]

#: Fragmentation is measured at this many evenly spaced events (and at an OOM and at the end).
FRAGMENTATION_SAMPLES = 96


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
    the snapshot's segments); each block allocated by an event costs a row of 21 bytes, its address,
    request and frames read from the event that made it.
    """

    def __init__(self, trace: Trace, before: Sequence[Allocation] = ()):
        self.trace = trace
        self.before: List[Allocation] = list(before)
        self.born = array("i")
        self.size = array("q")
        self.freed = array("i")  # -1: never freed in the window
        self.gone = array("i")
        self.held = array("b")  # still allocated at the end

    def add(self, block: Allocation) -> None:
        block.row = len(self.born)
        self.born.append(block.born)
        self.size.append(block.size)
        self.freed.append(-1)
        self.gone.append(-1)
        self.held.append(1)

    def update(self, block: Allocation) -> None:
        """Write back what the replay changed on a block (its free, its end, whether it is allocated)."""
        row = block.row
        if row is not None:
            self.freed[row] = -1 if block.freed is None else block.freed
            self.gone[row] = -1 if block.gone is None else block.gone
            self.held[row] = block.allocated

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
        action, addr, req, _t = self.trace.row(born)
        block = Allocation(addr, self.size[row], int(req), born, self.trace.frames_at(born), bool(self.held[row]))
        block.freed = None if self.freed[row] < 0 else self.freed[row]
        block.gone = None if self.gone[row] < 0 else self.gone[row]
        block.row = row
        return block

    def __iter__(self) -> Iterator[Allocation]:
        yield from self.before
        for k in range(len(self.before), len(self)):
            yield self[k]

    def live_at(self, index: int) -> List[Allocation]:
        out = [a for a in self.before if a.live_at(index)]
        offset = len(self.before)
        for row, (born, freed) in enumerate(zip(self.born, self.freed)):
            if born <= index and (freed < 0 or freed > index):
                out.append(self[offset + row])
        return out


class Times(Sequence):
    """Seconds from the first event after each event, computed from the trace's ``time_us`` column (nothing copied)."""

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
    reserved: array  # torch's reserved_bytes after each event
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

    @property
    def events(self) -> int:
        return len(self.allocated)

    def peak(self, series: str = "allocated") -> Tuple[int, int]:
        """``(bytes, event index)`` of the highest point of ``series`` (the first such event); (start, -1) without events."""
        values = self.allocated if series == "allocated" else self.reserved
        start = self.initial_allocated if series == "allocated" else self.initial_reserved
        if not values:
            return start, -1
        top = max(values)
        if top <= start:
            return start, -1
        return top, values.index(top)

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

    def add(self, addr: int, size: int, small: bool) -> None:
        if addr in self.info:
            return
        bisect.insort(self.starts, addr)
        self.info[addr] = (addr + size, small)
        self.blocks[addr] = []

    def remove(self, addr: int) -> None:
        if self.info.pop(addr, None) is None:
            return
        i = bisect.bisect_left(self.starts, addr)
        del self.starts[i]
        self.blocks.pop(addr, None)

    def find(self, addr: int) -> Optional[int]:
        i = bisect.bisect_right(self.starts, addr) - 1
        if i >= 0:
            start = self.starts[i]
            if addr < self.info[start][0]:
                return start
        return None

    def largest_free(self, sizes: Mapping[int, Any]) -> Optional[int]:
        if not self.starts:
            return None
        best = 0
        for start in self.starts:
            end = self.info[start][0]
            at = start
            for b in self.blocks[start]:
                if b - at > best:
                    best = b - at
                at = max(at, b + sizes[b].size)
            if end - at > best:
                best = end - at
        return best


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

    # The end: blocks in place and plain segments.
    final: Dict[int, Tuple[int, int, bool, tuple]] = {}
    plain_end: Dict[int, Tuple[int, bool]] = {}
    reserved_end = 0
    for seg in segments:
        reserved_end += seg.size
        if not seg.expandable:
            plain_end[seg.addr] = (seg.size, seg.small)
        for b in seg.blocks:
            if b.state in (ALLOCATED, PENDING) and b.size > 0:
                final[b.addr] = (b.size, b.requested, b.state == ALLOCATED, b.frames)

    start, plain, reserved, anomalies = _walk_back(trace, final, plain_end, reserved_end)

    layout = _Layout()
    for addr, (size, small) in plain.items():
        layout.add(addr, size, small)
    live: Dict[int, Allocation] = {}
    for addr in sorted(start):
        seg = layout.find(addr)
        if seg is not None:
            layout.blocks[seg].append(addr)
    before: List[Allocation] = []
    allocated = 0
    active = 0
    for addr in sorted(start):
        size, req, alloc, frames, known = start[addr]
        if not known:
            size = _block_size(layout, layout.find(addr), addr, round_size(req), max_split) if req > 0 else 0
        block = Allocation(addr, size, req, -1, frames, alloc)
        live[addr] = block
        before.append(block)
        active += size
        if alloc:
            allocated += size
    initial_allocated, initial_reserved, initial_blocks = allocated, reserved, len(live)
    allocations = Allocations(trace, before)

    # Walk forward, event by event.
    n = len(trace)
    alloc_series, reserved_series = array("q"), array("q")
    every = max(1, n // FRAGMENTATION_SAMPLES)
    frag: List[Fragmentation] = []
    ooms: List[OomState] = []
    first_us = next((t for _a, _d, _s, t in trace.rows() if t != NO_TIME), None)
    timed = first_us is not None
    gaps = timed and (trace.odd or NO_TIME in trace.time)  # some events without a time: carry the last one
    times = array("d") if gaps else None
    last_t = 0.0
    for i, (action, addr, size, t) in enumerate(trace.rows()):
        if action == "alloc":
            req = int(size)
            seg = layout.find(addr)
            size = _block_size(layout, seg, addr, round_size(req), max_split) if req > 0 else 0
            old = live.get(addr)
            if old is not None:  # a block we thought still in place: its free fell outside the window
                anomalies += 1
                _drop(layout, old, i)
                if old.allocated:
                    allocated -= old.size
                active -= old.size
                allocations.update(old)
            block = Allocation(addr, size, req, i, None)
            allocations.add(block)
            live[addr] = block
            if seg is not None:
                bisect.insort(layout.blocks[seg], addr)
            allocated += size
            active += size
        elif action == "free_requested":
            block = live.get(addr)
            if block is None:
                anomalies += 1
            elif block.allocated:
                block.allocated = False
                block.freed = i
                allocated -= block.size
                allocations.update(block)
        elif action == "free_completed":
            block = live.pop(addr, None)
            if block is None:
                anomalies += 1
            else:
                if block.allocated:
                    block.allocated = False
                    block.freed = i
                    allocated -= block.size
                active -= block.size
                _drop(layout, block, i)
                allocations.update(block)
        elif action == "segment_alloc":
            size = int(size)
            reserved += size
            if not expandable:
                layout.add(addr, size, size == SMALL_BUFFER)
        elif action == "segment_free":
            reserved -= int(size)
            layout.remove(addr)
        elif action == "segment_map":
            reserved += int(size)
        elif action == "segment_unmap":
            reserved -= int(size)
        elif action == "oom":
            e = trace[i]
            here = Fragmentation(i, reserved - active, layout.largest_free(live))
            free = e.get("device_free", e.get("addr"))
            ooms.append(OomState(i, int(e.get("size", 0)), None if free is None else int(free), allocated, reserved,
                                 tuple(e.get("frames") or ()), here))
        if times is not None:
            last_t = (t - first_us) / 1e6 if t != NO_TIME else last_t
            times.append(last_t)
        alloc_series.append(allocated)
        reserved_series.append(reserved)
        if i % every == 0 or i == n - 1:
            frag.append(Fragmentation(i, reserved - active, layout.largest_free(live)))

    blocks = exact = 0
    for addr, (size, _req, _alloc, _frames) in final.items():
        block = live.get(addr)
        if block is not None and block.born >= 0:
            blocks += 1
            exact += block.size == size
    check = Check(blocks, exact, sum(s for s, _r, a, _f in final.values() if a), allocated, reserved_end, reserved,
                  anomalies)
    if times is None:
        times = Times(trace.time, first_us) if timed else Times(None, n=n)
    return DeviceReplay(device, times, alloc_series, reserved_series, timed, first_us, initial_allocated,
                        initial_reserved, initial_blocks, allocations, tuple(frag), tuple(ooms), check,
                        expandable)


def _walk_back(trace: Trace, final, plain_end, reserved_end):
    """Walk the events back from the end: the blocks in place at the start (which allocated), the plain segments, reserved."""
    anomalies = 0
    start: Dict[int, list] = {a: [size, req, alloc, frames, True] for a, (size, req, alloc, frames) in final.items()}
    plain = dict(plain_end)
    reserved = reserved_end
    for action, addr, size, _t in trace.rows(reverse=True):
        if action == "alloc":
            if start.pop(addr, None) is None:
                anomalies += 1
        elif action == "free_requested":
            block = start.get(addr)
            if block is None:
                anomalies += 1
                start[addr] = [None, int(size), True, None, False]
            else:
                block[2] = True
        elif action == "free_completed":
            start[addr] = [None, int(size), False, None, False]
        elif action == "segment_alloc":
            reserved -= int(size)
            plain.pop(addr, None)
        elif action == "segment_free":
            size = int(size)
            reserved += size
            plain[addr] = (size, size == SMALL_BUFFER)
        elif action == "segment_map":
            reserved -= int(size)
        elif action == "segment_unmap":
            reserved += int(size)
    return start, plain, reserved, anomalies


def _drop(layout: _Layout, block: Allocation, index: int) -> None:
    block.gone = index
    seg = layout.find(block.addr)
    if seg is not None:
        starts = layout.blocks[seg]
        i = bisect.bisect_left(starts, block.addr)
        if i < len(starts) and starts[i] == block.addr:
            del starts[i]
