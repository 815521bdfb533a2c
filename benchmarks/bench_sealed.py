"""What one sealed run costs (``ipy_gpumem.sealed.run_sealed``), next to a bare fork and a fresh interpreter.

A sealed run forks the user's process, seals the child (shims, seccomp filter) and brings its
result back on a pipe. Side by side in one process, each timed ``--repeat`` times (medians):
a bare ``os.fork()`` + ``waitpid`` of a child that exits at once, ``run_sealed(lambda: 1)``, and
``python -c pass`` (what a tool that runs the cell in a new interpreter pays before importing
anything), first with torch imported, then with 1 GiB of tensors in the process (fork copies page
tables, not pages: the cost grows with the mapped memory, not with what the child touches).

    python benchmarks/bench_sealed.py [--repeat 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def _median_ms(fn, repeat):
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _bare_fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    import torch

    from ipy_gpumem.sealed import run_sealed

    def sealed():
        outcome = run_sealed(lambda: 1, deadline_s=30)
        assert outcome.ok and outcome.value == 1, outcome

    def interpreter():
        subprocess.run([sys.executable, "-c", "pass"], check=True)

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {args.repeat} runs each, medians\n")
    print("| process holds | bare fork + wait | run_sealed(lambda: 1) | sealed / bare fork | python -c pass |")
    print("|---|---:|---:|---:|---:|")
    held = []
    for label, gib in (("torch imported", 0), ("torch + 1 GiB of tensors", 1)):
        held.extend(torch.ones(2**28) for _ in range(gib))  # 2**28 float32 = 1 GiB, touched
        fork, seal, fresh = (_median_ms(f, args.repeat) for f in (_bare_fork, sealed, interpreter))
        print(f"| {label} | {fork:.2f} ms | {seal:.2f} ms | {seal / fork:.1f}x | {fresh:.1f} ms |")


if __name__ == "__main__":
    main()
