"""Chart views and the live chart outside a kernel: tier choice, text and HTML renderings, widget
state and lifecycle, seeding, the sample rate, and the redraw budget."""
import math
import re
import sys
import types
import urllib.parse

import pytest

from ipy_gpumem.chart.live import MAX_RATE, MIN_RATE, LiveChart, RedrawBudget, check_rate, make_view
from ipy_gpumem.chart.timeline import HOST_RSS, Timeline, seed_timeline
from ipy_gpumem.chart.views import (
    HtmlChartView, StatusLineView, TextChartView, chart_html, choose_tier, sidebar_unavailable,
    status_line, timeline_text, widgets_status,
)
from ipy_gpumem.core.probes import DeviceSample, HostSample, MemoryProbe, Sample
from ipy_gpumem.core.records import CellRecord, DeviceRecord, HostRecord
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


def _fake_ipykernel():
    """A stand-in ``ipykernel`` module (the test is about telling front ends apart); ipywidgets,
    imported while it is in place, reads its version."""
    module = types.ModuleType("ipykernel")
    module.version_info = (7, 0, 0)
    return module


def test_tier_follows_the_front_end(monkeypatch):
    # Whatever earlier tests of this worker left: no Colab module, no VS Code environment.
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    for name in ("VSCODE_PID", "VSCODE_CWD", "VSCODE_IPC_HOOK_CLI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    assert choose_tier(None) == ("text", None)
    tier, note = choose_tier(None, prefer="widget")
    assert tier == "text" and "terminal" in note
    monkeypatch.setitem(sys.modules, "ipykernel", _fake_ipykernel())
    zmq_shell = type("ZMQInteractiveShell", (), {})()
    # In a kernel the live plotly figure is the default where it can be shown (plotly, anywidget).
    from ipy_gpumem.chart.views import plotly_widget_status

    # Found, not imported: with the stand-in ipykernel, Colab's ipywidgets 7.7 cannot be imported (no
    # ipykernel.comm), and the figure is still the default (its link reports that, ``link_error``).
    live = plotly_widget_status() is None
    assert choose_tier(zmq_shell) == ("plotly" if live else "html", None), plotly_widget_status()
    assert choose_tier(zmq_shell, prefer="html") == ("html", None)
    if widgets_status() is None:
        assert choose_tier(zmq_shell, prefer="widget") == ("widget", None)
    monkeypatch.setenv("VSCODE_PID", "1")  # VS Code: the picture by default, the figure when asked
    assert choose_tier(zmq_shell) == ("html", None)
    if plotly_widget_status() is None:
        assert choose_tier(zmq_shell, prefer="plotly") == ("plotly", None)
    monkeypatch.delenv("VSCODE_PID")
    monkeypatch.setitem(sys.modules, "anywidget", None)  # an import of it now fails
    if widgets_status() is None:
        assert choose_tier(zmq_shell) == ("html", None)  # the default falls back quietly
        tier, note = choose_tier(zmq_shell, prefer="plotly")
        assert tier == "html" and "anywidget" in note
    monkeypatch.delitem(sys.modules, "anywidget")
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert choose_tier(zmq_shell) == ("html", None)
    tier, note = choose_tier(zmq_shell, prefer="widget")
    assert tier == "html" and "Colab" in note
    with pytest.raises(ValueError):
        choose_tier(zmq_shell, prefer="3d")


def test_sidebar_reasons(monkeypatch):
    sys = __import__("sys")
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    assert "terminal" in sidebar_unavailable(None)
    monkeypatch.setitem(sys.modules, "ipykernel", _fake_ipykernel())
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
    assert "[1] cuda:0 +1024.00 MiB" in text and "[3]" in text  # torch spells 1 GiB so
    assert timeline_text(Timeline().snapshot()) == "ipy_gpumem chart: no samples yet"


def test_text_sparkline_shows_the_peaks_the_samples_missed():
    tl = Timeline()
    for i in range(40):
        tl.add(Sample(float(i), HostSample(GiB, None), (DeviceSample(0, GiB, 2 * GiB, None, None, None, None),)))
    tl.cell_started(10.0, "[1]", "spike()")
    rec = CellRecord(1, None, "spike()", 0.0, 1.0, devices=(DeviceRecord(0, "GPU", GiB, GiB, 5 * GiB),))
    tl.cell_finished(11.0, rec)  # peaked at 5 GiB between two samples at 1 GiB
    line = next(ln for ln in timeline_text(tl.snapshot(), width=40).splitlines() if ln.startswith("cuda:0 allocated"))
    spark = line.split("  ")[1]
    assert "█" in spark and spark.count("█") <= 2 and spark.index("█") in (10, 11)
    assert line.endswith("1024.00 MiB .. 5.00 GiB")
    assert "[1] cuda:0 +0 bytes (peak +4.00 GiB)" in timeline_text(tl.snapshot())


def test_text_chart_never_reads_hover_text(monkeypatch):
    import ipy_gpumem.chart.svg as svg

    def no_hover(span):
        raise AssertionError("timeline_text read a hover text")

    monkeypatch.setattr(svg, "span_hover", no_hover)
    assert "[2] cuda:0 +1024.00 MiB" in timeline_text(gpu_timeline().snapshot())


def _img_svg(html: str) -> str:
    src = re.search(r"src='data:image/svg\+xml,([^']*)'", html).group(1)
    return urllib.parse.unquote(src)


def test_chart_html_is_an_image_with_a_hover_box_per_cell():
    snap = gpu_timeline().snapshot()
    html = chart_html(snap)
    svg = _img_svg(html)
    assert svg.startswith("<svg") and svg.endswith("</svg>") and "16.00 GiB total" in svg
    assert "<title>" not in svg  # no tooltips inside an image: the boxes carry them
    assert "<svg" not in html.replace(html[html.index("src='"):html.index("' style")], "")  # nothing a sanitizer strips
    boxes = re.findall(r'<div title="([^"]*)" style="position:absolute;left:[\d.]+%;width:[\d.]+%;height:100%">', html)
    assert len(boxes) == len(snap.spans) == 4
    assert boxes[0].startswith("[1] x0 = big()\ncuda:0 allocated +1024.00 MiB")
    assert "running…" in boxes[-1]
    assert html.startswith('<div class="ipy-gpumem-chart"') and "ipy_gpumem · cuda:0 3.25 GiB allocated" in html


def test_chart_html_escapes_cell_text_everywhere():
    tl = Timeline()
    tl.cell_started(0.0, "[*]", "x = '<img src=x onerror=alert(1)>' # \" & '")
    tl.add(Sample(0.5, HostSample(GiB, None), ()))
    html = chart_html(tl.snapshot())
    assert "<img src=x" not in html and "onerror=alert(1)>" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html and "&quot; &amp; &#x27;" in html
    assert "<img src=x" not in _img_svg(html)


def test_html_view_bundle_updates_in_place():
    tl = gpu_timeline()
    view = HtmlChartView(tl)
    updates = []
    view.handle = types.SimpleNamespace(update=lambda bundle, raw: updates.append(bundle))  # fake handle
    assert view.refresh() is True
    assert view.refresh() is False  # nothing changed: no redraw
    tl.add(Sample(200.0, HostSample(GiB, None), (), None))
    assert view.refresh() is True and len(updates) == 2
    assert set(updates[-1]) == {"text/html", "text/plain"}
    assert "16.00 GiB total" in _img_svg(updates[-1]["text/html"])
    tl.add(Sample(201.0, HostSample(GiB, None), (), None))
    view.freeze()  # the output keeps the latest picture
    assert len(updates) == 3 and not view.live
    tl.add(Sample(202.0, HostSample(GiB, None), (), None))
    assert view.refresh() is False and len(updates) == 3


def test_status_line_view_says_where_the_chart_is():
    view = StatusLineView(gpu_timeline(), where="chart in the right sidebar")
    bundle = view.bundle(view.timeline.snapshot())
    assert bundle["text/plain"].startswith("ipy_gpumem · cuda:0") and "right sidebar" in bundle["text/plain"]
    updates = []
    view.handle = types.SimpleNamespace(update=lambda bundle, raw: updates.append(bundle))
    view.say("no right sidebar in this front end: the chart is below")  # what the front end reported
    assert "chart is below" in updates[-1]["text/plain"] and "sidebar;" not in updates[-1]["text/plain"]
    view.say("no right sidebar in this front end: the chart is below")
    assert len(updates) == 1  # said once


def test_text_view_is_printed_once(capsys):
    view = make_view("text", gpu_timeline(), note="no notebook front end here")
    assert isinstance(view, TextChartView)
    view.display()
    out = capsys.readouterr().out
    assert out.startswith("ipy_gpumem: no notebook front end here\nipy_gpumem · cuda:0")
    assert view.live is False


def _widgets():
    """Live widget models in this process (ipywidgets 8 keeps them in _instances, 7 in Widget.widgets)."""
    import ipywidgets.widgets.widget as widget_module

    instances = getattr(widget_module, "_instances", None)
    return dict(instances if instances is not None else widget_module.Widget.widgets)


def test_widget_view_holds_the_chart_and_closes_its_widgets_when_frozen():
    pytest.importorskip("ipywidgets")
    from ipy_gpumem.chart.views import WidgetChartView

    before = set(_widgets())
    tl = gpu_timeline()
    view = WidgetChartView(tl)
    assert view.refresh() is True
    assert "<img" in view.html.value and "running [*]" in view.html.value
    created = set(_widgets()) - before
    assert created == {w.model_id for w in view.widgets} and len(created) == 3  # HTML, its layout, its style
    updates = []
    view.handle = types.SimpleNamespace(update=lambda bundle, raw: updates.append(bundle))
    bundle = view.bundle(tl.snapshot())
    assert set(bundle) == {"application/vnd.jupyter.widget-view+json", "text/html", "text/plain"}
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == view.html.model_id
    tl.add(Sample(500.0, HostSample(GiB, None), (DeviceSample(0, GiB, 2 * GiB, None, None, 3 * GiB, 16 * GiB),), None))
    assert view.finalize() is True and "application/vnd.jupyter.widget-view+json" in updates[-1]
    view.freeze()
    assert set(_widgets()) == before  # closed: nothing left in the kernel, nothing in the saved state
    # the output keeps the plotly figure and a picture, no dead widget
    assert set(updates[-1]) == {"application/vnd.plotly.v1+json", "text/html", "text/plain"}
    assert "<img" in updates[-1]["text/html"] and not view.live


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
    assert snap.spans[1].failed and snap.spans[1].error == "ValueError"
    assert snap.series[HOST_RSS] == (50 * MiB, 250 * MiB, 250 * MiB, 506 * MiB)
    assert snap.t[1] - snap.t[0] == pytest.approx(2.0) and snap.t[2] - snap.t[0] == pytest.approx(3.0)


# ---------------------------------------------------------------------------------------------
# The live chart: rate, lifecycle, redraw budget
# ---------------------------------------------------------------------------------------------


class FakeView:
    """A view that counts its redraws (fake; real views need a display)."""

    inline = True
    live = True

    def __init__(self):
        self.refreshes = self.finals = self.frozen = 0

    def refresh(self, force=False):
        self.refreshes += 1
        return True

    def finalize(self):
        self.finals += 1
        return True

    def freeze(self):
        self.frozen += 1
        self.live = False


@pytest.fixture
def live():
    chart = LiveChart(MemoryProbe(), lambda: [], lambda: None)
    chart.views.append(FakeView())
    yield chart
    chart.close()


def test_rate_zero_then_back_restarts_the_sampler(live):
    live.ensure_sampler()
    assert live.sampler.running
    live.set_rate(0)
    assert live.sampler is None
    live.set_rate(4)
    assert live.sampler is not None and live.sampler.running and live.sampler.interval == 0.25
    live.sample_rate = 10  # the attribute is the same setter
    assert live.sampler.interval == 0.1
    live.stop_sampler()  # %gpumem off: a new rate does not start it behind the user's back
    live.set_rate(4)
    assert live.sampler is None
    live.ensure_sampler()  # %gpumem on
    assert live.sampler.running


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1, 1e-10, MIN_RATE / 2, MAX_RATE * 1.01, "fast"])
def test_rates_outside_the_range_are_refused_and_change_nothing(live, bad):
    live.ensure_sampler()
    with pytest.raises(ValueError, match="sample_rate"):
        live.set_rate(bad)
    assert live.sample_rate == 4.0 and live.sampler.running and live.sampler.error is None


def test_the_rate_range():
    assert check_rate(0) == 0.0 and check_rate(MIN_RATE) == MIN_RATE and check_rate(MAX_RATE) == MAX_RATE
    assert 1 / MIN_RATE <= 1000 and not math.isnan(check_rate("4"))


def test_close_stops_everything_and_freezes_every_view(live):
    live.ensure_sampler()
    sampler, view = live.sampler, live.views[0]
    live.close()
    assert not sampler.running and live.sampler is None and live.views == [] and view.frozen == 1


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_budget_refills_at_its_share_and_caps_at_its_burst():
    clock = FakeClock()
    budget = RedrawBudget(share=0.01, burst=0.05, clock=clock)
    assert budget.allows()
    budget.spend(0.06)
    assert not budget.allows()
    clock.now += 0.5  # +5 ms of budget: still 5 ms short
    assert not budget.allows()
    clock.now += 1.0
    assert budget.allows()
    clock.now += 1000
    budget.spend(0.049)
    assert budget.allows()  # the burst capped the refill at 50 ms


def test_cells_faster_than_the_budget_are_drawn_by_the_sampler(live):
    clock = FakeClock()
    live.budget = RedrawBudget(share=0.003, burst=0.001, clock=clock)
    live._ensure_timeline()
    live.sampler = types.SimpleNamespace(running=True, stop=lambda: None)  # a sampler that is running (fake)
    view = live.views[0]
    sample = Sample(1.0, HostSample(GiB, None), ())
    rec = CellRecord(1, None, "x = 1", 0.0, 0.01, host=HostRecord(GiB, GiB, GiB))
    live.budget.spend(0.002)  # spent: the next cell ends while the budget is empty
    live.cell_started(sample, "x = 1")
    assert live.cell_finished(sample, rec) is None
    assert view.finals == 0 and live._pending
    live._on_redraw()  # the sampler's tick: still no budget
    assert view.finals == 0
    clock.now += 1.0
    live._on_redraw()
    assert view.finals == 1 and not live._pending


def test_without_a_sampler_every_cell_end_redraws(live):
    live.set_rate(0)
    live.budget.spend(10.0)  # even without budget: nobody else would draw it
    sample = Sample(1.0, HostSample(GiB, None), ())
    live.cell_started(sample, "x = 1")
    live.cell_finished(sample, CellRecord(1, None, "x = 1", 0.0, 0.01, host=HostRecord(GiB, GiB, GiB)))
    assert live.views[0].finals == 1


def test_an_idle_chart_is_not_redrawn_for_repeated_numbers(live):
    clock = FakeClock()
    live.budget = RedrawBudget(clock=clock)
    timeline = live._ensure_timeline()
    view = live.views[0]
    timeline.add(Sample(0.0, HostSample(GiB, None), ()))
    live._on_redraw()
    assert view.refreshes == 1
    for i in range(1, 5):
        clock.now += 1.0
        timeline.add(Sample(float(i), HostSample(GiB + 4096, None), ()))
        live._on_redraw()
    assert view.refreshes == 1  # idle, nothing moved
    timeline.add(Sample(5.0, HostSample(2 * GiB, None), ()))
    live._on_redraw()
    assert view.refreshes == 2  # a real move
    clock.now += 600.0
    timeline.add(Sample(605.0, HostSample(2 * GiB, None), ()))
    live._on_redraw()
    assert view.refreshes == 2  # ten idle minutes later, still no redraw: the time axis does not stretch
    live.cell_started(Sample(606.0, HostSample(2 * GiB, None), ()), "y = 2")
    live._on_redraw()
    assert view.refreshes == 3  # a cell runs: the idle time is drawn now


def test_repeated_charts_keep_one_live_view_and_no_widgets(ip, monkeypatch):
    """Every %gpumem chart used to leave six widgets alive forever; now replaced views close theirs."""
    pytest.importorskip("ipywidgets")
    from IPython.utils.capture import capture_output

    import ipy_gpumem.chart.views as views

    monkeypatch.setattr(views, "in_kernel", lambda shell=None: True)  # as in a kernel
    before = set(_widgets())
    chart = LiveChart(MemoryProbe(), lambda: [], lambda: None)
    try:
        with capture_output():
            for kind in ("widget", None, "plotly", "html") * 10:
                chart.show(ip, kind, run=False)
        assert len(chart.views) == 1 and len(set(_widgets()) - before) == 0  # the last one is html
        with capture_output():
            chart.show(ip, "widget", run=False)
        assert len(set(_widgets()) - before) == 3
        from ipy_gpumem.chart.views import plotly_widget_status

        if plotly_widget_status() is None:
            with capture_output():
                chart.show(ip, None, run=False)  # the default: the figure's state, link and layout, the HTML widget closed
            assert len(set(_widgets()) - before) == 3 and chart.views[0].tier == "plotly"
    finally:
        chart.close()
    assert set(_widgets()) == before and chart.views == []


def test_a_view_that_fails_to_draw_stops_alone_and_says_so_once(live):
    """A fake fault (a view raising mid-redraw, which nothing here can cause for real): the view stops,
    the recording and the timeline go on, and the next cell's end says so once, in one line."""
    broken = live.views[0]

    def boom(*args, **kwargs):
        raise RuntimeError("plotly went away\nsecond line")

    broken.finalize = boom
    sample = Sample(1.0, HostSample(GiB, None), ())
    live.cell_started(sample, "x = 1")
    message = live.cell_finished(sample, CellRecord(1, None, "x = 1", 0.0, 0.01, host=HostRecord(GiB, GiB, GiB)))
    assert message is not None and "RuntimeError: plotly went away" in message and "\n" not in message
    assert broken not in live.views and not broken.live
    live.cell_started(sample, "y = 2")
    assert live.cell_finished(sample, CellRecord(2, None, "y = 2", 0.0, 0.01, host=HostRecord(GiB, GiB, GiB))) is None
    assert len(live.timeline.snapshot().spans) == 2  # recording went on
