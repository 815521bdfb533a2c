"""What finding the ranks costs a cell that launches nothing (issues 20 and 28).

In one IPython shell: the same trivial cell without the extension, then with it in ABBA blocks of
250 cells with its rank watch (A) and with the watch replaced by one that does nothing (B): the
difference of the medians is what rank discovery adds to a cell, and the ratio of the two is the
whole cell's; then unloaded again. Then a watch's own two calls timed alone, and the one read they
make (the main thread's children, one ``pread``) timed alone; and how often each cell listed this
process's children and woke the reading thread. The machine's load is printed with the figures.

    python benchmarks/bench_ranks.py [--cells 3000]
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
import time


class _NoRanks:
    listings = 0
    wakeups = 0

    def cell_started(self):
        pass

    def cell_finished(self, failure=None):
        return None

    def close(self):
        pass


def _per_cell(ip, cells: int) -> float:
    times = []
    for _ in range(cells):
        t0 = time.perf_counter()
        ip.run_cell("x = 1", store_history=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _median_call(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=3000)
    args = parser.parse_args()
    from IPython.core.interactiveshell import InteractiveShell

    load_before = os.getloadavg()
    ip = InteractiveShell.instance()
    _per_cell(ip, 200)  # warm
    bare = _per_cell(ip, args.cells)
    ip.run_line_magic("load_ext", "ipy_gpumem")
    from ipy_gpumem.core.children import MainThreadChildren
    from ipy_gpumem.extension import current_magics

    watcher = current_magics().watcher
    _per_cell(ip, 200)
    watch = watcher.ranks
    threads_before = sum(t.name == "ipy_gpumem-ranks" for t in threading.enumerate())
    # ABBA blocks with and without the rank watch, so the machine's drift hits both alike.
    loaded, without = [], []
    listed = woken = with_cells = 0
    block = 250
    for i in range(max(1, args.cells // block)):
        for use in ((True, False) if i % 2 == 0 else (False, True)):
            if use:
                before, wakes = watch.listings, watch.wakeups
                loaded.append(_per_cell(ip, block))
                listed += watch.listings - before
                woken += watch.wakeups - wakes
                with_cells += block
            else:
                watcher.ranks = _NoRanks()
                without.append(_per_cell(ip, block))
                watcher.ranks = watch
    threads_after = sum(t.name == "ipy_gpumem-ranks" for t in threading.enumerate())
    loaded_med, without_med = statistics.median(loaded), statistics.median(without)
    ratios = sorted(a / b for a, b in zip(loaded, without))
    ip.run_line_magic("unload_ext", "ipy_gpumem")
    bare_after = _per_cell(ip, args.cells)
    watch = type(watch)()

    def pair():
        watch.cell_started()
        watch.cell_finished()

    pair_s = _median_call(pair, args.cells)
    watch.close()
    main_children = MainThreadChildren()
    pread_s = _median_call(main_children.read, args.cells)
    main_children.close()
    load_after = os.getloadavg()
    us = 1e6
    print(f"cells: {args.cells} of `x = 1`, median per cell; load {load_before[0]:.2f} before, {load_after[0]:.2f} after "
          f"({os.cpu_count()} CPUs)")
    print(f"  extension unloaded:                 {bare * us:7.1f} us  (unloaded again at the end: {bare_after * us:.1f} us)")
    print(f"  loaded:                             {loaded_med * us:7.1f} us")
    print(f"  loaded, rank watch doing nothing:   {without_med * us:7.1f} us")
    print(f"  rank discovery per cell:            {(loaded_med - without_med) * us:7.1f} us  "
          f"(whole cell {loaded_med / without_med:.3f}x; per block pair {ratios[0]:.3f}x to {ratios[-1]:.3f}x)")
    print(f"  its two calls timed alone:          {pair_s * us:7.1f} us")
    print(f"  of which the one pread:             {pread_s * us:7.1f} us")
    print(f"  children listed per cell:           {listed / with_cells:7.2f}")
    print(f"  reading thread woken per cell:      {woken / with_cells:7.2f}  "
          f"(its threads: {threads_before} before, {threads_after} after)")


if __name__ == "__main__":
    main()
