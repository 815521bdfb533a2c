"""Real GPU snapshots: read and replay time, the replay checked against each capture's end state, the estimate's allocator model against the real segments, and a large file.

    python benchmarks/bench_snapshots.py [--captures DIR] [--big-mb 300]

Captures default to tests/fixtures/snapshots (trimmed copies of ../shared/gpu-captures; the
numbers are the same, frames aside). The large file is made here: a real capture's events
repeated until the pickle is about --big-mb MB; it is read in a fresh process, once with
``ipy_gpumem.snapshot`` and once with a bare ``pickle.load`` (the alternative: reading it at all),
and each process's peak RSS is reported.
"""
import argparse
import gzip
import os
import pickle
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from ipy_gpumem.core.units import format_bytes as b  # noqa: E402
from ipy_gpumem.preflight.allocator import replay as model_replay  # noqa: E402
from ipy_gpumem.snapshots import read_snapshot  # noqa: E402
from ipy_gpumem.snapshots.load import load_snapshot  # noqa: E402
from ipy_gpumem.snapshots.replay import rounder  # noqa: E402


def pct(a, b_):
    return f"{100.0 * (a - b_) / b_:+.2f}%" if b_ else "n/a"


def captures_table(folder):
    print("| capture | format | events | read + replay | block sizes inferred, exact | end state | peak allocated "
          "| counting requests instead | peak reserved |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in sorted(os.listdir(folder)):
        if ".pickle" not in name:
            continue
        t0 = time.perf_counter()
        report = read_snapshot(os.path.join(folder, name))
        dt = time.perf_counter() - t0
        for d, r in sorted(report.replays.items()):
            peak, at = r.peak()
            round_size = rounder(report.settings)
            req = sum(round_size(a.requested) for a in r.live_at(at)) if at >= 0 else peak
            c = r.check
            print(f"| {name.split('.')[0]} cuda:{d} | {report.generation.split()[0]} | {r.events} | {dt * 1000:.0f} ms "
                  f"| {c.exact}/{c.blocks} | {'exact' if c.ok else 'OFF'} | {b(peak)} | {pct(req, peak)} "
                  f"| {b(r.peak('reserved')[0])} |")


def model_table(folder):
    print("| capture | events | peak reserved, real | model | error | reserved over time: largest gap (of the real peak) |")
    print("|---|---|---|---|---|---|")
    for name in sorted(os.listdir(folder)):
        if ".pickle" not in name:
            continue
        report = read_snapshot(os.path.join(folder, name))
        for d, r in sorted(report.replays.items()):
            if r.events < 100 or r.expandable:
                continue
            # The model starts empty: give it the blocks in place when recording began, then the trace.
            events, keys = [], {}
            for a in r.allocations:
                if a.born < 0:
                    keys[id(a)] = len(keys)
                    events.append((keys[id(a)], a.requested))
            order = []
            for a in r.allocations:
                if a.born >= 0:
                    order.append((a.born, 0, a))
                if a.gone is not None:
                    order.append((a.gone, 1, a))
            trace_index = []
            for i, kind, a in sorted(order, key=lambda x: (x[0], x[1])):
                if kind == 0:
                    keys[id(a)] = len(keys)
                    events.append((keys[id(a)], a.requested))
                else:
                    events.append((keys[id(a)], -1))
                trace_index.append(i)
            out = model_replay(events)
            real_peak = r.peak("reserved")[0]
            base = len(events) - len(trace_index)
            gap = 0
            for k, i in enumerate(trace_index):
                gap = max(gap, abs(out.reserved[base + k] - r.reserved[i]))
            print(f"| {name.split('.')[0]} cuda:{d} | {r.events} | {b(real_peak)} | {b(out.peak_reserved)} "
                  f"| {pct(out.peak_reserved, real_peak)} | {b(gap)} ({100.0 * gap / real_peak:.1f}%) |")


_CHILD = r"""
import resource, sys, time, pickle
t = time.perf_counter()
if sys.argv[1] == "ipy_gpumem":
    import ipy_gpumem
    r = ipy_gpumem.snapshot(sys.argv[2])
    peak = r.to_dict()["peak_allocated"]
else:
    with open(sys.argv[2], "rb") as fh:
        pickle.load(fh)
    peak = None
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, peak)
"""


def big_file(folder, megabytes):
    with gzip.open(os.path.join(folder, "ZidongLiu_memory.pickle.gz"), "rb") as fh:
        data = pickle.load(fh)
    trace = data["device_traces"][0]
    one = len(pickle.dumps(data, protocol=4))
    copies = max(1, int(megabytes * 2**20 / one))
    data["device_traces"][0] = [dict(e) for _ in range(copies) for e in trace]  # fresh dicts: no memo sharing
    with tempfile.NamedTemporaryFile(suffix=".pickle", delete=False) as fh:
        pickle.dump(data, fh, protocol=4)
        path = fh.name
    size = os.path.getsize(path)
    del data
    print(f"A real capture's events repeated {copies} times: {size / 2**20:.0f} MB, {copies * len(trace):,} events")
    print()
    print("| reader | time | peak RSS of the process |")
    print("|---|---|---|")
    rows = {}
    for reader in ("pickle.load", "ipy_gpumem"):
        out = subprocess.run([sys.executable, "-c", _CHILD, reader, path], capture_output=True, text=True,
                             cwd=os.path.dirname(HERE))
        if out.returncode != 0:
            print(f"| {reader} | failed: {out.stderr.strip().splitlines()[-1]} | |")
            continue
        seconds, rss, _ = out.stdout.split()
        rows[reader] = (float(seconds), int(rss))
        print(f"| {reader} | {float(seconds):.1f} s | {b(int(rss))} |")
    if len(rows) == 2:
        print()
        print(f"ipy_gpumem / pickle.load: {rows['ipy_gpumem'][0] / rows['pickle.load'][0]:.2f}x time, "
              f"{rows['ipy_gpumem'][1] / rows['pickle.load'][1]:.2f}x peak RSS")
    os.unlink(path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--captures", default=os.path.join(os.path.dirname(HERE), "tests", "fixtures", "snapshots"))
    parser.add_argument("--big-mb", type=float, default=300)
    args = parser.parse_args()
    captures_table(args.captures)
    print()
    model_table(args.captures)
    print()
    if args.big_mb > 0:
        big_file(args.captures, args.big_mb)


if __name__ == "__main__":
    main()
