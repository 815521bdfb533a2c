"""Time one census (``tensors.census.take``: every tensor a namespace reaches, by role and owner) on namespaces a notebook really holds, beside ``who()`` on the same namespace in the same process.

Run from the repository root:

    python benchmarks/bench_census.py [--repeat 200]

Namespaces:

- ``seed``: the seed scenario: an MLP of ~8 M parameters after one Adam step, its output and loss
  keeping their graph, and 100 small variables.
- ``seed + 1M ints``: the same plus ``big = list(range(1_000_000))``. The first census proves the
  list holds no tensor in full; every later one re-checks a slice of it (the issue's bound: at
  most 5 ms for a census then).
- ``seed + 4096 x 4096 ints``: the same plus a 4096 x 4096 list of lists of ints.
- ``20-layer MLP + Adam``: a deeper model, for the cost per parameter and per graph node.

For each it prints the first census (ms), the median of ``--repeat`` later ones (ms), the same for
``who()`` and their ratio. Ends with markdown table rows.
"""
from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    print(f"python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}")
    print("command: python benchmarks/bench_census.py " + " ".join(sys.argv[1:]))
    rows = []
    for name, ns in namespaces():
        c_first, c_med = timed(lambda: take(ns, caches=False, user_modules=False), args.repeat)
        w_first, w_med = timed(lambda: who(ns), max(10, args.repeat // 10))
        snap = take(ns, caches=False, user_modules=False)
        rows.append((name, c_first, c_med, w_first, w_med, snap.complete))
        print(f"{name}: census first {c_first * 1e3:.2f} ms, then {c_med * 1e3:.3f} ms (complete: {snap.complete}); "
              f"who() first {w_first * 1e3:.2f} ms, then {w_med * 1e3:.3f} ms; census / who() {c_med / w_med:.2f}x")
    print()
    print("| namespace | census, first | census, then (median) | who(), then (median) | census / who() |")
    print("|---|---|---|---|---|")
    for name, c_first, c_med, _w_first, w_med, _complete in rows:
        print(f"| {name} | {c_first * 1e3:.2f} ms | {c_med * 1e3:.3f} ms | {w_med * 1e3:.3f} ms | {c_med / w_med:.2f}x |")


if __name__ == "__main__":
    main()
