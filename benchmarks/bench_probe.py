"""Time what the probes cost every cell (a cell's start and end readings), beside a second copy of the package, in one process.

Run from the repository root:

    python benchmarks/bench_probe.py --before DIR [--rounds 30] [--calls 2000]

``--before DIR`` holds ``ipy_gpumem_before``: ``mkdir DIR && git archive REV ipy_gpumem | tar -x -C
DIR && mv DIR/ipy_gpumem DIR/ipy_gpumem_before`` (its imports are relative, so it loads under that
name). Both copies read this process's real torch (imported first, as a notebook that uses the
extension has it), through ``MemoryProbe(cuda=CudaProbe(internals=tensors.torch_api.api))`` as
``%load_ext`` builds it.

Per round, each copy in turn (A B B A) runs ``--calls`` cells' worth of probe work: ``start()``
(the opening reading and the peak resets a cell's start makes), ``sample()`` (its closing reading)
and ``cuda.status()`` (asked again by the watcher). Printed: the median per-cell microseconds of
each copy over the rounds, their ratio (this copy / before), and the machine's load.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _probe(package: str):
    probes = importlib.import_module(f"{package}.core.probes")
    api = importlib.import_module(f"{package}.tensors.torch_api").api
    return probes.MemoryProbe(cuda=probes.CudaProbe(internals=api))


def _per_cell_us(probe, calls: int) -> float:
    start, sample, status = probe.start, probe.sample, probe.cuda.status
    t0 = time.perf_counter()
    for _ in range(calls):
        start()
        sample()
        status()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a folder holding ipy_gpumem_before (see the docstring)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.abspath(args.before))
    import torch  # noqa: F401 - the user's torch, imported before the cells as in a notebook

    probes = {"this": _probe("ipy_gpumem"), "before": _probe("ipy_gpumem_before")}
    for probe in probes.values():
        _per_cell_us(probe, 200)  # warm: the first reading opens /proc files, finds the build
    times = {name: [] for name in probes}
    for _ in range(args.rounds):
        for name in ("this", "before", "before", "this"):
            times[name].append(_per_cell_us(probes[name], args.calls))
    this, before = statistics.median(times["this"]), statistics.median(times["before"])
    ratios = [a / b for a, b in zip(times["this"], times["before"])]
    print(f"per cell (start + sample + status), median of {len(times['this'])} runs of {args.calls}:")
    print(f"  this copy   {this:8.2f} us")
    print(f"  before      {before:8.2f} us")
    print(f"  ratio       {this / before:8.3f}  (median of paired ratios {statistics.median(ratios):.3f})")
    print(f"  reason now: {probes['this'].sample().reason!r}")
    print(f"  load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")


if __name__ == "__main__":
    main()
