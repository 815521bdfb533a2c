"""Per-cell hook cost inside a real Jupyter kernel: the kernel's own run_cell, timed from inside.

A first cell wraps the kernel shell's ``run_cell``/``run_cell_async`` and, once the tool is
loaded, the tool's registered hooks with timers; then a jupyter_client executes the same trivial
cell N times without and N times with the extension, and a last cell reads the timings.
Reported: the time in the tool's hooks per cell as a share of the kernel's bare run_cell (the
same cells before the tool was loaded), and of the request-to-idle round trip the client sees.

    python benchmarks/bench_kernel_hooks.py [--cells 300] [--model] [--gap MS]

With ``--model`` the namespace holds a 20-layer MLP with Adam after one step (80 parameter and
state tensors and their gradients) before any cell is timed: the end-of-cell census then has work
to do, and the kernel defers it to the event loop's idle time (after the hooks), so it shows in
the client's round trip, if anywhere, not in the hooks' time. ``--gap`` waits that many
milliseconds between cells, as a person does: then the census runs while the kernel is idle.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

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
# the census, wherever it runs (the idle time after a cell, or the next cell's start)
from ipy_gpumem.extension import current_magics as _cm
_anatomy = _cm().watcher.anatomy
_census_real = _anatomy.census
_t["census"] = [0.0, 0]
def _census_timed(*a, **k):
    t0 = time.perf_counter()
    try:
        return _census_real(*a, **k)
    finally:
        _t["census"][0] += time.perf_counter() - t0
        _t["census"][1] += 1
_anatomy.census = _census_timed
_t["phase"] = "loaded"
'''

MODEL = r'''
import torch
_layers = [torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)]
for _ in range(20):
    _layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
mlp = torch.nn.Sequential(*_layers)
batch = torch.randn(64, 256)
opt = torch.optim.Adam(mlp.parameters())
mlp(batch).square().mean().backward()
opt.step()
del _layers
'''

REPORT = r'''
import json
_t["phase"] = "report"
print(json.dumps({"bare": _t["bare"], "loaded": _t["loaded"], "hooks": _t["hooks"], "census": _t["census"]}))
'''


def _run(kc, code, timeout=120):
    """Execute ``code`` and wait for its idle; return (seconds from request to idle, stdout text)."""
    t0 = time.perf_counter()
    msg_id = kc.execute(code)
    out = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return time.perf_counter() - t0, "".join(out)


def _cell(kc, gap_ms):
    """One timed ``x = 1`` round trip, then ``gap_ms`` of the client's think time (not timed)."""
    seconds = _run(kc, "x = 1")[0]
    if gap_ms:
        time.sleep(gap_ms / 1e3)
    return seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", type=int, default=300)
    parser.add_argument("--model", action="store_true", help="a 20-layer MLP with Adam in the namespace")
    parser.add_argument("--gap", type=float, default=0.0, help="milliseconds between cells (default 0)")
    args = parser.parse_args()
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    km.kernel_spec.argv[0] = sys.executable
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=120)
    try:
        _run(kc, SETUP)
        _run(kc, MODEL if args.model else "import torch")
        for _ in range(20):
            _run(kc, "x = 1")
        bare_rt = [_cell(kc, args.gap) for _ in range(args.cells)]
        _run(kc, LOAD)
        for _ in range(20):
            _run(kc, "x = 1")
        _run(kc, '_t["loaded"].clear(); _t["hooks"] = 0.0; _t["census"][:] = [0.0, 0]')
        loaded_rt = [_cell(kc, args.gap) for _ in range(args.cells)]
        _, text = _run(kc, REPORT)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    data = json.loads(text)
    bare = data["bare"][30:]  # the timed bare cells (set-up and warm-up cells are first)
    loaded = data["loaded"][1:]  # after the clear, minus the clearing cell itself
    hooks_per_cell = data["hooks"] / max(len(data["loaded"]), 1)
    import IPython
    import ipykernel

    b, l = statistics.median(bare), statistics.median(loaded)
    rb, rl = statistics.median(bare_rt), statistics.median(loaded_rt)
    held = "a 20-layer MLP with Adam" if args.model else "torch imported, no tensors"
    print(f"IPython {IPython.__version__}, ipykernel {ipykernel.__version__}, {args.cells} cells `x = 1` each; "
          f"namespace: {held}; {args.gap:g} ms between cells\n")
    print("| measure | bare | with ipy_gpumem | time in ipy_gpumem's hooks per cell | share |")
    print("|---|---:|---:|---:|---:|")
    print(f"| kernel's run_cell (median) | {b * 1e6:.1f} us | {l * 1e6:.1f} us | {hooks_per_cell * 1e6:.2f} us "
          f"| {hooks_per_cell / b * 100:.1f}% of a bare run_cell |")
    print(f"| request to idle, seen by the client (median) | {rb * 1e3:.2f} ms | {rl * 1e3:.2f} ms | "
          f"{hooks_per_cell * 1e6:.2f} us | {hooks_per_cell / rb * 100:.1f}% of a bare round trip |")
    seconds, counts = data["census"]
    print(f"\nthe census: {counts} counts, {seconds / max(counts, 1) * 1e6:.1f} us each (in the hooks or in "
          "the idle time after a cell)")


if __name__ == "__main__":
    main()
