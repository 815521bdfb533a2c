"""What the live chart costs: the sampler thread's CPU share, one chart update, the timeline's memory.

Run from the repository root (about a minute with the defaults)::

    python benchmarks/bench_sampler.py            # --seconds 10 per CPU measurement
    python benchmarks/bench_sampler.py --seconds 3 --quick

CPU share is measured two ways, side by side: the sampler thread's own CPU time
(``time.thread_time()`` read inside the thread, ``Sampler.cpu_seconds``) and the whole process's
CPU time delta (``time.process_time()``) minus an idle baseline taken the same way with no
sampler. Both are percentages of one core. On a machine without CUDA the probe reads host RSS
only; with CUDA initialized it also reads torch's allocator counters and NVML.
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ipy_gpumem.core.probes import DeviceSample, HostSample, MemoryProbe, Sample  # noqa: E402
from ipy_gpumem.core.records import CellRecord, DeviceRecord, HostRecord  # noqa: E402
from ipy_gpumem.chart.sampler import Sampler  # noqa: E402
from ipy_gpumem.chart.svg import timeline_svg  # noqa: E402
from ipy_gpumem.chart.timeline import Timeline  # noqa: E402

GiB, MiB = 2**30, 2**20
ROWS: list = []  # (measurement, result, notes)
CPU_ROWS: list = []  # (configuration, samples, redraws, thread CPU %, process CPU - idle %)


def row(what: str, value: str, note: str = "") -> None:
    ROWS.append((what, value, note))
    print(f"  {what}: {value} {note}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# CPU share of the sampler thread
# --------------------------------------------------------------------------------------------


def idle_baseline(seconds: float) -> float:
    """Process CPU share while the main thread just sleeps (the interpreter's own background)."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return (time.process_time() - cpu0) / (time.perf_counter() - wall0)


def sampler_share(hz: float, seconds: float, redraw: bool) -> tuple:
    """``(thread CPU share, process CPU share, samples, redraws)`` of a real sampler run."""
    timeline = Timeline()
    probe = MemoryProbe()
    state = {"version": -1}

    def on_redraw():
        # What the live HTML tier does each redraw: skip when unchanged, else rebuild the SVG.
        if timeline.version != state["version"]:
            state["version"] = timeline.version
            timeline_svg(timeline.snapshot())

    sampler = Sampler(probe, interval=1.0 / hz, on_sample=timeline.add,
                      redraw_interval=1.0, on_redraw=on_redraw if redraw else None)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    sampler.start()
    time.sleep(seconds)
    sampler.stop()
    process = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    if sampler.error:
        raise RuntimeError(sampler.error)
    return sampler.cpu_share, process, sampler.samples, sampler.redraws


def bench_cpu(seconds: float, rates: list) -> None:
    base = idle_baseline(seconds)
    CPU_ROWS.append(("idle baseline: no sampler, main thread asleep", "", "", "", f"{base * 100:.3f} (absolute)"))
    for hz, redraw in [(r, False) for r in rates] + [(rates[0], True)]:
        thread, process, samples, redraws = sampler_share(hz, seconds, redraw)
        label = f"{hz:g} Hz: probe + Timeline.add" + (" + timeline_svg redraw at 1 Hz" if redraw else "")
        CPU_ROWS.append((label, str(samples), str(redraws), f"{thread * 100:.3f}", f"{max(process - base, 0) * 100:.3f}"))
        print(f"  {CPU_ROWS[-1]}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# One chart update
# --------------------------------------------------------------------------------------------


def session_snapshot(points: int):
    """A timeline of exactly ``points`` samples, 40 cells, no merging, and 4 drawn series: cuda:0
    allocated, reserved and used, and cuda:1 allocated (host RSS is kept but not drawn)."""
    tl = Timeline(max_points=2 * points + 8, max_spans=4 * points)
    total = int(15.78 * GiB)
    for i in range(points):
        a = GiB + (i * 7919) % (6 * GiB)
        devices = (DeviceSample(0, a, 8 * GiB, None, None, 9 * GiB + i * 512, total),
                   DeviceSample(1, 2 * GiB + (i * 104729) % GiB, None, None, None, None, total))
        tl.add(Sample(i * 0.25, HostSample(2 * GiB + i * 4096, None), devices))
        if i % (points // 40) == 0:
            tl.cell_started(i * 0.25, f"[{i}]", f"step({i})")
        elif i % (points // 40) == points // 80:
            tl.cell_finished(i * 0.25, None)
    return tl


def median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_svg(points: int) -> None:
    tl = session_snapshot(points)
    snap = tl.snapshot()
    drawn = sum(1 for k in snap.series if k.startswith("cuda:"))
    ms = median_ms(lambda: timeline_svg(snap), 50 if points <= 2000 else 10)
    size = len(timeline_svg(snap))
    row(f"timeline_svg, {points} points x {drawn} drawn series + {len(snap.spans)} spans", f"{ms:.2f} ms",
        f"string build, median; {size / 1024:.0f} KiB of SVG")

    def uncached_snapshot():
        tl._cached = None  # snapshot() returns its cached copy while nothing changed; time a real one
        return tl.snapshot()

    ms = median_ms(uncached_snapshot, 20 if points <= 2000 else 5)
    row(f"Timeline.snapshot(), {points} points x {len(snap.series)} series", f"{ms:.2f} ms",
        "the copy for drawing, median")


def bench_plotly(points: int) -> None:
    try:
        import plotly
        import plotly.graph_objects as go
    except ImportError:
        row(f"plotly update, {points} points x 4 traces", "n/a", "plotly not installed")
        return
    xs = [i * 0.25 for i in range(points)]
    ys = [[(i * (k + 7919)) % (6 * GiB) for i in range(points)] for k in range(4)]
    try:
        fig = go.FigureWidget()
        kind = "FigureWidget batch_update"
    except Exception as exc:  # noqa: BLE001 - plotly>=6 without anywidget raises ImportError
        fig = go.Figure()
        kind = f"go.Figure update (FigureWidget unavailable: {type(exc).__name__})"
    for _ in range(4):
        fig.add_scatter(x=[0], y=[0], mode="lines")
    flip = {"n": 0}

    def update():
        flip["n"] += 1  # new values every time, as a redraw would push
        with fig.batch_update():
            for k, trace in enumerate(fig.data):
                trace.x = xs
                trace.y = ys[(k + flip["n"]) % 4]

    ms = median_ms(update, 10 if points <= 2000 else 3)
    row(f"plotly {plotly.__version__} {kind}, {points} points x 4 traces", f"{ms:.2f} ms",
        "median; no kernel attached, so no message is sent")


def bench_html_widget(points: int) -> None:
    try:
        import ipywidgets
    except ImportError:
        return
    snap = session_snapshot(points).snapshot()
    html = ipywidgets.HTML()
    ms = median_ms(lambda: setattr(html, "value", timeline_svg(snap) + " "), 20 if points <= 2000 else 5)
    row(f"ipywidgets.HTML.value = timeline_svg(...), {points} points", f"{ms:.2f} ms",
        "median; build + trait set, no kernel attached")


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------


def retained(build) -> int:
    """Bytes still allocated (tracemalloc) by what ``build()`` returns, after a collection."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        kept = build()
        gc.collect()
        size = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    del kept
    return size


def ten_thousand_cells():
    tl = Timeline()
    for n in range(1, 10_001):
        t = n * 3.0
        tl.cell_started(t, f"[{n}]", f"y = model(batch_{n})  # a typical first line of a cell")
        tl.add(Sample(t + 0.5, HostSample(2 * GiB, None),
                      (DeviceSample(0, n * MiB % (8 * GiB), 8 * GiB, None, None, 9 * GiB, 16 * GiB),)))
        dev = DeviceRecord(0, "GPU", GiB, 2 * GiB, 3 * GiB, 4 * GiB, 4 * GiB, 4 * GiB, None, None, 16 * GiB)
        tl.cell_finished(t + 1.0, CellRecord(n, None, f"y = model(batch_{n})\n" * 20, 0.0, 1.0, devices=(dev,)))
    tl.snapshot()  # a view keeps the latest snapshot cached: count it
    return tl


def samples_at_4hz(count: int):
    tl = Timeline()
    for i in range(count):
        a = GiB + (i * 7919) % (6 * GiB)
        tl.add(Sample(i * 0.25, HostSample(2 * GiB + (i % 100) * 4096, None),
                      (DeviceSample(0, a, 8 * GiB, None, None, 9 * GiB + i, 16 * GiB),)))
    tl.snapshot()
    return tl


def bench_memory() -> None:
    size = retained(ten_thousand_cells)
    row("Timeline memory after 10,000 cells (records passed in, not kept)", f"{size / MiB:.2f} MiB",
        "tracemalloc, incl. cached snapshot; 500 spans kept")
    for hours in (1, 24):
        count = hours * 3600 * 4
        size = retained(lambda: samples_at_4hz(count))
        row(f"Timeline memory after {hours} h at 4 Hz ({count:,} synthetic GPU samples)", f"{size / MiB:.2f} MiB",
            "tracemalloc, incl. cached snapshot; 2000 points x 4 series kept")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds per CPU measurement (default 10)")
    parser.add_argument("--rates", type=float, nargs="+", default=[4, 50, 100], help="sampling rates in Hz")
    parser.add_argument("--quick", action="store_true", help="skip the 10k-point and memory measurements")
    args = parser.parse_args(argv)
    torch = sys.modules.get("torch")
    cuda = bool(torch is not None and torch.cuda.is_initialized())
    print(f"# bench_sampler: Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"CUDA {'initialized' if cuda else 'not in use (host RSS only)'}", file=sys.stderr)
    bench_cpu(args.seconds, args.rates)
    for points in ((1000,) if args.quick else (1000, 2000, 10_000)):
        bench_svg(points)
        bench_html_widget(points)
        bench_plotly(points)
    if not args.quick:
        bench_memory()
    command = "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:]))
    print(f"\n`{command}`  \nPython {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"CUDA {'initialized' if cuda else 'not in use (host RSS only)'}\n")
    print(f"Sampler CPU, % of one core, {args.seconds:g} s each (real MemoryProbe):\n")
    print("| configuration | samples | redraws | thread CPU % | process CPU - idle % |\n|---|---|---|---|---|")
    for cells in CPU_ROWS:
        print("| " + " | ".join(cells) + " |")
    print("\nOne chart update and the timeline's memory:\n")
    print("| measurement | result | notes |\n|---|---|---|")
    for what, value, note in ROWS:
        print(f"| {what} | {value} | {note} |")


if __name__ == "__main__":
    main()
