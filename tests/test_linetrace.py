"""The line tracer: per-line deltas and peaks, loop aggregation, and never raising into user code."""
import sys

import pytest

from ipy_gpumem.linetrace import LineTracer
from ipy_gpumem.probes import HostProbe, MemoryProbe
from ipy_gpumem.units import GiB, MiB

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="exact RSS needs procfs")


def run_traced(source, probe, ns=None, **kwargs):
    ns = {} if ns is None else ns
    code = compile(source, "<cell-under-test>", "exec")
    tracer = LineTracer(probe, ns, **kwargs)
    assert tracer.start()
    try:
        exec(code, ns)
    finally:
        tracer.stop()
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
    assert by[2].hits == 3  # two iterations plus the final check
    assert by[3].hits == 2 and by[3].devices[0].allocated_delta == 2 * GiB  # summed over hits
    assert by[4].hits == 2 and by[4].devices[0].allocated_delta == -2 * GiB
    assert by[1].devices[0].reserved_delta == 2 * GiB
    assert by[3].devices[0].allocated_peak == 2 * GiB
    # a peak increase is per execution: the loop header never needs more than it starts with,
    # even though memory is higher at its later hits than at its first
    assert by[2].devices[0].peak_increase == 0 and by[3].devices[0].peak_increase == 1 * GiB
    assert tracer.device_peaks[0] == (2 * GiB, 2 * GiB)
    assert by[3].source == "    fake.advance()"


@linux
def test_real_host_memory_per_line():
    probe = MemoryProbe()
    src = (
        "a = bytearray(48 * 2**20)\n"
        "b = bytearray(96 * 2**20)\n"
        "del b\n"
        "c = len(a)\n"
    )
    _, lines = run_traced(src, probe)
    by = {ln.lineno: ln for ln in lines}
    assert 48 * MiB <= by[1].host.rss_delta <= 50 * MiB
    assert 96 * MiB <= by[2].host.rss_delta <= 98 * MiB
    assert -98 * MiB <= by[3].host.rss_delta <= -94 * MiB
    assert abs(by[4].host.rss_delta) < 2 * MiB
    if probe.host.can_reset_peak:
        assert by[2].host.rss_peak_increase >= 96 * MiB
        assert by[4].host.rss_peak_increase < 4 * MiB  # each line's peak is its own


def test_functions_called_from_the_cell_are_not_traced_separately():
    probe = MemoryProbe()
    src = "def f():\n    x = 1\n    return x\ny = f()\nz = [f() for _ in range(3)]\n"
    _, lines = run_traced(src, probe)
    assert [ln.lineno for ln in lines] == [1, 4, 5]


def test_another_tracer_is_respected():
    probe = MemoryProbe()

    def other(frame, event, arg):
        return None

    sys.settrace(other)
    try:
        tracer = LineTracer(probe, {})
        assert tracer.start() is False
        assert "debugger or coverage" in tracer.reason
        assert sys.gettrace() is other
    finally:
        sys.settrace(None)


class _Exploding(HostProbe):
    """Fault injection (fake): the host probe dies in the middle of a traced cell."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def rss(self):
        self.calls += 1
        if self.calls > 2:
            raise RuntimeError("probe exploded")
        return super().rss()


def test_a_failing_probe_stops_tracing_without_touching_the_cell():
    probe = MemoryProbe(host=_Exploding())
    ns = {}
    src = "a = 1\nb = 2\nc = 3\nd = a + b + c\n"
    tracer, lines = run_traced(src, probe, ns)
    assert ns["d"] == 6  # the cell ran to the end
    assert tracer.reason.startswith("line tracing stopped: RuntimeError")
    assert sys.gettrace() is None
