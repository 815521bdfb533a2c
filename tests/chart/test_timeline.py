"""The session timeline: typed series keys, spans that carry numbers (never display text) from real
records, peak-preserving downsampling, bounded size over a million samples, thread safety, and
holding nothing but numbers and short strings."""
import gc
import random
import sys
import threading
import time
import weakref
from collections import deque
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipy_gpumem.core.probes import DeviceSample, HostSample, MemoryProbe, Sample
from ipy_gpumem.cell.recorder import Measurement
from ipy_gpumem.core.records import CellRecord, DeviceRecord, HostRecord
from ipy_gpumem.chart.timeline import (HOST_RSS, Change, MissedPeak, SeriesKey, Span, Timeline, TimelineSnapshot,
                                       _Bucket, _Points, _Run, _Running, _Spans)
from ipy_gpumem.core.devices import HOST, Device, cuda
from ipy_gpumem.core.units import GiB, MiB

ALLOC0, RESERVED0, USED0 = (SeriesKey(cuda(0), q) for q in ("allocated", "reserved", "used"))

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="exact RSS needs procfs")


def host(t, rss):
    return Sample(t, HostSample(rss, None), ())


def gpu(t, allocated, reserved=None, used=None, total=16 * GiB, index=0, rss=GiB):
    dev = DeviceSample(index, allocated, reserved, None, None, used, total)
    return Sample(t, HostSample(rss, None), (dev,))


def device_record(n=7, source="y = model(x)\nloss = y.sum()", error=None, duration=1.25):
    dev = DeviceRecord(0, "GPU", allocated_before=2 * GiB, allocated_after=3 * GiB, peak_allocated=4 * GiB,
                       reserved_before=2 * GiB, reserved_after=4 * GiB, peak_reserved=4 * GiB, total=16 * GiB)
    return CellRecord(n, None, source, time.time(), duration, error=error, devices=(dev,),
                      host=HostRecord(GiB, GiB, GiB))


# --------------------------------------------------------------------------------------------
# Spans, labels and hover texts
# --------------------------------------------------------------------------------------------


def test_span_from_a_device_record_carries_its_numbers():
    tl = Timeline()
    tl.add(gpu(100.0, 2 * GiB))
    tl.cell_started(100.5, "[7]", "y = model(x)\nloss = y.sum()")
    tl.add(gpu(101.0, 4 * GiB))
    tl.cell_finished(101.75, device_record(error="OutOfMemoryError"))
    snap = tl.snapshot()
    (span,) = snap.spans
    assert span.label == "[7]" and span.start == pytest.approx(0.5) and span.end == pytest.approx(1.75)
    assert span.failed and span.error == "OutOfMemoryError" and snap.running is None and span.recorded
    assert span.first_line == "y = model(x)" and span.duration == 1.25
    assert span.moved == 2 * GiB  # the peak increase is the biggest change (CellRecord.moved_bytes)
    assert span.changes == (Change(cuda(0), GiB, 4 * GiB, 2 * GiB, 2 * GiB),)
    assert snap.capacities[cuda(0)] == 16 * GiB and snap.capacities[HOST] is None


@linux
def test_span_from_a_real_measurement_on_this_machine():
    probe = MemoryProbe()
    tl = Timeline()
    source = "blob = bytearray(b'\\x01') * (64 * 2**20)  # a real 64 MiB"
    tl.cell_started(time.perf_counter(), "[3]", source)
    measurement = Measurement(probe, probe.sample(), source=source)
    tl.add(probe.sample())
    blob = bytearray(b"\x01") * (64 * MiB)
    tl.add(probe.sample())
    record = measurement.finish(execution_count=3).record()
    tl.cell_finished(time.perf_counter(), record)
    span = tl.snapshot().spans[0]
    assert span.label == "[3]" and not span.failed
    assert span.first_line.startswith("blob = bytearray(")
    (change,) = span.changes
    assert change.device == HOST and 60 * MiB <= change.delta <= 80 * MiB
    assert 60 * MiB <= span.moved <= 80 * MiB
    rss = tl.snapshot().series[HOST_RSS]
    assert rss[-1] - rss[0] >= 60 * MiB
    del blob


def test_first_lines_are_clipped_and_host_changes_kept_on_cpu():
    record = CellRecord(4, None, "\n\n   " + "x" * 200, time.time(), 75.0,
                        host=HostRecord(GiB, GiB + 64 * MiB, GiB + 96 * MiB))
    tl = Timeline()
    tl.cell_finished(10.0, record)
    (span,) = tl.snapshot().spans
    assert span.first_line.startswith("xxx") and span.first_line.endswith("…") and len(span.first_line) == 80
    assert span.changes == (Change(HOST, 64 * MiB, GiB + 96 * MiB, 96 * MiB),)
    assert span.duration == 75.0 and span.moved == 96 * MiB


def test_spans_keep_numbers_and_short_strings_never_display_text():
    tl = Timeline()
    tl.cell_started(1.0, "[*]", "y = model(x)\nz = 2")
    tl.cell_finished(2.0, device_record())
    for span in tl.snapshot().spans:
        strings = [v for v in span if isinstance(v, str)]
        assert strings == ["[7]", "y = model(x)"]  # label and first line; the hover is written by views
        assert all("\n" not in v and "GiB" not in v for v in strings)


def test_running_span_then_finished():
    tl = Timeline()
    tl.cell_started(10.0, "[1]", "import torch")
    snap = tl.snapshot()
    assert snap.running is not None and snap.running.end is None and snap.running.label == "[1]"
    assert snap.spans == (snap.running,) and not snap.running.recorded and tl.running
    tl.cell_finished(12.0, None)
    snap = tl.snapshot()
    assert snap.running is None and snap.spans[0].end == pytest.approx(2.0) and not tl.running
    assert not snap.spans[0].recorded and snap.spans[0].changes == ()


def test_record_label_wins_and_lone_records_and_restarts_make_spans():
    tl = Timeline()
    tl.cell_started(0.0, "[ ]", "a = 1")
    tl.cell_finished(1.0, device_record(n=5))  # the count is only reliable at the end
    tl.cell_finished(5.0, device_record(n=6, duration=2.0))  # no running span: t - duration
    tl.cell_finished(6.0, None)  # nothing running, no record: nothing happens
    tl.cell_started(7.0, "[7]", "b = 2")
    tl.cell_started(8.0, "[8]", "c = 3")  # the unfinished [7] is closed at 8.0
    snap = tl.snapshot()
    assert [s.label for s in snap.spans] == ["[5]", "[6]", "[7]", "[8]"]
    assert snap.spans[1].start == pytest.approx(3.0) and snap.spans[1].end == pytest.approx(5.0)
    assert snap.spans[2].end == pytest.approx(8.0) and snap.running.label == "[8]"


def test_spans_stay_bounded_over_10k_cells_by_merging_the_oldest():
    tl = Timeline(max_spans=100)
    for n in range(1, 10_001):
        t = n * 2.0
        tl.cell_started(t, f"[{n}]", f"step({n})")
        tl.cell_finished(t + 1.0, device_record(n=n) if n == 17 else None)
    snap = tl.snapshot()
    assert len(snap.spans) < 100
    assert sum(s.cells for s in snap.spans) == 10_000  # merged, not dropped: coverage kept
    assert snap.spans[-1].label == "[10000]" and snap.spans[-1].cells == 1
    oldest = snap.spans[0]
    assert oldest.cells > 1 and oldest.label == f"[1]–[{oldest.cells}]" and oldest.start == 0.0
    # every fully merged span covers the same number of cells: one resolution for the old part
    merged = [s.cells for s in snap.spans if s.cells > 1]
    assert len(set(merged[:-1])) == 1 and merged[0] >= merged[-1]
    biggest = next(s for s in snap.spans if s.start <= 32.0 <= s.end)  # [17] ran at 34 - 2
    assert biggest.largest.label == "[17]" and biggest.largest.first_line == "y = model(x)"  # the record's source
    assert biggest.moved == biggest.largest.moved == 2 * GiB and biggest.largest.start == pytest.approx(32.0)
    assert all(a.end <= b.start for a, b in zip(snap.spans, snap.spans[1:]))


# --------------------------------------------------------------------------------------------
# Series and downsampling
# --------------------------------------------------------------------------------------------


def test_device_series_keys_capacities_and_late_keys():
    tl = Timeline()
    tl.add(host(0.0, GiB))
    tl.add(gpu(1.0, 100, 200, used=None))
    tl.add(gpu(2.0, 300, 400, used=900))
    tl.add(gpu(3.0, 5, 6, index=1, total=8 * GiB))
    snap = tl.snapshot()
    assert snap.keys == (HOST_RSS, ALLOC0, RESERVED0, USED0, SeriesKey(cuda(1), "allocated"),
                         SeriesKey(cuda(1), "reserved"))
    assert all(isinstance(k.device, Device) for k in snap.keys)  # fields, never "cuda:0 allocated"
    assert snap.series[ALLOC0] == (None, 100, 300, None)
    assert snap.series[USED0] == (None, None, 900, None)
    assert snap.t == (0.0, 1.0, 2.0, 3.0) and snap.origin == 0.0
    assert dict(snap.capacities) == {cuda(0): 16 * GiB, cuda(1): 8 * GiB, HOST: None}
    assert snap.devices() == (cuda(0), cuda(1))


def test_missed_peaks_are_the_record_peaks_above_every_sample():
    tl = Timeline()
    tl.cell_started(0.0, "[1]", "spike()")
    tl.add(gpu(0.5, 2 * GiB))
    tl.cell_finished(1.0, device_record(n=1))  # peak 4 GiB, never sampled
    tl.cell_started(2.0, "[2]", "flat()")
    tl.add(gpu(2.5, 5 * GiB))
    tl.cell_finished(3.0, device_record(n=2))  # peak 4 GiB, below the 5 GiB sampled
    snap = tl.snapshot()
    assert snap.missed_peaks([ALLOC0]) == (MissedPeak(ALLOC0, 0.0, 1.0, 4 * GiB),)
    assert snap.missed_peaks([RESERVED0]) == ()  # per-cell peaks exist for allocated and RSS only


def test_times_are_relative_and_kept_in_order():
    tl = Timeline()
    tl.add(host(1000.0, 1))
    tl.add(host(1000.5, 2))
    tl.add(host(1000.4, 3))  # two threads can interleave by microseconds: clamped, never reordered
    assert tl.snapshot().t == (0.0, 0.5, 0.5)


@pytest.mark.slow
def test_a_single_spike_among_100k_flat_points_survives():
    tl = Timeline(max_points=2000)
    spike_at = 12_345
    for i in range(100_000):
        tl.add(host(i * 0.25, 5 * GiB if i == spike_at else GiB))
    snap = tl.snapshot()
    assert len(snap.t) <= 2000 and snap.stride > 1
    rss = snap.series[HOST_RSS]
    assert max(rss) == 5 * GiB and rss.count(5 * GiB) == 1
    at = rss.index(5 * GiB)
    bucket_start = snap.t[at]
    bucket_end = snap.t[at + 1]
    assert bucket_start <= spike_at * 0.25 < bucket_end  # stamped with its bucket's first time
    assert min(snap.lows[HOST_RSS]) == GiB


def test_a_dip_survives_in_the_lows_and_recent_points_are_exact():
    tl = Timeline(max_points=100)
    values = [GiB + (i % 5) * MiB for i in range(5000)]
    values[100] = 1
    for i, v in enumerate(values):
        tl.add(host(float(i), v))
    snap = tl.snapshot()
    assert min(snap.lows[HOST_RSS]) == 1
    recent = len(snap.t) - snap.merged
    assert recent == 50
    assert snap.series[HOST_RSS][-recent:] == tuple(values[-recent:])
    assert snap.t[-recent:] == tuple(float(i) for i in range(5000 - recent, 5000))
    assert snap.added == 5000


def test_merged_buckets_have_one_uniform_resolution():
    tl = Timeline(max_points=64)
    for i in range(10_000):
        tl.add(host(float(i), i))
    snap = tl.snapshot()
    full = snap.merged - 1  # the last merged point is the bucket being filled
    gaps = {snap.t[i + 1] - snap.t[i] for i in range(full - 1)}
    assert gaps == {float(snap.stride)}


@settings(max_examples=60, deadline=None)
@given(
    max_points=st.integers(8, 40),
    values=st.lists(st.one_of(st.none(), st.integers(0, 2**40)), min_size=1, max_size=600),
)
def test_downsampling_invariants(max_points, values):
    tl = Timeline(max_points=max_points)
    for i, v in enumerate(values):
        tl.add(Sample(float(i), HostSample(v, None), ()))
    snap = tl.snapshot()
    assert len(snap.t) <= max_points
    assert list(snap.t) == sorted(snap.t)
    present = [v for v in values if v is not None]
    if present:
        assert max(v for v in snap.series[HOST_RSS] if v is not None) == max(present)
        assert min(v for v in snap.lows[HOST_RSS] if v is not None) == min(present)
        for hi, lo in zip(snap.series[HOST_RSS], snap.lows[HOST_RSS]):
            assert (hi is None) == (lo is None) and (hi is None or lo <= hi)
    else:
        assert HOST_RSS not in snap.series


def _deep_size(root) -> int:
    seen, stack, total = set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


@pytest.mark.slow
def test_many_adds_stay_bounded_in_memory_and_cost_the_same_late_as_early():
    """300k adds (a sample every 10 ms for 50 minutes): the same few thousand numbers whatever the count, and
    the last 50k adds cost what the first 50k did (an O(n) add would cost six times more there)."""
    tl = Timeline(max_points=2000)
    samples = [gpu(0.0, GiB + (i % 97) * MiB, 2 * GiB, 3 * GiB) for i in range(1000)]
    sizes, cpu = {}, {}
    total = 300_000
    for i in range(total):
        if i in (0, total - 50_000):
            began = time.thread_time()  # CPU time: what the adds cost, whatever else the machine runs
        s = samples[i % 1000]
        tl.add(Sample(i * 0.01, s.host, s.devices))
        if i + 1 in (50_000, total):
            cpu[i + 1] = time.thread_time() - began
            sizes[i + 1] = (_deep_size(tl), len(tl))
    (size_early, points_early), (size_late, points_late) = sizes[50_000], sizes[total]
    assert points_late <= 2000 and points_early <= 2000
    # the same few thousand numbers, whatever the count: bounded, not growing with the session
    assert size_late < 1.3 * size_early and size_late < 4 * 2**20
    snap = tl.snapshot()
    assert len(snap.t) <= 2000 and snap.added == total and snap.stride >= 128
    assert cpu[total] < 3 * cpu[50_000], cpu


# --------------------------------------------------------------------------------------------
# Versions, snapshots, threads and references
# --------------------------------------------------------------------------------------------


def test_moved_counts_changes_worth_a_redraw_not_repeated_numbers():
    tl = Timeline()
    tl.add(host(0.0, GiB))
    moved = tl.moved
    for i in range(1, 20):  # an idle session: the same RSS, give or take a few KiB
        tl.add(host(float(i), GiB + (i % 3) * 4096))
    assert tl.moved == moved and tl.version > moved
    tl.add(host(30.0, GiB + 64 * MiB))
    assert tl.moved == moved + 1
    tl.cell_started(31.0, "[1]", "x")
    tl.cell_finished(32.0, None)
    assert tl.moved == moved + 3


def test_version_increments_on_every_change_and_snapshots_are_cached():
    tl = Timeline()
    versions = [tl.version]
    for step in (lambda: tl.add(host(0.0, 1)), lambda: tl.cell_started(0.1, "[1]", "x"),
                 lambda: tl.cell_finished(0.2, None), tl.clear):
        step()
        versions.append(tl.version)
    assert versions == sorted(set(versions)) and len(versions) == 5
    snap = tl.snapshot()
    assert tl.snapshot() is snap and snap.version == tl.version and snap.empty
    tl.cell_finished(1.0, None)  # nothing running, no record: no change
    assert tl.snapshot() is snap


def test_snapshot_is_immutable():
    tl = Timeline()
    tl.add(host(0.0, 1))
    snap = tl.snapshot()
    with pytest.raises(Exception):
        snap.t = ()
    with pytest.raises(TypeError):
        snap.series[HOST_RSS] = (2,)
    assert isinstance(snap.series[HOST_RSS], tuple)


@pytest.mark.slow
def test_a_thread_adding_while_the_main_thread_snapshots():
    tl = Timeline(max_points=256, max_spans=16)
    done = threading.Event()
    errors = []

    def feed():
        try:
            for i in range(50_000):
                tl.add(gpu(i * 0.001, i, 2 * i, 3 * i))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=feed)
    thread.start()
    last_version, snapshots, n = -1, 0, 0
    while not done.is_set() or snapshots == 0:
        n += 1
        tl.cell_started(n * 0.01, f"[{n}]", "x")
        tl.cell_finished(n * 0.01 + 0.005, None)
        snap = tl.snapshot()
        snapshots += 1
        assert snap.version > last_version
        last_version = snap.version
        assert len(snap.t) <= 256 and list(snap.t) == sorted(snap.t)
        assert all(len(col) == len(snap.t) for col in snap.series.values())
        assert all(len(col) == len(snap.t) for col in snap.lows.values())
        assert len(snap.spans) <= 16
    thread.join()
    assert not errors and snapshots > 1
    assert max(tl.snapshot().series[ALLOC0]) == 49_999


ALLOWED = (int, float, str, bool, type(None), tuple, list, dict, deque, MappingProxyType, Span, Change, SeriesKey,
           Device, TimelineSnapshot, Timeline, _Points, _Spans, _Bucket, _Run, _Running, type(threading.Lock()))


def _walk(root):
    seen, stack = set(), [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        yield obj
        stack.extend(gc.get_referents(obj))


@pytest.mark.slow
def test_holds_only_numbers_and_strings_never_samples_or_records():
    tl = Timeline(max_points=16, max_spans=4)
    record = device_record()
    ref = weakref.ref(record)
    for i in range(100):
        tl.add(gpu(float(i), i, i, i))
        tl.cell_started(i + 0.1, f"[{i}]", "x = 1")
        tl.cell_finished(i + 0.2, record)
    snap = tl.snapshot()
    for root in (tl, snap):
        for obj in _walk(root):
            assert type(obj) in ALLOWED, f"timeline holds a {type(obj).__name__}"
    del record
    gc.collect()
    assert ref() is None


def test_clear_forgets_everything():
    tl = Timeline()
    tl.add(gpu(5.0, 1))
    tl.cell_started(5.0, "[1]", "x")
    tl.clear()
    snap = tl.snapshot()
    assert snap.empty and snap.running is None and dict(snap.capacities) == {HOST: None}
    tl.add(host(99.0, 7))
    assert tl.snapshot().t == (0.0,)  # the session restarts at the next timestamp


def test_rejects_tiny_bounds():
    with pytest.raises(ValueError):
        Timeline(max_points=4)
    with pytest.raises(ValueError):
        Timeline(max_spans=2)


def test_random_sessions_keep_spans_ordered():
    rng = random.Random(5)
    tl = Timeline(max_points=32, max_spans=8)
    t = 0.0
    for n in range(300):
        tl.cell_started(t, f"[{n}]", "x")
        for _ in range(rng.randint(0, 5)):
            t += rng.random()
            tl.add(host(t, rng.randint(0, GiB)))
        t += rng.random()
        tl.cell_finished(t, None)
    snap = tl.snapshot()
    assert len(snap.spans) < 8 and sum(s.cells for s in snap.spans) == 300
    assert all(s.start <= s.end for s in snap.spans)
