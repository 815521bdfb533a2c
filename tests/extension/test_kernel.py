"""The extension in a real kernel (nbclient): outputs land in the right cell, nesting, errors."""
import pytest

from kernel_helpers import execute, kernel_manager, needs_nbclient, outputs, plain

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.compat, needs_nbclient]


@pytest.fixture(scope="module")
def nb():
    cells = [
        "import torch, IPython\nIPython.version_info[0]",                         # 0: loaded by config
        "x = torch.ones(2**26)",                                                   # 1: +256 MiB line
        "small = 1",                                                               # 2: silent
        "",                                                                        # 3: empty (not sent)
        "%%capture cap\ny = torch.ones(2**25)\nget_ipython().run_cell('z = 1')",  # 4: nested, one line
        "%%time\nw = torch.ones(2**25)\nraise KeyError('swallowed?')",           # 5: %%time + error
        "%%gpumem --lines -o rec\na = torch.ones(2**24)\nb = a * 2\n1/0",        # 6: report after error
        "import ipy_gpumem\n[(r.execution_count, r.error) for r in ipy_gpumem.history()]",  # 7
        "%gpumem status",                                                          # 8
        "%gpumem nonsense",                                                        # 9
    ]
    return execute(cells, extensions=["ipy_gpumem"])


def test_loaded_through_config_and_first_cell_recorded(nb):
    history = eval(plain(nb.cells[7])[0])
    assert history[0] == (1, None)  # the very first cell, without %load_ext


def test_line_lands_in_its_own_cell(nb):
    line = [t for t in plain(nb.cells[1]) if t.startswith("[2] host")]
    assert len(line) == 1 and "+25" in line[0] and "MiB RSS" in line[0]
    html = outputs(nb.cells[1], "display_data")[0]["data"]["text/html"]
    assert "ipy-gpumem" in html
    assert outputs(nb.cells[2]) == [] and outputs(nb.cells[3]) == []


def test_nested_run_cell_gives_one_line_in_the_outer_cell(nb):
    lines = [t for t in plain(nb.cells[4]) if t.startswith("[")]
    assert len(lines) == 1 and lines[0].startswith("[4] host +12")


def test_time_swallowed_error_is_recorded(nb):
    history = dict(eval(plain(nb.cells[7])[0]))
    assert history[5] == "KeyError"
    ipython_major = int(plain(nb.cells[0])[0])
    errors = outputs(nb.cells[5], "error")
    assert [e.ename for e in errors] == ["KeyError"]  # 7/8 print it, 9 re-raises it
    assert "KeyError" in [t for t in plain(nb.cells[5]) if t.startswith("[5]")][0]
    assert ipython_major >= 7


def test_gpumem_report_follows_the_users_unchanged_error(nb):
    cell = nb.cells[6]
    kinds = [o.output_type for o in cell.outputs]
    assert kinds == ["error", "display_data", "display_data"]  # the report, then its chart
    assert cell.outputs[0].ename == "ZeroDivisionError"
    chart = cell.outputs[2]["data"]
    assert list(chart)[0] == "application/vnd.plotly.v1+json" and "data:image/svg+xml," in chart["text/html"]
    assert not any("ipy_gpumem" in line for line in cell.outputs[0].traceback)
    report = cell.outputs[1]["data"]["text/plain"]
    assert report.startswith("%%gpumem [6]") and "ZeroDivisionError" in report.splitlines()[0]
    assert "b = a * 2" in report


def test_status_and_usage_error(nb):
    assert "host:" in plain(nb.cells[8])[0]
    # IPython shows a UsageError as one line on stderr, never a traceback
    streams = outputs(nb.cells[9], "stream")
    assert [o.name for o in streams] == ["stderr"] and outputs(nb.cells[9], "error") == []
    assert streams[0].text.startswith("UsageError: %gpumem: unknown mode 'nonsense'")


def _run_and_wait(kc, code, timeout=60):
    """Execute ``code`` in the kernel behind ``kc``; return its stdout once the kernel is idle."""
    msg_id = kc.execute(code)
    out = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(out)


def test_the_end_of_cell_count_runs_while_the_kernel_is_idle():
    """The count each cell's explanation starts from is taken after the kernel said "idle", when
    the user pauses; a cell that comes sooner takes it at its start. Either way it is taken once."""
    import time

    km = kernel_manager()
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        _run_and_wait(kc, "%load_ext ipy_gpumem\nimport torch\nx = torch.zeros(1000)")
        _run_and_wait(kc, """
import time, traceback
from ipy_gpumem.extension import current_magics
_anatomy = current_magics().watcher.anatomy
_counts, _ends = [], []
_real = _anatomy.census
def _counted(*a, **k):
    where = [f.name for f in traceback.extract_stack()]
    _counts.append((time.monotonic(), "pre_run_cell" in where))
    return _real(*a, **k)
_anatomy.census = _counted
get_ipython().events.register("post_run_cell", lambda result: _ends.append(time.monotonic()))
def _unhurried():  # the idle-time count waits 2 s: a cell sent with the one before it surely comes sooner
    import ipy_gpumem.extension
    ipy_gpumem.extension.IDLE_DELAY_S = 2.0
""")
        time.sleep(0.3)  # the set-up cell's own count, in the idle time
        _run_and_wait(kc, "y = x + 1")
        time.sleep(0.3)  # a pause: its count is taken now, not in the next cell
        _run_and_wait(kc, "q = 1; _unhurried()")  # a quiet cell (it changed nothing a count depends on): no count
        time.sleep(0.3)
        # No pause: the second request already waits when the first cell ends, so its start takes the
        # count of `z = x + 2` (sent together; the idle-time count now waits 2 s, so a loaded machine's
        # slow round trip cannot make the next request come after it).
        kc.execute("z = x + 2")
        kc.execute("w = x + 3")
        report = _run_and_wait(kc, "print(repr((_counts, _ends)))")
        time.sleep(2.5)  # past the delay of the idle-time counts `z` and `w` scheduled: nothing is left to count
        again = _run_and_wait(kc, "print(repr(_counts))")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    counts, ends = eval(report)
    # after the set-up cell, `y = x + 1` (idle), `z = x + 2` (at `w`'s start), `w = x + 3` (at the report's
    # start); `q = 1` counted nothing
    assert [at_start for _, at_start in counts] == [False, False, True, True], counts
    assert eval(again)[:4] == counts and len(eval(again)) == 4, again  # taken once: not again when idle
    from ipy_gpumem.extension import IDLE_DELAY_S

    # the idle-time count of `y = x + 1` (ends[0] is the set-up cell's) waited for the reply to go out
    assert counts[1][0] - ends[1] >= IDLE_DELAY_S * 0.9
