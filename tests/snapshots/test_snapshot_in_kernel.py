"""``%gpumem snapshot`` in a real Jupyter kernel (nbclient): the report as text and HTML, its chart as a
plotly figure of its own output with the SVG picture beside it, and one-line errors for bad input."""
import os

import pytest

from kernel_helpers import execute, needs_nbclient, outputs, plain

pytestmark = [pytest.mark.slow, pytest.mark.compat, needs_nbclient]

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "snapshots")
OOM = os.path.join(HERE, "Constructor-Sun_memory_snapshot.pickle.gz")  # an OOM on cuda:1, 3 devices
TIMED = os.path.join(HERE, "magma27.pickle.gz")
PLOTLY = "application/vnd.plotly.v1+json"


@pytest.fixture(scope="module")
def nb():
    return execute(["%load_ext ipy_gpumem",
                    f"%gpumem snapshot {OOM}",
                    f"%gpumem snapshot {TIMED} --from 0.05 --to 0.2",
                    "%gpumem snapshot /no/such/file.pickle",
                    f"%gpumem snapshot {OOM} --device 7",
                    f"%gpumem snapshot {OOM} --device 0"])


def displays(cell):
    return [o for o in outputs(cell) if o.output_type in ("display_data", "execute_result")]


def test_the_report_then_its_figure(nb):
    cell = nb.cells[1]
    report, chart = displays(cell)
    assert not outputs(cell, "error") and not outputs(cell, "stream")
    text, html = report["data"]["text/plain"], report["data"]["text/html"]
    for shown in (text, html):
        assert "Peak allocated" in shown and "78.29 GiB" in shown
        assert "Out of memory" in shown and "4.95 GiB" in shown and "91.25 MiB" in shown
        assert "Allocated at the peak, by site" in shown and "train/models.py:181 (update_nodes)" in shown
        assert "Diagnosis" in shown  # the OOM panel, once
    assert "<svg" not in html  # the chart is its own output, next
    figure = chart["data"][PLOTLY]
    names = [t.get("name") for t in figure["data"]]
    assert {"cuda:1 allocated", "cuda:1 reserved", "peak allocated 78.29 GiB"} <= set(names)
    assert figure["layout"]["xaxis"]["title"]["text"] == "time (s)"
    assert "<img" in chart["data"]["text/html"] and chart["data"]["text/plain"].startswith("(chart of")


def test_a_time_window(nb):
    report, chart = displays(nb.cells[2])
    assert "showing 50 ms to 200 ms" in report["data"]["text/plain"]
    figure = chart["data"][PLOTLY]
    xs = [x for t in figure["data"] if t.get("name", "").endswith("allocated") for x in t["x"]]
    assert xs and 0.05 <= min(xs) and max(xs) <= 0.2


def test_bad_input_is_one_line_without_a_traceback(nb):
    for cell, words in ((nb.cells[3], "cannot read"), (nb.cells[4], "has no cuda:7; it has cuda:0, cuda:1, cuda:2")):
        assert not displays(cell)
        streams = outputs(cell, "stream")
        errors = [o for o in outputs(cell, "error")]
        text = "".join(o.text for o in streams) + "".join(o.get("evalue", "") for o in errors)
        assert words in text, plain(cell)
        assert all(o.name == "stderr" for o in streams) and "UsageError" in "".join(o.text for o in streams)
        assert "Traceback" not in text and not errors


def test_another_device(nb):
    report, chart = displays(nb.cells[5])
    assert report["data"]["text/plain"].startswith("Memory snapshot Constructor-Sun_memory_snapshot.pickle.gz: cuda:0")
    assert "cuda:0 allocated" in [t.get("name") for t in chart["data"][PLOTLY]["data"]]
