"""Where the per-cell hook time goes, step by step, inside real ``run_cell`` calls.

The extension is loaded into an InteractiveShell and the same trivial cell runs N times; timers
wrap the watcher's start and finish, the end-of-cell reading and its parts. A second pass times a
bare ``/proc/self/statm`` read from a post_run_cell callback twice in a row and ``getrusage``, to
show what the first ``/proc`` access after a cell costs on this machine against the next one.
Medians after a warm-up.

    python benchmarks/bench_hook_steps.py [--cells 3000]
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import time


def timed(acc, key, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc.setdefault(key, []).append(time.perf_counter() - t0)
    return wrapper


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", type=int, default=3000)
    args = parser.parse_args()
    from IPython.core.interactiveshell import InteractiveShell
    import torch  # noqa: F401 - a user's session has torch imported

    ip = InteractiveShell.instance()
    ip.run_cell("import torch\nmlp = torch.nn.Linear(4, 4)", store_history=True)
    ip.run_line_magic("load_ext", "ipy_gpumem")
    magics = ip.magics_manager.registry["GpuMemMagics"]
    watcher, probe = magics.watcher, magics.probe
    acc: dict = {}
    watcher.start = timed(acc, "watcher.start (pre_run_cell)", watcher.start)
    watcher.finish = timed(acc, "watcher.finish (post_run_cell)", watcher.finish)
    probe.sample = timed(acc, "  the end reading (probe.sample)", probe.sample)
    probe.host.rss = timed(acc, "    host RSS (/proc/self/statm)", probe.host.rss)
    probe.host.peak_rss = timed(acc, "    host peak (getrusage)", probe.host.peak_rss)
    probe.cuda.sample = timed(acc, "    CUDA counters (none here)", probe.cuda.sample)
    for _ in range(args.cells):
        ip.run_cell("x = 1", store_history=True)
    ip.run_line_magic("unload_ext", "ipy_gpumem")

    statm = os.open("/proc/self/statm", os.O_RDONLY)
    raw: dict = {"first /proc read after the cell": [], "the same read again": [], "getrusage": []}

    def post(result=None):
        t0 = time.perf_counter()
        os.pread(statm, 128, 0)
        t1 = time.perf_counter()
        os.pread(statm, 128, 0)
        t2 = time.perf_counter()
        resource.getrusage(resource.RUSAGE_SELF)
        t3 = time.perf_counter()
        raw["first /proc read after the cell"].append(t1 - t0)
        raw["the same read again"].append(t2 - t1)
        raw["getrusage"].append(t3 - t2)

    ip.events.register("post_run_cell", post)
    for _ in range(args.cells):
        ip.run_cell("x = 1", store_history=True)
    ip.events.unregister("post_run_cell", post)

    warm = args.cells // 6
    print(f"{args.cells} cells `x = 1`, medians after {warm} warm-up cells\n")
    print("| step | median |\n|---|---:|")
    for key, values in list(acc.items()) + list(raw.items()):
        print(f"| {key} | {statistics.median(values[warm:]) * 1e6:.2f} us |")


if __name__ == "__main__":
    main()
