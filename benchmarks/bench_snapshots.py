"""Real GPU snapshots: read and replay time, the replay checked against each capture's end state, the estimate's allocator model against the real segments, and a large file.

    python benchmarks/bench_snapshots.py [--captures DIR] [--big-mb 300]

Captures default to tests/fixtures/snapshots (trimmed copies of ../shared/gpu-captures; the
numbers are the same, frames aside). The large file is made here, once per size, in /tmp: the
pickled events of a real capture (ZidongLiu, 23,105 events) repeated byte for byte until the file
is about --big-mb MB, framed as pickle frames it (so every copy reads as that capture's events do,
first-seen strings and stacks included). It is read in a fresh process each by a bare
``pickle.load`` (the alternative: reading it at all), by the streaming reader alone
(``load_snapshot``) and by ``ipy_gpumem.snapshot`` with ``to_dict()`` (read and replay), and each
process's time, peak RSS (VmHWM: ru_maxrss would carry this process's peak into the child) and
peak RSS over its RSS before reading are reported.
"""
import argparse
import gzip
import os
import pickle
import pickletools
import struct
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
            allocations = list(r.allocations)  # built on demand from columns: held here so id() stays theirs
            for a in allocations:
                if a.born < 0:
                    keys[id(a)] = len(keys)
                    events.append((keys[id(a)], a.requested))
            order = []
            for a in allocations:
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
def rss(field="VmHWM"):
    # Not ru_maxrss: Linux carries the parent's peak into it across fork and exec (this benchmark's
    # own process is a few hundred MB by now). VmHWM is this process's own peak, VmRSS its RSS now.
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))
if sys.argv[1] == "pickle.load":
    before = rss("VmRSS")
    t = time.perf_counter()
    with open(sys.argv[2], "rb") as fh:
        pickle.load(fh)
elif sys.argv[1] == "load_snapshot":
    from ipy_gpumem.snapshots.load import load_snapshot
    before = rss("VmRSS")
    t = time.perf_counter()
    load_snapshot(sys.argv[2])
else:
    import ipy_gpumem
    from ipy_gpumem.snapshots import view
    before = rss("VmRSS")
    t = time.perf_counter()
    ipy_gpumem.snapshot(sys.argv[2]).to_dict()
print(time.perf_counter() - t, rss(), before)
"""

_FRAME = 1 << 16


def _framed(ops):
    """Opcode bytes grouped into pickle frames of about 64 KiB, as the pickler writes them."""
    out, body = [], []
    size = 0
    for op in ops:
        body.append(op)
        size += len(op)
        if size >= _FRAME:
            out.append(b"\x95" + struct.pack("<Q", size) + b"".join(body))
            body, size = [], 0
    if body:
        out.append(b"\x95" + struct.pack("<Q", size) + b"".join(body))
    return b"".join(out)


def build_big(folder, megabytes):
    """A ~``megabytes`` MB snapshot in /tmp (kept for the next run): a real capture's events repeated byte for byte."""
    path = os.path.join(tempfile.gettempdir(), f"ipy_gpumem_snapshot_{int(megabytes)}mb.pickle")
    with gzip.open(os.path.join(folder, "ZidongLiu_memory.pickle.gz"), "rb") as fh:
        data = pickle.load(fh)
    events = len(data["device_traces"][0])
    data["device_traces"] = data.pop("device_traces")  # last: nothing after the copies refers back into the memo
    blob = pickle.dumps(data, protocol=4)
    found = [(op.name, arg, pos) for op, arg, pos in pickletools.genops(blob)]
    ends = [pos for _n, _a, pos in found[1:]] + [len(blob)]
    ops = [(name, arg, blob[pos:end]) for (name, arg, pos), end in zip(found, ends) if name != "FRAME"]
    key = next(i for i, (name, arg, _b) in enumerate(ops) if arg == "device_traces")
    first = next(i for i in range(key, len(ops)) if ops[i][0] == "MARK") + 1  # the trace's first event
    assert [n for n, _a, _b in ops[-4:]] == ["APPENDS", "APPEND", "SETITEMS", "STOP"]
    region = _framed([b for _n, _a, b in ops[first:-4]])
    copies = max(1, int(megabytes * 2**20 / len(region)))
    if not (os.path.exists(path) and os.path.getsize(path) > copies * len(region)):
        with open(path, "wb") as fh:
            fh.write(ops[0][2] + _framed([b for _n, _a, b in ops[1:first]]))
            for _ in range(copies):
                fh.write(region)
            fh.write(_framed([b for _n, _a, b in ops[-4:]]))
    return path, copies * events


def big_file(folder, megabytes):
    path, events = build_big(folder, megabytes)
    size = os.path.getsize(path)
    print(f"A real capture's events repeated to {size / 2**20:.0f} MB ({size:,} bytes), {events:,} events, in {path}")
    print()
    print("| reader | time | per 100 MB | peak RSS of the process | peak RSS over RSS before reading |")
    print("|---|---|---|---|---|")
    rows = {}
    for reader in ("pickle.load", "load_snapshot", "ipy_gpumem"):
        out = subprocess.run([sys.executable, "-c", _CHILD, reader, path], capture_output=True, text=True,
                             cwd=os.path.dirname(HERE))
        if out.returncode != 0:
            print(f"| {reader} | failed: {(out.stderr.strip().splitlines() or ['?'])[-1]} | | | |")
            continue
        seconds, rss, before = out.stdout.split()
        seconds, rss, before = float(seconds), int(rss), int(before)
        rows[reader] = (seconds, rss, rss - before)
        name = {"ipy_gpumem": "ipy_gpumem.snapshot + to_dict (read and replay)",
                "load_snapshot": "load_snapshot (the streaming reader alone)"}.get(reader, reader)
        print(f"| {name} | {seconds:.1f} s | {seconds * 100 * 2**20 / size:.2f} s | {b(rss)} | {b(rss - before)} "
              f"({(rss - before) / size:.2f}x the file) |")
    if "ipy_gpumem" in rows and "pickle.load" in rows:
        print()
        print(f"ipy_gpumem / pickle.load: {rows['ipy_gpumem'][0] / rows['pickle.load'][0]:.2f}x time, "
              f"{rows['ipy_gpumem'][2] / rows['pickle.load'][2]:.2f}x the memory it adds; "
              f"{rows['ipy_gpumem'][2] / events:.0f} bytes per event")


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
