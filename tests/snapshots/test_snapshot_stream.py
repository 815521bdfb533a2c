"""The streaming snapshot reader gives exactly what plain unpickling gives, on every capture, every protocol and every framing, and refuses what is not plain data in one line."""
import gzip
import io
import os
import pickle
import pickletools
import random
import struct

import pytest

from ipy_gpumem.snapshots import SnapshotError, read_snapshot, stream
from ipy_gpumem.snapshots.load import _PlainData, load_snapshot
from ipy_gpumem.snapshots.report import SnapshotReport
from ipy_gpumem.snapshots.schema import parse
from ipy_gpumem.snapshots.trace import Trace

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "snapshots")
CAPTURES = sorted(f for f in os.listdir(HERE) if f.endswith(".pickle.gz"))


def raw(name):
    with gzip.open(os.path.join(HERE, name), "rb") as fh:
        return _PlainData(fh).load()  # the plain C unpickler: what the streaming reader must match


def plain_report(data, source):
    return SnapshotReport(parse(data), source).to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("name", CAPTURES)
def test_every_capture_reads_as_plain_unpickling_does(name):
    data = raw(name)
    assert read_snapshot(os.path.join(HERE, name)).to_dict() == plain_report(data, name)
    streamed = load_snapshot(os.path.join(HERE, name))
    if isinstance(data, dict):
        for trace, events in zip(streamed["device_traces"], data["device_traces"]):
            assert isinstance(trace, Trace) and len(trace) == len(events)
            assert list(trace) == events  # every event, key order and values, rebuilt from the columns
        assert streamed["segments"] == data["segments"]


@pytest.mark.slow
@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_protocols_2_to_5(protocol):
    data = raw("Constructor-Sun_memory_snapshot.pickle.gz")  # three devices, an OOM, expandable segments
    got = read_snapshot(pickle.dumps(data, protocol=protocol)).to_dict()
    want = read_snapshot(data).to_dict()
    got.pop("source"), want.pop("source")
    assert got == want


def reframed(blob, seed):
    """The same pickle with FRAME opcodes put back at random opcode boundaries (frames of 1 to 300 bytes)."""
    rng = random.Random(seed)
    starts = [pos for op, _arg, pos in pickletools.genops(blob) if op.name not in ("FRAME", "PROTO")]
    body = bytearray()
    kept = [(p, blob[p:q]) for p, q in zip(starts, starts[1:] + [len(blob)])]
    out = bytearray(blob[:2])
    for _p, op in kept:
        if op[:1] == b"\x95":
            continue
        body += op
        if len(body) > rng.randint(1, 300):
            out += b"\x95" + struct.pack("<Q", len(body)) + body
            body = bytearray()
    out += b"\x95" + struct.pack("<Q", len(body)) + body
    return bytes(out)


@pytest.mark.slow
def test_frames_and_buffers_split_anywhere(monkeypatch):
    data = raw("bcrafton.pickle.gz")
    want = plain_report(data, "snapshot bytes")
    blob = pickle.dumps(data, protocol=4)
    assert read_snapshot(blob).to_dict() == want
    awkward = reframed(blob, 1)
    assert pickle.loads(awkward) == data  # still a valid pickle of the same data
    assert read_snapshot(awkward).to_dict() == want
    # A buffer refilled every few bytes: events cut at every place, read the general way or the fast one.
    monkeypatch.setattr(stream, "CHUNK", 97)
    monkeypatch.setattr(stream, "MARGIN", 211)
    assert read_snapshot(awkward).to_dict() == want
    assert list(load_snapshot(awkward)["device_traces"][0]) == data["device_traces"][0]


def test_an_event_shared_by_reference_reads_the_plain_way():
    data = raw("sil_mem_snapshot.pickle.gz")
    data["device_traces"][0] = data["device_traces"][0] * 2  # the same dicts twice: memo references to events
    got = read_snapshot(pickle.dumps(data, protocol=4)).to_dict()
    assert got["events"] == 2 * 97
    assert got == plain_report(data, "snapshot bytes")


class Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize("where", ["top", "event"])
def test_a_class_reference_runs_nothing(tmp_path, protocol, where):
    marker = tmp_path / "ran"
    data = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 2}] * 3]}
    if where == "top":
        data["x"] = Evil(marker)
    else:
        data["device_traces"][0] = [dict(e) for e in data["device_traces"][0]] + [{"action": Evil(marker)}]
    f = tmp_path / "evil.pickle"
    f.write_bytes(pickle.dumps(data, protocol=protocol))
    with pytest.raises(SnapshotError, match=r"refers to (posix|nt|os)\.system") as err:
        read_snapshot(str(f))
    assert "\n" not in str(err.value) and not marker.exists()


@pytest.mark.slow
def test_a_truncated_file_gives_one_line(tmp_path):
    blob = (gzip.open(os.path.join(HERE, "ZidongLiu_memory.pickle.gz")).read())
    for cut in (3, 11, 5000, len(blob) // 2, len(blob) - 1):
        f = tmp_path / "cut.pickle"
        f.write_bytes(blob[:cut])
        with pytest.raises(SnapshotError, match="not a readable pickle") as err:
            read_snapshot(str(f))
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("content", [
    b"\x80\x04" + bytes(range(256)) * 4,
    b"\x80\x04\x95\x05\x00\x00\x00\x00\x00\x00\x00}\x94(zzzz",
    b"\x80\x05" + os.urandom(3000),
    b"\x00\x01garbage",
    b"",
])
def test_garbage_gives_one_line(tmp_path, content):
    f = tmp_path / "g.pickle"
    f.write_bytes(content)
    with pytest.raises(SnapshotError) as err:
        read_snapshot(str(f))
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_the_limit_counts_uncompressed_bytes(tmp_path):
    gz = os.path.join(HERE, "ZidongLiu_memory.pickle.gz")
    unpacked = len(gzip.open(gz).read())
    between = (os.path.getsize(gz) + unpacked) // 2
    with pytest.raises(SnapshotError, match="over the limit") as err:
        read_snapshot(gz, max_bytes=between)
    assert "\n" not in str(err.value)
    assert read_snapshot(gz, max_bytes=unpacked).to_dict()["events"] == 23105


def test_trace_columns_rebuild_any_event():
    events = [{"action": "alloc", "addr": 1 << 40, "size": 512, "stream": 0, "time_us": 5, "frames": []},
              {"action": "oom", "device_free": 3, "size": 1 << 33, "stream": 0, "frames": [{"name": "f"}]},
              {"addr": 7, "action": "free_completed", "size": 512.0},  # a float size: kept whole
              {"action": "alloc", "addr": 1 << 70, "size": 1},  # too big for a column
              {"action": "segment_map", "addr": 0, "size": 2, "note": ["a", "list"]}]
    trace = Trace.from_events(events)
    assert list(trace) == events and trace[-1] == events[-1] and trace[1:3] == events[1:3]
    assert sorted(trace.odd) == [2, 3, 4]
    assert [r[0] for r in trace.rows()] == [e.get("action") for e in events]
    assert [r[0] for r in trace.rows(reverse=True)] == [e.get("action") for e in reversed(events)]


@pytest.mark.parametrize("protocol", [0, 1])
def test_protocols_0_and_1_are_read_by_the_same_bounded_reader(protocol):
    data = raw("sil_mem_snapshot.pickle.gz")
    got = read_snapshot(pickle.dumps(data, protocol=protocol)).to_dict()
    want = read_snapshot(data).to_dict()
    got.pop("source"), want.pop("source")
    assert got == want


@pytest.mark.slow
def test_json_snapshots_read_as_their_pickle(tmp_path):
    import json

    for name in ("Constructor-Sun_memory_snapshot.pickle.gz", "Muduard_memory_snapshot.pickle.gz"):
        data = raw(name)
        f = tmp_path / "s.json"
        f.write_text(json.dumps(data))  # what json.dump(torch.cuda.memory._snapshot(), fh) writes (tuples as lists)
        got, want = read_snapshot(str(f)).to_dict(), read_snapshot(data).to_dict()
        got.pop("source"), want.pop("source")
        assert got == want
        gz = tmp_path / "s.json.gz"
        gz.write_bytes(gzip.compress(f.read_bytes()))
        assert read_snapshot(str(gz)).to_dict()["peak_allocated"] == want["peak_allocated"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"segments": [}')
    with pytest.raises(SnapshotError, match="not a readable JSON snapshot") as err:
        read_snapshot(str(bad))
    assert "\n" not in str(err.value)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SnapshotError, match="nested too deep|not a memory snapshot"):
        read_snapshot(str(deep))


def plain_pickle(*ops):
    return b"\x80\x04" + b"".join(ops) + b"."


@pytest.mark.parametrize("content,match", [
    (plain_pickle(b"N", b"r" + struct.pack("<I", 1 << 28), b"0", b"h\x00"), "memo entry 0 is missing"),  # a gap: never filled
    (plain_pickle(b"N\x94", b"N", b"q\x00", b"0"), "memo entry 0 written twice"),
    (plain_pickle(b"]\x94", b"h\x00", b"a"), "a change to a container after a reference to it"),  # a list in itself
    (plain_pickle(b"]\x942", b"a"), "a change to a container after a reference to it"),  # DUP: the same
    (plain_pickle(b"}\x94", b"]\x94", b"N", b"s"), "a dict key is a list"),  # hashing a container: never
    (plain_pickle(b"\x8b" + struct.pack("<i", 4000) + b"\x01" * 4000), "an integer of 4000 bytes"),
    (b"(lp0\ng0\na.", "a change to a container after a reference to it"),  # protocol 0: a cycle
])
def test_plain_data_only_within_bounds(tmp_path, content, match):
    with pytest.raises(SnapshotError, match=match) as err:
        load_snapshot(content)
    assert "\n" not in str(err.value)


def test_shared_stacks_are_counted_not_copied():
    # A snapshot whose blocks share one long stack, as torch's do (each block a memo reference to it):
    # read without a copy per block, and what the references stand for stays within the bound.
    frames = [{"filename": f"f{i}.py", "line": i, "name": "g"} for i in range(2000)]
    blocks = [{"address": i * 512, "size": 512, "requested_size": 512, "state": "active_allocated",
               "frames": frames} for i in range(1000)]
    data = {"segments": [{"device": 0, "address": 0, "total_size": 2 << 20, "segment_type": "small",
                          "blocks": blocks}], "device_traces": [[]]}
    with pytest.raises(SnapshotError, match="stand for more than"):  # 1000 x 2000 frames from ~80 KB
        load_snapshot(pickle.dumps(data, protocol=4))
    data["segments"][0]["blocks"] = blocks[:20]
    parsed = load_snapshot(pickle.dumps(data, protocol=4))["segments"][0]["blocks"]
    assert all(b["frames"] is parsed[0]["frames"] for b in parsed)  # shared, as in the file
    report = read_snapshot(pickle.dumps(data, protocol=4))
    assert report.to_dict()["sites"][0]["blocks"] == 20


@pytest.mark.slow
def test_trace_columns_widen_when_a_value_needs_it():
    events = [{"action": "alloc", "addr": i, "size": 512, "stream": i % 300, "frames": [{"line": i}]}
              for i in range(40_000)]
    events.append({"action": "alloc", "addr": 1, "size": 5 << 30, "stream": 0, "frames": []})
    trace = Trace.from_events(events)
    assert (trace.size.typecode, trace.frame.typecode, trace.extra.typecode) == ("q", "i", "H")
    assert trace[-1] == events[-1] and trace[39_999] == events[39_999] and len(trace.extras) == 300
    small = Trace.from_events(events[:10])
    assert (small.size.typecode, small.frame.typecode, small.extra.typecode) == ("I", "h", "B")


@pytest.mark.parametrize("late", [-1, 1 << 32, (1 << 32) - 1, 1 << 62])
def test_event_times_are_offsets_until_one_does_not_fit(late):
    """4 bytes an event while every time is 0 to 71 minutes after the first; one before it, later, or equal to
    the column's "no time" mark turns the column into absolute times, in bulk or one event at a time."""
    first = 1_763_324_225_835_213
    events = [{"action": "alloc", "addr": i, "size": 512, "time_us": first + i} for i in range(3)]
    events.insert(1, {"action": "alloc", "addr": 9, "size": 512})  # no time
    timed = Trace.from_events(events)
    assert timed.time.typecode == "I" and list(timed) == events
    events.append({"action": "free_completed", "addr": 0, "size": 512, "time_us": first + late})
    for trace in (Trace.from_events(events), Trace.from_events(events[:3])):
        if len(trace) == 3:
            trace.extend_columns([trace.action_code(e["action"]) for e in events[3:]], [e["addr"] for e in events[3:]],
                                 [e["size"] for e in events[3:]], [e["time_us"] for e in events[3:]], None, [0, 0], 2)
        assert trace.time.typecode == "q" and [trace.time_at(i) for i in range(5)][::2] == [first, first + 1,
                                                                                              first + late]
        assert trace[1] == events[1] and trace[4]["time_us"] == first + late
    untimed = Trace.from_events([{"action": "alloc", "addr": 1, "size": 2}] * 3)
    assert untimed.time.typecode == "I" and all("time_us" not in e for e in untimed)


@pytest.mark.slow
def test_values_every_event_had_until_one_differs():
    """The fast path writes a value every event of a run had into its template (torch's stream, its fresh "N/A"
    strings); events that differ, one or a run of them, and a stack shared by an allocation and its free, read as
    plain unpickling reads them, in bulk or over a buffer refilled every few bytes."""
    stacks = [[{"filename": f"f{i}.py", "line": i, "name": "g"}] for i in range(40)]
    events = []
    for i in range(3000):
        stream_ = 0 if i < 1000 or i % 700 == 3 else 7 if i < 2000 else 1 << 40  # a run, single misfits, a new run
        frames = stacks[i % 40] if i % 3 else list(stacks[i % 40])  # a fresh list, or one shared by reference
        for action in ("alloc", "free_requested"):
            events.append({"action": action, "addr": i * 512, "size": 512, "stream": stream_,
                           "time_us": 1_763_324_225_835_213 + i, "compile_context": "".join(["N/", "A"]),
                           "frames": frames})
    data = {"segments": [], "device_traces": [events]}
    blob = pickle.dumps(data, protocol=4)
    assert list(load_snapshot(blob)["device_traces"][0]) == events
    fast = [0]
    bulk = stream._Machine.bulk

    def counted(self, tpl, trace, rows):
        fast[0] += len(rows) if tpl.fixed else 0
        return bulk(self, tpl, trace, rows)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream._Machine, "bulk", counted)
        assert list(load_snapshot(blob)["device_traces"][0]) == events
        assert fast[0] > len(events) // 3  # the runs went the way of a template with their values written in
        mp.setattr(stream, "CHUNK", 97)
        mp.setattr(stream, "MARGIN", 211)
        assert list(load_snapshot(blob)["device_traces"][0]) == events


def test_addresses_and_times_of_every_width():
    """Numbers the fast path moves as bytes (a run of LONG1 tokens of one width) or unpickles (any other run): every
    width, the top bit set (one byte more), negative numbers, and runs that change width, read as plain unpickling."""
    values = [1 << 40, (1 << 47) + 5, 0x7F00_0000_0000, -(1 << 44), 1 << 62, -1, 255, 1 << 16, 1 << 31]
    events = [{"action": "alloc", "addr": values[i // 1500] + i, "size": 512,
               "time_us": 1_763_324_225_835_213 + (i if i % 1000 else -i), "frames": []} for i in range(13_500)]
    blob = pickle.dumps({"segments": [], "device_traces": [events]}, protocol=4)
    moved = []
    column = stream._long1_column

    def counted(data, n):
        out = column(data, n)
        moved.append(out is not None)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stream, "_long1_column", counted)
        assert list(load_snapshot(blob)["device_traces"][0]) == events
    assert any(moved) and not all(moved)


@pytest.mark.slow
def test_dicts_in_lists_the_fast_way(monkeypatch):
    """With the fast way for dicts in lists from the first one (a big snapshot's blocks and frames), the segments
    read as plain unpickling reads them, and what shared stacks stand for is still counted."""
    monkeypatch.setattr(stream, "DICTS_AFTER", 0)
    made = []
    put = stream._Machine.put_dicts

    def counted(self, shape, rows):
        ok = put(self, shape, rows)
        made.extend([shape.keys] * len(rows) if ok else [])
        return ok

    monkeypatch.setattr(stream._Machine, "put_dicts", counted)
    name = "Muduard_dump_snapshot.pickle.gz"  # 6,644 blocks in 673 segments
    assert load_snapshot(os.path.join(HERE, name))["segments"] == raw(name)["segments"]
    assert ("address", "size", "requested_size", "state", "frames") in made
    frames = [{"filename": f"f{i}.py", "line": i, "name": "g"} for i in range(2000)]
    blocks = [{"address": i * 512, "size": 512, "requested_size": 512, "state": "active_allocated",
               "frames": frames} for i in range(1000)]
    data = {"segments": [{"device": 0, "address": 0, "total_size": 2 << 20, "segment_type": "small",
                          "blocks": blocks}], "device_traces": [[]]}
    made.clear()
    with pytest.raises(SnapshotError, match="stand for more than"):  # 1000 x 2000 frames from ~80 KB
        load_snapshot(pickle.dumps(data, protocol=4))
    assert made  # the blocks after the first two went the fast way
    data["segments"][0]["blocks"] = blocks[:20]
    parsed = load_snapshot(pickle.dumps(data, protocol=4))["segments"][0]["blocks"]
    assert parsed == blocks[:20] and all(b["frames"] is parsed[0]["frames"] for b in parsed)


@pytest.mark.parametrize("late", [-1, 1 << 32, (1 << 32) - 1, (1 << 32) - 2])
def test_event_times_in_bulk_are_offsets_until_one_does_not_fit(late):
    """The fast path turns a run of times into 4-byte offsets at once; one before the first time, 71 minutes after
    it or equal to the "no time" mark, in the middle of a run, turns the column absolute, as one at a time does."""
    first = 1_763_324_225_835_213
    events = [{"action": "alloc", "addr": 1 << 40 | i, "size": 512, "time_us": first + i, "frames": []}
              for i in range(2000)]
    events[1500]["time_us"] = first + late
    trace = load_snapshot(pickle.dumps({"segments": [], "device_traces": [events]}, protocol=4))["device_traces"][0]
    assert list(trace) == events
    assert trace.time.typecode == ("I" if late == (1 << 32) - 2 else "q")
