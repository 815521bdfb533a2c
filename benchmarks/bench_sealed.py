"""What one sealed run costs (``ipy_gpumem.sealed.run_sealed``), next to a bare fork and a fresh interpreter.

A sealed run forks the user's process, seals the child (shims, seccomp filter) and brings its
result back on a pipe. Side by side in one process, each timed ``--repeat`` times (medians):
a bare ``os.fork()`` + ``waitpid`` of a child that exits at once, ``run_sealed(lambda: 1)``, and
``python -c pass`` (what a tool that runs the cell in a new interpreter pays before importing
anything), first with torch imported, then with 1 GiB of tensors in the process (fork copies page
tables, not pages: the cost grows with the mapped memory, not with what the child touches).

Then what the answer's safety costs, side by side in this process: an estimate's answer (a
GPT-2-sized step's 200,000 allocation events, its tables and notes) encoded and decoded as plain
data (what crosses the pipe: nothing in it can run code) next to ``pickle`` (what crossed before);
and, inside one sealed child, a system call the OS guard refuses (``mkdir`` from C) next to one it
lets through (``getpid``): the refused one waits for the parent to name it (the seccomp listener).

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
    del held
    _answer_table(args.repeat)
    _refusal_table()


def _estimate_answer(events=200_000):
    """An Estimate's plain form as estimate_here sends it back: the events dominate."""
    roles = {"cuda:0": {"parameters": 497_759_232, "gradients": 497_759_232, "optimizer_state": 995_518_464,
                        "activations": 6_442_450_944, "other_tensors": 65_536}}
    return {"device": "cuda:0", "gpu": "A100-80", "cublas_workspaces": 8_519_680, "peak_allocated": 9_000_000_000,
            "peak_reserved": 9_500_000_000, "start_allocated": 2_000_000_000, "fixed_costs": {"cuda_context": 440401920},
            "roles": roles, "phases": [{"phase": p, "step": s, "peak": 123456789, "roles": roles}
                                       for s in (1, 2) for p in ("forward", "backward", "optimizer")],
            "modules": [{"module": f"h.{i}", "type": "Block", "activations": 1 << 28, "calls": 2, "peak": 1 << 29}
                        for i in range(10)],
            "peak_step": 2, "peak_phase": "backward", "notes": ["a note"] * 5, "seconds": 1.1,
            "events": [(k, 4096 * (k % 97 + 1)) for k in range(events // 2)] + [(k, -1) for k in range(events // 2)]}


def _answer_table(repeat):
    import pickle

    from ipy_gpumem.preflight.result import Estimate
    from ipy_gpumem.sealed import plain

    est = Estimate(**{k: v for k, v in _estimate_answer().items()})
    marks = [(i, i % 7, 1 + i // 1000) for i in range(2000)]
    before = (est, marks, ("model", "optimizer", "inputs"))  # what crossed: objects, pickled
    now = (est.to_plain(), [n for m in marks for n in m], ["model", "optimizer", "inputs"])  # what crosses

    def as_plain():
        value = plain.decode(plain.encode((est.to_plain(), [n for m in marks for n in m], list(before[2]))))
        return Estimate.from_plain(value[0]), list(zip(value[1][0::3], value[1][1::3], value[1][2::3]))

    as_pickle = _median_ms(lambda: pickle.loads(pickle.dumps(before, pickle.HIGHEST_PROTOCOL)), repeat)
    plain_ms = _median_ms(as_plain, repeat)
    assert as_plain()[0].events == est.events
    size_pickle, size_plain = len(pickle.dumps(before, pickle.HIGHEST_PROTOCOL)), len(plain.encode(now))
    print("\n| an estimate's answer (200,000 events), child to parent | encode + decode + rebuild | bytes |")
    print("|---|---:|---:|")
    print(f"| pickle of the Estimate (before: it could run code) | {as_pickle:.1f} ms | {size_pickle:,} |")
    print(f"| plain data, Estimate rebuilt (now) | {plain_ms:.1f} ms ({plain_ms / as_pickle:.2f}x) | {size_plain:,} |")


def _refusal_table(calls=2000):
    import ctypes

    from ipy_gpumem.sealed import run_sealed

    def child():
        libc = ctypes.CDLL(None, use_errno=True)
        t0 = time.perf_counter()
        for _ in range(calls):
            libc.getpid()
        allowed = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(calls):
            libc.mkdir(b"/nonexistent-ipy-gpumem-bench", 0o755)
        refused = time.perf_counter() - t0
        return allowed / calls * 1e6, refused / calls * 1e6

    outcome = run_sealed(child, deadline_s=120)
    allowed, refused = outcome.value
    print(f"\n| inside a sealed child ({outcome.guard}) | per call |")
    print("|---|---:|")
    print(f"| getpid() from C, let through | {allowed:.2f} us |")
    print(f"| mkdir() from C, refused and named by the parent | {refused:.1f} us ({refused / allowed:.0f}x) |")
    print(f"| listed | {outcome.refused[0] if outcome.refused else 'nothing'} |")


if __name__ == "__main__":
    main()
