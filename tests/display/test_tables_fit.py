"""The tables fit the notebook and keep their looks untrusted (issue 22, item 5).

An output area is 716 px wide in JupyterLab's default layout: the ``--lines`` table, the
estimate's per-line table and the history must fit in it, the source next to the line number.
An untrusted copy drops ``<style>`` elements and keeps inline styles (filtered by JupyterLab's
sanitizer, which drops values outside CSS's grammar, such as ``var()``), so every cell carries its
own style. The width test measures in headless Chromium (marked ``browser``).
"""
import re

import pytest

from ipy_gpumem.core.records import CellRecord, DeviceRecord, HostRecord, LineRecord
from ipy_gpumem.core.units import GiB, MiB
from ipy_gpumem.cell.view import cell_report_view, history_view

SOURCE = ("%%gpumem --lines",
          "model = build_model(config, vocabulary_size=32000, hidden_size=4096).to(device)",
          "optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)",
          "for step, (inputs, targets) in enumerate(loader):",
          "    outputs = model(inputs.to(device, non_blocking=True), attention_mask=mask)",
          "    loss = criterion(outputs.logits.view(-1, outputs.logits.size(-1)), targets.view(-1))",
          "    loss.backward()",
          "    optimizer.step(); optimizer.zero_grad(set_to_none=True)")


def _dev(index, delta, peak):
    return DeviceRecord(index, None, GiB, GiB + delta, GiB + max(delta, 0) + peak, 2 * GiB, 2 * GiB + delta,
                        2 * GiB + delta, allocated_delta_sum=delta, reserved_delta_sum=delta, peak_increase_max=peak)


def lines_record(devices=1, roles=True):
    lines = []
    for n, delta in zip(range(2, 9), (3 * GiB, 2 * GiB, 0, 512 * MiB, -64 * MiB, 1536 * MiB, -2 * GiB)):
        role = {"cuda:0": {"activations": delta, "gradients": 256 * MiB}} if roles and devices else None
        lines.append(LineRecord(n, SOURCE[n - 1], 12 if n > 3 else 1,
                                HostRecord(GiB, GiB + 48 * MiB, GiB + 96 * MiB, 48 * MiB),
                                tuple(_dev(i, delta, 768 * MiB) for i in range(devices)), 1.25, roles=role,
                                temporaries={"cuda:0": 300 * MiB} if role else None))
    return CellRecord(5, None, "\n".join(SOURCE), 0.0, 12.5,
                      host=HostRecord(GiB, GiB + 300 * MiB, GiB + 400 * MiB),
                      devices=tuple(_dev(i, 3 * GiB, GiB) for i in range(devices)), lines=tuple(lines))


def history_records(devices=1):
    records = []
    for n in range(1, 9):
        records.append(CellRecord(n, None, SOURCE[n - 1] + "  # " + "x" * 30, 0.0, 125.0,
                                  host=HostRecord(GiB, GiB + 12 * MiB, GiB + 700 * MiB),
                                  devices=tuple(_dev(i, -1536 * MiB if n % 2 else 3 * GiB, 512 * MiB)
                                                for i in range(devices)),
                                  error="OutOfMemoryError" if n == 4 else None))
    return records


def estimate():
    from ipy_gpumem.preflight.cell import CellEstimate, LineEstimate
    from ipy_gpumem.preflight.result import Estimate
    from ipy_gpumem.preflight.view import estimate_view

    roles = {"cuda:0": {"activations": 900 * MiB}}
    step = {"cuda:0": {"parameters": 420 * MiB, "gradients": 420 * MiB, "optimizer_state": 840 * MiB,
                       "activations": 900 * MiB}}
    phases = [{"phase": kind, "step": n, "peak": (n + 2) * 300 * MiB, "roles": step}
              for n in (1, 2) for kind in ("forward", "backward", "optimizer_step", "zero_grad")]
    est = Estimate("cuda:0", 3 * GiB, 4 * GiB, 0, roles, phases, [], {})
    lines = [LineEstimate(n, 1, 512 * MiB * n, 0, 768 * MiB) for n in range(2, 9)]
    return estimate_view(CellEstimate(est, lines, SOURCE), title=None)


def views():
    return {
        "--lines, one GPU": cell_report_view(lines_record(1), SOURCE),
        "--lines, host": cell_report_view(lines_record(0, roles=False), SOURCE),
        "estimate": estimate(),
        "history, one GPU": history_view(history_records(1)),
        "history, host": history_view(history_records(0)),
    }


def _luminance(hex_colour):
    channels = [int(hex_colour.lstrip("#")[i:i + 2], 16) / 255 for i in (0, 2, 4)]
    r, g, b = (c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _contrast(a, b):
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_growth_and_fits_colours_read_on_jupyterlabs_light_and_dark_themes():
    """Issue 31: the "fits" green was dim on the dark theme (4.1:1 against its #111). Each colour is read as
    JupyterLab's own light and dark themes resolve it (their CSS, from the installed package); an untrusted
    copy keeps the plain value, which reads on white."""
    import importlib.util
    import pathlib

    from ipy_gpumem.display.view import CELL_CSS

    spec = importlib.util.find_spec("jupyterlab")  # found, not imported (importing it takes seconds)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("jupyterlab is not installed")
    themes = pathlib.Path(list(spec.submodule_search_locations)[0]) / "themes" / "@jupyterlab"
    for theme, background in (("theme-light-extension", "#ffffff"), ("theme-dark-extension", "#111111")):
        css = (themes / theme / "index.css").read_text(encoding="utf-8")
        assert f"--jp-layout-color0:{'white' if 'light' in theme else '#111'}" in css.replace(" ", "")
        for style in ("up", "down", "err"):
            plain, themed = re.findall(r"color:([^;]+)", CELL_CSS[style])[:2]
            name, fallback = re.fullmatch(r"var\((--[a-z0-9-]+),(#[0-9a-f]{6})\)", themed).groups()
            # e.g. --jp-success-color0:var(--md-green-900,#1b5e20)
            value = re.search(re.escape(name) + r":\s*var\(--[a-z0-9-]+,\s*(#[0-9a-f]{6})\)", css).group(1)
            assert _contrast(value, background) >= 4.5, (theme, style, value)
            assert fallback == plain and _contrast(plain, "#ffffff") >= 4.5, (style, plain)


def _cells(html):
    return re.findall(r"<t[dh]\b([^>]*)>", html)


@pytest.mark.parametrize("name", list(views()))
def test_every_cell_carries_its_own_style_and_no_style_element(name):
    html = views()[name].html
    assert "<table" in html and "<style" not in html
    cells = _cells(html)
    assert cells
    for attrs in cells:
        style = re.search(r'style="([^"]*)"', attrs).group(1)
        assert re.search(r"text-align:(left|right)", style), attrs
        assert "white-space:" in style and "padding:" in style
    box = re.search(r'<div class="ipy-gpumem" style="([^"]*)"', html).group(1)
    # monospace survives the sanitizer (which drops var()): a plain family first
    assert box.startswith("font-family:monospace;") and "font-size:12px" in box
    for cls, colour in (("up", "color:#c0392b"), ("down", "color:#27864a"), ("dim", "color:#888888")):
        for attrs in _cells(html):
            if f'class="{cls}"' in attrs:
                assert colour in attrs, attrs


def test_the_source_comes_right_after_the_line_number():
    html = views()["--lines, one GPU"].html
    headers = re.findall(r"<th[^>]*>([^<]*)</th>", html)
    first = headers.index("line")
    assert headers[first:first + 4] == ["line", "source", "", "hits"]  # the source heads a row of its own
    # each line's source runs across the table's whole width, right after its number
    source = "model = build_model(config, vocabulary_size=32000, hidden_size=4096).to(device)"
    row = re.search(r"<tr><td[^>]*>2</td><td colspan=\"(\d+)\"[^>]*><div[^>]*>([^<]*)</div></td></tr>", html)
    assert row and row.group(2) == source.replace('"', "&quot;") and int(row.group(1)) >= 6
    assert "by role: act +3.00 GiB" in html  # the long words under the numbers, across the width too
    text = views()["--lines, one GPU"].text  # terminals keep the source last, unpadded
    assert text.splitlines()[[i for i, t in enumerate(text.splitlines()) if t.lstrip().startswith("line")][0]] \
        .rstrip().endswith("source")


# -- in Chromium --------------------------------------------------------------------------------------

#: JupyterLab 4's rules for tables in an output (rendermime's .jp-RenderedHTMLCommon), which
#: apply whatever the output's own styles: ours must win where they matter.
_LAB_TABLE_CSS = """
.out table {border-collapse:collapse;border-spacing:0;border:none;font-size:13px;table-layout:fixed;
            margin-left:auto;margin-right:auto}
.out td, .out th, .out tr {vertical-align:middle;padding:0.5em;line-height:normal;white-space:normal;
                           max-width:none;border:none;text-align:right}
body {font-family:sans-serif;margin:0}
"""


def _untrusted(html):
    """What JupyterLab's sanitizer leaves of an untrusted output, for our HTML: no <style>
    element, and no declaration whose value uses var() (outside the grammar it accepts)."""
    html = re.sub(r"<style.*?</style>", "", html, flags=re.S)
    return re.sub(r"[a-z-]+:var\([^;\"]*\)\)?;?", "", html)


@pytest.fixture(scope="module")
def page():
    pytest.importorskip("playwright.sync_api")
    from browser_helpers import CHROMIUM_ARGS, find_chromium
    from playwright.sync_api import sync_playwright

    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield browser.new_page(viewport={"width": 1200, "height": 900})
        browser.close()


def _measure(page, html, width=716):
    page.set_content(f"<html><head><style>{_LAB_TABLE_CSS}</style></head><body>"
                     f'<div class="out" style="width:{width}px">{html}</div></body></html>')
    return page.evaluate("""() => {
        const out = document.querySelector('.out'), box = out.querySelector('.ipy-gpumem');
        const tables = [...out.querySelectorAll('table')].map(t => ({
            width: t.getBoundingClientRect().width,
            source: [...t.querySelectorAll('th')].findIndex(th => th.textContent === 'source'),
            // a stacked table's source runs across its width, wrapped in a box: that box's right edge
            sourceRight: t.querySelector('td[colspan] > div')
                ? Math.max(...[...t.querySelectorAll('td[colspan] > div')].map(d => d.getBoundingClientRect().right))
                : Math.max(0, ...[...t.querySelectorAll('tr')].map(tr => {
                const i = [...t.querySelectorAll('th')].findIndex(th => th.textContent === 'source');
                return i < 0 || !tr.children[i] ? 0 : tr.children[i].getBoundingClientRect().right; }))}));
        const td = out.querySelector('td'), up = out.querySelector('td.up') || out.querySelector('td.down');
        return {scroll: box.scrollWidth, client: box.clientWidth, outer: out.scrollWidth, tables,
                font: getComputedStyle(td).fontFamily, align: up ? getComputedStyle(up).textAlign : null,
                up: up ? getComputedStyle(up).color : null};
    }""")


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.parametrize("untrusted", [False, True], ids=["trusted", "untrusted"])
@pytest.mark.parametrize("name", list(views()))
def test_every_table_fits_a_716_px_output(page, name, untrusted):
    html = views()[name].html
    m = _measure(page, _untrusted(html) if untrusted else html)
    if not untrusted:
        assert m["outer"] <= 716, (name, m)  # the output never widens
        if not name.startswith("history"):
            assert m["scroll"] <= m["client"] + 1, (name, m)
            assert all(t["width"] <= 716 for t in m["tables"]), (name, m)
        # else: its source holds a 30-character word ("x" * 30) beside an error column, which no longer breaks
        # mid-word (issue 31): that table scrolls in its own box, the source right after the cell in sight
    else:
        # an untrusted copy keeps monospace, alignment and colours; the source stays in sight
        assert "monospace" in m["font"], m
        assert m["align"] == "right", m  # a change: a number
        assert m["up"] in ("rgb(192, 57, 43)", "rgb(39, 134, 74)"), m  # and its colour
    assert all(t["sourceRight"] <= 716 for t in m["tables"]), (name, m)


@pytest.mark.slow
@pytest.mark.browser
def test_no_table_breaks_an_identifier_in_a_596_px_output(page):
    """Issue 31: at a 1280 px window with the sidebar open an output is 596 px wide, and the ``--lines`` table
    broke code mid-identifier ("opt.zero_grad(set_t|o_none=True)"), the estimate's phases mid-word
    ("backwar|d"). Words wrap at spaces; a table that cannot fit scrolls in its own box."""
    from browser_helpers import BROKEN_WORDS_JS

    for name, view in views().items():
        for html in (view.html, _untrusted(view.html)):
            m = _measure(page, html, width=596)
            words = page.evaluate(BROKEN_WORDS_JS, ".out")
            assert words["words"] > 20 and words["broken"] == [], (name, words)
            assert m["outer"] <= 596, (name, m)  # the output never widens: a wide table scrolls in its box
            assert all(t["sourceRight"] <= 596 for t in m["tables"]), (name, m)  # with its source in sight


@pytest.mark.browser
def test_two_devices_scroll_inside_the_output_with_the_source_in_sight(page):
    m = _measure(page, cell_report_view(lines_record(2), SOURCE).html)
    assert m["outer"] <= 716, m  # the output never widens: the table scrolls in its own box
    assert all(t["sourceRight"] <= 716 for t in m["tables"]), m
