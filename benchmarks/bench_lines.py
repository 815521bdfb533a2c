"""``%%gpumem --lines`` on loop-heavy cells against the same plain cell, in one process, in a shell and in a kernel.

Each cell runs plain, then under ``%%gpumem`` (whole-cell report), then under ``%%gpumem --lines``,
alternating for ``--repeat`` rounds; medians are reported with the ratio to the plain cell, and
the cost per marker two ways: (``--lines`` time - plain time) / markers executed (the hits the
record counts), and the time measured inside the markers themselves (precise where a cell's own
time varies by more than its markers cost). A marker runs before each executed statement of the cell's own code (not of the
functions it calls), so the cost depends on how many cell lines run, not on the work inside them.

``--kernel`` runs the same cells in a real ipykernel (through jupyter_client, timed from the
client: the message round trip is the same for both cells and cancels out), which is where
notebooks run them: a kernel process has more threads and a busier heap than a bare shell.

    python benchmarks/bench_lines.py [--repeat 5] [--kernel]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
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
MARKERS = "sum(line.hits for line in _bench_rec.lines)"
# Time spent inside the markers themselves, measured from inside (a cell's total time varies by
# more than the markers cost in a training loop): LineTracer.mark wrapped with a timer.
INSTRUMENT = (
    "import time as _t\n"
    "from ipy_gpumem.cell import lines as _lines\n"
    "_bench_inside = [0.0, 0]\n"
    "_bench_mark = _lines.LineTracer.mark\n"
    "def _bench_timed(self, lineno):\n"
    "    t0 = _t.perf_counter(); _bench_mark(self, lineno); _bench_inside[0] += _t.perf_counter() - t0\n"
    "    _bench_inside[1] += 1\n"
    "_lines.LineTracer.mark = _bench_timed\n"
)
INSIDE = "round(_bench_inside[0] / max(_bench_inside[1], 1) * 1e9)"  # ns per marker, over every run so far


class Shell:
    """The cells in this process's InteractiveShell."""

    def __init__(self):
        from IPython.core.interactiveshell import InteractiveShell

        self.ip = InteractiveShell.instance()
        self.run(SETUP)
        self.run("%load_ext ipy_gpumem")
        self.run(INSTRUMENT)

    def run(self, source) -> float:
        from IPython.utils.capture import capture_output

        with contextlib.redirect_stdout(io.StringIO()), capture_output():
            t0 = time.perf_counter()
            self.ip.run_cell(source, store_history=True)
            return time.perf_counter() - t0

    def value(self, expression):
        return int(self.ip.ev(expression))

    def close(self):
        self.run("%unload_ext ipy_gpumem")


class Kernel:
    """The cells in a real ipykernel of this interpreter, timed from the client."""

    def __init__(self):
        from jupyter_client.manager import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.kernel_spec.argv[0] = sys.executable  # this interpreter, whatever kernelspecs exist
        self.km.start_kernel()
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.run(SETUP)
        self.run("%load_ext ipy_gpumem")
        self.run(INSTRUMENT)

    def run(self, source) -> float:
        t0 = time.perf_counter()
        reply = self.kc.execute_interactive(source, timeout=600, output_hook=lambda msg: None)
        elapsed = time.perf_counter() - t0
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"cell failed in the kernel: {reply['content']}")
        return elapsed

    def value(self, expression):
        reply = self.kc.execute_interactive("", user_expressions={"v": expression}, timeout=60,
                                            output_hook=lambda msg: None)
        return int(reply["content"]["user_expressions"]["v"]["data"]["text/plain"])

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--kernel", action="store_true", help="run the cells in a real ipykernel")
    args = parser.parse_args()
    where = Kernel() if args.kernel else Shell()
    import IPython

    print(f"{'ipykernel' if args.kernel else 'InteractiveShell'}, IPython {IPython.__version__}, Python "
          f"{sys.version.split()[0]}, {args.repeat} rounds, medians")
    print("| cell | plain | %%gpumem | %%gpumem --lines | --lines / plain | markers | per marker (difference) "
          "| per marker (inside) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    try:
        for label, body in CELLS.items():
            plain, whole, lines = [], [], []
            for _ in range(args.repeat):
                where.run("%gpumem off")  # the plain cell: the hooks pay nothing measurable
                plain.append(where.run(body))
                where.run("%gpumem on")
                whole.append(where.run("%%gpumem\n" + body))
                lines.append(where.run("%%gpumem --lines -o _bench_rec\n" + body))
            where.run("_bench_inside[:] = [0.0, 0]")
            for _ in range(args.repeat):
                where.run("%%gpumem --lines -o _bench_rec\n" + body)
            inside = where.value(INSIDE) / 1e3
            markers = where.value(MARKERS)
            p, w, ln = statistics.median(plain), statistics.median(whole), statistics.median(lines)
            per = (ln - p) / markers if markers else float("nan")
            print(f"| {label} | {p * 1e3:.1f} ms | {w * 1e3:.1f} ms | {ln * 1e3:.1f} ms | {ln / p:.2f}x | "
                  f"{markers:,} | {per * 1e6:.1f} us | {inside:.1f} us |")
    finally:
        where.close()


if __name__ == "__main__":
    main()
