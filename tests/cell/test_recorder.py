"""Measurement -> CellRecord arithmetic, peaks, the bounded ledger and the JSON/DataFrame forms (data only, schema 1)."""
import json
import re

import pytest

from ipy_gpumem.cell.recorder import MAX_SOURCE_CHARS, Ledger, Measurement
from ipy_gpumem.core.records import (ROW_FIELDS, SCHEMA, CellRecord, DeviceRecord, HostRecord, records_frame,
                                     write_csv)
from ipy_gpumem.core.units import GiB, MiB

from conftest import dev_sample, make_sample, run


def test_deltas_and_per_cell_peak_from_scripted_allocator(fake_gpu):
    fake, probe = fake_gpu([(1 * GiB, 2 * GiB), (4 * GiB, 6 * GiB), (2 * GiB, 6 * GiB)])
    fake.peak = [9 * GiB, 9 * GiB]  # an earlier cell's peak, still standing
    m = Measurement.begin(probe, source="x = big()", track_peaks=True)
    assert fake.resets == 1  # the peak counters were reset before the cell ran
    Measurement.begin(probe, track_peaks=True)
    assert fake.resets == 1  # a peak already at the current value is left alone
    fake.advance()  # the cell allocates 3 GiB...
    fake.advance()  # ...and frees 2 GiB of it
    rec = m.finish(execution_count=7).record()
    dev = rec.devices[0]
    assert rec.execution_count == 7
    assert (dev.allocated_before, dev.allocated_after, dev.peak_allocated) == (1 * GiB, 2 * GiB, 4 * GiB)
    assert (dev.reserved_before, dev.reserved_after, dev.peak_reserved) == (2 * GiB, 6 * GiB, 6 * GiB)
    assert dev.allocated_delta == 1 * GiB and dev.peak_increase == 3 * GiB and dev.reserved_delta == 4 * GiB
    assert dev.used_after == 6 * GiB + 512 * MiB and dev.total == 16 * GiB
    assert dev.name == "Fake GPU (test)"
    assert rec.peaks == "per cell"


def test_without_peak_reset_peaks_are_sampled_and_counters_untouched(fake_gpu):
    fake, probe = fake_gpu([(1 * GiB, 2 * GiB), (4 * GiB, 6 * GiB), (2 * GiB, 6 * GiB)])
    fake.peak = [9 * GiB, 9 * GiB]  # the user's own lifetime peak must survive
    m = Measurement.begin(probe, track_peaks=False)
    fake.advance()
    m.observe(probe.sample())  # what the sampler thread does
    fake.advance()
    rec = m.finish().record()
    assert fake.resets == 0
    assert rec.devices[0].peak_allocated == 4 * GiB  # sampled, not the stale 9 GiB lifetime peak
    assert rec.peaks == "sampled"


def test_device_initialized_during_the_cell_starts_at_zero(fake_gpu):
    fake, probe = fake_gpu([(0, 0), (3 * GiB, 4 * GiB)])
    fake.initialized = False
    m = Measurement.begin(probe)
    assert m.start.reason == "CUDA not initialized yet"
    fake.initialized = True
    fake.advance()
    rec = m.finish().record()
    dev = rec.devices[0]
    assert (dev.allocated_before, dev.allocated_after, dev.peak_allocated) == (0, 3 * GiB, 3 * GiB)
    assert dev.used_before is None and rec.devices_note is None


def test_cpu_only_record_carries_host_memory(fake_gpu):
    fake, probe = fake_gpu([(0, 0)])
    fake.initialized = False
    m = Measurement.begin(probe, source="buf = bytearray(2**26)")
    buf = bytearray(64 * MiB)
    rec = m.finish().record()
    assert rec.devices == () and rec.devices_note == "CUDA not initialized yet"
    assert 63 * MiB <= rec.host.rss_delta <= 66 * MiB  # the kernel's per-CPU RSS counters lag a little
    assert rec.host.peak_rss >= rec.host.rss_after
    del buf


def test_records_hold_only_plain_values_and_serialise():
    rec = CellRecord(3, "cell-1", "x = 1", 1.5e9, 0.25, "ValueError", "bad <value>",
                     HostRecord(100, 200, 300), (DeviceRecord(0, "GPU", 1, 2, 3, 4, 5, 6, 7, 8, 9),))
    data = json.loads(json.dumps(rec.to_dict()))
    assert data["schema"] == SCHEMA == 1 and list(data)[0] == "schema"
    assert data["host"] == {"rss_before": 100, "rss_after": 200, "peak_rss": 300, "rss_delta": 100, "rss_peak_increase": 200}
    assert data["devices"][0]["allocated_delta"] == 1 and data["devices"][0]["device"] == "cuda:0"
    assert set(data) >= {"execution_count", "cell_id", "source", "duration_s", "error", "host", "devices"}
    assert "lines" not in data

    def leaves(obj):
        if isinstance(obj, (CellRecord, HostRecord, DeviceRecord)):
            for v in vars(obj).values():
                yield from leaves(v)
        elif isinstance(obj, tuple):
            for v in obj:
                yield from leaves(v)
        else:
            yield obj

    assert all(v is None or isinstance(v, (int, float, str, bool)) for v in leaves(rec))


def test_source_and_message_are_bounded(fake_gpu):
    _, probe = fake_gpu([(0, 0)])
    m = Measurement.begin(probe, source="x" * (MAX_SOURCE_CHARS * 3))
    rec = m.finish(error="E", error_message="y" * 100_000).record()
    assert len(rec.source) < MAX_SOURCE_CHARS + 100
    assert len(rec.error_message) < 2100


def test_ledger_is_bounded_and_builds_records_only_when_asked(fake_gpu):
    ledger = Ledger(maxlen=3)
    recs = [CellRecord(i, None, "", 0.0, 0.0) for i in range(5)]
    for r in recs:
        ledger.append(r)
    assert [r.execution_count for r in ledger.records()] == [2, 3, 4]
    assert ledger.last().execution_count == 4
    ledger.resize(2)
    assert [r.execution_count for r in ledger.records()] == [3, 4] and ledger.maxlen == 2
    _, probe = fake_gpu([(0, 0), (GiB, GiB)])
    m = Measurement.begin(probe, source="x = f()").finish(execution_count=9)
    ledger.append(m)
    assert m._record is None  # finishing a cell builds nothing
    assert ledger.tail(1)[0].execution_count == 9 and ledger.last() is ledger.tail(1)[0]  # built once
    ledger.clear()
    assert len(ledger) == 0 and ledger.last() is None and ledger.tail(3) == []


def test_moved_agrees_with_the_record(fake_gpu):
    fake, probe = fake_gpu([(GiB, GiB), (GiB + 20 * MiB, GiB + 20 * MiB)])
    m = Measurement.begin(probe)
    fake.advance()
    m.finish()
    assert m.moved(16 * MiB) and not m.moved(32 * MiB)
    assert m.record().moved_bytes == 20 * MiB


def test_records_frame_one_row_per_cell_and_device():
    pd = pytest.importorskip("pandas")
    recs = [
        CellRecord(1, None, "import torch", 0.0, 0.1, host=HostRecord(10, 20, 30)),
        CellRecord(2, None, "x = f()", 0.0, 0.1, host=HostRecord(20, 20, 20),
                   devices=(DeviceRecord(0, "GPU", 0, 2**40, 2**40, 0, 2**41, 2**41, None, None, None),)),
    ]
    frame = records_frame(recs)
    assert list(frame["device"]) == ["host", "host", "cuda:0"]
    assert int(frame.loc[2, "delta"]) == 2**40 and pd.isna(frame.loc[2, "used_after"])
    assert int(frame.loc[0, "delta"]) == 10 and int(frame.loc[2, "rss_after"]) == 20  # host RSS on every row
    assert list(frame.columns) == list(ROW_FIELDS)


def test_csv_and_dataframe_share_one_row_schema(tmp_path):
    import csv

    recs = [CellRecord(2, "c2", "x = f()", 0.0, 0.1, host=HostRecord(20, 30, 40),
                       devices=(DeviceRecord(0, "GPU", 0, 2**40, 2**40, 0, 2**41, 2**41, None, None, None),))]
    path = tmp_path / "cells.csv"
    write_csv(str(path), recs)
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == list(ROW_FIELDS)
    assert [r["schema"] for r in rows] == [str(SCHEMA)] * 2  # a CSV file says its version on every row
    assert [r["device"] for r in rows] == ["host", "cuda:0"]
    assert rows[1]["delta"] == str(2**40) and rows[0]["delta"] == "10" and rows[1]["rss_after"] == "30"


# -- to_dict() is data: numbers and names, never a sentence ---------------------------------------------


#: The keys whose strings are text kept as it came, not made from the record: the user's code (a cell's,
#: a line's), an error's message (the cell's, a failed rank's), and what the probe and the count said they
#: could not measure (their own messages, as an error's). Every other string of a record is a name.
KEPT_TEXT = {"source", "error_message", "message", "devices_note", "left_out"}
#: The keys that held the views' sentences before schema 1.
SENTENCE_KEYS = {"reason", "note", "causes", "warning", "causes_new"}
#: A size as the words write it (``+64.00 MiB``): the mark of a sentence about memory.
WRITTEN_SIZE = re.compile(r"\d (bytes|KiB|MiB|GiB|TiB|PiB)\b")


def _strings(obj, path=()):
    """``(keys on the way, string)`` for every string value in a ``to_dict()``, and the keys it uses."""
    if isinstance(obj, str):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield path + (key,), None
            yield from _strings(value, path + (key,))
    elif isinstance(obj, list):
        for value in obj:
            yield from _strings(value, path)


@pytest.mark.slow
def test_a_real_cells_to_dict_holds_numbers_and_names_never_a_sentence(ip, gpumem, restore_user_ns):
    """Cells recorded for real (a ``--lines`` training step with its roles, a re-run that keeps memory, a
    failed cell): the views have words for each, and ``to_dict()`` has none of them. A name is at most
    three words (``per cell``, ``start order``, ``lin hook``) and writes no size; a sentence fails both."""
    pytest.importorskip("torch")
    from ipy_gpumem.display.words import cell_reason, line_reason, rerun_warning

    before = gpumem.threshold
    gpumem.threshold = 0  # every cell looked at (on the CPU a re-run is checked when RSS moved)
    try:
        run(ip, "import torch\nsw_keep = []")
        run(ip, "%%gpumem --lines -o sw_rec\n"
                "sw_model = torch.nn.Linear(1024, 1024)\n"
                "sw_opt = torch.optim.Adam(sw_model.parameters())\n"
                "sw_loss = sw_model(torch.randn(64, 1024)).square().mean()\n"
                "sw_loss.backward()\n"
                "sw_opt.step()\n")
        lines = ip.user_ns["sw_rec"]
        warned = []
        for _ in range(3):  # 64 MiB a run, kept by `sw_keep`: the run that first names it warns
            run(ip, "sw_keep.append(torch.ones(2**24) * 1)")
            warned += [rec for rec in [gpumem.ledger.last()] if rec.rerun is not None and rec.rerun.warns]
        rerun = warned[0] if warned else gpumem.ledger.last()
        run(ip, "raise ValueError('a message: with words, 64.00 MiB of them')")
        failed = gpumem.ledger.last()
    finally:
        gpumem.threshold = before
    # The views have words for these cells (until schema 1, to_dict() carried them too).
    assert cell_reason(lines) and any(line_reason(line) for line in lines.lines)
    assert rerun.rerun is not None and rerun.rerun.suspects and rerun_warning(rerun.rerun), rerun.rerun
    assert failed.error == "ValueError"
    for rec in (lines, rerun, failed):
        data = json.loads(json.dumps(rec.to_dict()))
        assert data["schema"] == SCHEMA
        found = list(_strings(data))
        assert not SENTENCE_KEYS & {path[-1] for path, value in found if value is None and path}
        for path, value in found:
            if value is None or KEPT_TEXT & set(path):
                continue
            assert len(value.split()) <= 3 and not WRITTEN_SIZE.search(value), (path, value)
