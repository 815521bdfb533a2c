"""Time ``who()`` on a 100k-object namespace plus a retained ResNet-50 graph and Adam state.

Run from the repository root:

    python benchmarks/bench_who.py [--batch 2] [--size 224] [--repeat 7]

It builds (a) a namespace of 100,000 mixed objects (ints, floats, strings, small lists and
dicts, a few tensors) and (b) a hand-written ResNet-50 (torchvision is not needed: bottleneck
blocks [3, 4, 6, 3], batch norm, ~25.6M parameters), runs one training step with Adam so the
optimizer state exists, then a second forward whose ``output`` and ``loss`` stay in the
namespace with their graph. It prints the report's summary and one markdown table row.
"""
from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time

import torch
from torch import nn

from ipy_gpumem.who.attribution import who
from ipy_gpumem.oom.analysis import analyse
from ipy_gpumem.oom.panel import oom_panel
from ipy_gpumem.oom.parse import parse_oom
from ipy_gpumem.core.probes import MemoryProbe
from ipy_gpumem.core.records import CellRecord, HostRecord


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


def mixed_namespace(n: int) -> dict:
    """``n`` user-like variables: mostly scalars and strings, some small containers, 5 tensors."""
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
    for i in range(5):
        ns[f"tensor_{i}"] = torch.randn(64, 64)
    ns["In"], ns["Out"], ns["_"] = ["", "x = 1"], {1: 2}, 2
    return ns


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


def main() -> None:
    """Build both parts, time ``who()`` and print the summary and a markdown row."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    t0 = time.perf_counter()
    ns = mixed_namespace(args.objects)
    ns.update(training_namespace(args.batch, args.size))
    setup_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in ns["model"].parameters())

    who(ns)  # warm-up: first-call imports and type caches
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        report = who(ns)
        times.append(time.perf_counter() - start)
    median_ms, worst_ms = statistics.median(times) * 1e3, max(times) * 1e3

    # The whole panel, as after a real out-of-memory error: parse the message, read the probe,
    # who(), the diagnosis and both renderings.
    try:
        torch.empty(2**60)
    except RuntimeError as exc:
        message, tb = str(exc), exc.__traceback__
    record = CellRecord(9, None, "x = torch.empty(2**60)", time.time(), 0.1, error="RuntimeError",
                        error_message=message, host=HostRecord(2**30, 2**30, 2**30))
    probe = MemoryProbe()
    panel_times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        view = oom_panel(analyse(parse_oom(message), record, namespace=ns, records=[record], probe=probe, tb=tb))
        panel_times.append(time.perf_counter() - start)
    panel_median, panel_worst = statistics.median(panel_times) * 1e3, max(panel_times) * 1e3
    assert view.text.startswith("Out of memory on")

    print(report.summary())
    print()
    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"setup (build + train step + forward): {setup_s:.1f} s; torch {torch.__version__}, "
          f"Python {platform.python_version()}, {torch.get_num_threads()} threads")
    print()
    print("| namespace objects | model | input | parameters | storages | retained graph "
          "| who() median | who() worst | OOM panel median | OOM panel worst | runs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {len(ns):,} | ResNet-50 (hand-written) + Adam "
          f"| {args.batch}x3x{args.size}x{args.size} "
          f"| {n_params / 1e6:.1f}M | {report.tensor_count} "
          f"| {report.categories['retained_graphs'] / 2**20:.1f} MiB "
          f"| {median_ms:.1f} ms | {worst_ms:.1f} ms | {panel_median:.1f} ms | {panel_worst:.1f} ms "
          f"| {args.repeat} |")


if __name__ == "__main__":
    main()
