"""Per-cell hook cost inside a real Jupyter kernel: the kernel's own run_cell, timed from inside.

A first cell wraps the kernel shell's ``run_cell``/``run_cell_async`` and, once the tool is
loaded, the tool's registered hooks with timers; then nbclient executes the same trivial cell N
times, and a last cell reads the timings. Reported: the time in the tool's hooks per cell as a
share of the kernel's bare run_cell (the same cells before the tool was loaded).

    python benchmarks/bench_kernel_hooks.py [--cells 300]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

SETUP = r'''
import time, functools, statistics
_t = {"bare": [], "loaded": [], "hooks": 0.0, "phase": "bare", "depth": 0}
_ip = get_ipython()
def _timed(fn):
    if getattr(fn, "_bench", False):
        return fn
    @functools.wraps(fn)
    def run(*a, **k):
        # run_cell calls run_cell_async on IPython 8+: time only the outermost of the two
        _t["depth"] += 1
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _t["depth"] -= 1
            if _t["depth"] == 0:
                _t.setdefault(_t["phase"], []).append(time.perf_counter() - t0)
    run._bench = True
    return run
def _timed_async(fn):
    @functools.wraps(fn)
    async def run(*a, **k):
        _t["depth"] += 1
        t0 = time.perf_counter()
        try:
            return await fn(*a, **k)
        finally:
            _t["depth"] -= 1
            if _t["depth"] == 0:
                _t.setdefault(_t["phase"], []).append(time.perf_counter() - t0)
    return run
_ip.run_cell = _timed(_ip.run_cell)
_ip.run_cell_async = _timed_async(_ip.run_cell_async)
def _wrap_hooks(before):
    for ev in ("pre_run_cell", "post_run_cell"):
        cbs = _ip.events.callbacks[ev]
        for i, cb in enumerate(cbs):
            if cb not in before[ev]:
                def timed(*a, _cb=cb):
                    t0 = time.perf_counter()
                    try:
                        return _cb(*a)
                    finally:
                        _t["hooks"] += time.perf_counter() - t0
                cbs[i] = timed
'''

LOAD = r'''
_before = {ev: list(_ip.events.callbacks[ev]) for ev in ("pre_run_cell", "post_run_cell")}
%load_ext ipy_gpumem
_wrap_hooks(_before)
_t["phase"] = "loaded"
_t["loaded"].clear(); _t["hooks"] = 0.0
'''

REPORT = r'''
import json
_t["phase"] = "report"
print(json.dumps({"bare": _t["bare"], "loaded": _t["loaded"], "hooks": _t["hooks"]}))
'''


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", type=int, default=300)
    args = parser.parse_args()
    import nbformat
    from nbclient import NotebookClient

    cells = [SETUP, "import torch"] + ["x = 1"] * args.cells + [LOAD] + ["x = 1"] * args.cells + [REPORT]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = NotebookClient(nb, timeout=600, kernel_name="python3")
    client.km = client.create_kernel_manager()
    client.km.kernel_spec.argv[0] = sys.executable
    client.execute()
    data = json.loads(nb.cells[-1].outputs[0]["text"])
    bare = data["bare"][20:]  # skip the set-up cells and warm-up
    loaded = data["loaded"][20:]
    hooks_per_cell = data["hooks"] / max(len(data["loaded"]), 1)
    import IPython
    import ipykernel

    print(f"IPython {IPython.__version__}, ipykernel {ipykernel.__version__}, {args.cells} cells each\n")
    print("| kernel run_cell, bare (median) | with ipy_gpumem (median) | time in ipy_gpumem's hooks per cell | share of a bare cell |")
    print("|---:|---:|---:|---:|")
    b, l = statistics.median(bare), statistics.median(loaded)
    print(f"| {b * 1e6:.1f} us | {l * 1e6:.1f} us | {hooks_per_cell * 1e6:.2f} us | {hooks_per_cell / b * 100:.1f}% |")


if __name__ == "__main__":
    main()
