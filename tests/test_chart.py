"""Chart views outside a kernel: tier choice, text and HTML renderings, widget state, seeding."""
import types

import pytest

from ipy_gpumem.chart.views import (
    HtmlChartView, StatusLineView, TextChartView, choose_tier, make_view, sidebar_unavailable, status_line,
    timeline_text, widgets_status,
)
from ipy_gpumem.core.probes import DeviceSample, HostSample, Sample
from ipy_gpumem.core.records import CellRecord, DeviceRecord, HostRecord
from ipy_gpumem.chart.timeline import Timeline, seed_timeline
from ipy_gpumem.core.units import GiB, MiB


def gpu_timeline(cells=3, running=True):
    tl = Timeline(max_points=200, max_spans=50)
    t = 100.0
    for i in range(cells):
        tl.cell_started(t, "[*]", f"x{i} = big()")
        for k in range(5):
            alloc = (i + 1) * GiB + k * 64 * MiB
            tl.add(Sample(t + k * 0.1, HostSample(2 * GiB, None),
                          (DeviceSample(0, alloc, alloc + GiB, None, None, alloc + 2 * GiB, 16 * GiB),), None))
        rec = CellRecord(i + 1, None, f"x{i} = big()", 0.0, 0.5, host=HostRecord(2 * GiB, 2 * GiB, 2 * GiB),
                         devices=(DeviceRecord(0, "GPU", i * GiB, (i + 1) * GiB, (i + 1) * GiB, 0, 0, 0, None, None, 16 * GiB),))
        tl.cell_finished(t + 0.5, rec)
        t += 1.0
    if running:
        tl.cell_started(t, "[*]", "train()")
    return tl


class FakeShell:
    """A stand-in shell object for tier choice: only its class name matters (fake)."""


def test_tier_follows_the_front_end(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, "ipykernel", raising=False)
    assert choose_tier(None) == ("text", None)
    tier, note = choose_tier(None, prefer="widget")
    assert tier == "text" and "terminal" in note
    monkeypatch.setitem(__import__("sys").modules, "ipykernel", types.ModuleType("ipykernel"))
    zmq_shell = type("ZMQInteractiveShell", (), {})()
    assert choose_tier(zmq_shell, prefer="html") == ("html", None)
    monkeypatch.setitem(__import__("sys").modules, "google.colab", types.ModuleType("google.colab"))
    tier, note = choose_tier(zmq_shell)
    assert tier == "html" and note is None  # Colab's default is the HTML chart, no complaint
    tier, note = choose_tier(zmq_shell, prefer="widget")
    assert tier == "html" and "Colab" in note
    with pytest.raises(ValueError):
        choose_tier(zmq_shell, prefer="3d")


def test_sidebar_reasons(monkeypatch):
    sys = __import__("sys")
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    assert "terminal" in sidebar_unavailable(None)
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    shell = type("ZMQInteractiveShell", (), {})()
    assert "VS Code" in sidebar_unavailable(shell, environ={"VSCODE_PID": "1"})
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert "Colab" in sidebar_unavailable(shell, environ={})


def test_status_line_and_text_chart():
    tl = gpu_timeline()
    snap = tl.snapshot()
    line = status_line(snap)
    assert line.startswith("cuda:0 3.25 GiB allocated · 4.25 GiB reserved · 5.25 GiB used of 16.00 GiB")
    assert "running [*]" in line
    text = timeline_text(snap)
    assert "cuda:0 allocated" in text and "cuda:0 reserved" in text
    assert "[1]" in text and "[3]" in text
    assert timeline_text(Timeline().snapshot()) == "ipy_gpumem chart: no samples yet"


def test_html_view_bundle_updates_in_place():
    tl = gpu_timeline()
    view = HtmlChartView(tl)
    updates = []
    view.handle = types.SimpleNamespace(update=lambda bundle, raw: updates.append(bundle))  # fake handle
    assert view.refresh() is True
    assert view.refresh() is False  # nothing changed: no redraw
    tl.add(Sample(200.0, HostSample(GiB, None), (), None))
    assert view.refresh() is True and len(updates) == 2
    html = updates[-1]["text/html"]
    assert "<svg" in html and "ipy_gpumem" in html and "16.00 GiB total" in html
    view.freeze()
    tl.add(Sample(201.0, HostSample(GiB, None), (), None))
    assert view.refresh() is False and not view.live


def test_status_line_view_says_where_the_chart_is():
    view = StatusLineView(gpu_timeline(), where="chart in the right sidebar")
    bundle = view._bundle(view.timeline.snapshot())
    assert bundle["text/plain"].startswith("ipy_gpumem · cuda:0") and "right sidebar" in bundle["text/plain"]


def test_text_view_is_printed_once(capsys):
    view = make_view("text", gpu_timeline(), note="no notebook front end here")
    assert isinstance(view, TextChartView)
    view.display()
    out = capsys.readouterr().out
    assert out.startswith("ipy_gpumem: no notebook front end here\nipy_gpumem · cuda:0")
    assert view.live is False


def test_widget_view_maps_the_timeline_onto_traces():
    pytest.importorskip("plotly")
    pytest.importorskip("ipywidgets")
    if widgets_status() is not None:
        pytest.skip(widgets_status())
    from ipy_gpumem.chart.views import WidgetChartView

    tl = gpu_timeline()
    view = WidgetChartView(tl)
    view.refresh()
    fig = view.figure
    names = [t.name for t in fig.data]
    assert names == ["cuda:0 allocated", "cuda:0 reserved", "cuda:0 used (all processes)", "cells"]
    n = len(fig.data[0].x)
    assert n == len(tl.snapshot().t) and max(fig.data[0].y) == 3 * GiB + 4 * 64 * MiB
    assert list(fig.data[3].text) == ["[1]", "[2]", "[3]", "[*]"]
    assert "x0 = big()" in fig.data[3].hovertext[0]
    shapes = fig.layout.shapes
    assert shapes[3].fillcolor == "#f59e0b"  # the running cell is highlighted
    assert any(s.type == "line" and s.y0 == 16 * GiB for s in shapes)  # capacity drawn
    assert list(fig.layout.yaxis.ticktext)[0] == "0 bytes"
    assert "running [*]" in view.header.value
    tl.add(Sample(500.0, HostSample(GiB, None), (DeviceSample(0, GiB, 2 * GiB, None, None, 3 * GiB, 16 * GiB),), None))
    view.refresh()
    assert len(fig.data[0].x) == n + 1
    bundle = view._bundle(tl.snapshot())
    assert set(bundle) == {"application/vnd.jupyter.widget-view+json", "text/html", "text/plain"}
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == view.box.model_id
    assert "<svg" in bundle["text/html"]  # the static snapshot a saved notebook shows


def test_widget_view_on_cpu_draws_host_rss():
    pytest.importorskip("plotly")
    if widgets_status() is not None:
        pytest.skip(widgets_status())
    from ipy_gpumem.chart.views import WidgetChartView

    tl = Timeline()
    tl.add(Sample(1.0, HostSample(100 * MiB, None), (), "CUDA not initialized yet"))
    tl.add(Sample(2.0, HostSample(300 * MiB, None), (), "CUDA not initialized yet"))
    view = WidgetChartView(tl)
    view.refresh()
    assert [t.name for t in view.figure.data] == ["host RSS", "cells"]
    assert "host 300.00 MiB resident" in view.header.value


def test_seeding_replays_recorded_cells():
    recs = [
        CellRecord(1, None, "import torch", 1000.0, 2.0, host=HostRecord(50 * MiB, 250 * MiB, 260 * MiB)),
        CellRecord(2, None, "x = torch.ones(2**26)", 1003.0, 0.5, host=HostRecord(250 * MiB, 506 * MiB, 506 * MiB),
                   error="ValueError"),
    ]
    tl = Timeline()
    seed_timeline(tl, recs, now_epoch=1010.0)
    snap = tl.snapshot()
    assert [s.label for s in snap.spans] == ["[1]", "[2]"]
    assert snap.spans[1].failed
    assert snap.series["host rss"] == (50 * MiB, 250 * MiB, 250 * MiB, 506 * MiB)
    assert snap.t[1] - snap.t[0] == pytest.approx(2.0) and snap.t[2] - snap.t[0] == pytest.approx(3.0)


def test_widget_view_first_draw_with_no_samples_yet():
    """Right after %load_ext the timeline is empty; the first draw must still build the figure."""
    pytest.importorskip("plotly")
    if widgets_status() is not None:
        pytest.skip(widgets_status())
    from ipy_gpumem.chart.views import WidgetChartView

    tl = Timeline()
    view = WidgetChartView(tl)
    view.refresh(force=True)
    assert [t.name for t in view.figure.data] == ["cells"]
    tl.add(Sample(1.0, HostSample(100 * MiB, None), (), None))
    view.refresh()
    assert [t.name for t in view.figure.data] == ["host RSS", "cells"]
