"""Time ``who()`` and the whole OOM panel on namespaces of 100k and 1.5M objects of several shapes.

Run from the repository root:

    python benchmarks/bench_who.py [--objects 100000 1500000] [--shapes ...] [--repeat 5]
                                   [--batch 2] [--size 224] [--budget 0.75] [--no-panel] [--before DIR]

``--before DIR`` times a second copy of the package beside this one, in the same process, call for
call (A B B A ...): make it with ``mkdir DIR && git archive REV ipy_gpumem | tar -x -C DIR && mv
DIR/ipy_gpumem DIR/ipy_gpumem_before`` (its imports are relative, so it loads under that name).

Shapes, each holding about N objects (N = ``--objects``):

- ``variables``: N names of mixed small values (ints, strings, floats, small lists, dicts and
  tuples), as a long session's namespace.
- ``list_of_ints``: one list of N ints.
- ``dict_of_objects``: one dict of N small objects (two scalar attributes each).
- ``nested``: records (a dict holding a list and a tuple) in lists of ten, N objects in all.
- ``tiny_tensors``: one list of N one-element tensors.
- ``resnet``: N mixed variables plus a hand-written ResNet-50 (torchvision is not needed:
  bottleneck blocks [3, 4, 6, 3], batch norm, ~25.6M parameters) after one Adam step, and a second
  forward whose ``output`` and ``loss`` keep their graph.

Every namespace also holds a few tensors. For each shape it prints ``who()``'s median and worst
time, whether the walk was complete (else what the budget left out), then the whole OOM panel
(``ipy_gpumem.oom.analysis.analyse`` + ``ipy_gpumem.oom.panel.oom_panel`` after a real CPU
out-of-memory error), timed separately: when the OOM room is being changed and that part fails,
the ``who()`` numbers still stand. Ends with markdown table rows.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import os
import platform
import shlex
import statistics
import sys
import time

import torch
from torch import nn

from ipy_gpumem.attribution.who import BUDGET_S, who


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: 1x1 reduce, 3x3 (strided), 1x1 expand, plus the shortcut."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1):
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet50(nn.Module):
    """The ResNet-50 layout: stem, four stages of bottlenecks, pooling, a linear classifier."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
            nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))
        stages, in_ch = [], 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            layers = []
            for i in range(blocks):
                layers.append(Bottleneck(in_ch, width, stride if i == 0 else 1))
                in_ch = width * Bottleneck.expansion
            stages.append(nn.Sequential(*layers))
        self.layers = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


class Record:
    """A small user object: two scalar attributes."""

    def __init__(self, key: int, value: float):
        self.key = key
        self.value = value


def variables(n: int) -> dict:
    """``n`` user-like variables: mostly scalars and strings, some small containers."""
    ns: dict = {}
    for i in range(n):
        r = i % 10
        if r < 4:
            value = i
        elif r < 6:
            value = f"string number {i}"
        elif r == 6:
            value = float(i)
        elif r == 7:
            value = [i, i + 1, str(i)]
        elif r == 8:
            value = {"a": i, "b": [i], "c": "x"}
        else:
            value = (i, None)
        ns[f"var_{i}"] = value
    return ns


def list_of_ints(n: int) -> dict:
    return {"ints": list(range(n))}


def dict_of_objects(n: int) -> dict:
    return {"records": {i: Record(i, float(i)) for i in range(n)}}


def nested(n: int) -> dict:
    """Lists of ten records ``{"id": i, "tags": [a, b], "pos": (x, y)}``: 9 objects per record."""
    records = n // 9
    return {"rows": [[{"id": i, "tags": ["a", "b"], "pos": (float(i), 0.5)} for i in range(j, min(j + 10, records))]
                     for j in range(0, records, 10)]}


def tiny_tensors(n: int) -> dict:
    return {"tensors": [torch.zeros(1) for _ in range(n)]}


def training_namespace(batch: int, size: int) -> dict:
    """ResNet-50, Adam after one step, and a second forward's ``output``/``loss`` with graph."""
    torch.manual_seed(0)
    model = ResNet50()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs = torch.randn(batch, 3, size, size)
    labels = torch.randint(0, 1000, (batch,))
    loss = nn.functional.cross_entropy(model(inputs), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    output = model(inputs)
    loss = nn.functional.cross_entropy(output, labels)
    return {"model": model, "optimizer": optimizer, "inputs": inputs, "labels": labels,
            "output": output, "loss": loss}


SHAPES = {"variables": variables, "list_of_ints": list_of_ints, "dict_of_objects": dict_of_objects,
          "nested": nested, "tiny_tensors": tiny_tensors, "resnet": variables}


def build(shape: str, n: int, batch: int, size: int) -> dict:
    ns = SHAPES[shape](n)
    if shape == "resnet":
        ns.update(training_namespace(batch, size))
    for i in range(5):
        ns[f"tensor_{i}"] = torch.randn(64, 64)
    return ns


def timed(fn, repeat: int):
    """``(median s, worst s, last result)`` of ``repeat`` calls after one warm-up."""
    result = fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), max(times), result


def side_by_side(fns: dict, repeat: int):
    """``{name: (median s, worst s, last result)}`` of the functions called in turn (A B B A ...), after a warm-up."""
    results = {name: fn() for name, fn in fns.items()}
    times = {name: [] for name in fns}
    names = list(fns)
    for i in range(repeat):
        for name in names if i % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            results[name] = fns[name]()
            times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(t), max(t), results[name]) for name, t in times.items()}


def panel_runner(ns: dict):
    """A function that runs the whole OOM panel on ``ns``, as after a real out-of-memory error."""
    from ipy_gpumem.core.probes import MemoryProbe
    from ipy_gpumem.core.records import CellRecord, HostRecord
    from ipy_gpumem.oom.analysis import analyse
    from ipy_gpumem.oom.panel import oom_panel
    from ipy_gpumem.oom.parse import parse_oom

    try:
        torch.empty(2**60)
    except RuntimeError as exc:
        message, tb = str(exc), exc.__traceback__
    record = CellRecord(9, None, "x = torch.empty(2**60)", time.time(), 0.1, error="RuntimeError",
                        error_message=message, host=HostRecord(2**30, 2**30, 2**30))
    probe = MemoryProbe()

    def run():
        view = oom_panel(analyse(parse_oom(message), record, namespace=ns, records=[record], probe=probe, tb=tb))
        assert view.text.startswith("Out of memory on"), view.text[:200]
        return view

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, nargs="+", default=[100_000, 1_500_000])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="who()'s time budget in seconds")
    parser.add_argument("--no-panel", action="store_true", help="time who() only")
    parser.add_argument("--before", default=None, help="a folder holding ipy_gpumem_before (see the docstring)")
    args = parser.parse_args()
    who_before = None
    if args.before:
        sys.path.insert(0, args.before)
        who_before = importlib.import_module("ipy_gpumem_before.attribution.who").who
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)

    rows = []
    for n in args.objects:
        for shape in args.shapes:
            start = time.perf_counter()
            ns = build(shape, n, args.batch, args.size)
            setup_s = time.perf_counter() - start
            fns = {"after": lambda: who(ns, budget_s=args.budget)}
            if who_before is not None:
                fns["before"] = lambda: who_before(ns, budget_s=args.budget)
            measured = side_by_side(fns, args.repeat)
            median, worst, report = measured["after"]
            before = ""
            if who_before is not None:
                b_median, _b_worst, b_report = measured["before"]
                before = (f" {b_median * 1e3:.1f} ms ({'complete' if b_report.complete else 'no'}) | "
                          f"{median / b_median:.2f}x |")
                print(f"{'':>16} {'':>10}          before: who() median {b_median * 1e3:7.1f} ms, complete "
                      f"{b_report.complete}; after / before {median / b_median:.2f}", flush=True)
            state = "complete" if report.complete else "incomplete: " + (report.notes[0] if report.notes else "")
            print(f"{shape:>16} {n:>10,} objects  who() median {median * 1e3:7.1f} ms  worst {worst * 1e3:7.1f} ms  "
                  f"{report.tensor_count:,} storages  {state}  (built in {setup_s:.1f} s)", flush=True)
            panel = "not run | -"
            if not args.no_panel:
                try:
                    p_median, p_worst, _ = timed(panel_runner(ns), args.repeat)
                    panel = f"{p_median * 1e3:.1f} ms | {p_worst * 1e3:.1f} ms"
                    print(f"{'':>16} {'':>10}          OOM panel median {p_median * 1e3:7.1f} ms  worst "
                          f"{p_worst * 1e3:7.1f} ms", flush=True)
                except Exception as exc:  # the OOM room is someone else's: who()'s numbers still stand
                    panel = f"failed ({type(exc).__name__}) | "
                    print(f"{'':>16} {'':>10}          OOM panel failed: {type(exc).__name__}: {exc}", flush=True)
            rows.append(f"| {shape} | {n:,} | {median * 1e3:.1f} ms | {worst * 1e3:.1f} ms | "
                        f"{'yes' if report.complete else 'no (budget)' if report.stopped else 'no'} | "
                        f"{report.tensor_count:,} | {panel} |{before}")
            del ns, report
            gc.collect()

    print()
    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {torch.get_num_threads()} threads, "
          f"who() budget {args.budget:g} s, {args.repeat} runs after one warm-up")
    print()
    print(f"load after: {os.getloadavg()[0]:.2f}")
    extra = " before: who() median (complete) | after / before |" if who_before is not None else ""
    print("| shape | objects | who() median | who() worst | complete | storages | OOM panel median | OOM panel worst |"
          + extra)
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if who_before is not None else ""))
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
