"""Time of ``%load_ext ipy_gpumem`` with torch already imported, in fresh processes, against neighbours.

Each measurement is a new interpreter that imports torch and IPython, builds a shell, then times
only the load call; the median over ``--runs`` processes is reported. Two settings: with the
bytecode cache (as after ``pip install``, which compiles ``.pyc`` files; one warm-up process
writes them) and without it (``PYTHONDONTWRITEBYTECODE=1``, every module compiled from source).

    python benchmarks/bench_load.py [--runs 15]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

PROBE = r"""
import time, sys, types
import torch
from IPython.core.interactiveshell import InteractiveShell
ip = InteractiveShell.instance()
ip.kernel = types.SimpleNamespace(shell=ip)  # ipyexperiments expects a kernel; harmless for the others
t0 = time.perf_counter()
{load}
print(time.perf_counter() - t0)
"""

TOOLS = {
    "ipy_gpumem": "ip.run_line_magic('load_ext', 'ipy_gpumem')",
    "ipython_memory_usage": "ip.run_line_magic('load_ext', 'ipython_memory_usage'); ip.run_line_magic('imu_start', '')",
    "ipyexperiments": "from ipyexperiments import IPyExperimentsCPU; exp = IPyExperimentsCPU()",
}


def measure(load: str, runs: int, bytecode: bool):
    env = dict(os.environ)
    if bytecode:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        subprocess.run([sys.executable, "-c", PROBE.format(load=load)], capture_output=True, env=env)  # writes .pyc
    else:
        # An empty cache directory and -B: nothing cached is read, nothing is written.
        import tempfile

        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="bench-load-nocache-")
    times = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-B" if not bytecode else "-c", *(["-c"] if not bytecode else []),
                              PROBE.format(load=load)], capture_output=True, text=True, env=env)
        if out.returncode != 0:
            return None, out.stderr.strip().splitlines()[-1] if out.stderr else "failed"
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return times, None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    print(f"{args.runs} fresh processes each, torch already imported\n")
    print("| tool | bytecode cache | load, median | min | max |")
    print("|---|---|---:|---:|---:|")
    for bytecode in (True, False):
        for name, load in TOOLS.items():
            times, err = measure(load, args.runs, bytecode)
            cache = "yes (.pyc)" if bytecode else "no (compiled from source)"
            if times is None:
                print(f"| {name} | {cache} | unavailable: {err} | | |")
                continue
            print(f"| {name} | {cache} | {statistics.median(times) * 1e3:.1f} ms | {min(times) * 1e3:.1f} ms "
                  f"| {max(times) * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
