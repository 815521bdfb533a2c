"""A real browser: JupyterLab 4 and Notebook 7 + headless Chromium (Debian's) + Playwright (NOTES §9), issue 31.

One JupyterLab server and one Chromium for the module, one notebook per front end. A cell that grows host
memory holds until the test has seen what it waits for (it waits on a file the test writes), so no step
depends on how fast the machine is. Both pages start with anywidget's 2 s deadline already passed (a
stand-in for a busy machine, see ``browser_helpers.ANYWIDGET_DEADLINE_PASSED_JS``), the condition in
which the live chart used to stay as first drawn. Timings are measured in the page at every animation
frame, against the kernel's own time of each cell's end (``browser_helpers.WATCH_JS``).

JupyterLab (a 1280 px window): ``%gpumem chart`` shows a chart within 1.5 s of its cell's end, at the
output's width, and gains points while a cell runs; a zoom made with the mouse and a legend click survive the
next updates; ``%gpumem sidebar`` draws the chart in the right sidebar at the sidebar's width within 1.5 s,
where it moves, never shows the inline copy (not for one frame, nor in the 15 s after the cell's end, when no
word of Notebook 7 is on the page either) and the line says where the chart is; a
``--lines`` table in the 596 px output breaks no identifier; saved, the notebook is small, holds each live
chart once, as last drawn with every series shown, and no widget reference; reopened with its kernel gone, it
shows no widget error and a figure where each live one was, at the output's width. Notebook 7: ``%gpumem
sidebar`` shows the chart inline within 2 s, where it moves, and the line says why; saved and reopened with its
kernel gone, the figure is where the live one was, at the output's width. In both: no error, traceback or
widget error in any output.

Run with ``IPY_GPUMEM_BROWSER=1 python -m pytest tests/whole/test_browser.py -q``. Screenshots, the browser
console, the server log and every observation land in ``artifacts/browser/``; ``IPY_GPUMEM_UPDATE_DOCS=1``
also copies the JupyterLab page with the sidebar to ``docs/chart-jupyterlab.png``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid

import pytest

from browser_helpers import (ANYWIDGET_DEADLINE_PASSED_JS, ARTIFACTS, BROKEN_WORDS_JS, CHARTS_JS, CHROMIUM_ARGS,
                             KERNEL_READY_JS, REPO, TIMES_JS, WATCH_JS, LabServer, find_chromium, run_command_js,
                             write_notebook)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

#: Grows host RSS a MiB every 0.25 s until the test writes ``flag`` (60 s at most).
HOLD = ("import os, time\nbufs = []\nwhile not os.path.exists({flag!r}) and len(bufs) < 240:\n"
        "    bufs.append(bytearray(2**20)); time.sleep(0.25)")
#: A ``--lines`` report whose source holds long identifiers (issue 31: "opt.zero_grad(set_t|o_none=True)").
LINES = ("%%gpumem --lines\nactivation_checkpoint_buffer = bytearray(2**22)\n"
         "gradient_accumulation_buffer = bytearray(2**21)  # opt.zero_grad(set_to_none=True)\n"
         "del activation_checkpoint_buffer")
VIEWPORT = {"width": 1280, "height": 900}
KERNEL_TIMEOUT = 90  # s: page opened -> the notebook's kernel idle (2 busy cores, cold caches)
STEP_TIMEOUT = 60  # s: any one thing the page should show next
#: Issue 31: a chart is drawn within 1.5 s of its cell's end; Notebook 7's inline copy of the sidebar's within 2 s.
FIRST_DRAW_S = 1.5
INLINE_FALLBACK_S = 2.0
#: Issue 31: in JupyterLab the chart stays in the sidebar, with no inline copy shown and no word of Notebook 7, this
#: long after the cell's end (a fallback decided by time once fired about 8 s after the sidebar had drawn).
SIDEBAR_HOLD_S = 15
#: Issue 8.9: a saved notebook used to carry about 5 MB per chart view (plotly's bundle).
MAX_SAVED_BYTES = 200 * 1024
ARTIFACT_NAMES = ("lab-zoomed.png", "lab-legend.png", "lab-sidebar.png", "lab-reopened.png", "nb7.png",
                  "nb7-reopened.png", "lab.json", "nb7.json", "console.log", "server.log")
DOCS_SHOT = os.path.join(REPO, "docs", "chart-jupyterlab.png")
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
_NUMBERED = re.compile(r"^\[\d+\]:$")


# ---------------------------------------------------------------------------------------------
# Fixtures: one server and one browser for the module
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def artifacts():
    os.makedirs(ARTIFACTS, exist_ok=True)
    for name in ARTIFACT_NAMES:  # no stale screenshot from an earlier run may pass for this one
        path = os.path.join(ARTIFACTS, name)
        if os.path.exists(path):
            os.remove(path)
    return ARTIFACTS


@pytest.fixture(scope="module")
def lab(tmp_path_factory, artifacts):
    import importlib.util

    for module in ("jupyterlab", "notebook", "playwright", "nbformat", "ipywidgets", "sidecar", "anywidget"):
        if importlib.util.find_spec(module) is None:  # found, not imported: the server imports them itself
            pytest.fail(f"IPY_GPUMEM_BROWSER=1 but {module} is not installed: "
                        "pip install -e '.[test,widgets,sidebar,browser]'")
    server = LabServer(str(tmp_path_factory.mktemp("lab")))
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.copyfile(server.log_path, os.path.join(artifacts, "server.log"))


@pytest.fixture(scope="module")
def browser(artifacts):
    chromium = find_chromium()
    if chromium is None:
        pytest.fail("IPY_GPUMEM_BROWSER=1 but no Chromium: apt-get install -y chromium "
                    "(or set IPY_GPUMEM_CHROMIUM); never `playwright install` here")
    from playwright.sync_api import sync_playwright

    start = time.monotonic()
    console = []
    with sync_playwright() as pw:
        chrome = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS, timeout=60_000)

        def page(label):
            pg = chrome.new_context(viewport=VIEWPORT).new_page()
            pg.add_init_script(ANYWIDGET_DEADLINE_PASSED_JS)
            pg.on("console", lambda m: console.append(f"[{label} {time.monotonic() - start:7.2f}] {m.type}: {m.text}"))
            pg.on("pageerror", lambda e: console.append(f"[{label} {time.monotonic() - start:7.2f}] pageerror: {e}"))
            return pg

        try:
            yield page
        finally:
            with open(os.path.join(artifacts, "console.log"), "w") as fh:
                fh.write("\n".join(console) + "\n")
            chrome.close()


# ---------------------------------------------------------------------------------------------
# Reading the page
# ---------------------------------------------------------------------------------------------


class Watch:
    """Observations of one page, kept for the artifacts; every observation fails on an error output."""

    def __init__(self, page, path, log):
        self.page, self.path, self.log, self.t0 = page, path, log, time.monotonic()

    def look(self):
        obs = self.page.evaluate(CHARTS_JS, self.path)
        obs["t"] = round(time.monotonic() - self.t0, 2)
        self.log.append(obs)
        assert not obs["errors"], f"an error or traceback in the outputs: {obs['errors']}"
        return obs

    def until(self, condition, what, timeout=STEP_TIMEOUT):
        deadline = time.monotonic() + timeout
        while True:
            obs = self.look()
            if condition(obs):
                return obs
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; last observations:\n" + "\n".join(
                    json.dumps({k: o.get(k) for k in ("t", "prompts", "figures", "sidebar", "outputs")})[:1500]
                    for o in self.log[-3:]))
            time.sleep(0.2)


def live(obs, cell):
    """The figure ipy_gpumem drew in ``cell``'s outputs, or None."""
    return next((f for f in obs["figures"] if f["cell"] == cell), None)


def points(fig):
    return fig["points"] if fig else 0


def pictures_shown(obs, cell):
    """How many first pictures ``cell`` shows (a live chart shows its picture until its figure is drawn)."""
    return sum(1 for p in obs["pictures"] if p["cell"] == cell and p["visible"])


def sidebar_figure(obs):
    return next((fig for side in obs["sidebar"] for fig in side["figures"]), None)


def running(obs, cell):
    prompts = obs["prompts"]
    return len(prompts) > cell and prompts[cell] == "[*]:"


def all_done(obs):
    return bool(obs["prompts"]) and all(p and _NUMBERED.match(p) for p in obs["prompts"]) and obs["kernel"] == "idle"


def line_text(obs, cell):
    return " ".join(o["text"] for o in obs["outputs"] if o["cell"] == cell and "ipy_gpumem ·" in o["text"])


def release(lab, flag):
    """Let a holding cell end."""
    with open(os.path.join(lab.root, flag), "w"):
        pass


def open_notebook(page, lab, cells, app):
    name = f"gpumem-{app}-{uuid.uuid4().hex[:8]}.ipynb"
    write_notebook(os.path.join(lab.root, name), cells)
    url = f"{lab.url}/lab/tree/{name}?reset" if app == "lab" else f"{lab.url}/notebooks/{name}"
    page.goto(url, wait_until="domcontentloaded", timeout=60_000)
    page.wait_for_function(KERNEL_READY_JS, arg=name, timeout=KERNEL_TIMEOUT * 1000, polling=250)
    return name


def hidden_traces(fig):
    """The traces a legend click hid: ``{name: visibility}``."""
    return {t["name"]: t["visible"] for t in fig["traces"] if t["visible"] is not True}


def click_legend(page, cell, name):
    """Click the legend entry ``name`` of the figure of ``cell``, as a user does."""
    handle = page.evaluate_handle(
        """([cell, name]) => [...window.jupyterapp.shell.currentWidget.content.widgets[cell].node.querySelectorAll(
             '.js-plotly-plot .legend .traces')].find((t) => (t.querySelector('.legendtext') || {}).textContent === name)
             || null""", [cell, name])
    element = handle.as_element()
    assert element is not None, f"no legend entry {name!r} in cell {cell}"
    element.scroll_into_view_if_needed()
    element.click()


def first_draw(times, cell, count, limit):
    """When ``cell`` (its execution count ``count``) first showed a chart, against its end in the kernel."""
    shown, end = times["shown"].get(str(cell)), times["replies"].get(str(count))
    assert shown and end, times
    figure = times["figure"].get(str(cell))
    drawn = {"after_end_s": round((shown["at"] - end) / 1000, 3), "width": shown["width"], "output": shown["output"],
             "figure_after_end_s": round((figure["at"] - end) / 1000, 3) if figure else None}
    assert drawn["after_end_s"] <= limit, drawn
    assert drawn["width"] <= drawn["output"] + 1, drawn  # laid out in its output, never wider
    return drawn


def drag_zoom(page, cell):
    """Zoom the figure of ``cell`` on x as a user does: drag across the middle of its plot."""
    handle = page.evaluate_handle(
        "(cell) => window.jupyterapp.shell.currentWidget.content.widgets[cell].node.querySelector('.js-plotly-plot .nsewdrag')",
        cell).as_element()
    handle.scroll_into_view_if_needed()
    box = handle.bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * 0.35, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.5, y + 1, steps=5)
    page.mouse.move(box["x"] + box["width"] * 0.65, y + 1, steps=5)
    page.mouse.up()


def save(page, root, path):
    """Save from the front end; the notebook as saved."""
    import nbformat

    file = os.path.join(root, path)
    before = os.path.getmtime(file)
    page.evaluate(run_command_js("docmanager:save"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and os.path.getmtime(file) == before:
        time.sleep(0.2)
    for _ in range(25):  # written, and complete
        try:
            with open(file, encoding="utf-8") as fh:
                text = fh.read()
            return text, nbformat.reads(text, as_version=4)
        except Exception:  # noqa: BLE001 - caught mid-write
            time.sleep(0.2)
    raise AssertionError(f"{path} was not saved")


def check_saved(text, nb, charts, shown):
    """Small, no widget reference, no error or traceback; each live chart once (its first picture emptied),
    its figure as last drawn, every series shown (a legend click in the page is not saved)."""
    assert len(text) <= MAX_SAVED_BYTES * len(charts), f"{len(text):,} bytes for {len(charts)} chart(s)"
    for index, cell in enumerate(nb.cells):
        for output in cell.outputs:
            assert output.get("output_type") != "error" and output.get("name") != "stderr", (index, output)
            assert WIDGET_MIME not in output.get("data", {}), (index, sorted(output["data"]))
    for index in charts:
        figures = [o["data"][PLOTLY_MIME] for o in nb.cells[index].outputs if PLOTLY_MIME in o.get("data", {})]
        assert figures, f"cell {index} saved no figure"
        saved = max(len(t.get("x", [])) for t in figures[-1]["data"] if str(t.get("uid", "")).startswith("series-"))
        assert saved >= shown, (index, saved, shown)  # what the page showed, not the first state
        assert not [t["name"] for t in figures[-1]["data"] if "visible" in t], figures[-1]["data"]
        pictures = [o for o in nb.cells[index].outputs if "data:image/svg+xml," in o.get("data", {}).get("text/html", "")]
        assert len(pictures) == 1 and PLOTLY_MIME in pictures[0]["data"], (index, [sorted(o["data"]) for o in pictures])


# ---------------------------------------------------------------------------------------------
# JupyterLab 4
# ---------------------------------------------------------------------------------------------


def test_jupyterlab_live_chart_moves_keeps_a_zoom_and_moves_to_the_sidebar(lab, browser, artifacts):
    flags = [f"release-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    cells = ["%load_ext ipy_gpumem\n%gpumem chart", HOLD.format(flag=flags[0]), "%gpumem sidebar",
             HOLD.format(flag=flags[1]), LINES]
    log: list = []
    page = browser("lab")
    try:
        name = open_notebook(page, lab, cells, "lab")
        page.evaluate(WATCH_JS)
        watch = Watch(page, name, log)
        page.evaluate(run_command_js("notebook:run-all-cells"))
        # -- the live figure gains points while cell 1 runs -------------------------------------------
        first = watch.until(lambda o: running(o, 1) and points(live(o, 0)) > 0, "the live figure with points",
                            KERNEL_TIMEOUT)
        # the chart (its picture, the figure after it) within 1.5 s of the cell's end, in its output's width
        log.append({"first_draw": first_draw(page.evaluate(TIMES_JS), cell=0, count=1, limit=FIRST_DRAW_S)})
        moved = watch.until(lambda o: points(live(o, 0)) >= points(live(first, 0)) + 3, "the live figure to move")
        assert running(moved, 1) and not live(moved, 0)["hidden"] and not pictures_shown(moved, 0)  # shown once
        # -- a zoom made with the mouse survives the next updates --------------------------------------
        drag_zoom(page, 0)
        zoomed = live(watch.until(lambda o: live(o, 0)["autorange"] is False, "the zoom", 10), 0)
        page.screenshot(path=os.path.join(artifacts, "lab-zoomed.png"))
        after = live(watch.until(lambda o: points(live(o, 0)) >= zoomed["points"] + 2, "an update after the zoom"), 0)
        assert after["autorange"] is False and after["range"] == pytest.approx(zoomed["range"]), (zoomed, after)
        # -- a legend click survives the next updates: "host RSS" stays hidden, and no other trace ----------
        names = [t["name"] for t in after["traces"]]
        click_legend(page, 0, "host RSS")
        clicked = live(watch.until(lambda o: hidden_traces(live(o, 0)) == {"host RSS": "legendonly"},
                                   "the legend click", 10), 0)
        kept = live(watch.until(lambda o: points(live(o, 0)) >= clicked["points"] + 2, "an update after the click"), 0)
        page.screenshot(path=os.path.join(artifacts, "lab-legend.png"))
        assert [t["name"] for t in kept["traces"]] == names, kept["traces"]  # the same traces, in the same order
        assert hidden_traces(kept) == {"host RSS": "legendonly"}, kept["traces"]
        click_legend(page, 0, "host RSS")  # shown again
        shown = points(kept)
        # -- %gpumem sidebar: the chart moves in the right sidebar; the inline copy is never shown -------
        release(lab, flags[0])
        side_obs = watch.until(lambda o: running(o, 3) and points(sidebar_figure(o)) > 0, "the sidebar's figure")
        side = side_obs["sidebar"][0]
        assert side["inRight"] and side["visible"] and sidebar_figure(side_obs)["drawn"], side
        times = page.evaluate(TIMES_JS)
        sidebar = {"after_end_s": round((times["side"]["at"] - times["replies"]["3"]) / 1000, 3),
                   "first": times["side"], "figure": times["sideFigure"]}
        log.append({"sidebar_first_draw": sidebar})
        assert sidebar["after_end_s"] <= FIRST_DRAW_S, sidebar
        # laid out at the sidebar's own width from the first draw: its picture, then its figure
        assert times["side"]["width"] <= times["side"]["sidebar"] + 1, sidebar
        assert times["sideFigure"]["width"] <= times["sideFigure"]["sidebar"] + 1, sidebar
        watch.until(lambda o: points(sidebar_figure(o)) >= points(sidebar_figure(side_obs)) + 3, "the sidebar to move")
        # JupyterLab shows the chart once, in the sidebar: the inline copy is there, hidden, and was never shown
        watch.until(lambda o: live(o, 2) is not None and live(o, 2)["hidden"], "the inline copy, hidden", 10)
        assert "2" not in page.evaluate(TIMES_JS)["shown"], "the inline copy was shown"
        page.screenshot(path=os.path.join(artifacts, "lab-sidebar.png"))
        if os.environ.get("IPY_GPUMEM_UPDATE_DOCS") == "1":
            os.makedirs(os.path.dirname(DOCS_SHOT), exist_ok=True)
            shutil.copyfile(os.path.join(artifacts, "lab-sidebar.png"), DOCS_SHOT)
        release(lab, flags[1])
        end = watch.until(lambda o: all_done(o) and "chart in the right sidebar" in line_text(o, 2),
                          "the line to say where the chart is")
        assert sidebar_figure(end) is not None and live(end, 2)["hidden"]
        assert "2" not in page.evaluate(TIMES_JS)["shown"], "the inline copy was shown"
        text = page.evaluate("() => document.body.innerText")
        assert "no right sidebar" not in text and "Notebook 7" not in text
        # -- the --lines table, in the output the open sidebar leaves (596 px), breaks no identifier -------
        page.evaluate("(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].node.classList.add('gpumem-lines')", 4)
        table = page.evaluate(BROKEN_WORDS_JS, ".gpumem-lines .jp-OutputArea-output")
        table["output"] = page.evaluate(
            "() => Math.round(document.querySelector('.gpumem-lines .jp-OutputArea-output').getBoundingClientRect().width)")
        log.append({"lines_table": table})
        assert table["words"] > 10 and table["broken"] == [] and table["output"] <= 620, table
        # -- the sidebar stays the only copy: nothing in JupyterLab decides by time (a fallback once fired about
        # 8 s after the sidebar had drawn). The page's watch saw every frame since, so what is left is to be
        # SIDEBAR_HOLD_S past the sidebar cell's end (the steps above took most of it): the sidebar still
        # drawn, the inline copy hidden and never shown, no word of Notebook 7 ----------------------------------
        held = watch.until(lambda o: time.time() * 1000 - times["replies"]["3"] >= SIDEBAR_HOLD_S * 1000,
                           "the sidebar's hold", SIDEBAR_HOLD_S + 10)
        log.append({"sidebar_hold_s": round(time.time() - times["replies"]["3"] / 1000, 1)})
        assert live(held, 2)["hidden"] and sidebar_figure(held)["drawn"], held
        assert "2" not in page.evaluate(TIMES_JS)["shown"], f"the inline copy was shown within {SIDEBAR_HOLD_S} s"
        assert "Notebook 7" not in page.evaluate("() => document.body.innerText")
        # -- saved: small, no widget reference, each chart once, as last drawn ---------------------------
        saved, nb = save(page, lab.root, name)
        log.append({"saved_bytes": len(saved)})
        check_saved(saved, nb, charts=(0, 2), shown=shown)
        # -- reopened with the kernel gone: a figure where each live one was, no widget error -------------
        page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
        page.reload(wait_until="domcontentloaded", timeout=60_000)
        again = Watch(page, name, log).until(
            lambda o: all(live(o, c) is not None and live(o, c)["drawn"] for c in (0, 2)), "the reopened charts",
            KERNEL_TIMEOUT)
        page.screenshot(path=os.path.join(artifacts, "lab-reopened.png"))
        for cell in (0, 2):
            fig = live(again, cell)
            assert not fig["hidden"] and not fig["png"] and fig["points"] >= shown, (cell, fig)
            assert abs(fig["width"] - fig["outputWidth"]) <= 24, (cell, fig)  # drawn at the output's width
        assert not again["sidebar"], again["sidebar"]
    finally:
        with open(os.path.join(artifacts, "lab.json"), "w") as fh:
            json.dump(log, fh, indent=1)
        page.context.close()


# ---------------------------------------------------------------------------------------------
# Notebook 7
# ---------------------------------------------------------------------------------------------


def test_notebook7_sidebar_falls_back_inline_and_moves(lab, browser, artifacts):
    flag = f"release-{uuid.uuid4().hex[:8]}"
    log: list = []
    page = browser("nb7")
    try:
        name = open_notebook(page, lab, ["%load_ext ipy_gpumem\n%gpumem sidebar", HOLD.format(flag=flag)], "notebook")
        page.evaluate(WATCH_JS)
        watch = Watch(page, name, log)
        page.evaluate(run_command_js("notebook:run-all-cells"))
        first = watch.until(lambda o: running(o, 1) and points(live(o, 0)) > 0, "the inline figure with points",
                            KERNEL_TIMEOUT)
        # no sidebar here: the chart inline within 2 s of the cell's end
        log.append({"first_draw": first_draw(page.evaluate(TIMES_JS), cell=0, count=1, limit=INLINE_FALLBACK_S)})
        moved = watch.until(lambda o: points(live(o, 0)) >= points(live(first, 0)) + 3, "the inline figure to move")
        fig = live(moved, 0)
        assert fig["drawn"] and not fig["hidden"] and not sidebar_figure(moved), moved  # inline: no sidebar here
        assert not pictures_shown(moved, 0), moved["pictures"]  # the figure replaced its picture
        page.screenshot(path=os.path.join(artifacts, "nb7.png"))
        release(lab, flag)
        end = watch.until(lambda o: all_done(o) and "no right sidebar in this front end" in line_text(o, 0),
                          "the line to say why the chart is inline")
        assert not live(end, 0)["hidden"]
        text = page.evaluate("() => document.body.innerText")
        assert "chart in the right sidebar" not in text
        saved, nb = save(page, lab.root, name)
        log.append({"saved_bytes": len(saved)})
        check_saved(saved, nb, charts=(0,), shown=points(fig))
        # -- reopened with the kernel gone: the figure where the live one was, no widget error --------------
        page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.shutdown()")
        page.reload(wait_until="domcontentloaded", timeout=60_000)
        again = Watch(page, name, log).until(lambda o: live(o, 0) is not None and live(o, 0)["drawn"],
                                             "the reopened chart", KERNEL_TIMEOUT)
        # Right after a reload on a busy machine the output area may still be settling (a first draw 100 px wider
        # than the output it then sits in was seen): the figure is at the output's width once the page is laid out.
        again = Watch(page, name, log).until(
            lambda o: live(o, 0) is not None and abs(live(o, 0)["width"] - live(o, 0)["outputWidth"]) <= 24,
            "the reopened chart at its output's width", 15)
        page.screenshot(path=os.path.join(artifacts, "nb7-reopened.png"))
        reopened = live(again, 0)
        assert not reopened["hidden"] and not reopened["png"] and reopened["points"] >= points(fig), reopened
        assert abs(reopened["width"] - reopened["outputWidth"]) <= 24, reopened  # drawn at the output's width
    finally:
        with open(os.path.join(artifacts, "nb7.json"), "w") as fh:
            json.dump(log, fh, indent=1)
        page.context.close()
