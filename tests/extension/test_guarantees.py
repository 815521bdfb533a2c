"""Every promise the docs make, kept: one regression test per class of defect, through a real IPython shell.

The classes (issue "Keep every promise"): recording never stops silently; a magic never breaks a
cell that runs without it; interrupts and exits stay ours; typed cells continue in a terminal;
configuration is validated; load, unload and reload leave nothing behind and lose nothing; our
own cost is never the user's; out-of-memory coverage; views that tell the truth. Faults that
cannot be caused otherwise (a Ctrl-C at one precise moment) are injected and labelled as such.
"""
import builtins
import gc
import os
import sys
import warnings

import pytest
from traitlets import TraitError

import ipy_gpumem
from ipy_gpumem import GpuMemWarning
from ipy_gpumem.core.units import MiB
from ipy_gpumem.cell.lines import HOOK_NAME

from conftest import htmls, run, texts

torch = pytest.importorskip("torch")
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="procfs")


@pytest.fixture(autouse=True)
def _torch_in_namespace(ip):
    ip.user_ns["torch"] = torch
    yield
    for name in ("y", "z", "x", "q", "r", "rec", "after", "total"):
        ip.user_ns.pop(name, None)


def _recorded(ip, source):
    """Run ``source``; True when the ledger got a record for it."""
    before = len(ipy_gpumem.history())
    res, _ = run(ip, source)
    records = ipy_gpumem.history()
    return len(records) == before + 1 and records[-1].source == source, res


# ---------------------------------------------------------------------------------------------
# Recording never stops silently
# ---------------------------------------------------------------------------------------------


def _error_without_the_extension(ip, source):
    ip.run_line_magic("unload_ext", "ipy_gpumem")
    try:
        res, _ = run(ip, source)
        return type(res.error_in_exec), res.success
    finally:
        ip.run_line_magic("load_ext", "ipy_gpumem")


@pytest.mark.slow
def test_a_cell_whose_exception_cannot_be_formatted_leaves_no_frame_behind(ip, gpumem):
    run(ip, "class Unprintable(Exception):\n    def __str__(self):\n        raise RuntimeError('no str')\n")
    res, _ = run(ip, "raise Unprintable()")
    gpumem = ip.magics_manager.registry["GpuMemMagics"]
    assert (type(res.error_in_exec), res.success) == _error_without_the_extension(ip, "raise Unprintable()")
    gpumem = ip.magics_manager.registry["GpuMemMagics"]
    run(ip, "raise Unprintable()")
    assert gpumem.watcher.depth == 0
    recorded, _ = _recorded(ip, "q = 1")
    assert recorded


def test_a_base_exception_escaping_run_cell_does_not_stop_recording(ip, gpumem):
    # Another extension's post_run_cell (registered before ours) raises SystemExit: IPython lets
    # it escape run_cell, and our post_run_cell for that cell never runs.
    fired = []

    def rude(result=None):
        if not fired:
            fired.append(1)
            raise SystemExit("another extension exits")

    ip.events.callbacks["post_run_cell"].insert(0, rude)
    try:
        with pytest.raises(SystemExit):
            ip.run_cell("q = 1", store_history=True)
    finally:
        ip.events.unregister("post_run_cell", rude)
    assert gpumem.watcher.depth == 1  # the escaped cell's frame is still there...
    recorded, _ = _recorded(ip, "q = 2")
    assert recorded and gpumem.watcher.depth == 0  # ...and dropped when the next cell starts


def test_nested_cells_still_give_one_record_for_the_outer_cell(ip, gpumem):
    for source in ("get_ipython().run_cell('z = 41 + 1')", "%%capture captured\nz = 43\nprint(z)"):
        recorded, res = _recorded(ip, source)
        assert res.success and recorded
    assert ip.user_ns["captured"].stdout == "43\n"
    assert gpumem.watcher.depth == 0


def test_gpumem_on_really_recovers(ip, gpumem):
    from ipy_gpumem.cell.stack import Frame

    gpumem.watcher._stack.push(Frame(None, "a cell that never ended"))  # a stale frame
    ip.run_line_magic("gpumem", "on")
    assert gpumem.watcher.depth == 0 and gpumem.broken is None
    recorded, _ = _recorded(ip, "q = 3")
    assert recorded


# ---------------------------------------------------------------------------------------------
# A magic never breaks a cell that runs without it
# ---------------------------------------------------------------------------------------------


def test_an_indented_body_runs_as_it_would_without_the_magic(ip, gpumem):
    res, cap = run(ip, "%%gpumem -o rec\n    y = 1\n    z = y + 1\n")
    assert res.success, res.error_in_exec
    assert ip.user_ns["z"] == 2 and ip.user_ns["rec"].detailed


@pytest.mark.slow
def test_a_lines_cell_that_resets_the_namespace_runs_to_its_end(ip, gpumem):
    res, cap = run(ip, "%%gpumem --lines\nx = 1\n%reset -f\ny = 2\n")
    assert res.success, res.error_in_exec
    assert ip.user_ns.get("y") == 2 and "x" not in ip.user_ns
    assert "%%gpumem" in texts(cap)[-1]
    assert not hasattr(builtins, HOOK_NAME)  # the markers' hook left builtins with the cell
    ip.user_ns["torch"] = torch


def test_a_lines_cell_that_reloads_the_extension_runs_to_its_end(ip, gpumem):
    res, _ = run(ip, "%%gpumem --lines\nx = 1\n%reload_ext ipy_gpumem\ny = 2\n")
    assert res.success, res.error_in_exec
    assert ip.user_ns["y"] == 2
    run(ip, "q = 1")
    assert not hasattr(builtins, HOOK_NAME)


@pytest.mark.parametrize("body", [
    "async for x in [1, 2]:\n    pass\n",
    "for x in 5:\n    pass\n",
    "a, b = 1\n",
])
def test_errors_under_lines_are_exactly_the_users(ip, gpumem, body):
    plain, plain_cap = run(ip, body)
    marked, marked_cap = run(ip, "%%gpumem --lines\n" + body)
    assert type(marked.error_in_exec) is type(plain.error_in_exec)
    assert str(marked.error_in_exec) == str(plain.error_in_exec)
    assert "ipy_gpumem" not in marked_cap.stdout  # no frame of ours in the traceback


@pytest.mark.parametrize("arg, says", [
    ("-o get_ipython", "IPython uses 'get_ipython'"), ("-o In", "IPython uses 'In'"), ("-o class", "keyword"),
    ("-o len", "builtin"), ("-o _7", "IPython uses '_7'"), ('"unterminated', "No closing quotation"),
    ("--bogus", "unrecognized arguments"), ("-d gpu-zero", "unknown device"), ("-d tpu", "accelerators torch knows and the host"),
])
def test_bad_cell_magic_arguments_are_one_line_and_lose_nothing(ip, gpumem, arg, says):
    in_list = ip.user_ns["In"]
    res, cap = run(ip, f"%%gpumem {arg}\nq = 1\n")
    assert type(res.error_in_exec).__name__ == "UsageError" and says in str(res.error_in_exec)
    assert "Traceback" not in cap.stdout and "q" not in ip.user_ns
    assert ip.user_ns["In"] is in_list and gpumem.broken is None
    assert ip.run_line_magic("gpumem", "history 1") is None  # later magics work
    recorded, _ = _recorded(ip, "q = 4")
    assert recorded


@pytest.mark.parametrize("line", ["history ²", "history ٣", "history -1", "history 1 2", "who cuda:x", "who cuda:7",
                                  "bogus", "status now", '"open'])
def test_bad_line_magic_arguments_are_usage_errors(ip, gpumem, line):
    res, cap = run(ip, f"%gpumem {line}")
    assert type(res.error_in_exec).__name__ == "UsageError", res.error_in_exec
    assert "Traceback" not in cap.stdout and gpumem.broken is None


def test_cell_magic_help_names_the_magic_as_typed(ip, gpumem):
    doc = ip.magics_manager.magics["cell"]["gpumem"].__doc__
    assert "%%gpumem [-l] [-o NAME] [-d DEVICE]" in doc and "gpumem_cell" not in doc
    assert "--lines" in doc and "-o, --output NAME" in doc


# ---------------------------------------------------------------------------------------------
# Interrupts and exits
# ---------------------------------------------------------------------------------------------


def test_ctrl_c_while_the_oom_panel_is_built_is_one_quiet_line(ip, gpumem, monkeypatch):
    from ipy_gpumem.oom import analysis

    def interrupted(*args, **kwargs):  # FAULT INJECTION: Ctrl-C at the moment the panel is being built
        raise KeyboardInterrupt

    monkeypatch.setattr(analysis, "analyse", interrupted)
    res, cap = run(ip, "torch.empty(2**60)")
    assert "DefaultCPUAllocator" in str(res.error_in_exec)  # the user's error, unchanged
    assert "ipy_gpumem: interrupted; this cell's memory report was skipped." in cap.stdout
    assert "Error in callback" not in cap.stdout + cap.stderr and "KeyboardInterrupt" not in cap.stdout
    assert gpumem.broken is None
    recorded, _ = _recorded(ip, "q = 5")
    assert recorded


@pytest.mark.slow
def test_system_exit_from_a_users_str_stays_out_of_run_cell(ip, gpumem):
    run(ip, "class Exiting(Exception):\n    def __str__(self):\n        raise SystemExit('from __str__')\n")
    res, _ = run(ip, "raise Exiting()")  # must return, not exit the shell
    assert (type(res.error_in_exec), res.success) == _error_without_the_extension(ip, "raise Exiting()")
    recorded, _ = _recorded(ip, "q = 6")
    assert recorded


# ---------------------------------------------------------------------------------------------
# Terminal IPython: a typed %%gpumem cell continues like %%time
# ---------------------------------------------------------------------------------------------


def test_check_complete_waits_for_the_body_like_time(ip, gpumem):
    for magic in ("%%time", "%%gpumem", "%%gpumem --lines", "%%gpumem -o rec"):
        assert ip.check_complete(f"{magic}\n")[0] == "incomplete", magic
        assert ip.check_complete(f"{magic}\nx = 1\n")[0] == "incomplete", magic
        assert ip.check_complete(f"{magic}\nx = 1\n\n")[0] == "complete", magic


# ---------------------------------------------------------------------------------------------
# Configuration is validated
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, value", [
    ("sample_rate", 1e-10), ("sample_rate", float("nan")), ("sample_rate", float("inf")), ("sample_rate", -1.0),
    ("sample_rate", 1000.0), ("history_size", 2**63), ("history_size", 0), ("devices", "0,0"), ("devices", "-1"),
    ("devices", "cuda"), ("threshold", "lots"), ("threshold", -5),
])
def test_bad_configuration_is_refused_and_nothing_changes(gpumem, name, value):
    before = getattr(gpumem, name), gpumem.ledger.maxlen, gpumem.watcher.settings
    with pytest.raises(TraitError):
        setattr(gpumem, name, value)
    assert (getattr(gpumem, name), gpumem.ledger.maxlen) == before[:2]


def test_devices_that_do_not_exist_are_refused_when_the_count_is_known(gpumem):
    count = gpumem.probe.cuda.device_count()
    if count is None:
        pytest.skip("the number of CUDA devices is unknown here")
    with pytest.raises(TraitError, match=f"cuda:{count} does not exist"):
        gpumem.devices = str(count)


def test_history_size_and_ledger_stay_in_step(gpumem):
    gpumem.history_size = 5
    assert gpumem.ledger.maxlen == 5
    gpumem.history_size = 10_000
    assert gpumem.ledger.maxlen == 10_000


# ---------------------------------------------------------------------------------------------
# Lifecycle: load, unload, reload
# ---------------------------------------------------------------------------------------------


def test_reload_keeps_the_history_and_the_warning_class(ip):
    ip.run_line_magic("load_ext", "ipy_gpumem")
    try:
        run(ip, "q = 7")
        count = len(ipy_gpumem.history())
        cls = ipy_gpumem.GpuMemWarning
        ip.run_line_magic("reload_ext", "ipy_gpumem")
        import ipy_gpumem as reloaded

        assert len(reloaded.history()) >= count  # nothing lost
        assert reloaded.GpuMemWarning is cls  # a user's warning filter still matches
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", cls)  # the user's filter, set with the old class
            warnings.warn("x", reloaded.GpuMemWarning)
    finally:
        ip.run_line_magic("unload_ext", "ipy_gpumem")


def test_one_fork_handler_however_often_it_is_loaded(ip, monkeypatch):
    registered = []
    real = os.register_at_fork
    monkeypatch.setattr(os, "register_at_fork", lambda **kw: registered.append(kw) or real(**kw))
    for _ in range(3):
        ip.run_line_magic("load_ext", "ipy_gpumem")
        ip.run_line_magic("unload_ext", "ipy_gpumem")
    assert len(registered) <= 1  # at most the first HostProbe of the process registers


@pytest.mark.slow
@linux
def test_loading_with_track_peaks_off_leaves_the_peak_rss_alone(ip):
    from traitlets.config import Config

    def hwm():
        with open("/proc/self/status") as fh:
            return int(next(line for line in fh if line.startswith("VmHWM")).split()[1])

    block = bytearray(96 * MiB)  # raise the high-water mark well above the RSS...
    del block
    gc.collect()
    before = hwm()
    c = Config()
    c.GpuMemMagics.track_peaks = False
    old = ip.config
    ip.config = c
    try:
        ip.run_line_magic("load_ext", "ipy_gpumem")
        run(ip, "q = 8")
        assert hwm() >= before  # ...and no clear_refs write brought it down
    finally:
        ip.run_line_magic("unload_ext", "ipy_gpumem")
        ip.config = old


# ---------------------------------------------------------------------------------------------
# Our cost is never the user's; out-of-memory coverage; views that tell the truth
# ---------------------------------------------------------------------------------------------


def test_cells_of_only_our_magics_are_not_recorded(ip, gpumem):
    before = len(ipy_gpumem.history())
    run(ip, "%gpumem chart text\n# and a comment")
    run(ip, "%gpumem history 2")
    assert len(ipy_gpumem.history()) == before
    recorded, _ = _recorded(ip, "q = 9\n%gpumem history 1")  # the user's code with it: the user's cell
    assert recorded


def test_a_plain_memory_error_gets_the_panel(ip, gpumem):
    res, cap = run(ip, "buffer = bytearray(2**62)")
    assert type(res.error_in_exec) is MemoryError
    panels = [t for t in texts(cap) if t.startswith("Out of memory on")]
    assert len(panels) == 1 and "host (cpu)" in panels[0]


def test_a_cpu_only_torch_says_cuda_will_not_appear(ip, gpumem):
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch")
    view = gpumem.run_mode("status")
    assert "this torch build has no CUDA (a CPU-only build)" in view.text and "not initialized yet" not in view.text


def test_history_shows_no_empty_cuda_columns_without_cuda(ip, gpumem):
    run(ip, "q = 10")
    view = gpumem.run_mode("history 3")
    header = view.text.splitlines()[0]
    if not any(rec.devices for rec in view.data):
        assert "Δallocated" not in header and "device" not in header and "Δhost RSS" in header


def test_a_loops_net_is_shown_apart_from_its_churn(ip, gpumem):
    # Each iteration allocates 8 MiB in one line and frees it in the next: the lines sum to a
    # large +/- pair, the loop keeps nothing; one list keeps 1 MiB per iteration.
    res, cap = run(ip, "%%gpumem --lines -o rec\n"
                       "kept = []\n"
                       "for i in range(12):\n"
                       "    big = torch.ones(2**21)\n"
                       "    kept.append(torch.ones(2**18))\n"
                       "    del big\n")
    assert res.success, res.error_in_exec
    rec = ip.user_ns["rec"]
    assert rec.loops and rec.loops[0].first == 3 and rec.loops[0].last == 6
    text = texts(cap)[-1]
    summary = [line for line in text.splitlines() if line.strip().startswith("Loop at line 3")]
    assert summary and "12 iterations" in summary[0] and "kept" in summary[0]
    assert "Loop at line 3" in htmls(cap)[-1]
    ip.user_ns.pop("kept", None)
    ip.user_ns.pop("big", None)
