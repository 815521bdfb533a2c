"""Property tests of the caching allocator model against the rules of torch's CUDACachingAllocator.cpp (rounding, pools, segment sizes, splitting, caching, release)."""
import pytest

from hypothesis import given, settings, strategies as st

from ipy_gpumem.preflight.allocator import (LARGE_BUFFER, MIN_BLOCK, MIN_LARGE_ALLOC, ROUND_LARGE, SMALL_BUFFER,
                                            SMALL_SIZE, CachingAllocatorModel, OutOfMemory, is_small, replay,
                                            round_size, segment_size)

MiB = 1 << 20
sizes = st.one_of(st.integers(0, 4096), st.integers(0, 2 * MiB), st.integers(0, 64 * MiB))


@given(sizes)
def test_round_size_is_the_next_multiple_of_512_and_at_least_512(size):
    r = round_size(size)
    if size == 0:
        assert r == 0  # a 0-byte request takes no block (NativeCachingAllocator::allocate)
    else:
        assert r % MIN_BLOCK == 0 and size <= r < size + MIN_BLOCK and r >= MIN_BLOCK


@given(st.integers(1, 64 * MiB))
def test_pool_and_segment_size_follow_get_pool_and_get_allocation_size(size):
    r = round_size(size)
    assert is_small(r) == (r <= SMALL_SIZE)
    seg = segment_size(r)
    if r <= SMALL_SIZE:
        assert seg == SMALL_BUFFER
    elif r < MIN_LARGE_ALLOC:
        assert seg == LARGE_BUFFER
    else:
        assert seg % ROUND_LARGE == 0 and r <= seg < r + ROUND_LARGE


def test_known_cases():
    m = CachingAllocatorModel()
    a = m.malloc(1)
    assert (m.allocated, m.reserved) == (512, 2 * MiB)
    b = m.malloc(MiB + 1)  # large pool: a 20 MiB segment
    assert m.reserved == 22 * MiB and m.allocated == 512 + MiB + 512
    e = m.malloc(11 * MiB)  # the rest of that segment serves it (split)
    assert m.reserved == 22 * MiB
    c = m.malloc(25 * MiB + 1)  # no cached block is big enough: its own segment, rounded to 2 MiB
    assert m.reserved == 22 * MiB + 26 * MiB
    m.free(c)
    assert m.reserved == 48 * MiB  # cached, not returned
    d = m.malloc(25 * MiB)  # served by the cached 26 MiB block: the remainder (1 MiB) is not split
    assert m.reserved == 48 * MiB and d.size == 26 * MiB
    for h in (a, b, d, e):
        m.free(h)
    assert m.allocated == 0
    assert m.release_cached() == 48 * MiB and m.reserved == 0


def test_a_large_block_is_split_only_when_more_than_1_mib_remains():
    m = CachingAllocatorModel()
    h = m.malloc(19 * MiB)  # 20 MiB segment, 1 MiB left: not split, the whole block is allocated
    assert h.size == 20 * MiB and m.allocated == 20 * MiB
    m.free(h)
    h = m.malloc(18 * MiB)  # 2 MiB left (> 1 MiB): split
    assert h.size == 18 * MiB and m.cached_blocks(small=False) == [(2 * MiB, h.addr + 18 * MiB)]


def test_small_blocks_split_down_to_512_and_best_fit_reuses_the_smallest_block():
    m = CachingAllocatorModel()
    hs = [m.malloc(1000) for _ in range(4)]
    assert all(h.size == 1024 for h in hs) and m.reserved == 2 * MiB
    m.free(hs[1])
    m.free(hs[3])  # merges with the rest of the segment
    again = m.malloc(1024)
    assert again.addr == hs[1].addr  # the exact fit, not the large remainder


def test_capacity_releases_cached_segments_before_running_out():
    m = CachingAllocatorModel(capacity=40 * MiB)
    a = m.malloc(30 * MiB)
    m.free(a)
    b = m.malloc(12 * MiB)  # cached 30 MiB block serves it
    m.free(b)
    c = m.malloc(35 * MiB)  # no cached block is big enough: the free 30 MiB segment is released
    assert m.reserved == 36 * MiB and m.num_releases == 1
    with pytest.raises(OutOfMemory):
        m.malloc(6 * MiB)  # needs a 20 MiB segment: 36 + 20 > 40
    m.free(c)


ops = st.lists(st.tuples(st.booleans(), sizes, st.integers(0, 1000)), max_size=120)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(ops)
def test_invariants_hold_for_any_sequence(seq):
    m = CachingAllocatorModel()
    live = []
    for alloc, size, pick in seq:
        if alloc or not live:
            h = m.malloc(size)
            if h is None:
                assert size == 0
                continue
            r = round_size(size)
            assert h.size >= r
            if h.small:
                assert h.size == r  # small blocks split whenever 512 bytes or more remain
            else:
                assert h.size - r <= SMALL_SIZE  # large blocks keep at most 1 MiB of slack
            assert h.small == is_small(r)
            live.append(h)
        else:
            m.free(live.pop(pick % len(live)))
        assert m.allocated == sum(h.size for h in live)
        assert m.reserved >= m.allocated and m.peak_reserved >= m.reserved
        free = sum(s for s, _a in m.cached_blocks())
        assert m.allocated + free == m.reserved  # every reserved byte is either in use or cached
    for h in live:
        m.free(h)
    assert m.allocated == 0
    m.release_cached()
    assert m.reserved == 0  # freed blocks merged back into whole segments


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 30 * MiB), min_size=1, max_size=40))
def test_replay_matches_the_model_and_a_capacity_only_fails_past_the_peak(requests):
    events = []
    for i, size in enumerate(requests):
        events.append((i, size))
        if i % 3 == 2:
            events.append((i - 1, -1))
    free_run = replay(events)
    assert free_run.oom_at is None and max(free_run.reserved) == free_run.peak_reserved
    assert replay(events, capacity=free_run.peak_reserved).oom_at is None
