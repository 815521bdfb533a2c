"""The plotly figures: what the session figure holds, that plotly accepts it, that its traces are fixed in
number and order with x values from the first draw, that the live view hands its link each new figure and
leaves a figure (never a widget) in its output, and the column figures (a cell, the history, an estimate)."""
import json
import re
import time

import pytest

from ipy_gpumem.chart.figures.timeline import FIXED_TRACES, PLOTLY_MIME, UIREVISION, byte_unit, timeline_figure
from ipy_gpumem.chart.style import DEVICE_COLORS, FAILED_COLOR, PEAK_COLOR, RUNNING_COLOR
from ipy_gpumem.chart.timeline import Timeline
from ipy_gpumem.core.devices import HOST, cuda
from ipy_gpumem.core.probes import DeviceSample, HostSample, Sample
from ipy_gpumem.core.records import CellRecord, DeviceRecord, HostRecord
from ipy_gpumem.core.units import GiB, MiB


def gpu(t, allocated, reserved=None, total=16 * GiB, index=0):
    return Sample(t, HostSample(GiB, None), (DeviceSample(index, allocated, reserved, None, None, None, total),))


def host(t, rss):
    return Sample(t, HostSample(rss, None), ())


def record(n, peak, error=None, source="y = model(x)"):
    dev = DeviceRecord(0, "GPU", allocated_before=GiB, allocated_after=GiB, peak_allocated=peak,
                       reserved_before=2 * GiB, reserved_after=2 * GiB, peak_reserved=peak, total=16 * GiB)
    return CellRecord(n, None, source, time.time(), 1.0, error=error, devices=(dev,), host=HostRecord(GiB, GiB, GiB))


def session(cells=5, points_per_cell=10, running=True, capacity=16 * GiB):
    tl = Timeline()
    t = 100.0
    for n in range(1, cells + 1):
        tl.cell_started(t, "[*]", f"step({n})\nmore()")
        for i in range(points_per_cell):
            tl.add(gpu(t + i * 0.1, GiB + i * 100 * MiB, 2 * GiB + i * 100 * MiB, total=capacity))
        t += points_per_cell * 0.1
        # a peak between samples (the record's exact peak is above every sample of the cell)
        tl.cell_finished(t, record(n, 9 * GiB if n == 2 else GiB + 950 * MiB, error="ValueError" if n == 3 else None))
        t += 0.2
    if running:
        tl.cell_started(t, "[*]", "train()")
        tl.add(gpu(t + 0.5, 3 * GiB, 4 * GiB, total=capacity))
    return tl


def _trace(figure, name):
    return next(trace for trace in figure["data"] if trace.get("name") == name)


def test_figure_has_the_series_bands_peaks_and_capacity_in_torch_words():
    figure = timeline_figure(session().snapshot())
    names = [trace["name"] for trace in figure["data"]]
    assert "cuda:0 allocated" in names and "cuda:0 reserved" in names and "cell peak (exact)" in names
    allocated, reserved = _trace(figure, "cuda:0 allocated"), _trace(figure, "cuda:0 reserved")
    assert allocated["line"]["color"] == reserved["line"]["color"] == DEVICE_COLORS[0]
    assert allocated["line"]["dash"] == "solid" and reserved["line"]["dash"] == "dash"
    assert figure["layout"]["yaxis"]["title"]["text"] == "GiB" and "GiB" in allocated["hovertemplate"]
    assert max(v for v in reserved["y"] if v is not None) == pytest.approx(4.0)
    peaks = _trace(figure, "cell peak (exact)")
    assert 9.0 in peaks["y"]  # the record's peak the samples missed
    # the cells: one hover marker each, naming the cell, its first line and what it did
    cells = _trace(figure, "cells")
    assert len(cells["x"]) == 6 and cells["text"][:2] == ["[1]", "[2]"]
    assert "[1] y = model(x)" in cells["hovertext"][0] and "cuda:0 allocated" in cells["hovertext"][0]
    assert "ValueError" in cells["hovertext"][2] and "running" in cells["hovertext"][-1]
    # the running cell amber, the failed one red, both as band fills
    fills = " ".join(trace.get("fillcolor", "") for trace in figure["data"])
    for colour in (RUNNING_COLOR, FAILED_COLOR):
        red, green, blue = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
        assert f"rgba({red},{green},{blue}," in fills
    # capacity: 16 GiB is on the scale of a 9 GiB peak, drawn as a line with its total
    (line,) = [shape for shape in figure["layout"]["shapes"] if shape["type"] == "line"]
    assert line["y0"] == pytest.approx(16.0) and "16.00 GiB total" in json.dumps(figure["layout"]["annotations"])


def test_figure_carries_what_a_user_needs_to_explore_it():
    figure = timeline_figure(session().snapshot(), filename="my-session")
    layout = figure["layout"]
    assert layout["uirevision"] == UIREVISION and layout["xaxis"]["rangeslider"]["visible"]
    assert layout["showlegend"] and figure["config"]["toImageButtonOptions"] == {
        "format": "png", "filename": "my-session", "scale": 2}
    assert figure["config"]["displaylogo"] is False


def test_off_scale_capacity_is_written_not_drawn():
    figure = timeline_figure(session(capacity=80 * GiB).snapshot())
    assert not [shape for shape in figure["layout"]["shapes"] if shape["type"] == "line"]
    assert "cuda:0 80.00 GiB total" in json.dumps(figure["layout"]["annotations"])


def test_host_only_sessions_chart_rss_and_empty_ones_say_so():
    tl = Timeline()
    for i in range(5):
        tl.add(host(10.0 + i, 300 * MiB + i * MiB))
    figure = timeline_figure(tl.snapshot())
    assert [trace["name"] for trace in figure["data"] if trace["x"]] == ["host RSS"]  # the other traces are empty
    assert figure["layout"]["yaxis"]["title"]["text"] == "host RSS (MiB)"
    empty = timeline_figure(None)
    assert not any(trace["x"] for trace in empty["data"]) and "no samples yet" in json.dumps(empty["layout"]["annotations"])
    assert byte_unit(0) == (1024, "KiB") and byte_unit(3 * GiB)[1] == "GiB"


def test_plotly_accepts_every_figure():
    go = pytest.importorskip("plotly.graph_objects")
    for figure in (timeline_figure(session().snapshot()), timeline_figure(None),
                   timeline_figure(session(capacity=80 * GiB, running=False).snapshot(), title="t")):
        go.Figure(data=figure["data"], layout=figure["layout"])  # raises on any property plotly does not know


def test_long_sessions_stay_small_and_keep_every_cells_peak():
    tl = session(cells=300, points_per_cell=40, running=False)
    snapshot = tl.snapshot()
    figure = timeline_figure(snapshot)
    size = len(json.dumps({PLOTLY_MIME: figure}))
    assert size < 200 * 1024, size
    assert len(_trace(figure, "cuda:0 allocated")["x"]) <= 2000  # the timeline's bound on points
    # the one big peak among 300 cells is still there, exactly
    assert 9.0 in _trace(figure, "cell peak (exact)")["y"]


# ---------------------------------------------------------------------------------------------
# Stable traces, and the live view (a real link widget, no front end)
# ---------------------------------------------------------------------------------------------


def test_every_figure_has_the_same_traces_in_the_same_order_each_with_x_values():
    """Issue 31, items 2 and 3: a legend click hid the wrong series after an update (band traces came and
    went, shifting indices), and a new figure drew its bands without x values."""
    empty = timeline_figure(Timeline().snapshot())
    busy = timeline_figure(session().snapshot())
    uids = [trace["uid"] for trace in busy["data"]]
    assert uids[:len(FIXED_TRACES)] == list(FIXED_TRACES) == [trace["uid"] for trace in empty["data"]]
    assert all("x" in trace and "y" in trace and len(trace["x"]) == len(trace["y"]) for trace in busy["data"])
    assert len(set(uids)) == len(uids)
    bands = [trace for trace in busy["data"] if trace["uid"].startswith("band-")]
    assert all(all(x is None or isinstance(x, float) for x in trace["x"]) for trace in bands)
    assert sum(len([x for x in trace["x"] if x is not None]) for trace in bands) == 5 * 6  # 6 cells, 5 corners each


def test_a_live_figure_only_appends_traces_and_keeps_a_gone_one_empty_in_its_place():
    from ipy_gpumem.chart.figures.timeline import session_figure
    from ipy_gpumem.chart.session import session_layout

    tl = Timeline()
    for i in range(5):
        tl.add(host(10.0 + i, 300 * MiB + i * MiB))
    first = session_figure(session_layout(tl.snapshot()))
    order = [trace["uid"] for trace in first["data"]]
    # uids go into plotly.js's CSS selectors: letters, digits, dashes and underscores only
    assert order[-1] == "series-cpu-rss" and all(re.fullmatch(r"[A-Za-z0-9_-]+", uid) for uid in order)
    tl.add(gpu(20.0, GiB, 2 * GiB))  # CUDA comes up: the chart now draws the device, not host RSS
    second = session_figure(session_layout(tl.snapshot()), order=order,
                            kept={trace["uid"]: trace for trace in first["data"]})
    uids = [trace["uid"] for trace in second["data"]]
    assert uids[:len(order)] == order and "series-cuda_3a_0-allocated" in uids[len(order):]  # appended, never inserted
    rss = second["data"][order.index("series-cpu-rss")]
    assert rss["x"] == [] and rss["y"] == [] and rss["showlegend"] is False and rss["name"] == "host RSS"


def _link_view(tl):
    pytest.importorskip("anywidget")
    from ipy_gpumem.chart.figures.live import PlotlyChartView

    view = PlotlyChartView(tl)
    updates = []
    view.handle = type("Handle", (), {"update": lambda self, bundle, raw: updates.append(bundle)})()
    figure = view.figure(tl.snapshot())
    view._make_link(tl.snapshot(), figure)  # what display() does after sending the figure
    return view, updates


def test_the_live_view_hands_its_link_each_new_figure_and_its_output_keeps_a_figure():
    tl = session()
    view, updates = _link_view(tl)
    try:
        state, link = view.state, view.link
        assert state is not None and state.chart == view.chart and state.figure["layout"]["meta"] == view.chart
        assert link.state == state.model_id  # the link's JavaScript finds the state's model by its id
        before = [trace["uid"] for trace in state.figure["data"]]
        tl.add(gpu(103.0, 5 * GiB, 6 * GiB))
        assert view.refresh(force=True) is True
        after = state.figure
        assert [trace["uid"] for trace in after["data"]][:len(before)] == before
        allocated = next(trace for trace in after["data"] if trace["name"] == "cuda:0 allocated")
        assert allocated["y"][-1] == 5.0  # the new point arrived
        assert after["layout"]["uirevision"] == UIREVISION and "range" not in after["layout"]["xaxis"]
        assert view.refresh(force=True) is True and state.figure is after  # nothing new: the same figure, nothing sent
        view.finalize()
        bundle = updates[-1]
        assert "application/vnd.jupyter.widget-view+json" not in bundle  # nothing a reopened notebook cannot draw
        assert bundle[PLOTLY_MIME]["layout"]["meta"] == view.chart and "image/png" not in bundle
        assert f'class="ipy-gpumem-chart {view.chart}"' in bundle["text/html"]
    finally:
        view.freeze()
    assert view.link is None and view.state is None and "application/vnd.jupyter.widget-view+json" not in updates[-1]
    assert state.comm is None and link.comm is None  # both models closed


def test_the_front_ends_report_is_kept_and_passed_on():
    tl = session()
    view, _updates = _link_view(tl)
    heard = []
    view.on_placement = heard.append
    try:
        # A stand-in for the front end's comm message (what the link's JavaScript sends).
        view.state._handle_custom_msg({"placement": {"sidebar": True, "inline": 0, "picture": False, "width": 301}}, [])
        assert view.placement == {"sidebar": True, "inline": 0, "picture": False, "width": 301} and heard == [view]
        view.state._handle_custom_msg({"something": "else"}, [])
        assert len(heard) == 1
    finally:
        view.freeze()


def test_the_links_script_reports_and_hides_only_what_the_front_end_drew():
    from ipy_gpumem.chart.figures.live import LINK_ESM

    assert "export default { initialize }" in LINK_ESM and "render" not in LINK_ESM  # a model, never a view
    assert "state.send({placement" in LINK_ESM and "plotly.react(" in LINK_ESM and "Fx.hover" in LINK_ESM
    assert "setTimeout(look" in LINK_ESM and "jupyterlab-sidecar" in LINK_ESM
    # The figure comes from the plain state model (anywidget drops every message to its own model for good
    # when its JavaScript took over 2 s to run), and the link's first run waits on nothing from the kernel.
    assert "manager.get_model(model.get('state'))" in LINK_ESM and "model.on(" not in LINK_ESM


class _Outputs:
    """A stand-in for IPython's ``display`` (labelled as such: no front end here): each output's bundles, the
    first as shown and then each update by its display id."""

    def __init__(self):
        self.shown = []

    def display(self, bundle, raw=True, display_id=False):
        self.shown.append([bundle])
        shown = self.shown[-1]
        return type("Handle", (), {"update": lambda _self, new, raw=True: shown.append(new)})()


def _until_sent(view, timeout=30.0):
    """Redraw as the sampler does until the figure replaced its placeholder (a condition, not a pause)."""
    deadline = time.monotonic() + timeout
    while not view.refresh():
        assert time.monotonic() < deadline, "the figure was never sent"
        time.sleep(0.01)


def test_the_picture_comes_first_and_the_figure_after_it(monkeypatch):
    """Issue 31, Do 5: a page's first plotly figure makes plotly.js evaluate, which held the page for 2.5-6 s on
    a busy machine, the picture sent with it too. The output shows the picture at once, the figure follows it
    (the sampler's first tick after FIGURE_AFTER), a rule hides the picture once the figure beside it is drawn,
    and the picture is emptied once the figure was drawn: a saved notebook holds the chart once."""
    pytest.importorskip("anywidget")
    import IPython.display

    from ipy_gpumem.chart.figures.live import PlotlyChartView

    out = _Outputs()
    monkeypatch.setattr(IPython.display, "display", out.display)
    view = PlotlyChartView(session())
    view.figure_after = 0.05
    try:
        view.display()
        (picture,), (placeholder,) = out.shown
        mark = f"{view.chart}-picture"
        assert PLOTLY_MIME not in picture and "data:image/svg+xml," in picture["text/html"] and mark in picture["text/html"]
        assert f".jp-OutputArea-child:has(.{mark}):has(+ .jp-OutputArea-child .js-plotly-plot .main-svg)" in picture["text/html"]
        assert placeholder == {"text/plain": ""} and view.owes  # the sampler's next tick owes the figure
        assert view.state is not None and view.state.figure["layout"]["meta"] == view.chart
        view.finalize()  # the chart's own cell ends at once: the figure is not due yet, nothing more is sent
        assert [len(shown) for shown in out.shown] == [1, 1]
        _until_sent(view)
        figure = out.shown[1][-1]
        assert figure[PLOTLY_MIME]["layout"]["meta"] == view.chart and view.state.figure == figure[PLOTLY_MIME]
        assert len(out.shown[0]) == 1 and not view.owes  # the picture shows until the figure is drawn
        view.finalize()  # the next cell's end: the page drew the figure since, the picture goes
        emptied = out.shown[0][-1]["text/html"]
        assert "<img" not in emptied and mark in emptied and "<style>" in emptied
    finally:
        view.freeze()
    assert PLOTLY_MIME in out.shown[1][-1] and len(out.shown[0]) == 2  # left: the figure once, the picture empty


def test_the_sidebars_picture_hides_the_inline_copy_while_the_sidebar_shows_it(monkeypatch):
    """The sidebar's outputs are its picture, then its figure; its picture's rule hides the inline copy (the
    picture marked ``-inline`` and the figure after it) for as long as the sidebar shows it, so JupyterLab
    never shows that copy; the front end's report empties the inline picture."""
    pytest.importorskip("anywidget")
    import types

    import IPython.display

    from ipy_gpumem.chart.figures.live import SIDEBAR_HEIGHT, PlotlyChartView

    out = _Outputs()
    monkeypatch.setattr(IPython.display, "display", out.display)
    sidebar = types.SimpleNamespace(outputs=())  # a stand-in for the Sidecar widget (its ``outputs`` trait)
    view = PlotlyChartView(session(), sidebar=True)
    view.figure_after = 0.05
    try:
        view.display(target=sidebar, before=lambda: out.display({"text/plain": "the line"}))
        (side,) = sidebar.outputs
        inline = f".jp-OutputArea-child:has(.{view.chart}-inline)"
        assert f"{inline},{inline} + .jp-OutputArea-child{{display:none}}" in side["data"]["text/html"]
        assert f'class="{view.chart}-picture {view.chart}-side"' in side["data"]["text/html"]
        line, picture, placeholder = out.shown
        assert line == [{"text/plain": "the line"}] and placeholder == [{"text/plain": ""}]
        assert f'class="{view.chart}-picture {view.chart}-inline"' in picture[0]["text/html"]
        assert f"{inline}," not in picture[0]["text/html"]  # only the sidebar's copy hides the inline one
        _until_sent(view)
        assert sidebar.outputs[0] is side and sidebar.outputs[1]["data"][PLOTLY_MIME]["layout"]["height"] == SIDEBAR_HEIGHT
        assert PLOTLY_MIME in out.shown[2][-1]
        view.state._handle_custom_msg({"placement": {"sidebar": True, "inline": 0, "picture": False, "width": 250}}, [])
        assert "<img" not in out.shown[1][-1]["text/html"] and f"{view.chart}-inline" in out.shown[1][-1]["text/html"]
    finally:
        view.freeze()


def test_without_a_sampler_the_figure_comes_with_its_picture(monkeypatch):
    pytest.importorskip("anywidget")
    import IPython.display

    from ipy_gpumem.chart.figures.live import PlotlyChartView

    out = _Outputs()
    monkeypatch.setattr(IPython.display, "display", out.display)
    view = PlotlyChartView(session())
    view.figure_after = 0  # what LiveChart sets when no sampler runs (rate 0): nobody would send it later
    try:
        view.display()
        assert PLOTLY_MIME in out.shown[1][0] and not view.owes
    finally:
        view.freeze()


def test_plotly_stays_off_the_figure_path():
    import subprocess
    import sys

    code = ("import sys\nfrom ipy_gpumem.chart.figures.timeline import timeline_figure\n"
            "from ipy_gpumem.chart.views import static_bundle\nstatic_bundle(None)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('plotly', 'ipywidgets', 'anywidget')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ---------------------------------------------------------------------------------------------
# One cell: the waterfall of its lines, or its samples
# ---------------------------------------------------------------------------------------------


def test_cell_waterfall_has_a_bar_per_line_stacked_by_role_with_hovers():
    from test_svg import _training_record

    from ipy_gpumem.chart.figures.cell import cell_figure
    from ipy_gpumem.chart.style import ROLE_COLORS

    figure = cell_figure(_training_record())
    layout = figure["layout"]
    assert layout["xaxis"]["categoryarray"] == ["before", "line 1", "line 2", "line 3", "line 4", "line 5", "after"]
    bars = {trace["name"]: trace for trace in figure["data"] if trace["type"] == "bar"}
    assert {"parameters", "gradients", "optimizer state", "activations", "other tensors"} <= set(bars)
    assert bars["parameters"]["marker"]["color"] == ROLE_COLORS["parameters"]
    # exact bytes: 880 MiB of activations on line 2, hung from where the line started
    act = bars["activations"]
    at = act["x"].index("line 2")
    assert act["y"][at] == pytest.approx(880 / 1024, abs=1e-3) and "line 2 ×1: out = model(x)" in act["hovertext"][at]
    assert bars["before / after"]["y"] == [1.0, pytest.approx(1 + (400 + 900 - 480 + 800) / 1024, abs=1e-3)]
    # a peak above the line's end gets its marker; the print line moved nothing and has no bar of a role
    peaks = next(trace for trace in figure["data"] if trace["name"] == "peak")
    assert "line 2" in peaks["x"] and "no change" in bars and "line 4" in bars["no change"]["x"]
    assert layout["yaxis"]["title"]["text"] == "cuda:0 allocated (GiB)"
    go = pytest.importorskip("plotly.graph_objects")
    go.Figure(data=figure["data"], layout=figure["layout"])


def test_cell_figure_from_samples_draws_the_exact_peak_and_never_raises():
    from ipy_gpumem.chart.figures.cell import cell_figure

    rec = record(3, 6 * GiB)
    samples = [gpu(10.0 + i * 0.1, GiB + i * 100 * MiB, 2 * GiB) for i in range(10)]
    figure = cell_figure(rec, samples)
    assert any(trace["name"] == "cuda:0 allocated" for trace in figure["data"])
    assert "peak 6.00 GiB (exact, from the record)" in json.dumps(figure["layout"]["annotations"])
    assert cell_figure(None) is None and cell_figure(rec, samples=5) is not None
    assert cell_figure(CellRecord(1, None, "pass", time.time(), 0.1)) is None  # no reading at all


def test_history_figure_has_a_column_per_cell_with_its_peak_and_reserved():
    from ipy_gpumem.chart.figures.history import history_figure

    records = [record(n, (9 if n == 3 else 2) * GiB, error="ValueError" if n == 4 else None) for n in range(1, 6)]
    figure = history_figure(records)
    assert figure["layout"]["xaxis"]["categoryarray"] == ["[1]", "[2]", "[3]", "[4]", "[5]"]
    assert "failed: [4]" in figure["layout"]["xaxis"]["title"]["text"]
    peaks = next(trace for trace in figure["data"] if trace["name"] == "peak (exact)")
    assert peaks["y"][2] == 9.0 and figure["layout"]["yaxis"]["title"]["text"] == "cuda:0 allocated (GiB)"
    assert any(trace["name"] == "cuda:0 reserved after" for trace in figure["data"])
    hovers = json.dumps([trace.get("hovertext") for trace in figure["data"]])
    assert "[3] y = model(x)" in hovers and "ValueError" in hovers
    assert history_figure([]) is None and history_figure([CellRecord(1, None, "pass", time.time(), 0.1)]) is None
    go = pytest.importorskip("plotly.graph_objects")
    go.Figure(data=figure["data"], layout=figure["layout"])


@pytest.mark.slow
def test_estimate_figure_draws_the_predicted_lines_against_the_gpu():
    torch = pytest.importorskip("torch")
    from ipy_gpumem.chart.figures.estimate import estimate_figure
    from ipy_gpumem.preflight.cell import estimate_cell

    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 256)
    step = "out = model(x)\nloss = out.sum()\nloss.backward()\nopt.step()\nopt.zero_grad()\n"
    cell = estimate_cell(step, {"model": model, "opt": opt, "x": x, "torch": torch}, gpu="T4")
    figure = estimate_figure(cell)
    ticks = figure["layout"]["xaxis"]["categoryarray"]
    assert ticks[0] == "before" and ticks[-1] == "peak" and "line 4" in ticks
    hovers = json.dumps([trace.get("hovertext") for trace in figure["data"]])
    assert "opt.step()" in hovers and "out = model(x)" in hovers
    assert "T4" in json.dumps(figure["layout"]["annotations"]) or cell.fit is None
    unit = figure["layout"]["yaxis"]["title"]["text"].split("(")[-1].rstrip(")")
    divisor = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    assert figure["data"][0]["y"][1] == pytest.approx(cell.estimate.peak_allocated / divisor, abs=1e-3)
    go = pytest.importorskip("plotly.graph_objects")
    go.Figure(data=figure["data"], layout=figure["layout"])


def test_colab_gets_plotly_js_from_its_cdn_over_the_picture(monkeypatch):
    """Colab renders no plotly MIME output: its static figures are plotly.js from the CDN, drawn over
    the SVG picture, which stays where scripts do not run (google.colab is a stand-in module here)."""
    import sys
    import types

    pytest.importorskip("plotly")
    from ipy_gpumem.chart.views import figure_output, static_bundle

    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    bundle = static_bundle(session().snapshot())
    html = bundle["text/html"]
    assert list(bundle)[0] == PLOTLY_MIME
    assert '<script src="https://cdn.plot.ly/plotly-' in html and "Plotly.newPlot(" in html
    assert html.index("data:image/svg+xml,") < html.index("<script")  # the picture first, inside the div
    assert "</script" not in html.split("<script>", 1)[1].split("})();")[0]  # the figure cannot close the script
    out = figure_output({"data": [], "layout": {"title": {"text": "</script><!--<b>x"}}}, None)
    script = out["text/html"].split("<script>", 1)[1]
    assert "\\u003c/script\\u003e\\u003c!--" in script and "<" not in script[:script.index("})();")]


def test_a_cell_that_launched_ranks_draws_one_series_per_rank():
    from ipy_gpumem.core.records import RankRecord

    ranks = (RankRecord(0, 101, HostRecord(200 * MiB, 210 * MiB, 300 * MiB)),
             RankRecord(1, 102, HostRecord(200 * MiB, 220 * MiB, 900 * MiB)))
    rec = CellRecord(4, None, "start_processes(train, nprocs=2)", time.time(), 2.0,
                     host=HostRecord(GiB, GiB, GiB), ranks=ranks)
    tl = Timeline()
    tl.add(host(10.0, GiB))
    tl.cell_started(10.0, "[*]", rec.source)
    tl.add(host(11.0, GiB))
    tl.cell_finished(12.0, rec)
    (span,) = tl.snapshot().spans
    assert [r.label for r in span.ranks] == ["rank 0", "rank 1"]
    figure = timeline_figure(tl.snapshot())
    traces = {trace["name"]: trace for trace in figure["data"]}
    assert {"rank 0 RSS", "rank 1 RSS", "host RSS"} <= set(traces)
    worst = traces["rank 1 RSS"]
    assert worst["x"][:3] == [0.0, 1.0, 2.0] and worst["y"][1] == pytest.approx(900 / 1024, abs=1e-3)
    assert traces["rank 0 RSS"]["line"]["color"] != worst["line"]["color"]
    assert figure["layout"]["yaxis"]["title"]["text"] == "host RSS (GiB)"  # the unit fits the ranks too


def test_history_lists_each_rank_under_the_cell_that_launched_it():
    from ipy_gpumem.core.records import RankRecord
    from ipy_gpumem.cell.view import history_view

    ranks = (RankRecord(0, 101, HostRecord(200 * MiB, 210 * MiB, 300 * MiB)),
             RankRecord(1, 102, HostRecord(200 * MiB, 220 * MiB, 900 * MiB), end="gone"))
    recs = [CellRecord(3, None, "x = 1", time.time(), 0.1, host=HostRecord(GiB, GiB, GiB)),
            CellRecord(4, None, "start_processes(train, nprocs=2)", time.time(), 2.0,
                       host=HostRecord(GiB, GiB, GiB), ranks=ranks),
            CellRecord(5, None, "y = 2", time.time(), 0.1, host=HostRecord(GiB, GiB, GiB))]
    text = history_view(recs).text
    lines = [ln for ln in text.splitlines() if ln.strip()]
    at = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("[4]"))
    assert lines[at + 1].lstrip().startswith("rank 0") and "pid 101" in lines[at + 1]
    assert lines[at + 2].lstrip().startswith("rank 1") and "+700.00 MiB" in lines[at + 2] and "gone" in lines[at + 2]
    assert lines[at + 3].lstrip().startswith("[5]")
