"""The background sampler with the real probe of this machine: rate, redraws, stopping, errors,
no leaks, no torch import, and its own CPU cost."""
import _thread
import gc
import os
import subprocess
import sys
import threading
import time
import weakref

import pytest

from ipy_gpumem.core.probes import MemoryProbe
from ipy_gpumem.chart.sampler import Sampler
from ipy_gpumem.chart.timeline import HOST_KEY, Timeline
from ipy_gpumem.core.units import MiB

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="exact RSS needs procfs")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


@linux
def test_real_probe_at_50hz_sees_a_64mib_allocation(stop_all):
    timeline = Timeline()
    sampler = Sampler(MemoryProbe(), interval=0.02, on_sample=timeline.add)
    stop_all(sampler)
    sampler.start()
    time.sleep(0.2)
    blob = bytearray(b"\x01") * (64 * MiB)  # written, so its pages are resident
    time.sleep(0.3)
    sampler.stop()
    snap = timeline.snapshot()
    rss = snap.series[HOST_KEY]
    assert 15 <= sampler.samples <= 35 and len(rss) == sampler.samples
    assert max(rss[len(rss) // 2:]) - min(rss[:5]) >= 60 * MiB
    assert snap.t[-1] == pytest.approx(0.5, abs=0.2)
    del blob


def test_redraws_less_often_than_it_samples(stop_all):
    calls = {"sample": 0, "redraw": 0}
    sampler = Sampler(MemoryProbe(), interval=0.01, redraw_interval=0.1,
                      on_sample=lambda s: calls.__setitem__("sample", calls["sample"] + 1),
                      on_redraw=lambda: calls.__setitem__("redraw", calls["redraw"] + 1))
    stop_all(sampler)
    sampler.start()
    time.sleep(0.55)
    sampler.stop()
    assert calls["sample"] == sampler.samples >= 20
    assert 2 <= calls["redraw"] == sampler.redraws <= 7
    assert calls["redraw"] * 4 < calls["sample"]


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


def test_restart_after_stop_and_interval_changes_take_effect_at_once(stop_all):
    sampler = Sampler(MemoryProbe(), interval=30.0)
    stop_all(sampler)
    sampler.start()
    time.sleep(0.05)
    sampler.interval = 0.01  # wakes the sleeping thread
    time.sleep(0.3)
    assert sampler.samples >= 10
    sampler.stop()
    sampler.start()
    assert sampler.running and sampler.samples <= 2
    sampler.stop()
    with pytest.raises(ValueError):
        sampler.interval = 0
    with pytest.raises(ValueError):
        Sampler(MemoryProbe(), redraw_interval=float("nan"))


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


def test_cpu_share_is_measured_in_the_thread_and_small(stop_all):
    timeline = Timeline()
    sampler = Sampler(MemoryProbe(), interval=0.05, on_sample=timeline.add)  # 20 Hz
    stop_all(sampler)
    sampler.start()
    time.sleep(1.0)
    sampler.stop()
    assert 0 < sampler.cpu_seconds < sampler.wall_seconds
    assert sampler.wall_seconds == pytest.approx(1.0, abs=0.3)
    # Measured about 0.1-0.3% here; 5% leaves room for a loaded CI machine.
    assert sampler.cpu_share < 0.05


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
