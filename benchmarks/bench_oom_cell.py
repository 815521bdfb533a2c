"""What an out-of-memory cell costs with the panel, against the same cell without the extension, in one shell.

Issue 17's scenario: the seed's state (a model, Adam after one step, the next forward's graph kept)
next to a 5M-item list and a numpy array of ``--gib`` GiB, then a cell that saves a checkpoint,
appends a log line, sleeps ``--sleep`` seconds (a slow data step) and dies of a real CPU
out-of-memory error. Timed from the cell's failure to ``run_cell``'s return (the traceback, the
panel, the record), with the extension unloaded and loaded, alternating, medians. The panel only
reads: the checkpoint and the log are checked to have been written once per run, never by it.

    python benchmarks/bench_oom_cell.py [--repeat 5] [--gib 3] [--sleep 2]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time

SETUP = """
import time, torch
from torch import nn
import numpy as np
model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
inputs, targets = torch.randn(256, 1024), torch.randint(0, 10, (256,))
loss = nn.functional.cross_entropy(model(inputs), targets)
optimizer.zero_grad(); loss.backward(); optimizer.step()
output = model(inputs)
loss = nn.functional.cross_entropy(output, targets)
big_list = list(range(5_000_000))
big_array = np.ones({gib} * 2**27)
"""

CELL = """
torch.save(model.state_dict(), ckpt_path)
with open(log_path, "a") as log:
    log.write("step\\n")
time.sleep({sleep})
failed_at = time.perf_counter()
scratch = torch.empty(2**40, 2**20)
"""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--gib", type=int, default=3)
    parser.add_argument("--sleep", type=float, default=2.0)
    args = parser.parse_args()
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    folder = tempfile.mkdtemp()
    ckpt, log = os.path.join(folder, "ckpt.pt"), os.path.join(folder, "train.log")
    ip.run_cell(SETUP.format(gib=args.gib))
    ip.user_ns.update(ckpt_path=ckpt, log_path=log)
    cell = CELL.format(sleep=args.sleep)

    def one(loaded: bool) -> float:
        if loaded:
            ip.run_line_magic("load_ext", "ipy_gpumem")
        shown = io.StringIO()
        with contextlib.redirect_stdout(shown), contextlib.redirect_stderr(io.StringIO()):
            result = ip.run_cell(cell)
        seconds = time.perf_counter() - ip.user_ns["failed_at"]
        assert "DefaultCPUAllocator" in str(result.error_in_exec), result.error_in_exec
        assert ("Out of memory on the host" in shown.getvalue()) == loaded, shown.getvalue()[-2000:]
        if loaded:
            ip.run_line_magic("unload_ext", "ipy_gpumem")
        return seconds

    plain, panel = [], []
    for _ in range(args.repeat):
        plain.append(one(False))
        panel.append(one(True))
    with open(log) as f:
        lines = f.read().count("\n")
    writes = "yes" if lines == 2 * args.repeat else f"no: {lines} log lines for {2 * args.repeat} runs"
    p, q = statistics.median(plain), statistics.median(panel)
    print(f"python {sys.version.split()[0]}; namespace: seed + 5M-item list + {args.gib} GiB numpy array; "
          f"the cell sleeps {args.sleep:g} s before it fails; {args.repeat} runs each, medians\n")
    print("| failure to run_cell's return | without ipy_gpumem | with the panel | panel's cost | log written once per run |")
    print("|---|---:|---:|---:|---|")
    print(f"| real CPU OOM | {p * 1e3:.1f} ms | {q * 1e3:.1f} ms | {(q - p) * 1e3:.1f} ms | {writes} |")


if __name__ == "__main__":
    main()
