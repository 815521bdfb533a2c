"""Real allocator snapshots (tests/fixtures/snapshots, recorded on GPUs by public projects): read safely, replayed exactly, shown.

Every capture's replay is checked against the capture's own end state: the blocks in place at the
end whose sizes the replay had to infer (events carry requests, counters count blocks) must come
out at exactly their recorded size, and allocated and reserved must land on the recorded totals.
"""
import faulthandler
import gzip
import io
import json
import os
import pickle

import pytest

import ipy_gpumem
from ipy_gpumem.snapshots import SnapshotError, read_snapshot
from ipy_gpumem.snapshots.load import load_snapshot
from ipy_gpumem.snapshots.replay import rounder
from ipy_gpumem.snapshots.sites import site_of
from ipy_gpumem.snapshots.view import open_snapshot

from snapshot_fixtures import path, raw

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "snapshots")
CAPTURES = sorted(f for f in os.listdir(HERE) if f.endswith(".pickle.gz"))
MiB, GiB = 2**20, 2**30


@pytest.mark.slow
def test_every_generation_is_here():
    assert len(CAPTURES) == 13
    generations = {read_snapshot(os.path.join(HERE, f)).generation.split()[0] for f in CAPTURES}
    assert {"2023", "2024", "2025", "2026", "segments"} <= generations


@pytest.mark.slow
@pytest.mark.parametrize("name", [c[: -len(".pickle.gz")] for c in CAPTURES])
def test_replay_lands_on_the_recorded_end_state(name):
    report = read_snapshot(path(name))
    for device, replay in report.replays.items():
        check = replay.check
        assert check.anomalies == 0, (device, check)
        assert check.exact == check.blocks, (device, check)  # every inferred block size is the real one
        assert check.allocated_replayed == check.allocated_real, (device, check)
        assert check.reserved_replayed == check.reserved_real, (device, check)
        assert check.ok
        assert replay.peak("allocated")[0] <= max(replay.peak("reserved")[0], replay.initial_reserved)
    data = report.to_dict()
    json.dumps(data)  # JSON-serialisable
    for key in ("peak_allocated", "peak_reserved", "start", "oom", "sites", "fragmentation", "annotations"):
        assert key in data


def test_block_sizes_not_requests_are_counted():
    # cranberrii's trace has allocations whose free range was not split (the rest was at most
    # 1 MiB): torch counts the whole block, and so must the peak.
    report = read_snapshot(path("cranberrii_memory_snapshot"))
    replay = report.replay()
    round_size = rounder(report.settings)
    kept = [a for a in replay.allocations if a.born >= 0 and a.size != round_size(a.requested)]
    assert len(kept) > 100
    assert all(0 < a.size - round_size(a.requested) <= MiB for a in kept)
    peak, at = replay.peak()
    live = replay.live_at(at)
    assert sum(a.size for a in live) == peak
    assert sum(round_size(a.requested) for a in live) < peak  # counting requests would be short


def test_an_oom_on_an_expandable_segment_device():
    report = read_snapshot(path("Constructor-Sun_memory_snapshot"))
    assert report.device == 1 and sorted(report.replays) == [0, 1, 2]
    oom = report.to_dict()["oom"]
    event = next(e for e in raw("Constructor-Sun_memory_snapshot")["device_traces"][1] if e["action"] == "oom")
    assert oom["requested"] == event["size"] == 5308694528
    assert oom["device_free"] == event["device_free"] == 95682560
    assert oom["expandable_segments"] is True and oom["largest_free_block"] is None
    assert oom["reserved"] - oom["allocated"] == oom["reserved_unallocated"] > 0
    # What the allocator held at the failure is the replay's counters at that event.
    replay = report.replay(1)
    assert (oom["allocated"], oom["reserved"]) == (replay.allocated[oom["event"]], replay.reserved[oom["event"]])
    assert oom["site"]["file"].endswith("train/models.py") and oom["site"]["line"] == 181
    assert report.to_dict()["devices"][0]["oom"] is None


@pytest.mark.slow
def test_the_state_when_recording_began():
    report = read_snapshot(path("JasperSolt_snapshot"))
    start = report.to_dict()["start"]
    replay = report.replay()
    assert start == {"allocated": replay.initial_allocated, "reserved": replay.initial_reserved,
                     "blocks": replay.initial_blocks}
    # Walking forward from it gives the recorded end (the check), and the first event starts from it.
    first = raw("JasperSolt_snapshot")["device_traces"][0][0]
    delta = replay.allocated[0] - start["allocated"]
    assert delta == (0 if first["action"] != "alloc" else replay.allocations[start["blocks"]].size)


@pytest.mark.slow
def test_sites_name_notebook_cells():
    report = read_snapshot(path("cranberrii_memory_snapshot"))
    sites = report.to_dict()["sites"]
    top = sites[0]
    assert top["name"].startswith("cell 3105878423.py, line ") and top["user"]
    assert any(s["name"] == "(allocated before recording began)" for s in sites)
    named = read_snapshot(path("cranberrii_memory_snapshot"), cells={"/tmp/ipykernel_114/3105878423.py": 7})
    assert named.to_dict()["sites"][0]["name"] == f"In [7], line {top['line']}"
    assert site_of([{"filename": "<ipython-input-5-0123abcd>", "name": "<module>", "line": 3}]).label == "In [5], line 3"


def test_annotations_and_metadata():
    data = read_snapshot(path("bcrafton")).to_dict()
    assert data["annotations"] and data["annotations"][0]["name"] == "Optimizer.step#AdamW.step"
    assert data["annotations"][0]["end"] > data["annotations"][0]["start"]
    assert data["allocator_settings"]["expandable_segments"] is False


def test_fragmentation_over_time():
    data = read_snapshot(path("magma27")).to_dict()
    frag = data["fragmentation"]
    assert len(frag["over_time"]) > 50
    for f in frag["over_time"]:
        assert 0 <= f["largest_free_block"] <= f["free_in_reserved"]
    # 13.2 GiB reserved, 1.3 GiB allocated at the end: most of it is free inside segments.
    assert frag["at_end"]["free_in_reserved"] > 10 * GiB


@pytest.mark.slow
def test_older_formats():
    segments_only = read_snapshot(path("Muduard_memory_snapshot"))
    assert segments_only.generation.startswith("segments only")
    assert segments_only.replay().events == 0
    history = read_snapshot(path("Yiyi-philosophy_oom_snapshot"))
    assert history.generation.startswith("2023")
    assert history.to_dict()["sites"][0]["file"].endswith("flexgen/pytorch_backend.py")


def test_sources_path_bytes_dict_and_protocol_5(tmp_path):
    data = raw("sil_mem_snapshot")
    plain = tmp_path / "s.pickle"
    plain.write_bytes(pickle.dumps(data, protocol=5))
    expected = read_snapshot(path("sil_mem_snapshot")).to_dict()
    for source in (str(plain), plain.read_bytes(), data):
        got = read_snapshot(source).to_dict()
        assert (got["peak_allocated"], got["peak_reserved"]) == (expected["peak_allocated"], expected["peak_reserved"])


def test_a_pickle_with_a_class_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    bad = tmp_path / "evil.pickle"
    bad.write_bytes(pickle.dumps({"segments": [], "device_traces": [], "x": Evil()}))
    with pytest.raises(SnapshotError, match="refers to"):
        read_snapshot(str(bad))
    assert not marker.exists()


@pytest.mark.parametrize("content,match", [
    (b"not a pickle at all", "not a readable pickle"),
    (pickle.dumps({"a": 1}), "not a memory snapshot"),
    (pickle.dumps([1, 2]), "segment 0"),
    (pickle.dumps({"segments": [], "device_traces": []}), "nothing was recorded"),
    (pickle.dumps({"segments": "x", "device_traces": []}), "must be lists"),
])
def test_bad_files_get_one_line(tmp_path, content, match):
    f = tmp_path / "f.pickle"
    f.write_bytes(content)
    with pytest.raises(SnapshotError, match=match) as err:
        read_snapshot(str(f))
    assert "\n" not in str(err.value)


def test_missing_and_oversized(tmp_path):
    with pytest.raises(SnapshotError, match="cannot read"):
        read_snapshot(str(tmp_path / "nope.pickle"))
    with pytest.raises(SnapshotError, match="over the limit"):
        read_snapshot(path("sil_mem_snapshot"), max_bytes=100)


@pytest.mark.slow
def test_views_text_html_and_zoom():
    report = open_snapshot(path("Constructor-Sun_memory_snapshot"))
    text = str(report)
    assert "Peak allocated 78.29 GiB" in text and "tried to allocate 4.95 GiB with 91.25 MiB free" in text
    assert "Diagnosis" in text  # the live OOM panel, fed from the recorded failure
    html = report.view().html
    assert "data:image/svg+xml," in html and "<svg" not in html and "78.29 GiB" in html  # an image: kept untrusted
    whole = report.peak()[0]
    t_peak = report.to_dict()["peak_allocated_at"]
    early = report.view(end=t_peak / 2)
    assert early.data["peak_allocated"] < whole
    panel = report.oom_panel()
    assert panel.data.oom.free == 95682560 and panel.data.memory.allocated == report.to_dict()["oom"]["allocated"]
    assert open_snapshot(path("JasperSolt_snapshot")).oom_panel() is None


@pytest.mark.slow
def test_public_api_and_magic(ip, gpumem):
    report = ipy_gpumem.snapshot(path("magma27"))
    assert report.to_dict()["peak_allocated"] == read_snapshot(path("magma27")).to_dict()["peak_allocated"]
    view = gpumem.run_mode(f"snapshot {path('magma27')} --from 0.05 --to 0.2")  # what %gpumem displays
    assert view.data["peak_allocated"] <= report.to_dict()["peak_allocated"]
    assert "showing 50 ms to 200 ms" in view.text


@pytest.mark.parametrize("line,match", [
    ("%gpumem snapshot", "needs the path"),
    ("%gpumem snapshot /no/such.pickle", "cannot read"),
    ("%gpumem snapshot a.pickle --from x", "--from takes seconds"),
    ("%gpumem snapshot a.pickle --from 2 --to 1", "is not after"),
    ("%gpumem snapshot a.pickle --device host", "--device takes a device of the snapshot"),
    ("%gpumem snapshot a.pickle --device mps", "--device takes a device of the snapshot"),
    ("%gpumem snapshot a.pickle --device tpu:0", "--device takes a device of the snapshot"),
    ("%gpumem snapshot a.pickle --colour", "unknown option"),
])
def test_magic_bad_input(ip, gpumem, line, match):
    from IPython.utils.capture import capture_output

    with capture_output() as out:
        result = ip.run_cell(line)
    assert result.error_in_exec is None or "UsageError" in type(result.error_in_exec).__name__
    assert match in out.stderr + out.stdout
    assert "Traceback" not in out.stderr + out.stdout


def test_magic_unknown_device(ip, gpumem):
    from IPython.utils.capture import capture_output

    with capture_output() as out:
        ip.run_cell(f"%gpumem snapshot {path('sil_mem_snapshot')} --device 3")
    assert "has no cuda:3; it has cuda:0" in out.stderr


class RecorderReplay:
    """A stand-in for torch's CUDA history recorder (no GPU here), labelled as such: it hands back a
    real capture (bcrafton's, recorded on a GPU) and notes every call, so the start/stop protocol of
    ``%%gpumem --trace`` is checked; tests/whole/test_gpu.py runs the real recorder."""

    def __init__(self, users_on):
        self.on = users_on
        self.calls = []

    def history_enabled(self):
        return self.on

    def record_history(self, n):
        self.calls.append(("record", n))
        self.on = True

    def stop_history(self):
        self.calls.append(("stop",))
        self.on = False

    def allocator_snapshot(self):
        self.calls.append(("snapshot",))
        return raw("bcrafton")


@pytest.mark.slow
def test_trace_starts_and_stops_its_own_recording(tmp_path):
    from ipy_gpumem.cell.allocator_trace import CellTrace

    api = RecorderReplay(users_on=False)
    keep = tmp_path / "cell.pickle"
    trace = CellTrace(api, path=str(keep), max_entries=500)
    snap, note = trace.end()
    assert api.calls == [("record", 500), ("snapshot",), ("stop",)] and api.on is False
    assert "ring buffer" in note and str(keep) in note  # 6486 events > 500: said, not hidden
    assert read_snapshot(str(keep)).to_dict()["peak_allocated"] == read_snapshot(snap).to_dict()["peak_allocated"]


def test_trace_leaves_the_users_recording_on_and_keeps_the_cells_events():
    from ipy_gpumem.cell.allocator_trace import CellTrace

    events = raw("bcrafton")["device_traces"][0]
    middle = events[len(events) // 2]["time_us"]
    api = RecorderReplay(users_on=True)
    trace = CellTrace(api, clock=lambda: middle / 1e6)
    snap, note = trace.end()
    assert api.calls == [("snapshot",)] and api.on is True  # nothing started, nothing stopped
    assert "left on" in note
    kept = snap["device_traces"][0]
    assert kept and all(e["time_us"] >= middle for e in kept) and len(kept) < len(events)
    # The cell's own window replays to the same end state: its start is the state before the cell.
    assert read_snapshot(snap).replay().check.ok


def test_trace_without_cuda_says_so_and_the_cell_runs(ip, gpumem):
    from IPython.utils.capture import capture_output

    pytest.importorskip("torch")
    with capture_output() as out:
        result = ip.run_cell("%%gpumem --trace\nt = 1 + 1")
    assert result.error_in_exec is None and ip.user_ns["t"] == 2
    assert "--trace needs a CUDA device" in out.stdout + out.stderr or "--trace: CUDA" in out.stdout + out.stderr
    with capture_output() as out:
        ip.run_cell("%%gpumem --trace --estimate\nt = 3")
    assert "do not combine" in out.stderr and ip.user_ns["t"] == 2


def test_a_failing_snapshot_costs_the_trace_not_the_recording(ip, gpumem, monkeypatch):
    """A fault we cannot cause here (torch's _snapshot() raising), made by a labelled stand-in."""
    from IPython.utils.capture import capture_output

    from ipy_gpumem.cell import allocator_trace

    class Broken(RecorderReplay):
        def allocator_snapshot(self):
            raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(allocator_trace.CellTrace, "begin", classmethod(lambda cls, path=None: (cls(Broken(False)), None)))
    with capture_output() as out:
        result = ip.run_cell("%%gpumem --trace\nu = 5")
    assert result.error_in_exec is None and ip.user_ns["u"] == 5
    assert "the allocator's snapshot failed (RuntimeError" in out.stdout + out.stderr
    assert gpumem.broken is None  # recording goes on


# -- %%gpumem --trace at an out-of-memory: one panel, from the recorded state at the failure -------

def _oom_message(rec, total="79.15 GiB"):
    """The message torch prints for the recorded failure ``rec`` (a ``RecordedOom``): its numbers in
    torch's two-decimal format; the total is an 80 GB A100's, which the snapshot does not record."""
    from ipy_gpumem.core.units import format_bytes as fb

    return (f"CUDA out of memory. Tried to allocate {fb(rec.requested)}. GPU {rec.device} has a total capacity of "
            f"{total} of which {fb(rec.device_free)} is free. Of the allocated memory {fb(rec.allocated)} is "
            f"allocated by PyTorch, and {fb(rec.reserved_unallocated)} is reserved by PyTorch but unallocated. If "
            "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "to avoid fragmentation.")


@pytest.mark.slow
def test_a_traced_cell_that_runs_out_of_memory_gets_one_panel_from_the_recording(ip, gpumem, monkeypatch):
    """The live path of ``%%gpumem --trace`` at a CUDA out-of-memory, which this CPU machine cannot
    cause. Two stand-ins, labelled: torch's recorder (``RecorderReplay``) hands back a real capture
    with an OOM event (Constructor-Sun's, recorded on cuda:1 of a GPU machine), its failing frame
    renamed to the line of this cell that raises; the cell raises the ``torch.OutOfMemoryError``
    torch would have raised for it, with the message built from the capture's own numbers.
    Everything after taking the snapshot is the extension's own path."""
    torch = pytest.importorskip("torch")
    from conftest import run

    from ipy_gpumem.cell import allocator_trace
    from ipy_gpumem.present.shell import cell_files

    recorded = read_snapshot(path("Constructor-Sun_memory_snapshot")).recorded_ooms()[-1]
    ip.user_ns.update(torch=torch, MESSAGE=_oom_message(recorded))

    class RecorderAtOom(RecorderReplay):
        def allocator_snapshot(self):
            self.calls.append(("snapshot",))
            snap = raw("Constructor-Sun_memory_snapshot")
            files = cell_files(ip)
            this_cell = max(files, key=files.get)  # the file name this very cell was compiled under
            for event in snap["device_traces"][1]:
                if event["action"] == "oom":
                    event["frames"] = [dict(f, filename=this_cell, line=3) if f["filename"].endswith("models.py")
                                       else f for f in event["frames"]]
            return snap

    monkeypatch.setattr(allocator_trace.CellTrace, "begin",
                        classmethod(lambda cls, path=None: (cls(RecorderAtOom(False)), None)))
    result, cap = run(ip, "%%gpumem --trace\nx = 1\nraise torch.OutOfMemoryError(MESSAGE)")
    assert type(result.error_in_exec).__name__ == "OutOfMemoryError"
    count = result.execution_count
    panels = [o for o in cap.outputs if o.data.get("text/plain", "").startswith("Out of memory on")]
    assert len(panels) == 1  # one panel ...
    assert sum("Diagnosis" in o.data.get("text/plain", "") for o in cap.outputs) == 1  # ... not two
    text = panels[0].data["text/plain"]
    # The answer first (issue 29): the recorded stack's phase and the cell's line; the error's numbers below.
    assert text.startswith("Out of memory on cuda:1: a 4.95 GiB allocation in the forward pass (")
    assert "\nThe error: tried to allocate 4.95 GiB with 91.25 MiB free" in text
    assert "Recorded at the failure (the cell's allocator trace): 132.93 MiB free inside reserved segments" in text
    assert f"the failing allocation: In [{count}], line 3" in text
    assert "the cell's allocator trace at the failure" in text  # the layers' source
    trace_report = [o for o in cap.outputs if o.data.get("text/plain", "").startswith(f"Memory snapshot of In [{count}]")]
    assert len(trace_report) == 1 and "Out of memory at" in trace_report[0].data["text/plain"]

    # The numbers, exact: the recording's, not the message's two-decimal roundings.
    from ipy_gpumem.oom.analysis import analyse

    outcome_oom = gpumem.watcher.oom.failure("OutOfMemoryError", ip.user_ns["MESSAGE"], 0.0)[0]
    exact = analyse(outcome_oom, None, namespace=None, recorded=[recorded])
    assert exact.recorded == recorded
    assert (exact.oom.requested, exact.oom.free) == (5309988864, 95682560) == (recorded.requested, recorded.device_free)
    assert (exact.memory.allocated, exact.memory.reserved) == (84063358976, 84202749952)
    rounded = analyse(outcome_oom, None, namespace=None)
    assert rounded.recorded is None and rounded.memory.allocated != 84063358976  # "78.29 GiB" read back


def test_a_recording_of_another_failure_is_not_used():
    from ipy_gpumem.oom.analysis import analyse, recorded_failure
    from ipy_gpumem.oom.parse import parse_oom

    recorded = read_snapshot(path("Constructor-Sun_memory_snapshot")).recorded_ooms()
    same = parse_oom("OutOfMemoryError: " + _oom_message(recorded[0]))
    assert recorded_failure(same, recorded) == recorded[0]
    other = parse_oom("OutOfMemoryError: " + _oom_message(recorded[0]._replace(requested=2 * 2**30)))
    assert recorded_failure(other, recorded) is None  # a 2 GiB request is not the recorded 4.95 GiB one
    on_cuda0 = parse_oom("OutOfMemoryError: " + _oom_message(recorded[0]._replace(device=0)))
    assert recorded_failure(on_cuda0, recorded) is None
    assert analyse(other, None, namespace=None, recorded=recorded).recorded is None


def test_the_largest_free_block_makes_fragmentation_certain():
    from ipy_gpumem.oom.analysis import RecordedOom, analyse
    from ipy_gpumem.oom.panel import oom_panel
    from ipy_gpumem.oom.parse import parse_oom

    GiB_ = 2**30
    rec = RecordedOom(0, 2 * GiB_, 100 * MiB, 10 * GiB_, 14 * GiB_, 4 * GiB_, 512 * MiB, "In [4], line 2", "a test")
    oom = parse_oom("OutOfMemoryError: " + _oom_message(rec))
    analysis = analyse(oom, None, namespace=None, recorded=[rec], env={}, modules=())
    frag = next(f for f in analysis.findings if f.key == "fragmentation")
    assert frag.confidence == "certain" and "the largest is 512.00 MiB, recorded at the failure" in frag.detail
    text = oom_panel(analysis).text
    assert "the largest free block 512.00 MiB (too small for the 2.00 GiB request)" in text


@pytest.mark.slow
def test_the_timeline_as_a_plotly_figure():
    go = pytest.importorskip("plotly.graph_objects")
    report = open_snapshot(path("bcrafton"))  # timed, with optimizer annotations
    fig = report.figure()
    go.Figure(data=fig["data"], layout=fig["layout"])  # plotly accepts every trace and layout key
    names = [t.get("name") for t in fig["data"]]
    peak, at = report.peak()
    assert {"cuda:0 allocated", "cuda:0 reserved", "peak allocated 3.60 GiB"} <= set(names)
    mark = next(t for t in fig["data"] if t.get("name", "").startswith("peak allocated"))
    assert mark["x"] == [report.time_of(at)] and mark["y"][0] == pytest.approx(peak / 2**30, abs=1e-4)
    assert fig["layout"]["xaxis"]["title"]["text"] == "time (s)" and fig["layout"]["xaxis"]["ticksuffix"] == " s"
    spans = [a for a in report.annotations() if a.start is not None and a.end is not None]
    markers = next(t for t in fig["data"] if t.get("name") == "annotations")
    assert len(markers["x"]) == len(spans) > 0 and "cells" not in " ".join(map(str, names))
    assert all(spans[i].start <= x <= spans[i].end for i, x in enumerate(markers["x"]))
    # A window: only its events, and its own peak.
    t_peak = report.time_of(at)
    early = report.figure(end=t_peak / 2)
    xs = [x for t in early["data"] if t.get("name") == "cuda:0 allocated" for x in t["x"]]
    assert max(xs) <= t_peak / 2 and not any(n == "peak allocated 3.60 GiB" for n in (t.get("name") for t in early["data"]))


@pytest.mark.slow
def test_a_capture_without_times_is_drawn_over_events():
    go = pytest.importorskip("plotly.graph_objects")
    report = open_snapshot(path("cranberrii_memory_snapshot"))
    fig = report.figure()
    go.Figure(data=fig["data"], layout=fig["layout"])
    assert fig["layout"]["xaxis"]["title"]["text"] == "event (no times recorded)" and fig["layout"]["xaxis"]["ticksuffix"] == ""
    assert "over events" in fig["layout"]["title"]["text"]
    mark = next(t for t in fig["data"] if t.get("name", "").startswith("peak allocated"))
    assert mark["x"] == [report.peak()[1]]
    empty = open_snapshot(path("Muduard_memory_snapshot")).figure()  # segments only, no events
    assert [a["text"] for a in empty["layout"]["annotations"]] == ["no allocator events recorded"]


def test_snapshot_display_keeps_its_inline_chart():
    bundle = ipy_gpumem.snapshot(path("magma27"))._repr_mimebundle_()
    # the chart inside the report, as an image of the SVG (an untrusted notebook strips an inline <svg>)
    assert "data:image/svg+xml," in bundle["text/html"] and "<svg" not in bundle["text/html"]
    assert "application/vnd.plotly.v1+json" not in bundle


# -- hostile files (issue 27): each fails, or reads, within 2 s and 256 MiB, in one line ---------------
def _gzip_members(*parts):
    """Concatenated gzip members (a valid .gz that unpacks to the parts joined): big bombs built in milliseconds,
    each distinct part compressed once (a 1 GiB bomb is one 1 MiB member 1,024 times)."""
    members = {}
    return b"".join(members[p] if p in members else members.setdefault(p, gzip.compress(p, 9)) for p in parts)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    import struct

    folder = tmp_path_factory.mktemp("hostile")
    blk = {"address": 0, "size": 512, "requested_size": 512, "state": "active_allocated", "frames": []}
    seg = {"device": 0, "address": 0, "total_size": 2 << 20, "segment_type": "small", "blocks": [blk] * 4000}
    files = {
        # a segment and a block memo-referenced 4,000 times each: 16 million blocks in 16 KB
        "memo_bomb.pickle": pickle.dumps({"segments": [seg] * 4000, "device_traces": [[]]}, protocol=4),
        # MARK after MARK over a deep stack (each one copied the stack)
        "mark_320k.pickle": b"\x80\x04" + b"N" * 100_000 + b"(1" * 110_000 + b".",
        "mark_800k.pickle": b"\x80\x04" + b"N" * 250_000 + b"(1" * 275_000 + b".",
        # LONG_BINPUT to memo index 2**28 in 9 bytes (the memo grew to it)
        "long_binput.pickle": b"\x80\x04N" + b"r" + struct.pack("<I", 1 << 28) + b".",
        # 64 KB of gzip that unpacks to 64 MiB of opcodes that do nothing
        "loop.pickle.gz": _gzip_members(b"\x80\x04" + b"N0" * (1 << 20), *[b"N0" * (1 << 20)] * 31, b"N."),
        # 1 MB of gzip that unpacks to a 1 GiB string
        "string.pickle.gz": _gzip_members(b"\x80\x04\x8d" + struct.pack("<Q", 1 << 30) + b"a" * (1 << 20),
                                          *[b"a" * (1 << 20)] * 1023, b"."),
    }
    for name, content in files.items():
        (folder / name).write_bytes(content)
    os.mkfifo(folder / "fifo.pickle")  # nobody writes to it: opening it for reading blocks
    (folder / "snapshot.json").write_text(json.dumps(raw("magma27")))
    return folder


HOSTILE = {"memo_bomb.pickle": "memo references stand for more than", "mark_320k.pickle": "stack holds more than",
           "mark_800k.pickle": "stack holds more than", "long_binput.pickle": "not a memory snapshot: NoneType",
           "loop.pickle.gz": "unpacks to more than 64 times its size", "string.pickle.gz": "unpacks to more than 64 times",
           "fifo.pickle": "is a FIFO, not a snapshot file"}

_MEASURE = r"""
import json, os, sys, time
import ipy_gpumem
from ipy_gpumem.snapshots import SnapshotError, view  # noqa: F401 - loaded before measuring
def status(field):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))
out = {}
for path in sys.argv[1:]:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # the peak RSS starts again from the RSS now
    before, t = status("VmRSS"), time.process_time()  # CPU seconds: the suite shares the machine
    try:
        message = "read: " + repr(ipy_gpumem.snapshot(path).to_dict()["peak_allocated"])
    except SnapshotError as exc:
        message = str(exc)
    out[os.path.basename(path)] = (time.process_time() - t, status("VmHWM") - before, message)
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak RSS is reset through /proc (Linux)")
def test_hostile_files_fail_within_2_s_and_256_mib_through_the_public_function(hostile):
    import subprocess
    import sys

    names = sorted(HOSTILE) + ["snapshot.json"]
    out = subprocess.run([sys.executable, "-c", _MEASURE] + [str(hostile / n) for n in names], capture_output=True,
                         text=True, timeout=300, cwd=os.path.dirname(HERE))
    assert out.returncode == 0, out.stderr[-2000:]
    measured = json.loads(out.stdout)
    for name in names:
        seconds, grew, message = measured[name]
        want = HOSTILE.get(name, "read: " + repr(read_snapshot(path("magma27")).to_dict()["peak_allocated"]))
        assert want in message and "\n" not in message, (name, message)
        assert seconds < 2.0, (name, seconds)
        assert grew < 256 * MiB, (name, grew)


@pytest.mark.slow
def test_hostile_files_in_a_real_shell(ip, gpumem, hostile):
    from IPython.utils.capture import capture_output

    faulthandler.dump_traceback_later(120, exit=True)  # a FIFO that blocked would hang the suite: fail it instead
    try:
        for name, words in HOSTILE.items():
            f = str(hostile / name)
            with pytest.raises(SnapshotError, match=words):
                ipy_gpumem.snapshot(f)
            with capture_output() as out:
                ip.run_cell(f"%gpumem snapshot {f}")
            shown = out.stderr + out.stdout
            assert words in shown and "Traceback" not in shown, (name, shown)
            assert len([line for line in shown.splitlines() if line.strip()]) == 1, shown
        view = gpumem.run_mode(f"snapshot {hostile / 'snapshot.json'}")
        assert view.data["peak_allocated"] == read_snapshot(path("magma27")).to_dict()["peak_allocated"]
    finally:
        faulthandler.cancel_dump_traceback_later()
