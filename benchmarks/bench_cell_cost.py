"""What the extension adds to a cell, whatever the namespace holds: loaded against a plain shell, in one process, ABBA.

One ``InteractiveShell`` with torch imported. For each scenario the namespace is built once; then
blocks of cells run alternately with ``ipy_gpumem`` loaded and unloaded (A B B A ...), so both
sides see the same machine load. Reported per scenario: the median cell time of each side (wall
time), the difference and the ratio, then the same for the process's CPU time (every thread of ours
included: what the extension costs whatever else the machine runs, the figure to read on a loaded
machine).

Scenarios (issue 28's rows):

- ``x = 1``: a trivial cell in a namespace with a small model (what every quiet cell pays).
- ``x = 1, 10k names``: the same with 10,000 more names (ints, strings, small lists).
- ``move 96 MiB``: a cell that allocates and keeps 96 MiB, then frees it in the next cell (not
  timed), with and without a list of 1M ints in the namespace (``+1M ints``).
- ``keep 32 MiB, N tensors``: ``keepK = torch.zeros(8_000_000)`` (a new name each time: a new cell
  that keeps 32 MiB, so the re-run snapshot is taken) with N small tensors held by objects in one
  list (a dataset kept as records of tensors), N = 12.5k ... 100k.
- ``x = 1, 1M tensors``: a trivial cell with a list of 1M one-element tensors in the namespace.
- ``x = 1, 1M names``, ``x = 1, 4096x4096``, ``x = 1, 200k records``: trivial cells with those.
- ``move 96 MiB`` variants of the large namespaces.

    python benchmarks/bench_cell_cost.py [--cells 200] [--rounds 2] [--only NAME ...]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import gc
import os
import statistics
import sys
import time


def run_block(ip, cells, n):
    times = []
    with contextlib.redirect_stdout(io.StringIO()):  # the per-cell lines are not what is measured
        _run(ip, cells, n, times)
    return times


_COUNTER = [0]


def _run(ip, cells, n, times):
    for _ in range(n):
        _COUNTER[0] += 1
        for source, timed in cells:
            source = source.replace("{i}", str(_COUNTER[0]))  # a new cell each time (not a re-run)
            t0, c0 = time.perf_counter(), time.process_time()
            ip.run_cell(source, store_history=True)
            if timed:
                times.append((time.perf_counter() - t0, time.process_time() - c0))


SMALL = ("import torch\n"
         "mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))\n"
         "batch = torch.randn(64, 256)\n")

SCENARIOS = {
    # name: (setup, [(cell source, timed)], cells per block factor)
    "x = 1": (SMALL, [("x = 1", True)], 1.0),
    "x = 1, 10k names": (SMALL + "g = globals()\nfor i in range(10_000):\n    g[f'v{i}'] = [i] if i % 3 == 0 else (str(i) if i % 3 == 1 else i)\n",
                         [("x = 1", True)], 1.0),
    "move 96 MiB": (SMALL, [("big = torch.ones(24 * 2**20)", True), ("del big", False)], 0.1),
    "move 96 MiB, +1M ints": (SMALL + "ints = list(range(1_000_000))\n",
                              [("big = torch.ones(24 * 2**20)", True), ("del big", False)], 0.1),
    "x = 1, 1M tensors": (SMALL + "tiny = [torch.zeros(1) for _ in range(1_000_000)]\n", [("x = 1", True)], 1.0),
    "x = 1, 1M names": (SMALL + "g = globals()\nfor i in range(1_000_000):\n    g[f'v{i}'] = i\n", [("x = 1", True)], 0.5),
    "x = 1, 4096x4096": (SMALL + "grid = [list(range(4096)) for _ in range(4096)]\n", [("x = 1", True)], 1.0),
    "x = 1, 200k records": (SMALL + "records = [{'id': i, 'name': str(i), 'tags': [i, i + 1]} for i in range(200_000)]\n",
                            [("x = 1", True)], 1.0),
    "move 96 MiB, 1M tensors": (SMALL + "tiny = [torch.zeros(1) for _ in range(1_000_000)]\n",
                                [("big = torch.ones(24 * 2**20)", True), ("del big", False)], 0.05),
    "move 96 MiB, 4096x4096": (SMALL + "grid = [list(range(4096)) for _ in range(4096)]\n",
                               [("big = torch.ones(24 * 2**20)", True), ("del big", False)], 0.1),
}
for _n in (12_500, 25_000, 50_000, 100_000):
    SCENARIOS[f"keep 32 MiB, {_n // 1000}k tensors"] = (
        SMALL + "class Rec:\n    def __init__(self, t):\n        self.t = t\n"
        f"data = [Rec(torch.zeros(4)) for _ in range({_n})]\n",
        [("keep{i} = torch.zeros(8_000_000)", True), ("del keep{i}", False)], 0.05)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", type=int, default=200, help="cells per block (scaled per scenario)")
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds")
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    from IPython.core.interactiveshell import InteractiveShell
    import torch  # noqa: F401 - a user's session has torch imported

    ip = InteractiveShell.instance()
    print(f"load before: {os.getloadavg()[0]:.2f}; python {sys.version.split()[0]}; cells per block {args.cells}")
    print("| scenario | plain cell (median) | loaded cell (median) | added | ratio | CPU: plain | loaded | added | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (setup, cells, factor) in SCENARIOS.items():
        if args.only and name not in args.only:
            continue
        ip.run_cell("%reset -f", store_history=False)
        ip.run_cell(setup, store_history=False)
        gc.collect()
        n = max(3, int(args.cells * factor))
        sides = {"plain": [], "loaded": []}
        for rnd in range(args.rounds):
            for side in (("plain", "loaded", "loaded", "plain") if rnd % 2 == 0 else ("loaded", "plain", "plain", "loaded")):
                if side == "loaded":
                    ip.run_line_magic("load_ext", "ipy_gpumem")
                run_block(ip, cells, 2)  # warm-up: the first cells after a load take the first census
                sides[side].extend(run_block(ip, cells, n))
                if side == "loaded":
                    ip.run_line_magic("unload_ext", "ipy_gpumem")
        plain, loaded = (statistics.median(w for w, _c in sides[k]) for k in ("plain", "loaded"))
        cplain, cloaded = (statistics.median(c for _w, c in sides[k]) for k in ("plain", "loaded"))
        print(f"| {name} | {plain * 1e6:,.0f} us | {loaded * 1e6:,.0f} us | {(loaded - plain) * 1e6:+,.0f} us | "
              f"{loaded / plain:.2f}x | {cplain * 1e6:,.0f} us | {cloaded * 1e6:,.0f} us | "
              f"{(cloaded - cplain) * 1e6:+,.0f} us | {cloaded / max(cplain, 1e-9):.2f}x |", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
