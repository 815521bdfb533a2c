"""Line markers and the line meter: per-line deltas and peaks, loops, and never raising into user code."""
import ast
import gc
import sys

import pytest

import builtins

from ipy_gpumem.cell.lines import HOOK_NAME, LineMarkers, LineTracer, remove_hook
from ipy_gpumem.core.probes import HostProbe, MemoryProbe
from ipy_gpumem.core.units import GiB, MiB
from tests.conftest import touched

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="exact RSS needs procfs")


def run_traced(source, probe, ns=None, **kwargs):
    """Mark ``source`` like the IPython transformer does, run it, return (tracer, line records)."""
    ns = {} if ns is None else ns
    tracer = LineTracer(probe, **kwargs)
    markers = LineMarkers()
    markers.armed = True
    markers.tracer = tracer
    tree = markers.visit(ast.parse(source))
    code = compile(tree, "<cell-under-test>", "exec")
    assert tracer.start()
    try:
        exec(code, ns)
    finally:
        tracer.stop()
        remove_hook()
    assert HOOK_NAME not in ns  # the user's namespace is never touched
    assert not hasattr(builtins, HOOK_NAME)  # and the hook is gone after the cell
    return tracer, tracer.records(source.splitlines())


def test_scripted_device_lines_loop_hits_and_sums(fake_gpu):
    # line 1 allocates 1 GiB (reserving 2); each loop iteration: line 3 +1 GiB, line 4 -1 GiB
    fake, probe = fake_gpu([(0, 0), (1 * GiB, 2 * GiB), (2 * GiB, 2 * GiB), (1 * GiB, 2 * GiB),
                            (2 * GiB, 2 * GiB), (1 * GiB, 2 * GiB)])
    src = "fake.advance()\nfor i in range(2):\n    fake.advance()\n    fake.advance()\nfake.pos = fake.pos\n"
    tracer, lines = run_traced(src, probe, {"fake": fake})
    by = {ln.lineno: ln for ln in lines}
    assert [ln.lineno for ln in lines] == [1, 2, 3, 4, 5]
    assert by[1].hits == 1 and by[1].devices[0].allocated_delta == 1 * GiB
    assert by[2].hits == 3  # two iterations plus the final fetch, as in line_profiler
    assert by[3].hits == 2 and by[3].devices[0].allocated_delta == 2 * GiB  # summed over hits
    assert by[4].hits == 2 and by[4].devices[0].allocated_delta == -2 * GiB
    assert by[1].devices[0].reserved_delta == 2 * GiB
    assert by[3].devices[0].peak_allocated == 2 * GiB
    # a peak increase is per execution: the loop header never needs more than it starts with,
    # even though memory is higher at its later hits than at its first
    assert by[2].devices[0].peak_increase == 0 and by[3].devices[0].peak_increase == 1 * GiB
    assert tracer.device_peaks[0] == (2 * GiB, 2 * GiB)
    assert by[3].source == "    fake.advance()"


@pytest.mark.slow
@linux
def test_real_host_memory_per_line():
    probe = MemoryProbe()
    src = (
        "a = touched(48 * 2**20)\n"
        "b = touched(96 * 2**20)\n"
        "del b\n"
        "c = len(a)\n"
    )
    # RSS is the whole process's: earlier tests' cyclic garbage, collected by an automatic gc pass
    # during a line, would show as that line's change; and the memory is mapped afresh (see touched)
    gc.collect()
    gc.disable()
    try:
        _, lines = run_traced(src, probe, {"touched": touched})
    finally:
        gc.enable()
    by = {ln.lineno: ln for ln in lines}
    assert 47 * MiB <= by[1].host.rss_delta <= 50 * MiB  # per-CPU RSS counters lag a little
    assert 95 * MiB <= by[2].host.rss_delta <= 98 * MiB
    assert -98 * MiB <= by[3].host.rss_delta <= -94 * MiB
    assert abs(by[4].host.rss_delta) < 2 * MiB
    if probe.host.can_reset_peak:
        assert by[2].host.rss_peak_increase >= 95 * MiB  # the same lag as the deltas above (CI: 95.875 MiB)
        assert by[4].host.rss_peak_increase < 4 * MiB  # each line's peak is its own


def test_functions_called_from_the_cell_are_not_traced_separately():
    probe = MemoryProbe()
    src = "def f():\n    x = 1\n    return x\ny = f()\nz = [f() for _ in range(3)]\n"
    _, lines = run_traced(src, probe)
    assert [ln.lineno for ln in lines] == [1, 4, 5]


def test_lines_work_under_a_debugger_or_coverage_tracer():
    probe = MemoryProbe()
    calls = []

    def other(frame, event, arg):  # what a debugger or coverage installs
        calls.append(event)
        return None

    sys.settrace(other)
    try:
        _, lines = run_traced("a = 1\nb = a + 1\n", probe)
        assert sys.gettrace() is other  # left in place
    finally:
        sys.settrace(None)
    assert [ln.lineno for ln in lines] == [1, 2]


def test_markers_leave_functions_classes_and_the_future_alone():
    markers = LineMarkers()
    markers.armed = True
    src = ("from __future__ import annotations\n"
           "def f(x):\n    y = x\n    return y\n"
           "class C:\n    z = 1\n"
           "for i in range(2):\n    if i:\n        pass\n    else:\n        pass\n"
           "try:\n    1/0\nexcept ZeroDivisionError:\n    pass\nfinally:\n    pass\n")
    tree = markers.visit(ast.parse(src))
    lines = sorted({n.value.args[0].value for n in ast.walk(tree)
                    if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
                    and isinstance(n.value.func, ast.Name) and n.value.func.id == HOOK_NAME})
    loop = [n for n in ast.walk(tree) if isinstance(n, ast.For)][0]
    assert ast.unparse(loop.iter) == "range(2)"  # the loop iterates the user's own iterable
    assert ast.unparse(loop.body[-1]) == f"{HOOK_NAME}(7)"  # the next fetch is the loop line's
    assert lines == [2, 5, 7, 8, 9, 11, 12, 13, 15, 17]  # not 1 (__future__), 3-4 (def), 6 (class)
    assert isinstance(tree.body[0], ast.ImportFrom)  # __future__ stays first
    assert not markers.armed  # one cell per arming
    again = ast.parse("x = 1")
    assert markers.visit(again) is again and len(again.body) == 1


def test_loop_headers_count_their_fetches_and_tests():
    probe = MemoryProbe()
    src = ("it = iter([bytearray(8 * 2**20) for _ in range(3)])\n"
           "kept = []\n"
           "for item in it:\n"
           "    kept.append(len(item))\n"
           "n = 0\n"
           "while n < 3:\n"
           "    n += 1\n")
    ns = {}
    _, lines = run_traced(src, probe, ns)
    by = {ln.lineno: ln for ln in lines}
    assert ns["kept"] == [8 * 2**20] * 3 and ns["n"] == 3
    assert by[3].hits == 4 and by[4].hits == 3  # for: 3 fetches + the final one
    assert by[6].hits == 4 and by[7].hits == 3  # while: 4 tests, 3 bodies


def test_an_error_while_fetching_is_the_users_own():
    def broken():
        yield 1
        raise ValueError("from the user's generator")

    with pytest.raises(ValueError, match="from the user's generator") as info:
        run_traced("for x in broken():\n    y = x\n", MemoryProbe(), {"broken": broken})
    frames = [tb.tb_frame.f_code.co_filename for tb in _walk(info.value.__traceback__)]
    assert not any("ipy_gpumem" in name for name in frames)  # no frame of ours between them


def _walk(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


@pytest.mark.parametrize("source", ["for x in 5:\n    pass\n", "a, b = 1\n", "for x in None:\n    y = 1\n"])
def test_errors_are_exactly_those_of_the_unmarked_code(source):
    def outcome(run):
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - comparing what the user would see
            return type(exc), str(exc)
        return None

    plain = outcome(lambda: exec(compile(source, "<plain>", "exec"), {}))
    marked = outcome(lambda: run_traced(source, MemoryProbe()))
    assert plain is not None and marked == plain


def test_statements_sharing_a_line_are_one_hit():
    _, lines = run_traced("a = 1; b = 2; c = 3\nfor i in range(3): d = i; e = i\n", MemoryProbe())
    by = {ln.lineno: ln for ln in lines}
    assert by[1].hits == 1
    assert by[2].hits == 4  # the loop line: 3 iterations and the final fetch, body included


def test_continue_hands_the_next_fetch_to_the_loop_line():
    ns = {}
    src = ("total = 0\n"
           "for i in range(6):\n"
           "    if i % 2:\n"
           "        continue\n"
           "    total += i\n")
    tracer, lines = run_traced(src, MemoryProbe(), ns)
    by = {ln.lineno: ln for ln in lines}
    assert ns["total"] == 0 + 2 + 4
    assert by[2].hits == 7 and by[3].hits == 6 and by[4].hits == 3 and by[5].hits == 3
    assert tracer.loop_spans() == ((2, 5, "for"),)


def test_a_cell_that_clears_its_namespace_keeps_running():
    # %reset -f empties the user's namespace mid-cell: the markers live in builtins, not there.
    ns = {}
    ns["wipe"] = ns.clear  # what %reset -f does to the user namespace
    _, lines = run_traced("a = 1\nwipe()\nb = 2\n", MemoryProbe(), ns)
    assert [ln.lineno for ln in lines] == [1, 2, 3] and ns == {"b": 2}


def test_ipythons_debugger_steps_over_the_marker():
    from ipy_gpumem.cell import markers

    code = markers._Hook.__call__.__code__
    assert "__debuggerskip__" in code.co_varnames and "__tracebackhide__" in code.co_varnames


def test_the_cell_magic_trampoline_is_not_marked():
    markers = LineMarkers()
    markers.armed = True
    tree = ast.parse("get_ipython().run_cell_magic('time', '', 'x = 1')")
    assert len(markers.visit(tree).body) == 1 and markers.armed  # still armed for the body it runs


class _Exploding(HostProbe):
    """Fault injection (fake): the host probe dies in the middle of a traced cell."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def _explode(self):
        self.calls += 1
        if self.calls > 2:
            raise RuntimeError("probe exploded")

    def rss(self):
        self._explode()
        return super().rss()

    def rss_after_reset(self):
        self._explode()
        return super().rss_after_reset()


def test_a_failing_probe_stops_measuring_without_touching_the_cell():
    probe = MemoryProbe(host=_Exploding())
    ns = {}
    src = "a = 1\nb = 2\nc = 3\nd = a + b + c\n"
    tracer, lines = run_traced(src, probe, ns)
    assert ns["d"] == 6  # the cell ran to the end
    assert tracer.reason.startswith("line measurement stopped: RuntimeError")


def test_a_device_without_a_context_at_the_first_marker_is_found_later(fake_gpu):
    # CUDA is up but no device has a context when the cell's first marker runs (FAKE: scripted
    # counters): the device list must not be cached empty for the rest of the cell.
    fake, probe = fake_gpu([(0, 0), (GiB, GiB), (GiB, GiB)])
    contexts = []
    probe.cuda.device_indices = lambda cuda: list(contexts)  # no context until wake() runs
    src = "wake()\nfake.advance()\nfake.pos = fake.pos\n"
    tracer, lines = run_traced(src, probe, {"fake": fake, "wake": lambda: contexts.append(0)})
    by = {ln.lineno: ln for ln in lines}
    assert by[1].devices[0].allocated_delta == 0  # the context came up during line 1
    assert by[2].devices[0].allocated_delta == GiB  # and line 2 is measured on it
