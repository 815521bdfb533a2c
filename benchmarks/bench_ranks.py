"""What finding the ranks costs a cell that launches nothing (issue 20).

In one IPython shell: the same trivial cell N times without the extension, then with it, in
alternating blocks of 250 cells with its rank watch and with the watch replaced by one that does
nothing (the difference of the medians is what rank discovery adds to a cell), then unloaded
again; then a watch's own two calls timed alone, and how often each cell listed this process's
children.

    python benchmarks/bench_ranks.py [--cells 3000]
"""
from __future__ import annotations

import argparse
import statistics
import time


class _NoRanks:
    listings = 0

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=3000)
    args = parser.parse_args()
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    _per_cell(ip, 200)  # warm
    bare = _per_cell(ip, args.cells)
    ip.run_line_magic("load_ext", "ipy_gpumem")
    from ipy_gpumem.extension import current_magics

    watcher = current_magics().watcher
    _per_cell(ip, 200)
    watch = watcher.ranks
    # Alternate blocks with and without the rank watch, so the machine's drift hits both alike.
    loaded, without, listed = [], [], 0
    block = 250
    for _ in range(max(1, args.cells // block)):
        before = watch.listings
        loaded.append(_per_cell(ip, block))
        listed += watch.listings - before
        watcher.ranks = _NoRanks()
        without.append(_per_cell(ip, block))
        watcher.ranks = watch
    listings = listed / (block * len(loaded))
    loaded, without = statistics.median(loaded), statistics.median(without)
    ip.run_line_magic("unload_ext", "ipy_gpumem")
    bare_after = _per_cell(ip, args.cells)
    pair = []
    watch = type(watch)()
    for _ in range(args.cells):
        t0 = time.perf_counter()
        watch.cell_started()
        watch.cell_finished()
        pair.append(time.perf_counter() - t0)
    watch.close()
    us = 1e6
    print(f"cells: {args.cells} of `x = 1`, median per cell")
    print(f"  extension unloaded:                 {bare * us:7.1f} us  (unloaded again at the end: {bare_after * us:.1f} us)")
    print(f"  loaded:                             {loaded * us:7.1f} us")
    print(f"  loaded, rank watch doing nothing:   {without * us:7.1f} us")
    print(f"  rank discovery per cell:            {(loaded - without) * us:7.1f} us")
    print(f"  its two calls timed alone:          {statistics.median(pair) * us:7.1f} us")
    print(f"  children listed per cell:           {listings:7.2f}")


if __name__ == "__main__":
    main()
