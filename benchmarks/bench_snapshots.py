"""Real GPU snapshots: read and replay time, the replay checked against each capture's end state, the estimate's allocator model against the real segments, and a large file.

    python benchmarks/bench_snapshots.py [--captures DIR] [--big-mb 300] [--before DIR] [--rounds 2]
    python benchmarks/bench_snapshots.py --big-only --big-mb 1024 --before /tmp/before --what replay

Captures default to tests/fixtures/snapshots (trimmed copies of ../shared/gpu-captures; the
numbers are the same, frames aside). The large file is made here, once per size, in /tmp: a real
capture (ZidongLiu, 23,105 events, 61 segments) scaled up, its copies side by side in address
and one after another in time, so that the replay lands exactly on the file's end state (see
``build_big``). It is read in fresh processes, by this code and, with ``--before DIR`` (a folder
holding an older ``ipy_gpumem``: ``git archive <commit> ipy_gpumem | tar -x -C DIR``), by that
one, alternately (ABBA) from this one run: ``load_snapshot`` alone (read) and
``ipy_gpumem.snapshot(...).to_dict()`` (read and replay). Each process reports its time and its
peak RSS (VmHWM: ru_maxrss would carry this process's peak into the child) over its RSS before
reading.
"""
import argparse
import gzip
import io
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


#: Each copy of the capture lives this far above the previous one (its addresses span under 2**36).
_SHIFT = 1 << 40


def _shifted(seg, c):
    out = dict(seg, address=seg["address"] + c * _SHIFT)
    out["blocks"] = [dict(b, address=b["address"] + c * _SHIFT) for b in seg["blocks"]]
    return out


def _ref(index):
    return b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)


def _int(value):
    data = pickle.encode_long(value)
    return b"\x8a" + bytes([len(data)]) + data


def _frame(data):
    return b"\x95" + struct.pack("<Q", len(data)) + data


class _Copies:
    """The capture's events written again as torch's pickler writes them, continuing a pickle whose
    memo is known: first-seen stacks and strings were written by the first copy, so each event
    refers to them; its own dict, fresh strings ("N/A") and frames list are new memo entries; a
    frames list shared by two events (an allocation and its free) is written once per copy and
    referred to after. Each event is laid out once; a copy only rewrites its numbers."""

    def __init__(self, events, memo, count):
        self.start = count
        self.parts = []  # per event: fixed bytes, then (what, value) to write after each
        lists = {}
        n = count
        for e in events:
            fixed, slots = [b"}\x94("], []
            n += 1
            for key, value in e.items():
                fixed.append(_ref(memo[id(key)]))
                if type(value) is int:
                    if key in ("addr", "time_us"):
                        slots.append((key, value))
                        fixed.append(b"")
                    else:
                        fixed.append(_int(value))
                elif type(value) is str:
                    if key == "action":
                        fixed.append(_ref(memo[id(value)]))
                    else:  # torch writes these afresh in every event
                        data = value.encode()
                        fixed.append(b"\x8c" + bytes([len(data)]) + data + b"\x94")
                        n += 1
                elif type(value) is list:  # frames
                    if id(value) in lists:
                        slots.append(("ref", lists[id(value)] - count))
                        fixed.append(b"")
                        continue
                    lists[id(value)] = n
                    n += 1
                    refs = [_ref(memo[id(f)]) for f in value]
                    body = refs[0] + b"a" if len(refs) == 1 else b"".join(
                        b"(" + b"".join(refs[i:i + 1000]) + b"e" for i in range(0, len(refs), 1000))
                    fixed.append(b"]\x94" + body)
                else:
                    raise ValueError(f"an event value of type {type(value).__name__}")
            fixed.append(b"u")
            self.parts.append((fixed, slots))
        self.per_copy = n - count  # memo entries each copy makes

    def write(self, c, span, out):
        base = self.start + (c - 1) * self.per_copy
        body = []
        for k, (fixed, slots) in enumerate(self.parts):
            if k % 1000 == 0:
                body.append(b"e(" if k else b"(")
            if not slots:
                body.extend(fixed)
                continue
            it = iter(slots)
            for piece in fixed:
                if piece:
                    body.append(piece)
                    continue
                what, value = next(it)
                body.append(_int(value + c * _SHIFT) if what == "addr" else _int(value + c * span)
                            if what == "time_us" else b"j" + struct.pack("<I", base + value))
            if len(body) > 4096:
                out.write(_frame(b"".join(body)))
                body = []
        body.append(b"e")
        out.write(_frame(b"".join(body)))


def build_big(folder, megabytes):
    """A ~``megabytes`` MB snapshot in /tmp (kept for the next run): a real capture scaled up, replayable.

    The ZidongLiu capture (23,105 events, 61 segments, 2025 format) is copied as many times as the
    size asks: copy ``c`` has the capture's segments and events with every address moved up by
    ``c`` TiB and every time after the previous copy's, so the copies never touch and the replay
    must land on the file's end state exactly, as on the capture. The first copy is pickled by
    Python's pickler; the others continue it as torch's pickler would write a longer recording
    of the same program (see :class:`_Copies`)."""
    path = os.path.join(tempfile.gettempdir(), f"ipy_gpumem_scaled_{int(megabytes)}mb.pickle")
    with gzip.open(os.path.join(folder, "ZidongLiu_memory.pickle.gz"), "rb") as fh:
        data = pickle.load(fh)
    events = data["device_traces"][0]
    span = events[-1]["time_us"] - events[0]["time_us"] + 1_000_000
    per_copy = 100 * len(events)  # bytes of events per copy, about; the segments add 1%
    copies = max(1, int(megabytes * 2**20 / per_copy))
    if os.path.exists(path) and os.path.getsize(path) > 0.9 * copies * per_copy:
        return path, copies * len(events), copies
    segments = data.pop("segments")
    traces = data.pop("device_traces")
    scaled = {"segments": [_shifted(seg, c) for c in range(copies) for seg in segments]}
    scaled.update(data)
    scaled["device_traces"] = traces  # last: the other copies' events follow the first's
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=4)
    pickler.dump(scaled)
    memo = {key: index for key, (index, _obj) in pickler.memo.copy().items()}
    blob = buf.getvalue()
    assert blob.endswith(b"eau."), blob[-8:]  # the trace's last APPENDS, APPEND to the traces, SETITEMS, STOP
    pos, last = 2, 2  # the pickler's frames lie back to back: find the last one, to cut its tail off
    while pos < len(blob):
        assert blob[pos] == 0x95
        last = pos
        pos += 9 + struct.unpack("<Q", blob[pos + 1:pos + 9])[0]
    copier = _Copies(events, memo, len(memo))
    with open(path, "wb") as fh:
        fh.write(blob[:last] + _frame(blob[last + 9:-3]))
        for c in range(1, copies):
            copier.write(c, span, fh)
        fh.write(_frame(b"au."))
    return path, copies * len(events), copies


_CHILD = r"""
import sys, time
if sys.argv[3] != "-":
    sys.path.insert(0, sys.argv[3])  # the code before the change (a git archive of it)
def rss(field="VmHWM"):
    # Not ru_maxrss: Linux carries the parent's peak into it across fork and exec (this benchmark's
    # own process is a few hundred MB by now). VmHWM is this process's own peak, VmRSS its RSS now.
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))
import ipy_gpumem
from ipy_gpumem.snapshots import view  # noqa: F401 - imported before measuring, as the extension has it
before = rss("VmRSS")
t, cpu = time.perf_counter(), time.process_time()
if sys.argv[1] == "read":
    from ipy_gpumem.snapshots.load import load_snapshot
    load_snapshot(sys.argv[2])
    check = "-"
else:
    report = ipy_gpumem.snapshot(sys.argv[2])
    report.to_dict()
    c = report.replay().check
    check = f"{c.exact}/{c.blocks},{'exact' if c.ok else 'OFF'},{c.anomalies}"
print(time.perf_counter() - t, time.process_time() - cpu, rss(), before, check)
"""


def _child(what, path, code):
    out = subprocess.run([sys.executable, "-c", _CHILD, what, path, code], capture_output=True, text=True,
                         cwd=os.path.dirname(HERE))
    if out.returncode != 0:
        raise RuntimeError((out.stderr.strip().splitlines() or ["?"])[-1])
    seconds, cpu, peak, before, check = out.stdout.split()
    return float(seconds), float(cpu), int(peak) - int(before), check


def big_file(folder, megabytes, before, rounds, whats=("read", "replay")):
    """The scaled capture read by the code before the change (``before``: a folder holding its
    ``ipy_gpumem``) and by this one, alternately in fresh processes (ABBA), from one run."""
    path, events, copies = build_big(folder, megabytes)
    size = os.path.getsize(path)
    print(f"The ZidongLiu capture scaled {copies} times to {size / 2**20:.0f} MB ({size:,} bytes): {events:,} events, "
          f"{61 * copies:,} segments, in {path}")
    print()
    codes = [("before", before), ("after", "-")] if before else [("after", "-")]
    results = {}
    order = []
    for r in range(rounds):
        order += codes if r % 2 == 0 else codes[::-1]
    for label, code in order:
        for what in whats:
            results.setdefault((label, what), []).append(_child(what, path, code))
    print("| code | what | time, wall (each round) | CPU time (each round) | peak RSS over RSS before reading | replay check |")
    print("|---|---|---|---|---|---|")
    for (label, what), runs in results.items():
        times = ", ".join(f"{t:.1f} s" for t, _u, _m, _c in runs)
        cpus = ", ".join(f"{u:.1f} s" for _t, u, _m, _c in runs)
        mems = ", ".join(f"{b(m)} ({m / size:.2f}x)" for _t, _u, m, _c in runs)
        name = "read (load_snapshot)" if what == "read" else "read + replay (snapshot().to_dict())"
        print(f"| {label} | {name} | {times} | {cpus} | {mems} | {runs[-1][3]} |")
    if before:
        for what in whats:
            t0 = min(t for t, _u, _m, _c in results[("before", what)])
            t1 = min(t for t, _u, _m, _c in results[("after", what)])
            u0 = min(u for _t, u, _m, _c in results[("before", what)])
            u1 = min(u for _t, u, _m, _c in results[("after", what)])
            m0 = max(m for _t, _u, m, _c in results[("before", what)])
            m1 = max(m for _t, _u, m, _c in results[("after", what)])
            print(f"\n{what}: after / before = {t1 / t0:.2f}x the wall time and {u1 / u0:.2f}x the CPU time (best of "
                  f"each), {m1 / m0:.2f}x the memory (worst of each); after: {m1 / size:.2f}x the file, "
                  f"{m1 / events:.0f} bytes per event")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--captures", default=os.path.join(os.path.dirname(HERE), "tests", "fixtures", "snapshots"))
    parser.add_argument("--big-mb", type=float, default=300)
    parser.add_argument("--before", default="", help="a folder holding the ipy_gpumem to compare with "
                        "(git archive <commit> ipy_gpumem | tar -x -C FOLDER)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--big-only", action="store_true")
    parser.add_argument("--what", default="read,replay", help="read, replay (read and replay) or both, comma-separated")
    args = parser.parse_args()
    if args.big_only:
        big_file(args.captures, args.big_mb, args.before, args.rounds, tuple(args.what.split(",")))
        return
    captures_table(args.captures)
    print()
    model_table(args.captures)
    print()
    if args.big_mb > 0:
        big_file(args.captures, args.big_mb, args.before, args.rounds, tuple(args.what.split(",")))


if __name__ == "__main__":
    main()
