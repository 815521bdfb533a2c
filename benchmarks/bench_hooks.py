"""Per-cell cost of memory tools' IPython hooks, measured inside real run_cell calls, side by side.

For each tool, in one process: load it, wrap exactly the pre/post_run_cell callbacks it
registered with a timer, run the same cells, and report the time spent inside its hooks per cell
as a share of a bare cell (the same cells with no tool loaded). The neighbours are
ipython_memory_usage and ipyexperiments from PyPI, measured the same way; their printed output
goes to a buffer, as ours would if it printed.

    python benchmarks/bench_hooks.py [--cells 3000] [--repeat 5]

With ``--census``, ipy_gpumem alone in two namespaces (the small MLP above, and a 20-layer MLP with
Adam after one step): the same cells with the extension loaded and unloaded, side by side, as a
ratio, and the part of the hook time that is the census (the count every explanation starts from,
made stale at the end of each recorded cell once torch is imported and taken, in a shell with no
event loop, when the next cell starts), timed inside the watcher.

Needs: pip install -e . torch==2.13.0 ipython_memory_usage ipyexperiments
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import io
import statistics
import sys
import time
import types

CELLS = {
    "x = 1": "x = 1",
    "small loop": "y = sum(i * i for i in range(200))",
    # A realistic small cell: one forward pass of a small MLP on the CPU (about a millisecond).
    "torch forward": "out = mlp(batch)",
}
SETUP = (
    "import torch\n"
    "mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))\n"
    "batch = torch.randn(64, 256)\n"
)


class TimedCallback:
    """Wraps one registered callback and accumulates the time spent in it."""

    def __init__(self, fn):
        self.fn = fn
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def wrap_new_callbacks(ip, before):
    """Replace the callbacks registered since ``before`` by timing wrappers; return them."""
    wrapped = []
    for event in ("pre_run_cell", "post_run_cell"):
        callbacks = ip.events.callbacks[event]
        for i, cb in enumerate(callbacks):
            if not any(cb is old or cb == old for old in before[event]):
                timed = TimedCallback(cb)
                callbacks[i] = timed
                wrapped.append((event, timed))
    return wrapped


def unwrap(ip, wrapped):
    for event, timed in wrapped:
        callbacks = ip.events.callbacks[event]
        if timed in callbacks:
            callbacks[callbacks.index(timed)] = timed.fn


def run_cells(ip, source, n):
    times = []
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        for _ in range(n):
            t0 = time.perf_counter()
            ip.run_cell(source, store_history=True)
            times.append(time.perf_counter() - t0)
    return times


def measure(ip, setup, teardown, source, n, repeat):
    """Median over ``repeat`` rounds of: (hook seconds per cell, run_cell seconds per cell)."""
    hook, total = [], []
    for _ in range(repeat):
        before = {e: list(ip.events.callbacks[e]) for e in ("pre_run_cell", "post_run_cell")}
        with contextlib.redirect_stdout(io.StringIO()):
            state = setup(ip)
        wrapped = wrap_new_callbacks(ip, before)
        warm = run_cells(ip, source, 20)
        # Slow tools (ms per cell) get fewer cells, enough for a stable mean in ~3 s.
        cells = max(100, min(n, int(3.0 / max(statistics.mean(warm), 1e-6))))
        for _, timed in wrapped:
            timed.seconds, timed.calls = 0.0, 0
        gc.collect()
        times = run_cells(ip, source, cells)
        hook.append(sum(t.seconds for _, t in wrapped) / cells)
        total.append(statistics.mean(times))
        unwrap(ip, wrapped)
        with contextlib.redirect_stdout(io.StringIO()):
            teardown(ip, state)
    return statistics.median(hook), statistics.median(total)


#: The namespaces of the census benchmark: what a user's names hold when every cell ends.
NAMESPACES = {
    "small MLP": SETUP,
    "20-layer MLP + Adam": (
        SETUP
        + "_layers = []\n"
        "for _ in range(20):\n"
        "    _layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]\n"
        "mlp = torch.nn.Sequential(*_layers)\n"
        "opt = torch.optim.Adam(mlp.parameters())\n"
        "mlp(batch).square().mean().backward()\n"
        "opt.step()\n"
        "del _layers\n"
    ),
}


def _fresh_history(ip):
    """Forget the input history (``In``, ``_iN``): every round is a session of at most ``n`` cells,
    whatever ran before it (the census walks every name, and IPython adds one per cell)."""
    with contextlib.redirect_stdout(io.StringIO()):
        ip.run_line_magic("reset", "-f in")


def census_cost(ip, n, repeat):
    """ipy_gpumem loaded vs unloaded, per namespace: run_cell time, hook time, the census's part."""
    print("| namespace | cell | run_cell, unloaded | run_cell, loaded | ratio | time in its hooks | "
          "of which the census |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, setup in NAMESPACES.items():
        ip.run_cell(setup, store_history=True)
        for label, source in (("x = 1", "x = 1"), ("torch forward", "out = mlp(batch)")):
            run_cells(ip, source, 200)
            rounds = []
            for _ in range(repeat):
                _fresh_history(ip)
                rounds.append(statistics.mean(run_cells(ip, source, n)))
            bare = statistics.median(rounds)
            census = []

            def setup_timed(ip):
                _fresh_history(ip)
                ip.run_line_magic("load_ext", "ipy_gpumem")
                anatomy = ip.magics_manager.registry["GpuMemMagics"].watcher.anatomy
                timed = TimedCallback(anatomy.census)
                anatomy.census = timed
                census.append(timed)

            def teardown(ip, _):
                ip.run_line_magic("unload_ext", "ipy_gpumem")

            hook, total = measure(ip, setup_timed, teardown, source, n, repeat)
            # The census runs once per recorded cell: its time per call, median over the rounds.
            per_call = statistics.median(t.seconds / max(t.calls, 1) for t in census)
            print(f"| {name} | `{label}` | {bare * 1e6:.1f} us | {total * 1e6:.1f} us | {total / bare:.2f}x | "
                  f"{hook * 1e6:.1f} us | {per_call * 1e6:.1f} us |")


def tools():
    def ours_setup(ip):
        ip.run_line_magic("load_ext", "ipy_gpumem")

    def ours_teardown(ip, _):
        ip.run_line_magic("unload_ext", "ipy_gpumem")

    yield "ipy_gpumem", ours_setup, ours_teardown

    try:
        import ipython_memory_usage.ipython_memory_usage as imu

        def imu_setup(ip):
            imu.start_watching_memory()

        def imu_teardown(ip, _):
            imu.stop_watching_memory()

        yield "ipython_memory_usage", imu_setup, imu_teardown
    except Exception as exc:  # noqa: BLE001
        print(f"(ipython_memory_usage unavailable: {exc})", file=sys.stderr)

    try:
        from ipyexperiments import IPyExperimentsCPU

        def ipyexp_setup(ip):
            # ipyexperiments reads ip.kernel.shell (it expects a Jupyter kernel); outside one, point
            # it at the shell itself so its hooks can run here as they would in a kernel.
            if not hasattr(ip, "kernel"):
                ip.kernel = types.SimpleNamespace(shell=ip)
            return IPyExperimentsCPU()

        def ipyexp_teardown(ip, exp):
            exp.finish()

        yield "ipyexperiments (defaults: gc.collect per cell)", ipyexp_setup, ipyexp_teardown

        def ipyexp_nogc_setup(ip):
            if not hasattr(ip, "kernel"):
                ip.kernel = types.SimpleNamespace(shell=ip)
            return IPyExperimentsCPU(cl_gc_collect=False)

        yield "ipyexperiments (cl_gc_collect=False)", ipyexp_nogc_setup, ipyexp_teardown
    except Exception as exc:  # noqa: BLE001
        print(f"(ipyexperiments unavailable: {exc})", file=sys.stderr)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--census", action="store_true", help="ipy_gpumem alone, in two namespaces (see above)")
    args = parser.parse_args()

    import IPython
    from IPython.core.interactiveshell import InteractiveShell
    import torch  # noqa: F401 - a user's session has torch imported

    ip = InteractiveShell.instance()
    print(f"IPython {IPython.__version__}, Python {sys.version.split()[0]}, {args.cells} cells x {args.repeat} rounds\n")
    if args.census:
        census_cost(ip, args.cells, args.repeat)
        return
    ip.run_cell(SETUP, store_history=True)
    print("| cell | tool | time in its hooks per cell | share of a bare cell | run_cell per cell | hook time vs ipy_gpumem |")
    print("|---|---|---:|---:|---:|---:|")
    for label, source in CELLS.items():
        run_cells(ip, source, 200)
        bare = statistics.median(statistics.mean(run_cells(ip, source, args.cells)) for _ in range(args.repeat))
        print(f"| `{label}` | (bare cell) | | | {bare * 1e6:.1f} us | |")
        ours = None
        for name, setup, teardown in tools():
            hook, total = measure(ip, setup, teardown, source, args.cells, args.repeat)
            if ours is None:
                ours = hook
            print(f"| `{label}` | {name} | {hook * 1e6:.2f} us | {hook / bare * 100:.1f}% | {total * 1e6:.1f} us | {hook / ours:.1f}x |")


if __name__ == "__main__":
    main()
