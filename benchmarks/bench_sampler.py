"""What the live chart costs: CPU idle and while cells run back to back, one redraw, the bytes a
saved notebook keeps, and the timeline's memory.

Run from the repository root::

    python benchmarks/bench_sampler.py                 # in-process, side by side (about 2 minutes)
    python benchmarks/bench_sampler.py --quick         # shorter rounds, no memory section
    python benchmarks/bench_sampler.py --kernel        # also real ipykernel processes (about 3 minutes)
    python benchmarks/bench_sampler.py --kernel --kernel-path /path/to/other/checkout   # compare another tree

**In process, side by side.** One process runs the same workload under each configuration in
interleaved rounds (A B C A B C ...), so drift and noise hit them alike, and reports the CPU each
adds over the same workload without a chart, as a percentage of one core and as a ratio:

* ``chart`` — what ships: ``LiveChart`` with the real ``MemoryProbe`` sampling at 4 Hz, an HTML
  view whose display handle serializes every update the way ipykernel does (JSON + HMAC), the
  redraw budget and the idle rule.
* ``every cell end`` — the policy before: the same chart redrawing at every cell's end and at every
  sampler tick (no budget, no idle rule).
* ``plotly widget`` — the widget before: a plotly ``FigureWidget`` redrawn at every cell end and
  tick, with its HTML fallback rebuilt (only when plotly and anywidget are installed).

"Cells back to back" are fake cells on the main thread: the hooks' ``cell_started`` /
``cell_finished`` around ``--cell-ms`` of sleep, one after the other, as a notebook's Run All does
(the 1 ms row is a stress case: a real kernel needs about 4 ms per cell for its own messages).
Each round is measured after 2 s of the same workload, with the redraw budget's initial burst
(20 ms, a session's first redraws) already spent: the rows show the steady state.

**In a kernel** (``--kernel``): a real ipykernel per configuration (no chart, ``%gpumem chart``
(the live plotly figure), ``%gpumem chart html`` (the SVG updated in place), ``%gpumem chart widget``), idle for ``--seconds`` and then executing ``time.sleep(0.1)`` cells
back to back from a client; the kernel process's CPU time from ``/proc`` (Linux only).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import hmac
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ipy_gpumem.chart.live import LiveChart, RedrawBudget  # noqa: E402
from ipy_gpumem.chart.svg import timeline_svg  # noqa: E402
from ipy_gpumem.chart.timeline import Timeline  # noqa: E402
from ipy_gpumem.chart.views import HtmlChartView, chart_html, timeline_text  # noqa: E402
from ipy_gpumem.core.probes import DeviceSample, HostSample, MemoryProbe, Sample  # noqa: E402
from ipy_gpumem.core.records import CellRecord, DeviceRecord, HostRecord  # noqa: E402

GiB, MiB = 2**30, 2**20
ROWS: list = []  # (measurement, result, notes)
CPU_ROWS: list = []  # (workload, configuration, CPU % of a core over the baseline, ratio, redraws)
KERNEL_ROWS: list = []


def row(what: str, value: str, note: str = "") -> None:
    ROWS.append((what, value, note))
    print(f"  {what}: {value} {note}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# In process: the chart's CPU, side by side
# --------------------------------------------------------------------------------------------


class KernelLikeHandle:
    """A display handle that pays what ipykernel pays per update_display_data in the calling
    thread: the bundle serialized to JSON and signed (HMAC-SHA256), then dropped (no socket)."""

    key = b"x" * 32

    def __init__(self):
        self.updates = 0
        self.bytes = 0

    def update(self, bundle, raw=True):
        payload = json.dumps({"data": bundle, "metadata": {}, "transient": {"display_id": "x"}}).encode()
        hmac.new(self.key, payload, hashlib.sha256).hexdigest()
        self.updates += 1
        self.bytes = len(payload)


class EveryTimeChart(LiveChart):
    """The policy before this change: redraw at every cell end and every sampler tick."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.budget = RedrawBudget(share=float("inf"), burst=float("inf"))

    def _on_redraw(self):
        if self.views:
            self._redraw(final=self._pending)


class PlotlyView:
    """The widget view before this change (plotly FigureWidget + an HTML fallback), reduced to what
    a redraw does: every series and cell band pushed to the figure, the fallback rebuilt."""

    inline = True
    live = True

    def __init__(self, timeline, handle):
        import threading

        import plotly.graph_objects as go

        self.timeline, self.handle, self.go = timeline, handle, go
        self.lock = threading.Lock()  # the sampler thread and the main thread both redraw
        self.figure = go.FigureWidget(layout=dict(height=300, hovermode="x unified"))
        self._drawn = -1
        self._keys = None
        self.draws = 0

    def refresh(self, force=False):
        with self.lock:
            return self._refresh(force)

    def _refresh(self, force):
        snap = self.timeline.snapshot()
        if snap.version == self._drawn and not force:
            return False
        keys = [k for k in snap.series if any(v is not None for v in snap.series[k])]
        fig, times = self.figure, list(snap.t)
        with fig.batch_update():
            if keys != self._keys:
                fig.data = ()
                for _ in keys:
                    fig.add_trace(self.go.Scatter(mode="lines"))
                fig.add_trace(self.go.Scatter(mode="text"))
                self._keys = keys
            for trace, key in zip(fig.data, keys):
                values = list(snap.series[key])
                trace.x, trace.y = times, values
                trace.customdata = [f"{v}" for v in values]
            spans = list(snap.spans)[-120:]
            fig.data[len(keys)].x = [s.start for s in spans]
            fig.data[len(keys)].text = [s.label for s in spans]
            fig.layout.shapes = [dict(type="rect", x0=s.start, x1=s.end or snap.end, y0=0, y1=1, yref="paper")
                                 for s in spans]
        self._drawn = snap.version
        self.draws += 1
        return True

    def finalize(self):
        drew = self.refresh()
        if drew:
            snap = self.timeline.snapshot()
            self.handle.update({"text/html": timeline_svg(snap), "text/plain": timeline_text(snap)})
        return drew

    def freeze(self):
        self.live = False


def _record(n: int, probe_sample) -> CellRecord:
    rss = probe_sample.host.rss
    return CellRecord(n, None, f"step({n})", time.time(), 0.01, host=HostRecord(rss, rss, rss))


class Config:
    """One configuration of the side-by-side rounds: builds its chart, runs cells, reports."""

    def __init__(self, name: str, make):
        self.name = name
        self.make = make
        self.cpu = []
        self.wall = []
        self.redraws = 0
        self.chart = None

    def start(self, probe):
        self.chart = self.make(probe) if self.make is not None else None
        if self.chart is not None:
            # The steady state: a session's first 20 ms of redraws (the budget's burst) are spent.
            self.chart.budget.spend(self.chart.budget.burst)

    def stop(self):
        if self.chart is not None:
            self.chart.close()
            self.chart = None


def _html_chart(probe, cls=LiveChart):
    chart = cls(probe, lambda: [], lambda: None)
    chart._ensure_timeline()
    view = HtmlChartView(chart.timeline)
    view.handle = KernelLikeHandle()
    chart.views.append(view)
    chart.ensure_sampler()
    return chart


def _plotly_chart(probe):
    chart = EveryTimeChart(probe, lambda: [], lambda: None)
    chart._ensure_timeline()
    chart.views.append(PlotlyView(chart.timeline, KernelLikeHandle()))
    chart.ensure_sampler()
    return chart


def configurations() -> list:
    configs = [Config("no chart (baseline)", None), Config("chart", _html_chart),
               Config("every cell end", lambda probe: _html_chart(probe, EveryTimeChart))]
    try:
        import plotly.graph_objects as go

        go.FigureWidget()
        configs.append(Config("plotly widget, every cell end", _plotly_chart))
    except Exception as exc:  # noqa: BLE001 - plotly or anywidget missing
        print(f"  (plotly widget configuration skipped: {type(exc).__name__}: {exc})", file=sys.stderr)
    return configs


def _cells(config: Config, probe, seconds: float, cell_s: float) -> None:
    n, wall0 = 0, time.perf_counter()
    if cell_s <= 0:
        time.sleep(seconds)
        return
    while time.perf_counter() - wall0 < seconds:
        n += 1
        start = probe.sample()
        if config.chart is not None:
            config.chart.cell_started(start, f"step({n})")
        time.sleep(cell_s)
        end = probe.sample()
        if config.chart is not None:
            config.chart.cell_finished(end, _record(n, end))


def _updates(config: Config) -> int:
    if config.chart is None:
        return 0
    # Redraws: a plotly view's figure updates, an HTML view's display updates.
    return sum(getattr(view, "draws", None) or getattr(getattr(view, "handle", None), "updates", 0)
               for view in config.chart.views)


def run_round(config: Config, probe, seconds: float, cell_s: float, warmup: float = 2.0) -> None:
    """``seconds`` of cells back to back (``cell_s`` each; 0 for idle: no cells at all), measured
    after ``warmup`` seconds of the same (the redraw budget's initial burst is not the steady state)."""
    config.start(probe)
    _cells(config, probe, warmup, cell_s)
    gc.collect()
    updates = _updates(config)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    _cells(config, probe, seconds, cell_s)
    config.cpu.append(time.process_time() - cpu0)
    config.wall.append(time.perf_counter() - wall0)
    config.redraws += _updates(config) - updates
    config.stop()


def bench_cpu(workload: str, seconds: float, rounds: int, cell_s: float) -> None:
    probe = MemoryProbe()
    configs = configurations()
    for _ in range(rounds):
        for config in configs:
            run_round(config, probe, seconds, cell_s)
    base = configs[0]
    base_share = sum(base.cpu) / sum(base.wall)
    chart_extra = None
    for config in configs:
        share = sum(config.cpu) / sum(config.wall)
        extra = share - base_share
        if config.name == "chart":
            chart_extra = extra
        ratio = "" if config is base or chart_extra is None or config.name == "chart" else \
            f"{extra / chart_extra:.1f}x" if chart_extra > 0 else "n/a"
        value = f"{base_share * 100:.2f} (absolute)" if config is base else f"{extra * 100:+.2f}"
        redraws = f"{config.redraws / sum(config.wall):.1f}/s" if config is not base else ""
        CPU_ROWS.append((workload, config.name, value, ratio, redraws))
        print(f"  {CPU_ROWS[-1]}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# In real kernels
# --------------------------------------------------------------------------------------------


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _kernel(path: str):
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    km.kernel_spec.argv[0] = sys.executable
    km.start_kernel(env=dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=path), cwd=path)
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    return km, kc


def _execute(kc, code: str, timeout: float = 120) -> str:
    msg_id = kc.execute(code)
    text = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text.append(msg["content"]["text"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(text)


def _drain(kc) -> None:
    while True:
        try:
            kc.get_iopub_msg(timeout=0.05)
        except Exception:  # noqa: BLE001 - queue.Empty
            return


def kernel_run(path: str, kind, seconds: float, cell: str) -> tuple:
    km, kc = _kernel(path)
    try:
        pid = km.provisioner.process.pid
        _execute(kc, "%load_ext ipy_gpumem")
        if kind is not None:
            _execute(kc, f"%gpumem chart {kind}".rstrip())
        _execute(kc, "x = 1")
        time.sleep(2.0)
        _drain(kc)
        cpu0, wall0 = _proc_cpu(pid), time.perf_counter()
        time.sleep(seconds)
        idle = (_proc_cpu(pid) - cpu0) / (time.perf_counter() - wall0)
        _drain(kc)
        n = 0
        cpu0, wall0 = _proc_cpu(pid), time.perf_counter()
        while time.perf_counter() - wall0 < seconds:
            _execute(kc, cell)
            n += 1
        wall = time.perf_counter() - wall0
        busy = (_proc_cpu(pid) - cpu0) / wall
        return idle, busy, n, wall
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def bench_kernels(paths: list, seconds: float, rounds: int) -> None:
    cell = "import time; time.sleep(0.1)"
    for path in paths:
        label = "this tree" if os.path.abspath(path) == os.path.abspath(ROOT) else path
        results = {}
        for _ in range(rounds):
            for kind in (None, "", "html", "widget"):
                idle, busy, n, wall = kernel_run(path, kind, seconds, cell)
                acc = results.setdefault(kind, [0.0, 0.0, 0, 0.0])
                acc[0] += idle * wall
                acc[1] += busy * wall
                acc[2] += n
                acc[3] += wall
        base_idle, base_busy = results[None][0] / results[None][3], results[None][1] / results[None][3]
        for kind, (idle_cpu, busy_cpu, n, wall) in results.items():
            name = "no chart" if kind is None else f"%gpumem chart {kind}".rstrip()
            if kind is None:
                KERNEL_ROWS.append((label, name, f"{base_idle * 100:.2f} (absolute)", f"{base_busy * 100:.2f} (absolute)",
                                    f"{n / wall:.1f}"))
            else:
                KERNEL_ROWS.append((label, name, f"{(idle_cpu / wall - base_idle) * 100:+.2f}",
                                    f"{(busy_cpu / wall - base_busy) * 100:+.2f}", f"{n / wall:.1f}"))
            print(f"  {KERNEL_ROWS[-1]}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# One redraw, and the bytes it leaves
# --------------------------------------------------------------------------------------------


def session(points: int, cells: int):
    """A timeline of ``points`` samples, ``cells`` cells, and 4 drawn series: cuda:0 allocated,
    reserved and used, and cuda:1 allocated (host RSS is kept but not drawn)."""
    tl = Timeline(max_points=2 * points + 8, max_spans=2 * cells + 8)
    total = int(15.78 * GiB)
    every = max(1, points // cells)
    n = 0
    for i in range(points):
        a = GiB + (i * 7919) % (6 * GiB)
        devices = (DeviceSample(0, a, 8 * GiB, None, None, 9 * GiB + i * 512, total),
                   DeviceSample(1, 2 * GiB + (i * 104729) % GiB, None, None, None, None, total))
        tl.add(Sample(i * 0.25, HostSample(2 * GiB + i * 4096, None), devices))
        if i % every == 0:
            n += 1
            tl.cell_started(i * 0.25, "[*]", f"y = model(batch_{n})  # a typical first line of a cell")
        elif i % every == every // 2:
            dev = DeviceRecord(0, "GPU", GiB, 2 * GiB, 3 * GiB, 4 * GiB, 4 * GiB, 4 * GiB, None, None, total)
            tl.cell_finished(i * 0.25, CellRecord(n, None, f"y = model(batch_{n})", 0.0, 1.0, devices=(dev,)))
    return tl


def median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_redraw(points: int, cells: int) -> None:
    snap = session(points, cells).snapshot()
    html_ms = median_ms(lambda: chart_html(snap), 30)
    row(f"chart_html (the chart's HTML: image + hover boxes), {points} points x 4 series, {len(snap.spans)} cells",
        f"{html_ms:.2f} ms", f"median; {len(chart_html(snap)) / 1024:.0f} KiB")
    svg_ms = median_ms(lambda: timeline_svg(snap), 30)
    row("timeline_svg (inline SVG with <title> tooltips), same data", f"{svg_ms:.2f} ms",
        f"median; {len(timeline_svg(snap)) / 1024:.0f} KiB")
    handle = KernelLikeHandle()
    view = HtmlChartView.__new__(HtmlChartView)
    view.size = (760, 240)
    send_ms = median_ms(lambda: handle.update(view._bundle(snap)), 30)
    row("one HTML view redraw: bundle + JSON + HMAC, as ipykernel sends it", f"{send_ms:.2f} ms",
        f"median; {handle.bytes / 1024:.0f} KiB message")
    try:
        import plotly
        import plotly.graph_objects as go

        fig = go.FigureWidget()
        for _ in range(4):
            fig.add_scatter(x=[0], y=[0], mode="lines")
        xs = list(snap.t)
        keys = [k for k in snap.series if k.device.is_cuda][:4]

        def update():
            with fig.batch_update():
                for trace, key in zip(fig.data, keys):
                    trace.x, trace.y = xs, list(snap.series[key])

        plotly_ms = median_ms(update, 10)
        row(f"plotly {plotly.__version__} FigureWidget batch_update, same data (the widget before)",
            f"{plotly_ms:.2f} ms", f"median, no kernel attached; {plotly_ms / send_ms:.1f}x one HTML view redraw")
        state = fig.get_state()
        esm = len(state.get("_esm", "") or "")
        row("plotly FigureWidget saved state (the widget before)", f"{len(json.dumps(state, default=str)) / MiB:.2f} MiB",
            f"of which the _esm JavaScript bundle {esm / MiB:.2f} MiB: saved with every chart view")
    except Exception as exc:  # noqa: BLE001 - plotly or anywidget missing
        row("plotly comparison", "n/a", f"{type(exc).__name__}: {exc}")


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


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per round (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per configuration (default 3)")
    parser.add_argument("--cell-ms", type=float, default=100.0, help="length of each back-to-back cell (default 100)")
    parser.add_argument("--quick", action="store_true", help="1 round of 3 s, no memory section")
    parser.add_argument("--kernel", action="store_true", help="also measure real ipykernel processes (Linux)")
    parser.add_argument("--kernel-path", action="append", default=None,
                        help="checkout(s) to measure in kernels (default: this tree); repeat to compare")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.rounds = 3.0, 1
    torch = sys.modules.get("torch")
    cuda = bool(torch is not None and torch.cuda.is_initialized())
    machine = (f"Python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, "
               f"CUDA {'initialized' if cuda else 'not in use (host RSS only)'}")
    print(f"# bench_sampler: {machine}", file=sys.stderr)
    bench_cpu("idle (chart open, no cell running)", args.seconds, args.rounds, 0.0)
    bench_cpu(f"cells back to back ({args.cell_ms:g} ms each)", args.seconds, args.rounds, args.cell_ms / 1000)
    bench_cpu("cells back to back (1 ms each)", args.seconds, args.rounds, 0.001)
    bench_redraw(1000, 300)
    bench_redraw(1000, 40)
    if args.kernel:
        bench_kernels(args.kernel_path or [ROOT], 2 * args.seconds, max(1, args.rounds - 1))
    if not args.quick:
        bench_memory()
    command = "python " + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:]))
    print(f"\n`{command}`  \n{machine}\n")
    print(f"The chart's CPU in one process, side by side ({args.rounds} interleaved rounds of {args.seconds:g} s): "
          "% of one core over the same workload without a chart, and the ratio to what ships:\n")
    print("| workload | configuration | CPU % of a core | ratio to `chart` | redraws |\n|---|---|---|---|---|")
    for cells in CPU_ROWS:
        print("| " + " | ".join(cells) + " |")
    if KERNEL_ROWS:
        print("\nIn real kernels (kernel process CPU from /proc, % of one core over the kernel without a chart; "
              "busy = `time.sleep(0.1)` cells back to back):\n")
        print("| tree | chart | idle | busy | cells/s |\n|---|---|---|---|---|")
        for cells in KERNEL_ROWS:
            print("| " + " | ".join(cells) + " |")
    print("\nOne redraw, the bytes it leaves, and the timeline's memory:\n")
    print("| measurement | result | notes |\n|---|---|---|")
    for what, value, note in ROWS:
        print(f"| {what} | {value} | {note} |")


if __name__ == "__main__":
    main()
