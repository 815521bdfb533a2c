"""Tests for ``ipy_gpumem.oom.panel``: the OOM panel as text and HTML, on the seed scenario and on partial data."""
from __future__ import annotations

import html
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from test_diagnose import SEED_SOURCE, Seed  # noqa: E402  (the same real scenario)

from ipy_gpumem.who.attribution import who  # noqa: E402
from ipy_gpumem.oom.diagnose import MemoryState, explain, host_state  # noqa: E402
from ipy_gpumem.oom.parse import parse_oom  # noqa: E402
from ipy_gpumem.oom.panel import BAR_WIDTH, memory_layers, oom_panel_view  # noqa: E402
from ipy_gpumem.core.records import CellRecord, DeviceRecord, HostRecord  # noqa: E402
from ipy_gpumem.display.view import View  # noqa: E402
from ipy_gpumem.core.units import GiB, MiB  # noqa: E402

HEADLINE = "Out of memory on cuda:0: tried to allocate 2.32 GiB with 182.75 MiB free (15.78 GiB total)"
_SEG_WIDTH = re.compile(r'class="gm-seg"[^>]*?width:([0-9.]+)%')


def seed_panel(**kw):
    seed = Seed()
    records = [CellRecord(3, None, "model = model.to(device)", 0.0, 1.0,
                          devices=(DeviceRecord(0, allocated_before=2 * MiB, allocated_after=3769 * MiB),)),
               CellRecord(7, None, SEED_SOURCE, 0.0, 9.0, error="RuntimeError",
                          devices=(DeviceRecord(0, allocated_before=3769 * MiB, allocated_after=12195 * MiB),))]
    findings = seed.explain(records=records)
    return seed, findings, oom_panel_view(seed.oom, seed.state, findings, seed.who, records, **kw)


def bar_line(text):
    return next(line for line in text.splitlines() if line.startswith("["))


def test_seed_panel_text():
    seed, findings, view = seed_panel()
    text = view.text
    assert text.splitlines()[0] == HEADLINE
    assert "RuntimeError: CUDA out of memory. Tried to allocate 2.32 GiB" in text.splitlines()[1]
    bar = bar_line(text)
    assert len(bar) == BAR_WIDTH + 2 and bar.endswith("]")
    # 11.91 of 15.78 GiB allocated: 45 of 60 characters; each layer drawn with its own character.
    assert bar.count("█") == 45 and bar.count("▓") == 9 and bar.count("▒") == 5 and bar.count("·") == 1
    assert "^ requested 2.32 GiB (2.14 GiB more than free)" in text
    for legend in ("█ allocated by PyTorch", "▓ reserved but unallocated", "▒ outside PyTorch", "· free"):
        assert legend in text
    for size in ("11.91 GiB", "2.35 GiB", "1.34 GiB", "182.75 MiB"):
        assert size in text
    assert "optimizer state" in text and "output + loss (shared graph)" in text  # who holds it
    assert "[7] (RuntimeError)" in text and "+8.23 GiB" in text  # earlier cells
    positions = [text.index(f"{n}. {f.title}") for n, f in enumerate(findings, 1)]
    assert positions == sorted(positions)
    assert text.index("Who holds it") < text.index("What earlier cells") < text.index("Diagnosis")


def test_seed_panel_html():
    seed, findings, view = seed_panel()
    page = view.html
    assert html.escape(HEADLINE) in page
    widths = [float(w) for w in _SEG_WIDTH.findall(page)]
    assert len(widths) == 4 and sum(widths) == pytest.approx(100.0, abs=0.01)
    s = seed.state
    expected = [s.allocated, s.reserved_unallocated, s.outside_pytorch, s.free]
    assert widths == pytest.approx([100.0 * b / s.total for b in expected], abs=0.01)
    request = float(re.search(r'class="gm-request"[^>]*?width:([0-9.]+)%', page).group(1))
    assert request == pytest.approx(100.0 * seed.oom.requested / s.total, abs=0.01)
    assert re.findall(r'class="gm-finding" data-key="(\w+)"', page) == [f.key for f in findings]
    # The first finding comes right after the (collapsed) who and cells sections.
    assert page.index("<details") < page.index("Diagnosis") < page.index(html.escape(findings[0].title))
    assert "<script" not in page and "src=" not in page and "href=" not in page
    assert "<pre" in page and html.escape('os.environ["PYTORCH_CUDA_ALLOC_CONF"]') in page


def test_view_protocol():
    _, _, view = seed_panel()
    assert isinstance(view, View)
    assert set(view._repr_mimebundle_()) == {"text/plain", "text/html"}


def test_user_content_is_escaped():
    seed = Seed()
    evil = "<script>alert(1)</script>"
    ns = dict(seed.ns, d={evil: torch.zeros(256, 1024)})
    report = who(ns)
    assert any(evil in h["name"] for h in report.holders)
    source = f'ckpt = torch.load("{evil}.pt")'
    message = seed.oom.message + " " + evil
    oom = parse_oom(message)
    records = [CellRecord(2, None, f"x = 1  # {evil}", 0.0, 1.0,
                          devices=(DeviceRecord(0, allocated_before=0, allocated_after=GiB),))]
    findings = explain(oom, seed.state, report, records, failing_source=source, env={}, modules=())
    assert any(evil in f.snippet for f in findings)
    page = oom_panel_view(oom, seed.state, findings, report, records, error_name=evil).html
    assert "<script" not in page
    assert html.escape(evil) in page


def test_unknown_numbers_render_as_unknown():
    view = oom_panel_view(None, MemoryState("cuda"), [])
    assert "Out of memory on cuda: an allocation of unknown size failed with unknown free memory (total unknown)" \
        in view.text
    assert "no bar (total capacity unknown)" in view.text and "unknown" in view.html
    assert 'class="gm-seg"' not in view.html


def test_a_layer_with_unknown_bounds_merges_with_the_next():
    # cudaMallocAsync reports allocated and the device's free, but no reservation.
    msg = ("Allocation on device 0 would exceed allowed memory. (out of memory)\nCurrently allocated : 15.16 GiB\n"
           "Requested : 512.00 KiB\nDevice limit : 15.99 GiB\nFree (according to CUDA): 0 bytes\n")
    oom = parse_oom(msg)
    state = MemoryState.from_oom(oom)
    segments = memory_layers(state)
    assert [s.label for s in segments] == [
        "allocated by PyTorch", "reserved but unallocated + outside PyTorch (CUDA context, other processes)", "free"]
    view = oom_panel_view(oom, state, explain(oom, state, env={}, modules=()))
    widths = [float(w) for w in _SEG_WIDTH.findall(view.html)]
    assert sum(widths) == pytest.approx(100.0, abs=0.01)
    assert "15.16 GiB" in view.text and "0 bytes" in view.text


def test_cpu_panel():
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**60)
    oom = parse_oom(str(caught.value))
    state = MemoryState.from_oom(oom).merged(host_state())
    records = [CellRecord(4, None, "x = torch.rand(8192, 8192)", 0.0, 1.0,
                          host=HostRecord(rss_before=500 * MiB, rss_after=756 * MiB))]
    findings = explain(oom, state, records=records, failing_source="x = torch.empty(2**60)", env={}, modules=())
    view = oom_panel_view(oom, state, findings, records=records)
    first = view.text.splitlines()[0]
    assert first.startswith("Out of memory on the host (cpu): tried to allocate 4294967296.00 GiB")
    assert "this process (RSS)" in view.text and "Δhost RSS" in view.text and "+256.00 MiB" in view.text
    assert "cpu_oom" in re.findall(r'data-key="(\w+)"', view.html)
    if state.total is not None:
        assert "available" in first and "RAM)" in first
        assert sum(float(w) for w in _SEG_WIDTH.findall(view.html)) == pytest.approx(100.0, abs=0.01)


sizes = st.one_of(st.none(), st.integers(min_value=0, max_value=2 * 80 * GiB))


@settings(max_examples=300, deadline=None)
@given(device=st.sampled_from(["cuda:0", "cpu", "mps", "cuda"]), total=sizes, allocated=sizes, reserved=sizes,
       used=sizes, process_used=sizes, requested=sizes)
def test_any_state_renders(device, total, allocated, reserved, used, process_used, requested):
    state = MemoryState(device, total=total, allocated=allocated, reserved=reserved, used=used,
                        process_used=process_used)
    findings = explain(None, state, env={}, modules=(), requested=requested)
    view = oom_panel_view(None, state, findings)
    assert view.text and view.html
    widths = [float(w) for w in _SEG_WIDTH.findall(view.html)]
    if widths:
        assert sum(widths) == pytest.approx(100.0, abs=0.01)
        assert len(bar_line(view.text)) == BAR_WIDTH + 2
    segments = memory_layers(state)
    assert all(s.size is None or s.size >= 0 for s in segments)
