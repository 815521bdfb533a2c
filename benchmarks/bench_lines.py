"""``%%gpumem --lines`` on loop-heavy cells against the same plain cell, in one process.

Each cell runs plain, then under ``%%gpumem`` (whole-cell report), then under ``%%gpumem --lines``,
alternating for ``--repeat`` rounds; medians are reported with the ratio to the plain cell. The
line tracer runs a Python callback on every line of the cell's own code (not of the functions it
calls), so the cost depends on how many cell lines run, not on the work inside them.

    python benchmarks/bench_lines.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time

CELLS = {
    "tight Python loop (200k lines)": "acc = 0\nfor i in range(100_000):\n    acc += i\n",
    "torch CPU training loop (50 steps)": (
        "for step in range(50):\n"
        "    out = model(x)\n"
        "    loss = out.square().mean()\n"
        "    opt.zero_grad()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
    ),
}
SETUP = (
    "import torch\n"
    "model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
    "x = torch.randn(64, 512)\n"
)


def timed(ip, source):
    with contextlib.redirect_stdout(io.StringIO()):
        from IPython.utils.capture import capture_output

        with capture_output():
            t0 = time.perf_counter()
            ip.run_cell(source, store_history=True)
            return time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_cell(SETUP)
    print("| cell | plain | %%gpumem | %%gpumem --lines | --lines / plain |")
    print("|---|---:|---:|---:|---:|")
    for label, body in CELLS.items():
        plain, whole, lines = [], [], []
        ip.run_line_magic("load_ext", "ipy_gpumem")
        for _ in range(args.repeat):
            with contextlib.redirect_stdout(io.StringIO()):
                ip.run_line_magic("gpumem", "off")  # the plain cell: hooks pay nothing measurable
            plain.append(timed(ip, body))
            with contextlib.redirect_stdout(io.StringIO()):
                ip.run_line_magic("gpumem", "on")
            whole.append(timed(ip, "%%gpumem\n" + body))
            lines.append(timed(ip, "%%gpumem --lines\n" + body))
        ip.run_line_magic("unload_ext", "ipy_gpumem")
        p, w, ln = statistics.median(plain), statistics.median(whole), statistics.median(lines)
        print(f"| {label} | {p * 1e3:.1f} ms | {w * 1e3:.1f} ms | {ln * 1e3:.1f} ms | {ln / p:.2f}x |")


if __name__ == "__main__":
    main()
