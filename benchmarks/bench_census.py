"""Time one census (``tensors.census.take``: every tensor a namespace reaches, by role and owner) on namespaces a notebook really holds, beside ``who()`` on the same namespace in the same process; and a cell that moves 96 MiB with and without a list of 1M ints.

Run from the repository root:

    python benchmarks/bench_census.py [--repeat 200] [--before DIR] [--cells 40] [--no-cells]

``--before DIR`` times a second copy of the package beside this one, in the same process, call for
call (A B B A): make it with ``mkdir DIR && git archive REV ipy_gpumem | tar -x -C DIR && mv
DIR/ipy_gpumem DIR/ipy_gpumem_before`` (its imports are relative, so it loads under that name).

Namespaces:

- ``seed``: the seed scenario: an MLP of ~8 M parameters after one Adam step, its output and loss
  keeping their graph, and 100 small variables.
- ``seed + 1M ints``: the same plus ``big = list(range(1_000_000))``. The first census proves the
  list holds no tensor in full; every later one re-checks a slice of it (the issue's bound: at
  most 5 ms for a census then).
- ``seed + 4096 x 4096 ints``: the same plus a 4096 x 4096 list of lists of ints.
- ``20-layer MLP + Adam``: a deeper model, for the cost per parameter and per graph node.

For each it prints the first census (ms), the median of ``--repeat`` later ones (ms), the same for
``who()`` and their ratio; with ``--before``, the later censuses of both copies side by side.

The cells (issue 28's row): one shell with torch and a small model; ``big = torch.ones(24 * 2**20)``
(timed) and ``del big`` (not timed) run in blocks, with the extension unloaded, loaded, and (with
``--before``) the other copy loaded, in turn (A B C C B A), with and without ``ints =
list(range(1_000_000))`` in the namespace. Each such cell takes the census at its end and the re-run
snapshot (both walk the names). Reported: the median cell of each side and what the list adds.
Ends with markdown table rows and the machine's load.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

from ipy_gpumem.attribution.who import who
from ipy_gpumem.tensors.census import take


def seed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(256, 512), torch.randn(256, 512)
    out = model(x)
    loss = nn.functional.mse_loss(out, y)
    loss.backward()
    opt.step()
    out = model(x)
    loss = nn.functional.mse_loss(out, y)
    ns = {"model": model, "optimizer": opt, "inputs": x, "targets": y, "output": out, "loss": loss,
          "torch": torch, "nn": nn}
    ns.update({f"v{i}": i for i in range(50)})
    ns.update({f"s{i}": f"text {i}" for i in range(50)})
    return ns


def deep():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(20)])
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(32, 64)
    model(x).sum().backward()
    opt.step()
    out = model(x)
    return {"model": model, "opt": opt, "x": x, "out": out, "loss": out.sum()}


def namespaces():
    yield "seed", seed()
    ns = seed()
    ns["big"] = list(range(1_000_000))
    yield "seed + 1M ints", ns
    ns = seed()
    ns["grid"] = [list(range(4096)) for _ in range(4096)]
    yield "seed + 4096 x 4096 ints", ns
    yield "20-layer MLP + Adam", deep()


def timed(fn, repeat):
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def census_pair(before_dir):
    """``take`` of this copy and, with ``before_dir``, of the other one."""
    if not before_dir:
        return take, None
    sys.path.insert(0, before_dir)
    return take, importlib.import_module("ipy_gpumem_before.tensors.census").take


def side_by_side(takes, ns, repeat):
    """Medians of later censuses of each copy, A B B A."""
    for fn in takes.values():
        fn(ns, caches=False, user_modules=False)
    times = {name: [] for name in takes}
    names = list(takes)
    for i in range(repeat):
        for name in names if i % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            takes[name](ns, caches=False, user_modules=False)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


SMALL = ("import torch\n"
         "mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))\n"
         "batch = torch.randn(64, 256)\n")


class WalkClock:
    """Seconds spent in ``Walk.run`` (the census's and the re-run snapshot's walks) of one copy."""

    def __init__(self, walk_class):
        self.spent = 0.0
        run = walk_class.run
        clock = self

        def timed_run(walk):
            start = time.perf_counter()
            try:
                return run(walk)
            finally:
                clock.spent += time.perf_counter() - start

        walk_class.run = timed_run


def moving_cells(cells, before_dir):
    """Median time of a cell that moves 96 MiB (plain, loaded, loaded before), with and without 1M
    ints, and the median time its walks took (``walks``: immune to the noise of the 96 MiB memset)."""
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    sides = ["plain", "loaded"] + (["before"] if before_dir else [])
    extension = {"loaded": "ipy_gpumem", "before": "ipy_gpumem_before"}
    clocks = {"loaded": WalkClock(importlib.import_module("ipy_gpumem.tensors.walk").Walk)}
    if before_dir:
        clocks["before"] = WalkClock(importlib.import_module("ipy_gpumem_before.tensors.walk").Walk)
    out = {}
    for label, extra in (("move 96 MiB", ""), ("move 96 MiB, +1M ints", "ints = list(range(1_000_000))\n")):
        ip.run_cell("%reset -f", store_history=False)
        ip.run_cell(SMALL + extra, store_history=False)
        gc.collect()
        times = {side: [] for side in sides}
        walks = {side: [] for side in clocks}
        for rnd in range(2):
            for side in sides + sides[::-1] if rnd % 2 == 0 else sides[::-1] + sides:
                if side != "plain":
                    ip.run_line_magic("load_ext", extension[side])
                with contextlib.redirect_stdout(io.StringIO()):
                    for i in range(cells + 2):
                        clock = clocks.get(side)
                        spent = clock.spent if clock else 0.0
                        start = time.perf_counter()
                        ip.run_cell("big = torch.ones(24 * 2**20)", store_history=True)
                        if clock is not None:  # the census is taken at the cell's end or the next's start
                            ip.run_cell("pass", store_history=False)
                        if i >= 2:  # the first cells after a load take the first counts
                            times[side].append(time.perf_counter() - start)
                            if clock is not None:
                                walks[side].append(clock.spent - spent)
                        ip.run_cell("del big", store_history=True)
                if side != "plain":
                    ip.run_line_magic("unload_ext", extension[side])
        out[label] = {side: statistics.median(t) for side, t in times.items()}
        out[label].update({f"walks, {side}": statistics.median(t) for side, t in walks.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--before", default=None, help="a folder holding ipy_gpumem_before (see the docstring)")
    parser.add_argument("--cells", type=int, default=40, help="timed moving cells per block")
    parser.add_argument("--no-cells", action="store_true")
    args = parser.parse_args()
    print(f"python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, "
          f"load {os.getloadavg()[0]:.2f}")
    print("command: python benchmarks/bench_census.py " + " ".join(sys.argv[1:]))
    now_take, before_take = census_pair(args.before)
    rows, pairs = [], []
    for name, ns in namespaces():
        c_first, c_med = timed(lambda: take(ns, caches=False, user_modules=False), args.repeat)
        w_first, w_med = timed(lambda: who(ns), max(10, args.repeat // 10))
        snap = take(ns, caches=False, user_modules=False)
        rows.append((name, c_first, c_med, w_first, w_med, snap.complete))
        print(f"{name}: census first {c_first * 1e3:.2f} ms, then {c_med * 1e3:.3f} ms (complete: {snap.complete}); "
              f"who() first {w_first * 1e3:.2f} ms, then {w_med * 1e3:.3f} ms; census / who() {c_med / w_med:.2f}x")
        if before_take is not None:
            medians = side_by_side({"before": before_take, "after": now_take}, ns, args.repeat)
            pairs.append((name, medians["before"], medians["after"]))
            print(f"  side by side: before {medians['before'] * 1e3:.3f} ms, after {medians['after'] * 1e3:.3f} ms")
    print()
    print("| namespace | census, first | census, then (median) | who(), then (median) | census / who() |")
    print("|---|---|---|---|---|")
    for name, c_first, c_med, _w_first, w_med, _complete in rows:
        print(f"| {name} | {c_first * 1e3:.2f} ms | {c_med * 1e3:.3f} ms | {w_med * 1e3:.3f} ms | {c_med / w_med:.2f}x |")
    if pairs:
        print()
        print("| namespace | census before (median) | census after (median) | after / before |")
        print("|---|---|---|---|")
        for name, before, after in pairs:
            print(f"| {name} | {before * 1e3:.3f} ms | {after * 1e3:.3f} ms | {after / before:.2f}x |")
    if not args.no_cells:
        cells = moving_cells(args.cells, args.before)
        print()
        sides = list(next(iter(cells.values())))
        print("| cell | " + " | ".join(f"{s} (median)" for s in sides) + " |")
        print("|---|" + "---|" * len(sides))
        for label, medians in cells.items():
            print(f"| {label} | " + " | ".join(f"{medians[s] * 1e3:.1f} ms" for s in sides) + " |")
        for side in [s for s in sides if s != "plain" and not s.startswith("walks")]:
            added = (cells["move 96 MiB, +1M ints"][side] - cells["move 96 MiB, +1M ints"]["plain"]) - (
                cells["move 96 MiB"][side] - cells["move 96 MiB"]["plain"])
            walks = cells["move 96 MiB, +1M ints"][f"walks, {side}"] - cells["move 96 MiB"][f"walks, {side}"]
            print(f"what the 1M ints add to a moving cell, {side}: {added * 1e3:+.1f} ms (cells), "
                  f"{walks * 1e3:+.2f} ms (its walks)")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
