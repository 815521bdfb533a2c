"""What the extension adds to a cell, whatever the namespace holds: loaded against a plain shell, in one process, ABBA.

One ``InteractiveShell`` with torch imported. For each scenario the namespace is built once; then
blocks of cells run alternately with ``ipy_gpumem`` loaded and unloaded (A B B A ...), so both
sides see the same machine load. Reported per scenario: the median cell time of each side (wall
time), the difference and the ratio, then the same for the process's CPU time (every thread of ours
included: what the extension costs whatever else the machine runs, the figure to read on a loaded
machine), and the CPU time spent inside the extension's own ``pre_run_cell``/``post_run_cell``
callbacks (this thread's, median per cell; the rest of what a loaded cell adds is IPython's own
code running slower after ours evicted it from the caches).

``--before DIR`` measures a second copy of the package beside this one, a third side in the same
blocks (A B C C B A): copy its ``ipy_gpumem`` folder to ``DIR/ipy_gpumem_before`` (its imports are
relative, so it loads under that name), e.g. ``git archive <commit> ipy_gpumem | tar -x -C /tmp/b &&
mv /tmp/b/ipy_gpumem /tmp/b/ipy_gpumem_before``.

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

    python benchmarks/bench_cell_cost.py [--cells 200] [--rounds 2] [--only NAME ...] [--before DIR]
    python benchmarks/bench_cell_cost.py --profile 30000   # where a quiet cell's time inside the hooks goes
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


def run_block(ip, cells, n, hooks=None):
    times = []
    with contextlib.redirect_stdout(io.StringIO()):  # the per-cell lines are not what is measured
        _run(ip, cells, n, times, hooks)
    return times


_COUNTER = [0]


def _run(ip, cells, n, times, hooks):
    for _ in range(n):
        _COUNTER[0] += 1
        for source, timed in cells:
            source = source.replace("{i}", str(_COUNTER[0]))  # a new cell each time (not a re-run)
            if hooks is not None:
                hooks.spent = 0
            t0, c0 = time.perf_counter(), time.process_time()
            ip.run_cell(source, store_history=True)
            if timed:
                times.append((time.perf_counter() - t0, time.process_time() - c0,
                              hooks.spent if hooks is not None else None))


class HookClock:
    """Times, in this thread's CPU time, the ``pre_run_cell``/``post_run_cell`` callbacks an extension's
    load registered (found by comparing the shell's callbacks before and after it), and puts them back."""

    EVENTS = ("pre_run_cell", "post_run_cell")

    def __init__(self, ip, extension):
        self.ip, self.spent = ip, 0
        before = {event: list(ip.events.callbacks[event]) for event in self.EVENTS}
        ip.run_line_magic("load_ext", extension)
        self.swapped = []
        for event in self.EVENTS:
            callbacks = ip.events.callbacks[event]
            for k, callback in enumerate(callbacks):
                if callback not in before[event]:
                    callbacks[k] = self._timed(callback)
                    self.swapped.append((event, k, callback))

    def _timed(self, callback):
        clock = time.thread_time_ns

        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return callback(*args, **kwargs)
            finally:
                self.spent += clock() - t0
        return timed

    def unload(self, extension):
        for event, k, callback in self.swapped:  # the originals, for the unload to find
            self.ip.events.callbacks[event][k] = callback
        self.ip.run_line_magic("unload_ext", extension)


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


def profile(ip, cells: int, period: float = 0.0005) -> None:
    """Where a quiet cell's time inside the extension goes: ``cells`` cells ``x = 1`` with the SMALL
    namespace, sampled every ``period`` seconds of the process's CPU time (``ITIMER_PROF``); per
    function of ours, the share of the samples taken inside it (inclusive) and at it (the innermost
    function of ours), against all the samples inside our hooks. A sample costs the cell a frame
    walk, so the shares are the figure to read, not the microseconds."""
    import collections
    import signal

    ip.run_cell("%reset -f", store_history=False)
    ip.run_cell(SMALL, store_history=False)
    ip.run_line_magic("load_ext", "ipy_gpumem")
    run_block(ip, [("x = 1", False)], 300)  # past the first counts
    inside, leaf = collections.Counter(), collections.Counter()
    ours = [0]

    def sample(_signum, frame):
        seen, first = set(), True
        while frame is not None:
            code = frame.f_code
            if "ipy_gpumem" in code.co_filename:
                key = f"{code.co_filename.rpartition('ipy_gpumem')[2].lstrip('/')}:{code.co_name}"
                if key not in seen:
                    seen.add(key)
                    inside[key] += 1
                if first:
                    leaf[key] += 1
                    first = False
            frame = frame.f_back
        ours[0] += not first

    signal.signal(signal.SIGPROF, sample)
    signal.setitimer(signal.ITIMER_PROF, period, period)
    try:
        run_block(ip, [("x = 1", False)], cells)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, signal.SIG_DFL)
        ip.run_line_magic("unload_ext", "ipy_gpumem")
    total = max(ours[0], 1)
    print(f"{ours[0]} samples inside ipy_gpumem's hooks over {cells} cells `x = 1`; load {os.getloadavg()[0]:.2f}")
    print("| function (ipy_gpumem/...) | inside it | at it |")
    print("|---|---:|---:|")
    for key, count in inside.most_common(30):
        print(f"| {key} | {100 * count / total:.0f}% | {100 * leaf[key] / total:.0f}% |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", type=int, default=200, help="cells per block (scaled per scenario)")
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--before", default=None,
                        help="a folder holding another copy of the package as ipy_gpumem_before, measured beside this one")
    parser.add_argument("--profile", type=int, default=0, metavar="CELLS",
                        help="instead: where the time of CELLS quiet cells goes inside the extension (statistical)")
    args = parser.parse_args()
    from IPython.core.interactiveshell import InteractiveShell
    import torch  # noqa: F401 - a user's session has torch imported

    if args.profile:
        profile(InteractiveShell.instance(), args.profile)
        return

    extensions = {"loaded": "ipy_gpumem"}
    if args.before:
        sys.path.insert(0, args.before)
        extensions["before"] = "ipy_gpumem_before"
    ip = InteractiveShell.instance()
    print(f"load before: {os.getloadavg()[0]:.2f}; python {sys.version.split()[0]}; cells per block {args.cells}")
    print("| scenario | plain cell (median) | loaded cell (median) | added | ratio | CPU: plain | loaded | added | ratio "
          "| in its hooks (CPU) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    sides_order = ["plain"] + list(extensions)
    for name, (setup, cells, factor) in SCENARIOS.items():
        if args.only and name not in args.only:
            continue
        ip.run_cell("%reset -f", store_history=False)
        ip.run_cell(setup, store_history=False)
        gc.collect()
        n = max(3, int(args.cells * factor))
        sides = {side: [] for side in sides_order}
        for rnd in range(args.rounds):
            order = sides_order + sides_order[::-1]  # A B C C B A: each side sees the same load on average
            for side in (order if rnd % 2 == 0 else order[::-1]):
                hooks = HookClock(ip, extensions[side]) if side != "plain" else None
                run_block(ip, cells, 2)  # warm-up: the first cells after a load take the first count
                sides[side].extend(run_block(ip, cells, n, hooks))
                if hooks is not None:
                    hooks.unload(extensions[side])
        plain, cplain = (statistics.median(t[k] for t in sides["plain"]) for k in (0, 1))
        for side in extensions:
            loaded, cloaded = (statistics.median(t[k] for t in sides[side]) for k in (0, 1))
            inside = statistics.median(t[2] for t in sides[side]) / 1e9
            label = name if side == "loaded" else f"{name} (before: {args.before})"
            print(f"| {label} | {plain * 1e6:,.0f} us | {loaded * 1e6:,.0f} us | {(loaded - plain) * 1e6:+,.0f} us | "
                  f"{loaded / plain:.2f}x | {cplain * 1e6:,.0f} us | {cloaded * 1e6:,.0f} us | "
                  f"{(cloaded - cplain) * 1e6:+,.0f} us | {cloaded / max(cplain, 1e-9):.2f}x | {inside * 1e6:,.1f} us |",
                  flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
