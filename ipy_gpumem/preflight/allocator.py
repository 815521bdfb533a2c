"""A model of PyTorch's CUDA caching allocator that replays a sequence of allocations and frees into allocated and reserved bytes.

The rules are those of ``c10/cuda/CUDACachingAllocator.cpp`` with its default configuration (no
``max_split_size_mb``, no ``roundup_power2_divisions``, no expandable segments, one stream):

- every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``; smaller ones to 512),
  a request of 0 bytes takes no block at all (``NativeCachingAllocator::allocate``);
- requests of at most 1 MiB (``kSmallSize``) come from the small pool, larger ones from the large
  pool; a pool never serves the other's requests;
- a request is served by the smallest cached free block of its pool that is large enough (best
  fit: the pool is ordered by size, then address);
- when no cached block fits, a new segment is reserved (``cudaMalloc``): 2 MiB (``kSmallBuffer``)
  for a small request, 20 MiB (``kLargeBuffer``) for a request under 10 MiB (``kMinLargeAlloc``),
  otherwise the request rounded up to 2 MiB (``kRoundLarge``);
- a block larger than the request is split when the remainder is at least 512 bytes (small pool)
  or more than 1 MiB (large pool); otherwise the whole block is handed out and the whole block
  counts as allocated (``allocated_bytes`` adds ``block->size``);
- a freed block is merged with free neighbours of the same segment and cached, never returned;
- when reserving a new segment would pass the device's capacity, every cached segment that is
  wholly free is released (``release_cached_blocks``) and the reservation is tried again; if it
  still does not fit, that is an out-of-memory error.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

__all__ = ["MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER", "LARGE_BUFFER", "MIN_LARGE_ALLOC", "ROUND_LARGE",
           "round_size", "segment_size", "is_small", "CachingAllocatorModel", "Replay", "replay"]

MIN_BLOCK = 512                  # kMinBlockSize: all sizes are rounded to at least 512 bytes
SMALL_SIZE = 1 << 20             # kSmallSize: largest "small" request (1 MiB)
SMALL_BUFFER = 2 << 20           # kSmallBuffer: "small" requests are packed into 2 MiB segments
LARGE_BUFFER = 20 << 20          # kLargeBuffer: "large" requests under 10 MiB get 20 MiB segments
MIN_LARGE_ALLOC = 10 << 20       # kMinLargeAlloc: requests at least this large get their own segment
ROUND_LARGE = 2 << 20            # kRoundLarge: those segments are rounded up to 2 MiB


def round_size(size: int) -> int:
    """The block size the allocator hands out for a request of ``size`` bytes (0 for 0)."""
    if size <= 0:
        return 0
    if size < MIN_BLOCK:
        return MIN_BLOCK
    return MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)


def is_small(size: int) -> bool:
    """Whether a (rounded) request is served by the small pool."""
    return size <= SMALL_SIZE


def segment_size(size: int) -> int:
    """The size of the segment reserved for a (rounded) request no cached block can serve."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


class _Block:
    __slots__ = ("addr", "size", "prev", "next", "allocated", "small", "segment")

    def __init__(self, addr, size, small, segment):
        self.addr, self.size, self.small, self.segment = addr, size, small, segment
        self.prev = self.next = None
        self.allocated = False


class OutOfMemory(Exception):
    """The modelled allocator could not reserve a segment within the capacity it was given."""


class CachingAllocatorModel:
    """The caching allocator's state: segments, blocks, the two pools of free blocks, and its counters.

    Args:
        capacity: bytes the allocator may reserve in all (None: unlimited). Past it, cached free
            segments are released and, failing that, :class:`OutOfMemory` is raised.
    """

    def __init__(self, capacity: Optional[int] = None):
        self.capacity = capacity
        self._free = {True: [], False: []}  # small? -> sorted [(size, addr, block)] of free blocks
        self._next_addr = 1 << 40
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.segments = 0
        self.num_releases = 0

    # -- pools -------------------------------------------------------------------------------
    def _insert(self, block):
        bisect.insort(self._free[block.small], (block.size, block.addr, block))

    def _remove(self, block):
        pool = self._free[block.small]
        i = bisect.bisect_left(pool, (block.size, block.addr))
        assert pool[i][2] is block
        del pool[i]

    # -- the two operations ------------------------------------------------------------------
    def malloc(self, size: int):
        """Allocate ``size`` bytes; returns a handle for :meth:`free` (None for 0 bytes)."""
        size = round_size(size)
        if size == 0:
            return None
        small = is_small(size)
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            block = pool.pop(i)[2]
        else:
            block = self._new_segment(size, small)
        remaining = block.size - size
        if (remaining >= MIN_BLOCK) if small else (remaining > SMALL_SIZE):
            rest = _Block(block.addr + size, remaining, small, block.segment)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._insert(rest)
        block.allocated = True
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block) -> None:
        """Return a block to its pool, merged with its free neighbours."""
        if block is None:
            return
        block.allocated = False
        self.allocated -= block.size
        for other in (block.prev, block.next):
            if other is not None and not other.allocated:
                self._remove(other)
                if other is block.prev:
                    block.addr, block.prev = other.addr, other.prev
                    if other.prev is not None:
                        other.prev.next = block
                else:
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
                block.size += other.size
        self._insert(block)

    def _new_segment(self, size, small):
        want = segment_size(size)
        if self.capacity is not None and self.reserved + want > self.capacity:
            self.release_cached()
            if self.reserved + want > self.capacity:
                raise OutOfMemory(f"could not reserve {want} bytes: {self.reserved} reserved of {self.capacity}")
        block = _Block(self._next_addr, want, small, self.segments)
        self._next_addr += want + (1 << 21)
        self.segments += 1
        self.reserved += want
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def release_cached(self) -> int:
        """Release every cached segment that is wholly free (``empty_cache``); returns bytes released."""
        released = 0
        for small in (False, True):
            keep = []
            for entry in self._free[small]:
                block = entry[2]
                if block.prev is None and block.next is None:
                    released += block.size
                else:
                    keep.append(entry)
            self._free[small] = keep
        self.reserved -= released
        if released:
            self.num_releases += 1
        return released

    def cached_blocks(self, small: Optional[bool] = None) -> List[Tuple[int, int]]:
        """The free cached blocks as ``(size, address)``, smallest first (one pool or both)."""
        pools = (True, False) if small is None else (small,)
        return sorted((size, addr) for s in pools for size, addr, _b in self._free[s])


@dataclass
class Replay:
    """What a sequence of allocations and frees does to the modelled allocator."""

    peak_allocated: int = 0
    peak_reserved: int = 0
    #: allocated and reserved bytes after each event, in event order
    allocated: List[int] = field(default_factory=list)
    reserved: List[int] = field(default_factory=list)
    #: the block size each allocation event got, by the event's key
    block_sizes: Dict[int, int] = field(default_factory=dict)
    #: index of the event that ran out of memory (None: everything fit)
    oom_at: Optional[int] = None
    num_releases: int = 0


def replay(events: Iterable[Tuple[int, int]], capacity: Optional[int] = None, series: bool = True) -> Replay:
    """Replay ``(key, size)`` events: ``size >= 0`` allocates ``size`` bytes under a new ``key``,
    ``size < 0`` frees the block allocated under ``key``.

    With ``capacity``, the replay stops at the first event that cannot be served (``oom_at``).
    """
    model = CachingAllocatorModel(capacity)
    out = Replay()
    handles = {}
    for index, (key, size) in enumerate(events):
        if size >= 0:
            try:
                handle = model.malloc(size)
            except OutOfMemory:
                out.oom_at = index
                break
            handles[key] = handle
            out.block_sizes[key] = 0 if handle is None else handle.size
        else:
            model.free(handles.pop(key, None))
        if series:
            out.allocated.append(model.allocated)
            out.reserved.append(model.reserved)
    out.peak_allocated, out.peak_reserved = model.peak_allocated, model.peak_reserved
    out.num_releases = model.num_releases
    return out
