"""What watching the training phases costs a model of 300 submodules, in inference and in training, against the same loop unwatched, in one process.

Run from the repository root:

    python benchmarks/bench_phases.py [--rounds 7] [--steps 50]

The model is 100 blocks of ``Linear(32, 32) + ReLU`` (301 modules, small ops: the case where a
per-module hook costs the most relative to the work). ``%%gpumem`` watches a whole cell's phases
with ``anatomy.phases.PhaseWatcher`` (global hooks, ``tensors.hooks``) and a census on the first
two steps; this script does the same around a loop of ``--steps`` steps: plain and watched
alternate, ``--rounds`` times, and the medians are compared. One thread (``torch.set_num_threads(1)``)
so that the figures do not move with the machine's other work. Ends with markdown table rows.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import torch
from torch import nn

from ipy_gpumem.anatomy.phases import PhaseWatcher
from ipy_gpumem.tensors.census import take


def model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(100)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return model, opt, torch.randn(8, 32)


def inference(model, opt, x, steps):
    for _ in range(steps):
        with torch.no_grad():
            model(x)


def training(model, opt, x, steps):
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()


def read():
    return time.perf_counter(), {"cpu": (0, 0)}


def watched(loop, model, opt, x, steps):
    ns = {"model": model, "opt": opt, "x": x}

    def census(modules=(), optimizers=(), tensors=()):
        return take(ns, extra=list(modules) + list(optimizers) + list(tensors), caches=False, user_modules=False)

    watcher = PhaseWatcher(read, census, every=0)
    watcher.start()
    try:
        loop(model, opt, x, steps)
    finally:
        watcher.stop()
    if watcher.reason:
        raise RuntimeError(watcher.reason)
    return watcher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, 1 thread")
    print("command: python benchmarks/bench_phases.py " + " ".join(sys.argv[1:]))
    rows = []
    for name, loop in (("inference", inference), ("training", training)):
        model, opt, x = model_and_data()
        loop(model, opt, x, 5)  # warm up both paths
        watched(loop, model, opt, x, 5)
        plain, watch = [], []
        for _ in range(args.rounds):
            start = time.perf_counter()
            loop(model, opt, x, args.steps)
            plain.append(time.perf_counter() - start)
            start = time.perf_counter()
            w = watched(loop, model, opt, x, args.steps)
            watch.append(time.perf_counter() - start)
        counts = {kind: row["count"] for kind, row in w.summary().items()}
        p, q = statistics.median(plain), statistics.median(watch)
        rows.append((name, p, q, counts))
        print(f"{name}: plain {p * 1e3:.1f} ms, watched {q * 1e3:.1f} ms per {args.steps} steps: {q / p:.3f}x; "
              f"phases counted {counts}")
    print()
    print("| loop (300 submodules) | plain | phases watched | ratio |")
    print("|---|---|---|---|")
    for name, p, q, _counts in rows:
        print(f"| {name}, {args.steps} steps | {p * 1e3:.1f} ms | {q * 1e3:.1f} ms | {q / p:.3f}x |")


if __name__ == "__main__":
    main()
