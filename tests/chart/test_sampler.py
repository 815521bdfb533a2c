"""The background sampler: its schedule on a fake clock (rate, redraws, re-planning, huge and
refused intervals), and with the real probe of this machine: stopping, errors, no leaks, no torch
import, and its own CPU cost."""
import _thread
import gc
import os
import subprocess
import sys
import threading
import time
import weakref

import pytest

from ipy_gpumem.chart.sampler import MAX_INTERVAL, MAX_WAIT, MIN_INTERVAL, Sampler
from ipy_gpumem.chart.timeline import HOST_RSS, Timeline
from ipy_gpumem.core.probes import HostSample, MemoryProbe, Sample
from ipy_gpumem.core.units import MiB

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="exact RSS needs procfs")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/chart/ -> the checkout


class ExplodingProbe:
    """A stand-in for a broken probe (a driver call that raises); not a copy of our code."""

    def __init__(self, after: int = 0):
        self.after = after
        self.calls = 0

    def sample(self, devices=None, with_device_memory=True):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("NVML went away")
        return MemoryProbe().sample(with_device_memory=with_device_memory)


def sampler_threads(name="ipy_gpumem-sampler"):
    return [t for t in threading.enumerate() if t.name == name]


@pytest.fixture
def stop_all():
    started = []
    yield started.append
    for sampler in started:
        sampler.stop()


class FakeClock:
    """A clock for the sampler that only moves when the sampler waits (a fake, labelled as such)."""

    def __init__(self, now=1000.0):
        self.now = now
        self.waits = []

    def __call__(self):
        return self.now

    def wait(self, event, timeout):
        if event.is_set():
            return True
        self.waits.append(timeout)
        self.now += timeout
        return False


class CountingProbe:
    """A probe that returns host samples stamped by the fake clock (fake)."""

    def __init__(self, clock):
        self.clock = clock
        self.calls = 0

    def sample(self, devices=None, with_device_memory=True):
        self.calls += 1
        return Sample(self.clock(), HostSample(self.calls * MiB, None), ())


def run_for(sampler, clock, seconds, each=None):
    """Run the sampling loop in this thread until the fake clock passes ``seconds``."""
    end = clock.now + seconds
    feed = sampler.on_sample

    def on_sample(sample):
        if feed is not None:
            feed(sample)
        if each is not None:
            each(sample)
        if clock.now >= end:
            sampler.stop()

    sampler.on_sample = on_sample
    sampler.run()


def test_samples_on_a_fixed_schedule_and_redraws_less_often():
    clock = FakeClock()
    redraws = []
    timeline = Timeline()
    sampler = Sampler(CountingProbe(clock), interval=0.25, on_sample=timeline.add, redraw_interval=1.0,
                      on_redraw=lambda: redraws.append(clock.now), clock=clock, wait=clock.wait)
    run_for(sampler, clock, 10.0)
    assert sampler.samples == 41 and len(timeline.snapshot().t) == 41  # t = 0, 0.25, ..., 10
    assert timeline.snapshot().t[-1] == pytest.approx(10.0)
    assert redraws == [pytest.approx(1000.0 + s) for s in range(1, 11)] and sampler.redraws == 10
    assert all(w == pytest.approx(0.25) for w in clock.waits)  # it sleeps; never busy-waits
    assert sampler.wall_seconds == pytest.approx(10.0)


def test_a_new_interval_takes_effect_at_once():
    clock = FakeClock()
    sampler = Sampler(CountingProbe(clock), interval=30.0, clock=clock, wait=clock.wait)

    def speed_up(sample):
        if sampler.samples == 1:
            sampler.interval = 1 / 64  # wakes the sleeping loop: no 30 s wait first (and exact in binary)

    run_for(sampler, clock, 1.0, each=speed_up)
    assert clock.waits[0] == 1 / 64 and sampler.samples == 65


def test_huge_intervals_are_waited_in_steps_and_never_overflow():
    clock = FakeClock()
    sampler = Sampler(CountingProbe(clock), interval=MAX_INTERVAL, clock=clock, wait=clock.wait)
    run_for(sampler, clock, MAX_INTERVAL)
    assert sampler.samples == 2 and max(clock.waits) == MAX_WAIT  # one day in 60 s steps
    assert len(clock.waits) == MAX_INTERVAL / MAX_WAIT


@pytest.mark.parametrize("bad", [0, -1, MIN_INTERVAL / 2, MAX_INTERVAL * 2, 1e10, float("nan"), float("inf"), "x"])
def test_intervals_outside_the_range_are_refused(bad):
    with pytest.raises(ValueError, match="between|a number"):
        Sampler(MemoryProbe(), interval=bad)
    with pytest.raises(ValueError, match="between|a number"):
        Sampler(MemoryProbe(), redraw_interval=bad)
    sampler = Sampler(MemoryProbe(), interval=1.0)
    with pytest.raises(ValueError):
        sampler.interval = bad
    assert sampler.interval == 1.0


@linux
def test_real_probe_sees_a_64mib_allocation(stop_all):
    timeline = Timeline()
    sampler = Sampler(MemoryProbe(), interval=0.02, on_sample=timeline.add)
    stop_all(sampler)
    sampler.start()
    deadline = time.perf_counter() + 10
    while sampler.samples < 3 and time.perf_counter() < deadline:
        time.sleep(0.01)
    blob = bytearray(b"\x01") * (64 * MiB)  # written, so its pages are resident
    seen = sampler.samples
    while sampler.samples < seen + 3 and time.perf_counter() < deadline:
        time.sleep(0.01)
    sampler.stop()
    rss = timeline.snapshot().series[HOST_RSS]
    assert len(rss) == sampler.samples >= 6
    assert max(rss) - min(rss[:3]) >= 60 * MiB
    del blob


def test_stop_is_immediate_and_idempotent(stop_all):
    sampler = Sampler(MemoryProbe(), interval=30.0)  # asleep for 30 s unless woken
    stop_all(sampler)
    sampler.start()
    sampler.start()  # idempotent: still one thread
    assert sampler.running and len(sampler_threads()) == 1
    time.sleep(0.05)
    t0 = time.perf_counter()
    sampler.stop()
    assert time.perf_counter() - t0 < 0.5
    sampler.stop()
    assert not sampler.running and sampler_threads() == [] and sampler.error is None
    assert sampler.samples == 1


def test_restart_after_stop(stop_all):
    sampler = Sampler(MemoryProbe(), interval=0.01)
    stop_all(sampler)
    sampler.start()
    deadline = time.perf_counter() + 10
    while sampler.samples < 3 and time.perf_counter() < deadline:
        time.sleep(0.01)
    sampler.stop()
    sampler.start()
    assert sampler.running and sampler.samples <= 2
    sampler.stop()


@pytest.mark.parametrize("where", ["probe", "on_sample", "on_redraw"])
def test_an_error_stops_it_quietly_and_is_reported_once(where, capfd, stop_all):
    reports = []

    def boom(*args):
        raise ValueError("callback bug")

    kwargs = {"interval": 0.01, "redraw_interval": 0.01, "on_error": reports.append}
    probe = ExplodingProbe(after=2) if where == "probe" else MemoryProbe()
    if where == "on_sample":
        kwargs["on_sample"] = boom
    if where == "on_redraw":
        kwargs["on_redraw"] = boom
    sampler = Sampler(probe, **kwargs)
    stop_all(sampler)
    sampler.start()
    deadline = time.perf_counter() + 2
    while sampler.running and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert not sampler.running and sampler_threads() == []
    expected = "RuntimeError: NVML went away" if where == "probe" else "ValueError: callback bug"
    assert sampler.error is not None and sampler.error.endswith(expected)
    assert reports == [sampler.error]
    sampler.stop()  # still fine after an error
    assert capfd.readouterr() == ("", "")  # file-descriptor level: print() and threading's hook


def test_a_failing_error_callback_stays_silent(capsys):
    def bad_report(message):
        raise RuntimeError("the reporter is broken too")

    sampler = Sampler(ExplodingProbe(), interval=0.01, on_error=bad_report)
    sampler.start()
    sampler._thread.join(2)
    assert not sampler.running and "NVML went away" in sampler.error
    assert capsys.readouterr() == ("", "")


def test_a_callback_may_stop_its_own_sampler(stop_all):
    holder = {}

    def on_sample(sample):
        holder["sampler"].stop()  # from the sampler thread: must not join itself

    sampler = Sampler(MemoryProbe(), interval=0.01, on_sample=on_sample)
    holder["sampler"] = sampler
    stop_all(sampler)
    sampler.start()
    sampler._thread.join(2)
    assert not sampler.running and sampler.samples == 1 and sampler.error is None


def test_survives_keyboard_interrupt_in_the_main_thread(stop_all):
    sampler = Sampler(MemoryProbe(), interval=0.01)
    stop_all(sampler)
    sampler.start()
    with pytest.raises(KeyboardInterrupt):
        _thread.interrupt_main()  # what Ctrl-C does to a running cell
        time.sleep(1)
    assert sampler.running and sampler.error is None
    before = sampler.samples
    time.sleep(0.1)
    assert sampler.samples > before
    sampler.stop()
    assert not sampler.running


@pytest.mark.slow
@pytest.mark.parametrize("probe, call_stop", [(MemoryProbe, True), (ExplodingProbe, True), (ExplodingProbe, False)])
def test_nothing_keeps_a_stopped_sampler_alive(probe, call_stop):
    # atexit holds the sampler while it runs; stop() (or the error that ended the thread)
    # must unregister it, or every start() would leak one sampler until exit.
    sampler = Sampler(probe(), interval=0.01)
    sampler.start()
    time.sleep(0.05)
    if call_stop:
        sampler.stop()
    else:
        sampler._thread.join(2)
    ref = weakref.ref(sampler)
    del sampler
    gc.collect()
    assert ref() is None


@pytest.mark.slow
def test_cpu_share_is_measured_in_the_thread_and_small(stop_all):
    timeline = Timeline()
    sampler = Sampler(MemoryProbe(), interval=0.05, on_sample=timeline.add)  # 20 Hz
    stop_all(sampler)
    sampler.start()
    time.sleep(1.0)
    sampler.stop()
    assert 0 < sampler.cpu_seconds < sampler.wall_seconds
    assert sampler.wall_seconds == pytest.approx(1.0, abs=0.5)
    # Measured about 0.1-0.3% here; 5% leaves room for a loaded CI machine.
    assert sampler.cpu_seconds / sampler.wall_seconds < 0.05


def test_the_sampler_imports_no_torch_and_no_display_libraries():
    # The layering rule (core: no IPython, torch, plotly, ipywidgets) for the live-chart stack,
    # exercised end to end: sampling, the timeline and the SVG redraw, as the live tier runs them.
    code = (
        "import sys, time\n"
        "from ipy_gpumem.core.probes import MemoryProbe\n"
        "from ipy_gpumem.chart.sampler import Sampler\n"
        "from ipy_gpumem.chart.timeline import Timeline\n"
        "from ipy_gpumem.chart.svg import timeline_svg\n"
        "tl = Timeline()\n"
        "s = Sampler(MemoryProbe(), interval=0.01, on_sample=tl.add, redraw_interval=0.05,\n"
        "            on_redraw=lambda: timeline_svg(tl.snapshot()))\n"
        "s.start(); time.sleep(0.2); s.stop()\n"
        "assert s.samples > 5 and s.error is None, s.error\n"
        "print(sorted(m for m in ('torch', 'IPython', 'plotly', 'ipywidgets', 'pynvml') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]" and out.stderr == ""


def test_interpreter_exit_with_a_running_sampler_is_clean():
    code = (
        "from ipy_gpumem.core.probes import MemoryProbe\n"
        "from ipy_gpumem.chart.sampler import Sampler\n"
        "s = Sampler(MemoryProbe(), interval=0.001)\n"
        "s.start()\n"
        "print('bye')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout == "bye\n" and out.stderr == ""
