"""Inline SVG charts: valid XML, torch-spelled ticks, capacity, labelled and escaped spans and
their hover texts, missed peaks, the running cell, empty data, charts for an <img>, and one-cell
charts from samples, lines (stacked by role where they carry roles) or the record alone."""
import ast
import re
import sys
import time
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import run
from ipy_gpumem.cell.lines import LineMarkers, LineTracer
from ipy_gpumem.core.probes import DeviceSample, HostSample, MemoryProbe, Sample
from ipy_gpumem.core.records import CellRecord, DeviceRecord, HostRecord, LineRecord
from ipy_gpumem.chart.svg import (FAILED_COLOR, IMG_INK, ROLE_COLORS, RUNNING_COLOR, UP_COLOR, byte_ticks, cell_svg,
                                  draw_timeline, format_time, span_hover, time_ticks, timeline_svg)
from ipy_gpumem.chart.timeline import Timeline
from ipy_gpumem.core.roles import ROLE_WORDS, ROLES
from ipy_gpumem.core.text import clip
from ipy_gpumem.core.units import GiB, MiB, format_bytes, format_delta, parse_bytes
from ipy_gpumem.core.why import OwnerInfo, Why
from ipy_gpumem.display.words import line_reason
from tests.conftest import touched

SVG = "{http://www.w3.org/2000/svg}"
TOTAL = int(15.78 * GiB)
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="exact RSS needs procfs")


def parse(svg: str):
    root = ET.fromstring(svg)
    assert root.tag == SVG + "svg"
    return root


def texts(root) -> list:
    return [el.text for el in root.iter(SVG + "text")]


def titles(root) -> list:
    return [el.text for el in root.iter(SVG + "title")]


def gpu(t, allocated, reserved, used=None, total=TOTAL):
    return Sample(t, HostSample(GiB, None), (DeviceSample(0, allocated, reserved, None, None, used, total),))


def record(n, source, a0, a1, peak, r0=None, r1=None, error=None, total=TOTAL, lines=None, duration=1.0):
    dev = DeviceRecord(0, "GPU", a0, a1, peak, r0, r1, None, None, None, total)
    return CellRecord(n, None, source, time.time(), duration, error=error, devices=(dev,), lines=lines)


@pytest.fixture
def session():
    """A GPU-shaped session: 8 cells, the 5th failed with a <script> in its source, the 8th running."""
    tl = Timeline()
    t, level = 0.0, 0
    for n in range(1, 9):
        source = "x = '<script>alert(1)</script>' & more" if n == 5 else f"step_{n}()"
        tl.cell_started(t, f"[{n}]", source)
        for _ in range(20):
            tl.add(gpu(t, level, level + GiB, level + 2 * GiB))
            t += 0.5
        if n == 8:
            break
        after = level + GiB
        tl.cell_finished(t, record(n, source, level, after, after + GiB, error="OutOfMemoryError" if n == 5 else None))
        level = after
        t += 3.0
        tl.add(gpu(t, level, level + GiB, level + 2 * GiB))
    return tl.snapshot()


def test_timeline_chart_is_valid_xml_with_capacity_ticks_spans_and_legend(session):
    svg = timeline_svg(session, title="cuda:0 · a <test>")
    root = parse(svg)
    words = texts(root)
    assert "15.78 GiB total" in words  # the data reach 30% of it: drawn as a line
    ticks = [w for w in words if re.fullmatch(r"\d+(\.\d+)? (bytes|KiB|MiB|GiB)", w or "")]
    assert 3 <= len(ticks) <= 5 and re.fullmatch(r"0 (bytes|KiB|MiB|GiB)", ticks[0])
    assert len({w.split()[1] for w in ticks}) == 1, ticks  # one unit for the whole axis (issue 31: no "0 bytes ... 1.46 GiB")
    assert len({len(w.split()[0].partition(".")[2]) for w in ticks[1:]}) == 1, ticks  # and one number of decimals
    assert [f"[{n}]" for n in range(1, 9)] == [w for w in words if w and w.startswith("[")]
    assert {"cuda:0 allocated", "cuda:0 reserved", "cuda:0 used (all processes)"} <= set(words)
    assert "cuda:0 · a <test>" in words and "&lt;test&gt;" in svg
    paths = [p for p in root.iter(SVG + "path") if p.get("fill") == "none"]
    assert {p.get("stroke-dasharray") for p in paths} == {None, "6 3", "1.5 2.5"}  # solid, dashed, dotted
    assert "<script" not in svg and "http" not in svg.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_hover_titles_are_escaped_and_carry_the_record(session):
    svg = timeline_svg(session)
    root = parse(svg)
    hovers = [t for t in titles(root) if t and t.startswith("[")]
    failed = next(t for t in hovers if t.startswith("[5]"))
    assert failed.splitlines()[0] == "[5] x = '<script>alert(1)</script>' & more"  # after XML unescaping
    assert "OutOfMemoryError" in failed and "peak" in failed
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&#x27; &amp; more" in svg and "<script>" not in svg


def test_running_and_failed_spans_are_highlighted(session):
    root = parse(timeline_svg(session))
    groups = [g for g in root.iter(SVG + "g") if g.find(SVG + "title") is not None and g.find(SVG + "rect") is not None]
    by_label = {g.find(SVG + "title").text.split()[0]: g.find(SVG + "rect") for g in groups}
    assert by_label["[8]"].get("fill") == RUNNING_COLOR
    assert by_label["[5]"].get("fill") == FAILED_COLOR
    assert by_label["[3]"].get("fill") == "currentColor"
    running_text = [el for el in root.iter(SVG + "text") if el.text == "[8]"][0]
    assert running_text.get("font-weight") == "600"


def test_capacity_far_above_the_data_is_written_not_drawn():
    tl = Timeline()
    for i in range(10):
        tl.add(gpu(float(i), 100 * MiB, 200 * MiB, total=80 * GiB))
    root = parse(timeline_svg(tl.snapshot()))
    assert "80.00 GiB total (off scale)" in texts(root)
    assert max(parse_bytes(w) for w in texts(root) if re.fullmatch(r"[\d.]+ (bytes|KiB|MiB|GiB)", w or "")) < GiB


@linux
def test_cpu_timeline_from_the_real_probe_draws_host_rss():
    probe, tl = MemoryProbe(), Timeline()
    tl.cell_started(time.perf_counter(), "[1]", "blob = bytearray(...)")
    tl.add(probe.sample())
    blob = bytearray(b"\x01") * (32 * MiB)
    tl.add(probe.sample())
    tl.cell_finished(time.perf_counter(), None)
    root = parse(timeline_svg(tl.snapshot()))
    assert "host RSS" in texts(root) and "[1]" in texts(root)
    assert not any("total" in (w or "") for w in texts(root))  # no host capacity is invented
    del blob


@pytest.mark.parametrize("snapshot", [None, Timeline().snapshot()])
def test_empty_timeline_renders_a_placeholder(snapshot):
    root = parse(timeline_svg(snapshot))
    assert texts(root) == ["no samples yet"]


def test_spans_without_samples_and_late_keys_and_control_characters():
    tl = Timeline()
    tl.cell_started(1.0, "[1]", "print('\x1b[31mred\x00')")
    root = parse(timeline_svg(tl.snapshot()))  # a running cell, no sample yet
    assert "[1]" in texts(root)
    tl.add(Sample(2.0, HostSample(None, None), ()))
    tl.add(gpu(3.0, None, 5 * MiB))  # allocated unknown, reserved known
    tl.add(gpu(4.0, 3 * MiB, 5 * MiB))
    parse(timeline_svg(tl.snapshot(), width=300, height=50))


def test_long_sessions_get_minute_and_hour_ticks():
    assert format_time(150, 30, 300) == "2:30" and format_time(5400, 1800, 14400) == "1.5 h"
    tl = Timeline()
    for i in range(0, 7200, 10):
        tl.add(Sample(float(i), HostSample(GiB, None), ()))
    words = texts(parse(timeline_svg(tl.snapshot())))
    assert "0 min" in words and any(w.endswith(" min") and w != "0 min" for w in words)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=0, max_value=2.0**50, allow_nan=False))
def test_byte_ticks_are_three_to_five_round_values(top):
    axis_top, ticks = byte_ticks(top)
    assert 2 <= len(ticks) <= 5 and ticks[0] == 0 and axis_top == ticks[-1] >= top
    if top >= 4:
        assert 3 <= len(ticks)
    labels = [format_bytes(int(t)) for t in ticks]
    assert len(set(labels)) == len(labels)


def test_time_ticks_are_round_and_inside():
    ticks = time_ticks(0, 3600)
    assert ticks[0] == 0 and ticks[-1] <= 3600 and 2 <= len(ticks) <= 7
    assert len({round(b - a, 6) for a, b in zip(ticks, ticks[1:])}) == 1


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["add", "start", "finish"]),
            st.one_of(st.none(), st.integers(0, 2**44)),
            st.text(max_size=30),
        ),
        max_size=80,
    ),
    width=st.integers(40, 900),
    height=st.integers(10, 400),
)
def test_any_timeline_renders_valid_xml(steps, width, height):
    tl = Timeline(max_points=16, max_spans=8)
    for i, (kind, value, source) in enumerate(steps):
        if kind == "add":
            dev = () if value is None or value % 3 == 0 else (DeviceSample(value % 2, value, None, None, None, None, value * 2),)
            tl.add(Sample(float(i), HostSample(value, None), dev))
        elif kind == "start":
            tl.cell_started(float(i), f"[{i}]", source)
        else:
            tl.cell_finished(float(i), record(i, source, value, value, value) if value else None)
    parse(timeline_svg(tl.snapshot(), width=width, height=height, title=source if steps else None))


def test_chart_of_2000_points_by_4_series_is_fast():
    tl = Timeline(max_points=4000)
    for i in range(2000):
        tl.add(Sample(i * 0.25, HostSample(GiB + i * 4096, None),
                      (DeviceSample(0, (i * 7919) % (8 * GiB), 9 * GiB, None, None, 10 * GiB + i, TOTAL),)))
    snap = tl.snapshot()
    assert len(snap.t) == 2000 and len(snap.series) == 4
    timeline_svg(snap)
    best = min(_timed(lambda: timeline_svg(snap)) for _ in range(20))
    # About 1 ms measured (benchmarks/bench_sampler.py); 20 ms only catches a regression to
    # per-point Python formatting on a slow, loaded machine.
    assert best < 0.02


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# One cell
# --------------------------------------------------------------------------------------------


def _text_at(root, word):
    return next(el for el in root.iter(SVG + "text") if el.text == word)


def test_cell_waterfall_without_lines_labels_the_delta_at_its_bar_and_the_peak_at_its_whisker():
    rec = record(3, "for batch in loader:\n    step()", 2 * GiB, 7 * GiB, 11 * GiB, 2 * GiB, 12 * GiB)
    root = parse(cell_svg(rec))
    words = texts(root)
    assert {"before", "cell", "after"} <= set(words)
    assert "2.00 GiB" in words and "7.00 GiB" in words
    assert "+5.00 GiB" in words and "peak +9.00 GiB" in words
    assert not any("(peak" in (w or "") for w in words)
    # The delta sits inside its bar (below the bar's top at 7 GiB), the peak above the whisker
    # (at 11 GiB): the delta can no longer be read as the peak.
    delta_y, peak_y = float(_text_at(root, "+5.00 GiB").get("y")), float(_text_at(root, "peak +9.00 GiB").get("y"))
    after_y = float(_text_at(root, "7.00 GiB").get("y"))  # the after bar's value, just above 7 GiB
    assert peak_y < after_y < delta_y
    assert words[-1] == "[3] for batch in loader: · cuda:0 allocated"
    assert any("peak 11.00 GiB (+9.00 GiB)" in t for t in titles(root))


def test_cell_waterfall_with_lines_has_a_tick_and_hover_per_line():
    def line(no, src, d, pk, hits=1):
        dev = DeviceRecord(0, allocated_delta_sum=d, peak_increase_max=pk)
        return LineRecord(no, src, hits, HostRecord(), (dev,), 0.01)

    lines = (line(1, "a = torch.ones(2**28)", 1 * GiB, 1 * GiB), line(2, "for _ in range(3):", 0, 0, hits=4),
             line(3, "    b = a * 2  # <b>bold</b>", 3 * GiB, 4 * GiB, hits=3), line(4, "del a", -1 * GiB, 0))
    rec = record(9, "\n".join(ln.source for ln in lines), 4 * GiB, 7 * GiB, 9 * GiB, lines=lines)
    svg = cell_svg(rec, width=600)
    root = parse(svg)
    words = texts(root)
    # the x axis says what its ticks are
    assert {"line 1", "line 2", "line 3", "line 4", "before", "after"} <= set(words)
    assert "+3.00 GiB" in words and "peak +4.00 GiB" in words and "-1024.00 MiB" in words
    hover = next(t for t in titles(root) if t.startswith("line 3"))
    assert hover.splitlines() == ["line 3 ×3: b = a * 2 # <b>bold</b>",  # core.text.clip: one line, one space
                                  "  cuda:0 allocated +3.00 GiB, peak +4.00 GiB · 10 ms"]
    assert "&lt;b&gt;bold&lt;/b&gt;" in svg


def test_narrow_line_ticks_are_explained_once():
    lines = tuple(LineRecord(i, f"x{i} = {i}", 1, HostRecord(rss_delta_sum=i * MiB), (), 0.0) for i in range(1, 80))
    rec = CellRecord(2, None, "", time.time(), 1.0, host=HostRecord(GiB, GiB + 3160 * MiB, None), lines=lines)
    words = texts(parse(cell_svg(rec, width=640)))
    assert "1" in words and not any((w or "").startswith("line ") for w in words)
    assert "ticks: source lines" in words


@linux
def test_cell_waterfall_from_real_line_records():
    probe = MemoryProbe()
    source = "a = touched(48 * 2**20)\nb = touched(16 * 2**20)\ndel a\n"
    measurement_start = probe.sample()
    ns = {"touched": touched}  # memory mapped afresh: RSS moves by exactly what a line allocates
    tracer = LineTracer(probe, ns)
    markers = LineMarkers()  # what the extension installs for a --lines cell
    markers.armed = True
    assert tracer.start()
    try:
        exec(compile(markers.visit(ast.parse(source)), "<cell>", "exec"), ns)
    finally:
        tracer.stop()
    end = probe.sample()
    lines = tracer.records(source.splitlines())
    rec = CellRecord(4, None, source, time.time(), 0.1, lines=lines,
                     host=HostRecord(measurement_start.host.rss, end.host.rss, end.host.rss))
    root = parse(cell_svg(rec))
    assert {"line 1", "line 2", "line 3"} <= set(texts(root)) and texts(root)[-1].endswith("host RSS")
    assert any(t.startswith("line 1 ×1: a = touched") and "host RSS +4" in t for t in titles(root)), titles(root)


def test_many_lines_are_grouped_into_runs():
    lines = tuple(LineRecord(i, f"x{i} = {i}", 1, HostRecord(rss_delta_sum=i * MiB), (), 0.0) for i in range(1, 301))
    rec = CellRecord(2, None, "", time.time(), 1.0, host=HostRecord(GiB, GiB + 45150 * MiB, None), lines=lines)
    root = parse(cell_svg(rec, width=480))
    assert any(re.fullmatch(r"\d+–\d+", w or "") for w in texts(root))


def test_cell_chart_from_samples_draws_the_exact_peak():
    rec = record(3, "train()", 2 * GiB, 2 * GiB, 7 * GiB, 3 * GiB, 3 * GiB)
    samples = [gpu(i * 0.1, 2 * GiB + (i % 5) * GiB // 2, 3 * GiB) for i in range(30)]
    root = parse(cell_svg(rec, samples=samples))
    words = texts(root)
    assert "peak 7.00 GiB (exact, from the record)" in words and "cuda:0 allocated" in words
    assert words[-1] == "[3] train()"


@linux
def test_cell_chart_from_real_samples():
    probe = MemoryProbe()
    samples = [probe.sample() for _ in range(5)]
    rec = CellRecord(1, None, "pass", time.time(), 0.01, host=HostRecord(samples[0].host.rss, samples[-1].host.rss,
                                                                         samples[-1].host.rss))
    root = parse(cell_svg(rec, samples=samples))
    assert "host RSS" in texts(root)


@pytest.mark.parametrize("rec", [
    None,
    CellRecord(None, None, "", 0.0, 0.0),
    CellRecord(1, None, "x", 0.0, 0.0, devices=(DeviceRecord(0),)),
    CellRecord(1, None, "x", 0.0, 0.0, host=HostRecord(5, None, None), lines=()),
])
@pytest.mark.parametrize("samples", [None, [], [Sample(0.0, HostSample(None, None), ())],
                                     [Sample(0.0, HostSample(None, None), ()), None], "not samples"])
def test_cell_chart_never_raises_on_missing_data(rec, samples):
    parse(cell_svg(rec, samples=samples))


maybe_bytes = st.one_of(st.none(), st.integers(0, 2**42))


@pytest.mark.slow
@settings(max_examples=80, deadline=None)
@given(
    values=st.lists(maybe_bytes, min_size=7, max_size=7),
    line_deltas=st.one_of(st.none(), st.lists(st.tuples(st.integers(-2**40, 2**40), st.one_of(st.none(), st.integers(0, 2**40))), max_size=40)),
    on_device=st.booleans(),
    width=st.integers(0, 1000),
)
def test_any_cell_record_renders_valid_xml(values, line_deltas, on_device, width):
    a0, a1, peak, r0, r1, total, rss = values
    lines = None
    if line_deltas is not None:
        lines = tuple(
            LineRecord(i + 1, f"line <{i}>", 1,
                       HostRecord(rss_delta_sum=d, rss_peak_increase_max=p),
                       (DeviceRecord(0, allocated_delta_sum=d, peak_increase_max=p),) if on_device else (), 0.001)
            for i, (d, p) in enumerate(line_deltas))
    devices = (DeviceRecord(0, None, a0, a1, peak, r0, r1, None, None, None, total),) if on_device else ()
    rec = CellRecord(1, None, "x", 0.0, 0.1, devices=devices, host=HostRecord(rss, a1, peak), lines=lines)
    parse(cell_svg(rec, width=width))


# --------------------------------------------------------------------------------------------
# Hover texts (written here from the spans' numbers) and charts for an <img>
# --------------------------------------------------------------------------------------------


def test_span_hover_is_written_from_the_numbers():
    tl = Timeline()
    tl.cell_started(0.0, "[*]", "y = model(x)\nloss = y.sum()")
    tl.cell_finished(1.25, record(7, "y = model(x)", 2 * GiB, 3 * GiB, 4 * GiB, 2 * GiB, 4 * GiB,
                                  error="OutOfMemoryError", duration=1.25))
    (span,) = tl.snapshot().spans
    # torch spells exactly 1 GiB "1024.00 MiB" (its format_size compares with <=)
    assert span_hover(span).splitlines() == [
        "[7] y = model(x)",
        "cuda:0 allocated +1024.00 MiB, peak 4.00 GiB (+2.00 GiB) · reserved +2.00 GiB",
        "1.2 s · OutOfMemoryError",
    ]
    host_only = CellRecord(4, None, "x = 1", time.time(), 75.0, host=HostRecord(GiB, GiB + 64 * MiB, GiB + 96 * MiB))
    tl.cell_finished(80.0, host_only)
    assert span_hover(tl.snapshot().spans[-1]).splitlines()[1:] == [
        "host RSS +64.00 MiB, peak 1.09 GiB (+96.00 MiB)", "1 min 15 s"]


def test_merged_spans_name_the_largest_cell():
    tl = Timeline(max_spans=8)
    for n in range(1, 41):
        tl.cell_started(n * 2.0, f"[{n}]", f"step({n})")
        rec = record(n, f"step({n})", GiB, GiB, 3 * GiB if n == 3 else GiB) if n in (3, 4) else None
        tl.cell_finished(n * 2.0 + 1.0, rec)
    merged = tl.snapshot().spans[0]
    assert merged.cells > 1
    hover = span_hover(merged)
    assert hover.startswith(f"{merged.cells} cells [1]–") and "largest: [3] step(3)" in hover


def test_a_peak_the_samples_missed_is_drawn_and_named():
    tl = Timeline()
    tl.cell_started(0.0, "[1]", "spike()")
    for i in range(5):
        tl.add(gpu(i * 0.2, GiB, 2 * GiB))
    tl.cell_finished(1.0, record(1, "spike()", GiB, GiB, 6 * GiB))
    root = parse(timeline_svg(tl.snapshot()))
    assert "cell peak (exact)" in texts(root)
    ticks = [parse_bytes(w) for w in texts(root) if re.fullmatch(r"[\d.]+ (bytes|KiB|MiB|GiB)", w or "")]
    assert max(ticks) >= 6 * GiB  # the axis reaches the peak the samples never saw


def test_a_chart_for_an_img_has_no_titles_a_fixed_ink_and_boxes_for_the_html(session):
    drawing = draw_timeline(session, width=700, height=200, ink=IMG_INK, titles=False)
    root = parse(drawing.svg)
    assert titles(root) == [] and f"color:{IMG_INK}" in root.get("style")
    assert (drawing.width, drawing.height) == (700, 200)
    assert [box.span.label for box in drawing.boxes] == [span.label for span in session.spans]
    assert all(0 <= box.x0 < box.x1 <= 700 and 0 < box.y0 < box.y1 < 200 for box in drawing.boxes)
    assert len(drawing.svg) < len(timeline_svg(session, width=700, height=200))


def test_a_cell_chart_can_be_drawn_for_an_img():
    rec = record(3, "train()", 2 * GiB, 2 * GiB, 7 * GiB, 3 * GiB, 3 * GiB)
    for samples in (None, [gpu(i * 0.1, 2 * GiB, 3 * GiB) for i in range(5)]):
        root = parse(cell_svg(rec, samples=samples, ink=IMG_INK))
        assert f"color:{IMG_INK}" in root.get("style")
        assert "color:inherit" in parse(cell_svg(rec, samples=samples)).get("style")


# --------------------------------------------------------------------------------------------
# Lines stacked by role (LineRecord.roles): segments, colours, legend and hover
# --------------------------------------------------------------------------------------------


def role_groups(root) -> list:
    """``[(role, rect attributes, title)]`` of the role segments, in drawing order."""
    return [(g.get("data-role"), g.find(SVG + "rect").attrib, g.find(SVG + "title").text)
            for g in root.iter(SVG + "g") if g.get("class") == "role"]


def _height(attrs) -> float:
    return float(attrs["height"])


def _gpu_line(no, src, d, pk, roles=None, why=None, temporaries=None):
    dev = DeviceRecord(0, allocated_delta_sum=d, peak_increase_max=pk)
    return LineRecord(no, src, 1, HostRecord(), (dev,), 0.01, roles=roles, temporaries=temporaries, why=why)


def _why(*parts, **owners):
    """What a line's change is made of, as a record keeps it: ``(device, role, owner, bytes)`` parts, and the
    owners' info by name (the hover's sentence is made from it)."""
    return Why(parts=parts, owners=owners)


def _training_record(extra_line=None):
    """A hand-built CUDA cell: parameters, a forward pass, a backward (gradients up, activations
    released), a print, an optimizer step; with ``extra_line`` appended."""
    lines = [
        _gpu_line(1, "model = Net().cuda()", 400 * MiB, 400 * MiB,
                  {"cuda:0": {"parameters": 400 * MiB, "allocator_cache": 112 * MiB, "outside_pytorch": 300 * MiB}},
                  _why(("cuda:0", "parameters", "model", 400 * MiB), model=OwnerInfo("module", "Net", 400 * MiB))),
        _gpu_line(2, "out = model(x)", 900 * MiB, 1200 * MiB,
                  {"cuda:0": {"activations": 880 * MiB, "other_tensors": 20 * MiB}},
                  _why(("cuda:0", "activations", "out", 880 * MiB)), {"cuda:0": 300 * MiB}),
        _gpu_line(3, "out.sum().backward()", -480 * MiB, 500 * MiB,
                  {"cuda:0": {"gradients": 400 * MiB, "activations": -880 * MiB}},
                  _why(("cuda:0", "gradients", "model", 400 * MiB), ("cuda:0", "activations", "out", -880 * MiB))),
        _gpu_line(4, "print('<done>')", 0, 0, {}),
        _gpu_line(5, "opt.step()", 800 * MiB, 800 * MiB, {"cuda:0": {"optimizer_state": 800 * MiB}},
                  _why(("cuda:0", "optimizer_state", "opt", 800 * MiB),
                       opt=OwnerInfo("optimizer", "Adam", 0, ("exp_avg", "exp_avg_sq", "step")))),
    ]
    if extra_line is not None:
        lines.append(extra_line)
    after = GiB + sum(ln.devices[0].allocated_delta_sum for ln in lines)
    return record(5, "\n".join(ln.source for ln in lines), GiB, after, 3 * GiB, GiB, 3 * GiB,
                  total=16 * GiB, lines=tuple(lines))


def test_lines_with_roles_are_stacked_by_role_with_one_colour_each_a_legend_and_hovers():
    root = parse(cell_svg(_training_record(), width=640))
    groups = role_groups(root)
    # one segment per role in each line (ROLES order within a line; released ones first)
    assert [g[0] for g in groups] == ["parameters", "other_tensors", "activations", "activations", "gradients",
                                      "optimizer_state"]
    assert all(attrs["fill"] == ROLE_COLORS[role] for role, attrs, _ in groups)
    assert len(set(ROLE_COLORS.values())) == len(ROLES) and set(ROLE_COLORS) == set(ROLES)
    # allocated is drawn: the allocator's cache and memory outside PyTorch are not segments
    assert "allocator_cache" not in {g[0] for g in groups} and "outside_pytorch" not in {g[0] for g in groups}
    params, other, act, released, grads, optim = (g[1] for g in groups)
    # exact bytes on the chart's own scale: 880 MiB of activations is 2.2 times 400 MiB of parameters
    assert _height(act) / _height(params) == pytest.approx(880 / 400, rel=0.02)
    assert (_height(act) + _height(other)) / _height(optim) == pytest.approx(900 / 800, rel=0.02)
    # the backward both released and added: side by side, released (outlined) left of added
    assert float(released["width"]) == pytest.approx(float(grads["width"])) == pytest.approx(float(params["width"]) / 2)
    assert float(released["x"]) < float(grads["x"])
    assert released.get("stroke-dasharray") and "stroke-dasharray" not in grads
    bottom = lambda a: float(a["y"]) + _height(a)  # noqa: E731
    assert bottom(released) == pytest.approx(bottom(grads), abs=0.2)  # gradients rise from where activations fell
    assert _height(released) / _height(grads) == pytest.approx(880 / 400, rel=0.02)
    # legend: the roles drawn, in ROLES order, and "released"; no scaling note (exact bytes)
    words = texts(root)
    legend = [w for w in words if w in {ROLE_WORDS[r] for r in ROLES} | {"released"}]
    assert legend == ["parameters", "gradients", "optimizer state", "other tensors", "activations", "released"]
    assert not any("scaled" in (w or "") for w in words)
    assert "grew" not in words and "shrank" not in words  # every moving line is coloured by role
    swatches = {r.get("fill") for r in root.iter(SVG + "rect") if r.get("width") == "14"}
    assert {ROLE_COLORS[r] for r in ("parameters", "gradients", "optimizer_state", "activations",
                                     "other_tensors")} <= swatches
    # each segment's hover: the role and its exact bytes, the line, and why the line moved (made from its data)
    hover = groups[4][2].splitlines()
    assert hover[0] == "gradients +400.00 MiB"
    assert hover[1] == "line 3 ×1: out.sum().backward()"
    assert ("  -880.00 MiB activations released (saved in the graph of `out`); +400.00 MiB gradients for `model` "
            "(first backward; zero_grad(set_to_none=True) frees them between steps)") in hover
    assert "  +400.00 MiB parameters of `model` (Net)" in groups[0][2].splitlines()
    assert groups[3][2].splitlines()[0] == "activations -880.00 MiB"
    first = groups[0][2]
    assert "beside allocated: reserved but unallocated +112.00 MiB, outside PyTorch +300.00 MiB" in first
    assert "temporaries: 300.00 MiB came and went" in groups[1][2]
    # the delta and the peak are still written at their column
    assert {"+900.00 MiB", "-480.00 MiB", "peak +1.17 GiB", "line 1", "line 5"} <= set(words)


def test_a_line_without_roles_beside_lines_with_roles_is_drawn_as_before():
    plain = _gpu_line(6, "cache = torch.empty(2**28)", GiB, GiB)  # roles not measured
    root = parse(cell_svg(_training_record(plain), width=640))
    red = [r for r in root.iter(SVG + "rect") if r.get("fill") == UP_COLOR]
    assert len(red) == 1 and red[0].get("fill-opacity") == "0.75" and "stroke" not in red[0].attrib
    assert {"grew", "shrank", "parameters"} <= set(texts(root))  # plain bars are explained again
    hover = next(t for t in titles(root) if t.startswith("line 6"))
    assert hover.splitlines() == ["line 6 ×1: cache = torch.empty(2**28)",
                                  "  cuda:0 allocated +1024.00 MiB, peak +1024.00 MiB · 10 ms"]


def test_roles_of_another_device_change_nothing():
    def strip(rec, roles):
        lines = tuple(LineRecord(ln.lineno, ln.source, ln.hits, ln.host, ln.devices, ln.duration_s, roles=roles(ln),
                                 why=ln.why) for ln in rec.lines)
        return CellRecord(rec.execution_count, None, rec.source, rec.started_at, 1.0, devices=rec.devices, lines=lines)

    rec = _training_record()
    on_cpu = strip(rec, lambda ln: {"cpu": (ln.roles or {}).get("cuda:0", {})})  # the chart shows cuda:0
    assert cell_svg(on_cpu, width=640) == cell_svg(strip(rec, lambda ln: None), width=640)
    assert 'class="role"' not in cell_svg(on_cpu)


def test_host_rss_chart_scales_exact_role_bytes_to_the_rss_change_and_says_so():
    def line(no, src, rss, roles, owner):
        why = _why(*(("cpu", role, owner, value) for role, value in roles.items()))
        return LineRecord(no, src, 1, HostRecord(rss_delta_sum=rss, rss_peak_increase_max=max(rss, 0)), (), 0.01,
                          roles={"cpu": roles}, why=why)

    lines = (line(1, "model = make()", 12 * MiB, {"parameters": 8 * MiB}, "model"),
             line(2, "loss.backward()", 6 * MiB, {"gradients": 8 * MiB, "activations": -4 * MiB}, "out"),
             line(3, "del out", 0, {"activations": -2 * MiB}, "out"),  # RSS kept its pages
             line(4, "torch.cuda.empty_cache()", 2 * MiB, {"activations": -1 * MiB}, "out"),  # opposite ways
             line(5, "import scipy; t = torch.ones(1)", 64 * MiB, {"other_tensors": 4}, "t"))  # not it
    rec = CellRecord(3, None, "x", time.time(), 1.0, host=HostRecord(GiB, GiB + 84 * MiB, GiB + 84 * MiB), lines=lines)
    root = parse(cell_svg(rec, width=640))
    groups = role_groups(root)
    assert [(g[0], g[2].splitlines()[1][:6]) for g in groups] == [
        ("parameters", "line 1"), ("activations", "line 2"), ("gradients", "line 2")]
    params, released, grads = (g[1] for g in groups)
    # scaled to the bar's own change: 8 MiB of parameters fill the +12 MiB bar, and in line 2
    # +8 MiB -4 MiB (net +4) are drawn as +12 MiB -6 MiB (net +6, the RSS change)
    assert _height(grads) / _height(params) == pytest.approx(1.0, rel=0.02)
    assert _height(released) / _height(params) == pytest.approx(0.5, rel=0.02)
    assert "roles: exact tensor bytes, scaled to the RSS change" in texts(root)
    assert groups[0][2].splitlines()[0] == ("parameters +8.00 MiB (exact tensor bytes; drawn as +12.00 MiB, "
                                            "scaled to the host RSS change)")
    assert "+8.00 MiB parameters of `model`" in groups[0][2]
    # lines whose roles cannot fill their bar are plain, with the roles in their hover
    hover = next(t for t in titles(root) if t.startswith("line 3"))
    assert "roles (exact tensor bytes): activations -2.00 MiB" in hover
    assert "-2.00 MiB activations released (saved in the graph of `out`)" in hover
    hover = next(t for t in titles(root) if t.startswith("line 5"))
    assert "roles (exact tensor bytes): other tensors +4 bytes" in hover  # too small to be what moved RSS
    assert len([r for r in root.iter(SVG + "rect") if r.get("fill") == UP_COLOR]) == 2  # lines 4 and 5, as before
    assert {"grew", "shrank", "released"} <= set(texts(root))


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(roles=st.lists(st.dictionaries(st.sampled_from(ROLES + ("made_up <role>",)), st.integers(-2**40, 2**40),
                                      max_size=4), min_size=1, max_size=12),
       deltas=st.lists(st.integers(-2**40, 2**40), min_size=12, max_size=12), on_device=st.booleans(),
       width=st.integers(0, 900))
def test_any_role_table_renders_valid_xml(roles, deltas, on_device, width):
    label = "cuda:0" if on_device else "cpu"
    lines = tuple(LineRecord(i + 1, "x", 1, HostRecord(rss_delta_sum=d),
                             (DeviceRecord(0, allocated_delta_sum=d),) if on_device else (), 0.0,
                             roles={label: row}, why=_why((label, "other_tensors", "<why>", MiB)))
                  for i, (row, d) in enumerate(zip(roles, deltas)))
    devices = (DeviceRecord(0, None, 2**40, 2**41, None),) if on_device else ()
    rec = CellRecord(1, None, "x", 0.0, 0.1, devices=devices, host=HostRecord(2**40, 2**41, None), lines=lines)
    root = parse(cell_svg(rec, width=width))
    for role, attrs, title in role_groups(root):
        assert attrs["fill"] == ROLE_COLORS.get(role, "#999999") and title.endswith("tensors held by `<why>`")


@pytest.mark.slow
@linux
def test_a_real_training_cell_is_stacked_by_role(ip, gpumem):
    """A real ``%%gpumem --lines`` cell on CPU tensors: an MLP, a backward and an Adam step.

    The first layer holds 36 MiB of weights (and as much again in gradients, twice in Adam's
    state), above glibc's largest mmap threshold: each role's memory comes from fresh pages and
    moves host RSS.
    """
    pytest.importorskip("torch")  # the census counts roles once torch is imported (before the cell)
    try:  # with a shell running, ipywidgets registers a comm target when first imported: let that
        import ipywidgets  # noqa: F401 - happen here, not in a later test that fakes ipykernel
    except ImportError:
        pass
    run(ip, "import torch")
    res, _ = run(ip, "%%gpumem --lines -o roles_rec\n"
                     "from torch import nn\n"
                     "mlp = nn.Sequential(nn.Linear(3072, 3072), nn.ReLU(), nn.Linear(3072, 8))\n"
                     "opt = torch.optim.Adam(mlp.parameters())\n"
                     "loss = mlp(torch.randn(16, 3072)).square().mean()\n"
                     "loss.backward()\n"
                     "opt.step()\n")
    assert res.success, res.error_in_exec
    rec = ip.user_ns.pop("roles_rec")
    for name in ("nn", "mlp", "opt", "loss"):
        ip.user_ns.pop(name, None)
    by = {ln.lineno: ln for ln in rec.lines}
    assert by[3].roles["cpu"]["parameters"] > 36 * MiB
    assert by[6].roles["cpu"]["gradients"] == by[3].roles["cpu"]["parameters"]
    assert by[7].roles["cpu"]["optimizer_state"] >= 2 * by[3].roles["cpu"]["parameters"]  # exp_avg, exp_avg_sq, step

    root = parse(cell_svg(rec, width=640))
    groups = role_groups(root)
    where = {(role, title.splitlines()[1].split(" ×")[0]) for role, _a, title in groups}
    expected = {("parameters", "line 3"), ("gradients", "line 6"), ("optimizer_state", "line 7")}
    # A line is stacked when its RSS moved with its tensors; late in a long test session freed pages
    # may be reused and a line's RSS barely move (it is then drawn plain, its roles in its hover).
    assert where & expected and where <= expected | {(r, ln) for r, ln in where if r not in dict(expected)}
    assert all(attrs["fill"] == ROLE_COLORS[role] for role, attrs, _ in groups)
    words = texts(root)
    assert {ROLE_WORDS[role] for role, line in where & expected} <= set(words)
    for role, lineno in (("parameters", 3), ("gradients", 6), ("optimizer_state", 7)):
        if (role, f"line {lineno}") not in where:
            continue
        title = next(t for r, _a, t in groups if r == role and t.splitlines()[1].startswith(f"line {lineno} "))
        exact = by[lineno].roles["cpu"][role]
        # "(exact tensor bytes; drawn as ...)" follows when the segment was scaled to the RSS change.
        assert title.startswith(f"{ROLE_WORDS[role]} {format_delta(exact)}")
        assert line_reason(by[lineno]) and clip(line_reason(by[lineno]), 400) in title


def _legend_swatches(root, height):
    """The legend row's swatches in a drawn chart (the elements on its baseline), as what the eye
    tells apart: (shape, colour, dash, glyph)."""
    swatches = []
    for el in root:
        tag = el.tag.replace(SVG, "")
        y = el.get("y1") or el.get("y")
        on_row = y is not None and abs(float(y) - (height - 5)) <= 8
        if tag == "path" and "v6" in (el.get("d") or ""):
            on_row = abs(float(re.search(r"M[\d.]+,([\d.]+)", el.get("d")).group(1)) + 3 - (height - 8.5)) < 1
        if on_row and tag in ("line", "rect", "path"):
            swatches.append((tag, el.get("stroke") or el.get("fill"), el.get("stroke-dasharray") or "",
                             "peak" if tag == "path" else ""))
    return swatches


def _timeline_with_a_missed_peak(devices):
    tl = Timeline()
    tl.cell_started(0.0, "[1]", "spike()")
    for i in range(5):
        if devices:
            samples = tuple(DeviceSample(d, GiB, 2 * GiB, None, None, 3 * GiB, TOTAL) for d in range(devices))
            tl.add(Sample(i * 0.2, HostSample(GiB, None), samples))
        else:
            tl.add(Sample(i * 0.2, HostSample(GiB + i * MiB, None), ()))
    if devices:
        rec = CellRecord(1, None, "spike()", time.time(), 1.0, devices=tuple(
            DeviceRecord(d, "GPU", GiB, GiB, 6 * GiB, 2 * GiB, 2 * GiB, None, None, None, TOTAL) for d in range(devices)))
    else:
        rec = CellRecord(1, None, "spike()", time.time(), 1.0, host=HostRecord(GiB, GiB + 4 * MiB, 3 * GiB))
    tl.cell_finished(1.0, rec)
    return tl.snapshot()


@pytest.mark.parametrize("devices", [0, 1, 2])
def test_no_two_legend_entries_look_the_same(devices):
    """Issue 22: "host RSS" and "cell peak (exact)" were the same solid green line; issue 31: the peak
    mark was still the host's green. Every legend entry differs from every other in colour or line kind
    (or glyph), in the layout and as drawn, the peak has a colour of its own, and the peak marks over the
    cells are drawn with the legend's glyph."""
    from ipy_gpumem.chart.session import PEAK_KIND, session_layout
    from ipy_gpumem.chart.style import DEVICE_COLORS, HOST_COLOR, PEAK_COLOR

    snapshot = _timeline_with_a_missed_peak(devices)
    layout = session_layout(snapshot)
    assert layout.peaks, "the record's peak is above every sample"
    items = layout.legend
    looks = [(color, kind) for _label, color, kind in items if color is not None]
    assert len(set(looks)) == len(looks), items
    assert [kind for label, _c, kind in items if label == "cell peak (exact)"] == [PEAK_KIND]
    assert PEAK_COLOR not in (HOST_COLOR,) + DEVICE_COLORS
    root = parse(timeline_svg(snapshot, width=1400, height=220))  # wide enough for the whole legend row
    drawn = _legend_swatches(root, 220)
    assert len(drawn) == len(looks) and len(set(drawn)) == len(drawn), drawn
    marks = [el for el in root.iter(SVG + "path") if "v6" in (el.get("d") or "")]
    # the legend's swatch and the marks over the cells (one per device): one glyph, one colour
    assert {el.get("stroke") for el in marks} == {PEAK_COLOR}
    assert sum(el.get("d").count("v6") for el in marks) == 2 * (1 + max(devices, 1))


def test_the_waterfall_and_role_legends_have_no_two_entries_alike():
    from ipy_gpumem.chart.columns import record_columns
    from ipy_gpumem.chart.session import PEAK_KIND
    from ipy_gpumem.chart.style import DEVICE_COLORS, HOST_COLOR, LINE_KINDS, ROLE_COLORS

    for rec in (record(3, "x = f()", GiB, 3 * GiB, 5 * GiB, 2 * GiB, 4 * GiB), _training_record()):
        layout = record_columns(rec)
        for items in (layout.legend, layout.role_legend):
            looks = [(color, kind) for _label, color, kind in items if color is not None]
            assert len(set(looks)) == len(looks), items
    assert len(set(ROLE_COLORS.values())) == len(ROLE_COLORS)
    assert HOST_COLOR not in DEVICE_COLORS and len(set(DEVICE_COLORS)) == len(DEVICE_COLORS)
    assert PEAK_KIND not in LINE_KINDS.values()  # a peak is never a series' line style
