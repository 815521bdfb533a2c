"""Time of ``%load_ext ipy_gpumem`` with torch already imported, in fresh processes, against neighbours.

Each measurement is a new interpreter that imports torch and IPython, builds a shell, then times
only the load call; the median over ``--runs`` processes is reported.

    python benchmarks/bench_load.py [--runs 15]
"""
from __future__ import annotations

import argparse
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


def measure(load: str, runs: int):
    times = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", PROBE.format(load=load)], capture_output=True, text=True)
        if out.returncode != 0:
            return None, out.stderr.strip().splitlines()[-1] if out.stderr else "failed"
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return times, None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    print(f"{args.runs} fresh processes each, torch already imported\n")
    print("| tool | load, median | min | max |")
    print("|---|---:|---:|---:|")
    for name, load in TOOLS.items():
        times, err = measure(load, args.runs)
        if times is None:
            print(f"| {name} | unavailable: {err} | | |")
            continue
        print(f"| {name} | {statistics.median(times) * 1e3:.1f} ms | {min(times) * 1e3:.1f} ms | {max(times) * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
