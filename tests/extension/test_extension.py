"""The extension in a real InteractiveShell: hooks, magics, configuration, and never breaking a cell."""
import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
from IPython.utils.capture import capture_output

import ipy_gpumem
from ipy_gpumem import GpuMemWarning
from ipy_gpumem.core.probes import HostProbe, MemoryProbe
from ipy_gpumem.core.units import GiB, MiB

from conftest import htmls, run, texts

torch = pytest.importorskip("torch")
# Names a test makes in the suite's shared shell are removed after it (left there, these tests' 26 names made
# the shell's namespace larger than the census watch reads at every cell, and tensors/test_census_watch.py,
# which runs after this file now, compared a quiet cell's count with a fresh one that saw more).
pytestmark = pytest.mark.usefixtures("restore_user_ns")
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="exact RSS needs procfs")
#: What a record says about CUDA on this machine's CPU-only torch (a CUDA build says "not initialized yet").
NO_CUDA = "this torch build has no CUDA (a CPU-only build)" if torch.version.cuda is None else "CUDA not initialized yet"


# The kernel keeps RSS in per-CPU counters that are summed lazily, so a reading can lag the
# truth by a few dozen pages: "exact" below means within SLACK of the tensor's size. Tensors are
# larger than 32 MiB, glibc's largest mmap threshold: smaller blocks may be served from (and
# returned to) memory the heap already holds, which moves no RSS at all.
SLACK = 1 * MiB


@pytest.fixture(autouse=True)
def _torch_in_namespace(ip):
    ip.user_ns["torch"] = torch
    gc.collect()  # (the test's own doing) garbage from earlier tests must not be freed mid-cell


def _state(ip):
    return (
        len(ip.events.callbacks["pre_run_cell"]),
        len(ip.events.callbacks["post_run_cell"]),
        len(ip.input_transformers_cleanup),
        sum(type(c).__name__ == "GpuMemMagics" for c in ip.configurables),
        "gpumem" in ip.magics_manager.magics["line"],
        "gpumem" in ip.magics_manager.magics["cell"],
    )


# ---------------------------------------------------------------------------------------------
# load / unload
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_load_unload_reload_add_and_remove_exactly_one_set(ip):
    before = _state(ip)
    ip.run_line_magic("load_ext", "ipy_gpumem")
    loaded = _state(ip)
    assert loaded[:4] == (before[0] + 1, before[1] + 1, before[2] + 1, before[3] + 1)
    assert loaded[4:] == (True, True)
    ipy_gpumem.load_ipython_extension(ip)  # a second load changes nothing
    assert _state(ip) == loaded
    ip.run_line_magic("reload_ext", "ipy_gpumem")
    assert _state(ip) == loaded
    ip.run_line_magic("unload_ext", "ipy_gpumem")
    assert _state(ip) == before
    assert ipy_gpumem.history() == []


@pytest.mark.slow
def test_config_reaches_the_magics_through_the_shell_config(ip):
    from traitlets.config import Config

    c = Config()
    c.GpuMemMagics.threshold = "1 GiB"
    c.GpuMemMagics.track_peaks = False
    old = ip.config
    ip.config = c
    try:
        ip.run_line_magic("load_ext", "ipy_gpumem")
        magics = ip.magics_manager.registry["GpuMemMagics"]
        assert magics.watcher.settings.threshold == GiB and magics.track_peaks is False
        ip.run_line_magic("config", "GpuMemMagics.threshold = '2 MiB'")
        assert magics.watcher.settings.threshold == 2 * MiB
    finally:
        ip.run_line_magic("unload_ext", "ipy_gpumem")
        ip.config = old


@pytest.mark.slow
def test_bad_config_values_are_refused(gpumem):
    from traitlets import TraitError

    with pytest.raises(TraitError, match="threshold"):
        gpumem.threshold = "lots"
    with pytest.raises(TraitError, match="devices"):
        gpumem.devices = "gpu zero"
    with pytest.raises(TraitError):
        gpumem.history_size = 0


# ---------------------------------------------------------------------------------------------
# the per-cell record and line
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@linux
def test_every_cell_is_recorded_with_exact_host_deltas(ip, gpumem):
    run(ip, "import torch")
    res, cap = run(ip, "x = torch.ones(2**26)")  # 256 MiB, every page written
    rec = ipy_gpumem.last()
    assert rec.execution_count == res.execution_count
    assert rec.source == "x = torch.ones(2**26)"
    assert 256 * MiB - SLACK <= rec.host.rss_delta <= 256 * MiB + 2 * SLACK
    assert rec.devices == () and rec.devices_note == NO_CUDA
    assert len(cap.outputs) == 1
    line = texts(cap)[0]
    assert line.startswith(f"[{res.execution_count}] host +25")
    assert "MiB RSS" in line and "resident" in line
    res, cap = run(ip, "y = torch.ones(2**25); del y")  # 128 MiB for a moment
    rec = ipy_gpumem.last()
    assert abs(rec.host.rss_delta) < 2 * MiB
    assert 128 * MiB - SLACK <= rec.host.rss_peak_increase <= 128 * MiB + 2 * SLACK
    assert "(peak +12" in texts(cap)[0]
    run(ip, "del x")


@pytest.mark.slow
def test_quiet_cells_print_nothing(ip, gpumem):
    res, cap = run(ip, "a = 1")
    assert cap.outputs == [] and cap.stdout == "" and cap.stderr == ""
    assert ipy_gpumem.last().execution_count == res.execution_count


@pytest.mark.slow
def test_threshold_and_quiet_are_read_when_used(ip, gpumem):
    try:
        ip.run_line_magic("config", "GpuMemMagics.threshold = '1 GiB'")
        _, cap = run(ip, "b = bytearray(64 * 2**20); del b")
        assert cap.outputs == []
        ip.run_line_magic("config", "GpuMemMagics.threshold = 0")
        gpumem.quiet = True
        _, cap = run(ip, "b = bytearray(64 * 2**20); del b")
        assert cap.outputs == []
        gpumem.quiet = False
        _, cap = run(ip, "b = 1")
        assert len(cap.outputs) == 1  # threshold 0: every cell speaks
    finally:
        # %config stays in the shared shell's config, which the next load applies: back to the default.
        ip.run_line_magic("config", "GpuMemMagics.threshold = '16 MiB'")
        gpumem.quiet = False


def test_nested_run_cell_is_one_record(ip, gpumem):
    n = len(ipy_gpumem.history())
    res, _ = run(ip, "%%capture out\nget_ipython().run_cell('z = 1')\nprint('hi')")
    assert len(ipy_gpumem.history()) == n + 1
    assert ipy_gpumem.last().execution_count == res.execution_count
    run(ip, "%rerun -l 1")
    assert len(ipy_gpumem.history()) == n + 2


def test_empty_cells_are_not_cells(ip, gpumem):
    n = len(ipy_gpumem.history())
    for src in ["", "   \n\n  "]:
        _, cap = run(ip, src)
        assert cap.outputs == []
    assert len(ipy_gpumem.history()) == n


def test_user_errors_reach_the_user_unchanged(ip, gpumem):
    ip.user_ns["Boom"] = type("Boom", (Exception,), {})
    src = "err = Boom('original message')\nraise err"
    res, cap = run(ip, src)
    assert res.error_in_exec is ip.user_ns["err"]  # the very object the user raised
    assert "Boom: original message" in cap.stdout
    assert "ipy_gpumem" not in cap.stdout and "ipy_gpumem" not in cap.stderr
    rec = ipy_gpumem.last()
    assert rec.error == "Boom" and rec.error_message == "original message"
    assert rec.execution_count == res.execution_count


def test_errors_swallowed_by_time_are_still_recorded(ip, gpumem):
    res, cap = run(ip, "%%time\nraise KeyError('k')")
    assert ipy_gpumem.last().error == "KeyError"  # IPython 7/8 swallow it; 9 re-raises


def test_syntax_errors_are_recorded(ip, gpumem):
    res, _ = run(ip, "def (:")
    assert res.error_before_exec is not None
    assert ipy_gpumem.last().error == "SyntaxError"


def test_keyboard_interrupt_leaves_the_extension_working(ip, gpumem):
    run(ip, "raise KeyboardInterrupt")
    assert ipy_gpumem.last().error == "KeyboardInterrupt"
    assert sys.gettrace() is None
    run(ip, "ok = 1")
    assert ipy_gpumem.last().error is None


def test_records_keep_no_tensor_alive(ip, gpumem):
    run(ip, "%%gpumem --lines\nt = torch.ones(1000)\nu = t * 2")
    refs = [weakref.ref(ip.user_ns.pop(name)) for name in ("t", "u")]
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert ipy_gpumem.last().lines  # the records are still there


def test_hooks_never_collect_garbage_or_empty_caches(ip, gpumem, monkeypatch):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("gc"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    run(ip, "%%gpumem --lines\nq = [1] * 10\ndel q")
    run(ip, "q = 2")
    assert calls == []


@pytest.mark.slow
def test_history_frame_and_export(ip, gpumem, tmp_path):
    pd = pytest.importorskip("pandas")
    run(ip, "%gpumem clear")  # the suite's shell is shared: a test that launched ranks left rows of them
    run(ip, "a = bytearray(16 * 2**20)")
    frame = ipy_gpumem.history_frame()
    assert isinstance(frame, pd.DataFrame) and len(frame) == len(ipy_gpumem.history())
    path = tmp_path / "cells.json"
    with capture_output() as cap:
        ip.run_line_magic("gpumem", f"export {path}")
    assert "wrote" in cap.stdout
    data = json.loads(path.read_text())
    assert data[-1]["source"] == "a = bytearray(16 * 2**20)" and all(rec["schema"] == 1 for rec in data)
    csv_path = tmp_path / "cells.csv"
    ip.run_line_magic("gpumem", f"export {csv_path}")
    header, first = csv_path.read_text().splitlines()[:2]
    assert header.startswith("schema,execution_count,cell_id") and first.startswith("1,")  # its version on each row


# ---------------------------------------------------------------------------------------------
# %gpumem modes and bad input
# ---------------------------------------------------------------------------------------------


def test_status_history_on_off_clear(ip, gpumem):
    with capture_output() as cap:
        ip.run_line_magic("gpumem", "")
        ip.run_line_magic("gpumem", "status")
    assert all(f"No GPU in use: {NO_CUDA}." in t for t in texts(cap))
    assert all("host:" in t and "resident" in t for t in texts(cap))
    run(ip, "h = 1")
    with capture_output() as cap:
        ip.run_line_magic("gpumem", "history 1")
    assert "h = 1" in texts(cap)[0] and texts(cap)[0].count("\n") == 2
    with capture_output() as cap:
        ip.run_line_magic("gpumem", "off")
    assert "paused" in cap.stdout
    n = len(ipy_gpumem.history())
    run(ip, "h = 2")
    assert len(ipy_gpumem.history()) == n
    ip.run_line_magic("gpumem", "on")
    run(ip, "h = 3")
    assert len(ipy_gpumem.history()) == n + 1
    with capture_output() as cap:
        ip.run_line_magic("gpumem", "clear")
    assert ipy_gpumem.history() == [] and "forgot" in cap.stdout


@pytest.mark.parametrize("line, message", [
    ("bogus", "unknown mode 'bogus'"),
    ("history x", "optional number"),
    ("status now", "takes no arguments"),
    ("export", "needs one path"),
    ("export out.txt", "must end in .json or .csv"),
    ("export /nonexistent-dir/x.json", "cannot write"),
    ("'unclosed", "%gpumem:"),
])
def test_bad_line_arguments_give_one_clear_line(ip, gpumem, line, message):
    res, cap = run(ip, f"%gpumem {line}")
    assert type(res.error_in_exec).__name__ == "UsageError"
    assert message in str(res.error_in_exec)
    assert "Traceback" not in cap.stdout + cap.stderr


@pytest.mark.parametrize("line, message", [
    ("--bogus", "unrecognized arguments"),
    ("-d cuda:x", "unknown device"),
    ("-d tpu:0", "measures accelerators torch knows and the host"),
    ("-o 1abc", "needs a Python name"),
])
def test_bad_cell_arguments_do_not_run_the_cell(ip, gpumem, line, message):
    ip.user_ns.pop("ran", None)
    res, cap = run(ip, f"%%gpumem {line}\nran = True")
    assert type(res.error_in_exec).__name__ == "UsageError"
    assert message in str(res.error_in_exec)
    assert "ran" not in ip.user_ns


def test_help_documents_every_mode_and_flag(ip, gpumem):
    line_doc = ip.find_line_magic("gpumem").__doc__
    for word in ("status", "history", "on", "off", "clear", "export", "allocated by PyTorch", "reserved but"):
        assert word in line_doc
    cell_doc = ip.find_cell_magic("gpumem").__doc__
    for word in ("--lines", "-o NAME", "-d DEVICE", "In [4]"):
        assert word in cell_doc


# ---------------------------------------------------------------------------------------------
# %%gpumem
# ---------------------------------------------------------------------------------------------


@linux
def test_cell_magic_reports_once_and_stores_the_record(ip, gpumem):
    n = len(ipy_gpumem.history())
    res, cap = run(ip, "%%gpumem -o rec\nbig = torch.ones(2**25)\nbig.sum().item()")
    rec = ip.user_ns["rec"]
    assert rec is ipy_gpumem.last() and rec.detailed and rec.lines is None
    assert len(ipy_gpumem.history()) == n + 1
    assert res.result == 2**25  # the last expression is displayed as in any cell
    reports = [t for t in texts(cap) if t.startswith("%%gpumem")]
    assert len(reports) == 1 and len(cap.outputs) == 1  # the report, and no compact line
    assert reports[0].startswith(f"%%gpumem [{res.execution_count}]")
    assert "host RSS" in reports[0]
    assert 128 * MiB - SLACK <= rec.host.rss_delta <= 128 * MiB + 2 * SLACK
    run(ip, "del big")


@linux
def test_cell_magic_lines_exact_per_line(ip, gpumem):
    src = (
        "%%gpumem --lines -o rec\n"
        "a_lines = torch.ones(2**24)\n"
        "for i in range(3):\n"
        "    b = torch.ones(2**24)\n"  # > 32 MiB: glibc always maps (and unmaps) it
        "    del b\n"
        "c_lines = a_lines * 2\n"
    )
    res, cap = run(ip, src)
    rec = ip.user_ns["rec"]
    by = {ln.lineno: ln for ln in rec.lines}
    assert sorted(by) == [2, 3, 4, 5, 6]  # numbered like the cell the user sees
    assert by[2].source == "a_lines = torch.ones(2**24)"
    assert 64 * MiB - SLACK <= by[2].host.rss_delta <= 64 * MiB + 2 * SLACK
    assert by[3].hits == 4 and by[4].hits == 3 and by[5].hits == 3
    assert 192 * MiB - SLACK <= by[4].host.rss_delta <= 192 * MiB + 2 * SLACK  # 3 x 64 MiB, summed over hits
    assert -192 * MiB - 2 * SLACK <= by[5].host.rss_delta <= -192 * MiB + SLACK
    assert 64 * MiB - SLACK <= by[6].host.rss_delta <= 64 * MiB + 2 * SLACK
    if gpumem.probe.host.can_reset_peak:
        assert 64 * MiB - SLACK <= by[4].host.rss_peak_increase <= 64 * MiB + 2 * SLACK
    report = [t for t in texts(cap) if t.startswith("%%gpumem")][0]
    assert "    b = torch.ones(2**24)" in report and "hits" in report
    d = rec.to_dict()
    assert d["lines"][0]["lineno"] == 2 and set(d["lines"][0]) >= {"lineno", "source", "hits", "host", "devices"}
    run(ip, "del a_lines, c_lines")


def test_cell_magic_error_is_unchanged_and_reported(ip, gpumem):
    res, cap = run(ip, "%%gpumem --lines\nx1 = 1\nraise ValueError('from the cell')")
    assert isinstance(res.error_in_exec, ValueError) and str(res.error_in_exec) == "from the cell"
    assert "ValueError: from the cell" in cap.stdout
    assert "----> 3 raise ValueError" in cap.stdout  # numbered like the cell the user sees
    assert "run_cell_magic" not in cap.stdout  # no magic machinery in the traceback
    report = [t for t in texts(cap) if t.startswith("%%gpumem")][0]
    assert "ValueError" in report.splitlines()[0]
    assert ipy_gpumem.last().error == "ValueError"


def test_cell_magic_with_other_cell_magics(ip, gpumem):
    res, cap = run(ip, "%%gpumem --lines -o r1\n%%capture captured\nv = 1\nprint('captured text')")
    r1 = ip.user_ns["r1"]
    assert r1.detailed and [ln.lineno for ln in r1.lines] == [3, 4]
    assert ip.user_ns["captured"].stdout == "captured text\n"
    res, cap = run(ip, "%%time\n%%gpumem --lines -o r2\nw = 2\nw2 = 3")
    r2 = ip.user_ns["r2"]
    assert [(ln.lineno, ln.source) for ln in r2.lines] == [(3, "w = 2"), (4, "w2 = 3")]
    assert len([t for t in texts(cap) if t.startswith("%%gpumem")]) == 1


def test_cell_magic_called_programmatically(ip, gpumem):
    with capture_output() as cap:
        ip.run_cell_magic("gpumem", "-o prog --lines", "p = 1\np += 1")
    assert ip.user_ns["p"] == 2
    rec = ip.user_ns["prog"]
    assert rec.detailed and [ln.lineno for ln in rec.lines] == [1, 2]
    assert any(t.startswith("%%gpumem") for t in texts(cap))


def test_cell_magic_device_selection(ip, gpumem):
    run(ip, "%%gpumem -d host -o r\nx2 = 1")
    assert ip.user_ns["r"].devices == ()
    if torch.version.cuda is None:  # a CPU-only torch has no cuda:0 to measure: one line, the cell not run
        res, cap = run(ip, "%%gpumem -d cuda:0 -o r_nodev\nx_nodev = 1")
        assert "cuda:0 does not exist: this process sees 0 CUDA devices" in str(res.error_in_exec)
        assert "x_nodev" not in ip.user_ns and "r_nodev" not in ip.user_ns
    else:
        _, cap = run(ip, "%%gpumem -d cuda:0 -o r\nx2 = 1")
        assert f"No GPU measured: {NO_CUDA}" in texts(cap)[0]


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CPU-only torch: no accelerator in this process")
def test_another_accelerators_device_is_one_clear_line_and_the_cell_not_run(ip, gpumem):
    """-d mps, -d xpu:0 are read (issue 32); on this CPU-only build no such device exists: one line
    naming it, and the cell does not run. Their parsing into the devices measured is below."""
    for arg, words in (("mps", "this process sees no MPS device"), ("xpu:0", "this process sees no XPU device"),
                       ("xpu", "this process sees no XPU device"), ("hpu:1", "this process sees no HPU device")):
        ip.user_ns.pop("ran", None)
        res, cap = run(ip, f"%%gpumem -d {arg}\nran = True")
        assert type(res.error_in_exec).__name__ == "UsageError", arg
        assert str(res.error_in_exec) == f"-d {arg}: {words}", res.error_in_exec
        assert "ran" not in ip.user_ns and "Traceback" not in cap.stdout + cap.stderr


def test_the_devices_a_header_measures():
    from ipy_gpumem.cell.header import HeaderError, parse_args

    assert parse_args("-d mps").device_indices == (0,)  # MPS: one device, torch's index 0
    assert parse_args("-d xpu:1").device_indices == (1,) and parse_args("-d cuda:2").device_indices == (2,)
    assert parse_args("-d xpu").device_indices is None and parse_args("-d cuda").device_indices is None  # every one
    assert parse_args("-d host").device_indices == () and parse_args("").device_indices is None
    assert str(parse_args("-d XPU:0").device) == "xpu:0" and str(parse_args("-d mps").device) == "mps"
    for bad in ("-d tpu", "-d opengl:0", "-d meta"):
        with pytest.raises(HeaderError, match="measures accelerators torch knows"):
            parse_args(bad)


def test_cell_magic_top_level_await(ip, gpumem):
    res, _ = run(ip, "%%gpumem --lines -o r\nimport asyncio\nawait asyncio.sleep(0)\nafter = 1")
    assert res.success, res.error_in_exec
    assert ip.user_ns["after"] == 1
    assert [ln.lineno for ln in ip.user_ns["r"].lines] == [2, 3, 4]


def test_report_escapes_user_source_in_html(ip, gpumem):
    _, cap = run(ip, "%%gpumem --lines\ns = '<script>alert(1)</script>'")
    html = [h for h in htmls(cap) if "%%gpumem" in h][0]
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


# ---------------------------------------------------------------------------------------------
# never break the session
# ---------------------------------------------------------------------------------------------


class ExplodingHost(HostProbe):
    """Fault injection (fake): the host probe raises, as a broken psutil or /proc would."""

    armed = False

    def rss(self):
        if ExplodingHost.armed:
            raise RuntimeError("probe exploded")
        return super().rss()


def test_internal_error_warns_once_and_the_cells_still_run(ip, gpumem):
    gpumem.probe = MemoryProbe(host=ExplodingHost(), cuda=gpumem.probe.cuda)
    ExplodingHost.armed = True
    try:
        with pytest.warns(GpuMemWarning, match="stopped recording after an internal error"):
            res, cap = run(ip, "first = 1")
        assert res.success and ip.user_ns["first"] == 1
        assert "Traceback" not in cap.stdout + cap.stderr
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second warning would fail here
            res, _ = run(ip, "second = 2")
        assert res.success and ip.user_ns["second"] == 2
    finally:
        ExplodingHost.armed = False
    with capture_output():
        ip.run_line_magic("gpumem", "on")
    n = len(ipy_gpumem.history())
    run(ip, "third = 3")
    assert len(ipy_gpumem.history()) == n + 1


@pytest.mark.slow
def test_the_extension_never_imports_torch_itself():
    code = (
        "import sys\n"
        "from IPython.testing.globalipapp import start_ipython\n"
        "ip = start_ipython()\n"
        "ip.run_line_magic('load_ext', 'ipy_gpumem')\n"
        "ip.run_cell('x = bytearray(2**25)', store_history=True)\n"
        "ip.run_cell('%%gpumem --lines\\ny = 1', store_history=True)\n"
        "ip.run_line_magic('gpumem', 'status')\n"
        "import ipy_gpumem\n"
        "print('RESULT', 'torch' in sys.modules, len(ipy_gpumem.history()), ipy_gpumem.last().devices_note)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    result = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert result == ["RESULT False 2 torch is not imported"], out.stdout + out.stderr


@pytest.mark.slow
def test_terminal_ipython_prints_the_line():
    script = "%load_ext ipy_gpumem\nbuf = bytearray(2**26)\n%gpumem history\nexit\n"
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run(
        [sys.executable, "-m", "IPython", "--simple-prompt", "--no-banner", "--colors=NoColor", "--HistoryManager.enabled=False"],
        input=script, capture_output=True, text=True, timeout=120, env=env,
    )
    assert "[2] host +64" in out.stdout, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
