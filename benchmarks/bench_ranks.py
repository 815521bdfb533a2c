"""What finding the ranks costs a cell that launches nothing (issues 20 and 28).

In one IPython shell: the same trivial cell without the extension, then with it, alternating cell
by cell (A B B A ...) between its rank watch (A) and a watch that does nothing (B): the median of
the paired differences is what rank discovery adds to a cell, and with B's median the whole cell's
ratio; then unloaded again. Then a watch's own two calls timed alone, and the one read they
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
    from ipy_gpumem.ranks.children import MainThreadChildren
    from ipy_gpumem.extension import current_magics

    watcher = current_magics().watcher
    _per_cell(ip, 200)
    watch = watcher.ranks
    threads_before = sum(t.name == "ipy_gpumem-ranks" for t in threading.enumerate())
    # With and without the rank watch in alternate cells (A B B A ...): neighbouring cells share the
    # machine's state, so the median of the paired differences survives a loaded machine.
    none = _NoRanks()
    loaded, without = [], []
    listings, wakes = watch.listings, watch.wakeups
    for i in range(args.cells):
        for use in ((True, False) if i % 2 == 0 else (False, True)):
            watcher.ranks = watch if use else none
            t0 = time.perf_counter()
            ip.run_cell("x = 1", store_history=True)
            (loaded if use else without).append(time.perf_counter() - t0)
    watcher.ranks = watch
    listed, woken, with_cells = watch.listings - listings, watch.wakeups - wakes, len(loaded)
    threads_after = sum(t.name == "ipy_gpumem-ranks" for t in threading.enumerate())
    loaded_med, without_med = statistics.median(loaded), statistics.median(without)
    paired = statistics.median(a - b for a, b in zip(loaded, without))
    quartiles = statistics.quantiles([a - b for a, b in zip(loaded, without)], n=4)
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
    print(f"  rank discovery per cell:            {paired * us:7.1f} us  (median of paired differences, "
          f"quartiles {quartiles[0] * us:.1f} to {quartiles[2] * us:.1f} us; whole cell "
          f"{(without_med + paired) / without_med:.3f}x)")
    print(f"  its two calls timed alone:          {pair_s * us:7.1f} us")
    print(f"  of which the one pread:             {pread_s * us:7.1f} us")
    print(f"  children listed per cell:           {listed / with_cells:7.2f}")
    print(f"  reading thread woken per cell:      {woken / with_cells:7.2f}  "
          f"(its threads: {threads_before} before, {threads_after} after)")


if __name__ == "__main__":
    main()
