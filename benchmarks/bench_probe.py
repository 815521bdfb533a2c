"""Time what the probes cost every cell (a cell's start and end readings), beside a second copy of the package, in one process.

Run from the repository root:

    python benchmarks/bench_probe.py --before DIR [--rounds 30] [--calls 2000] [--fake-cuda]

``--before DIR`` holds ``ipy_gpumem_before``: ``mkdir DIR && git archive REV ipy_gpumem | tar -x -C
DIR && mv DIR/ipy_gpumem DIR/ipy_gpumem_before`` (its imports are relative, so it loads under that
name). Both copies read this process's real torch (imported first, as a notebook that uses the
extension has it), through ``MemoryProbe(cuda=CudaProbe(internals=tensors.torch_api.api))`` as
``%load_ext`` builds it.

``--fake-cuda`` reads instead a FAKE CUDA build (``tests/backend_fakes.py``: torch.cuda up, one
device, scripted stats; NVML absent, so the device view is its ``mem_get_info``), to time the CUDA
path's own Python on this machine without a GPU.

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


def _probe(package: str, torch_module=None):
    probes = importlib.import_module(f"{package}.core.probes")
    if torch_module is not None:
        return probes.MemoryProbe(cuda=probes.CudaProbe(torch_module=torch_module))
    api = importlib.import_module(f"{package}.tensors.torch_api").api
    return probes.MemoryProbe(cuda=probes.CudaProbe(internals=api))


def _fake_cuda():
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from backend_fakes import FakeCudaModule, fake_torch, nested, props

    cuda = FakeCudaModule(initialized=True, stats={0: nested(2**30, 2**31)}, props=props("FAKE GPU", 16 * 2**30),
                          mem_info=(8 * 2**30, 16 * 2**30))
    cuda.calls = type("NoCalls", (list,), {"append": lambda self, item: None})()  # keep nothing per call
    return fake_torch((2, 13), cuda="12.8", accelerator_type="cuda", cuda_module=cuda)


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
    parser.add_argument("--fake-cuda", action="store_true", help="read a FAKE CUDA build (see the docstring)")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.abspath(args.before))
    import torch  # noqa: F401 - the user's torch, imported before the cells as in a notebook

    fake = _fake_cuda() if args.fake_cuda else None
    probes = {"this": _probe("ipy_gpumem", fake), "before": _probe("ipy_gpumem_before", fake)}
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
    now = probes["this"].sample()
    print(f"  read now: {len(now.devices)} device(s), reason {now.reason!r}")
    print(f"  load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")


if __name__ == "__main__":
    main()
