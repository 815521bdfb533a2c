"""``parse_oom`` on typical messages and on the worst 1 MiB inputs found for it (target: at most 20 ms).

Each input is parsed ``--repeat`` times after one warm-up call; the table gives the median and the
slowest call, and what the parser found (kind, or "-" for nothing). The adversarial inputs are 1 MiB
of one repeated fragment (alone, and with a real message in the middle), random text, logs with a
message in the middle, and text that takes the whole-text clean-up path at its largest (128 KiB).
Every text is also timed as UTF-8 ``bytes`` where that is how the extension could receive it.

    python benchmarks/bench_parse.py [--repeat 7] [--parser PATH] [--only SUBSTRING]

``--parser`` times the ``parse_oom`` of another copy of ``ipy_gpumem/oom/parse.py``, for a before/after
comparison on the same machine and inputs, e.g. the previous version:

    git show HEAD~1:ipy_gpumem/oom/parse.py > /tmp/parse_before.py
    python benchmarks/bench_parse.py --parser /tmp/parse_before.py
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MiB = 1 << 20

V5 = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB. GPU 1 has a total capacity of "
    "79.15 GiB of which 1.12 GiB is free. Process 1623 has 30.02 GiB memory in use. Including non-PyTorch "
    "memory, this process has 47.99 GiB memory in use. Of the allocated memory 45.17 GiB is allocated by "
    "PyTorch, and 2.01 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large "
    "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation "
    "for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
V2 = (
    "RuntimeError: CUDA out of memory. Tried to allocate 2.87 GiB (GPU 0; 14.76 GiB total capacity; 8.77 GiB "
    "already allocated; 2.54 GiB free; 13.71 GiB reserved in total by PyTorch)"
)
JUPYTER = (
    "\x1b[0;31m---------------------------------------------------------------------------\x1b[0m\n"
    "\x1b[0;31mOutOfMemoryError\x1b[0m                          Traceback (most recent call last)\n"
    "Cell \x1b[0;32mIn[7], line 3\x1b[0m\n"
    "\x1b[0;32m----> 3\x1b[0m y \x1b[38;5;241m=\x1b[39m model(x)\n\n"
    "\x1b[0;31mOutOfMemoryError\x1b[0m: " + V5[len("torch.OutOfMemoryError: "):] + "\n"
)
FRAME = ('  File "/opt/conda/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1773, in '
         "_wrapped_call_impl\n    return self._call_impl(*args, **kwargs)\n")


def fill(piece: str, size: int) -> str:
    return (piece * (size // len(piece) + 1))[:size]


def log(size: int) -> str:
    """A training log: varied lines with single spaces, no out-of-memory message."""
    out, total, i = [], 0, 0
    while total < size:
        line = (f"2024-05-01 10:{i // 60 % 60:02d}:{i % 60:02d},{i % 1000:03d} INFO train.py:88 step {i} loss "
                f"0.{(i * 7919) % 10000:04d} lr 3e-4 gpu memory allocated {i % 80}.{i % 100:02d} GiB")
        out.append(line)
        total += len(line) + 1
        i += 1
    return "\n".join(out)[:size]


def middle(piece: str, message: str = V5) -> str:
    half = MiB // 2
    return fill(piece, half) + "\n" + message + "\n" + fill(piece, MiB - half - len(message) - 2)


def inputs():
    """(name, text) pairs: typical first, then the worst found, each at most 1 MiB."""
    rnd = random.Random(1)
    yield "v5 message alone", V5
    yield "v2 message alone", V2
    yield "Jupyter traceback (ANSI)", JUPYTER
    yield "v5 message, HTML-escaped", V5.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    yield "20 KiB traceback, v5 at the end", fill(FRAME, 20 * 1024) + V5
    yield "300 KiB log, v5 at the end", log(300 * 1024) + "\n" + V5
    yield "1 MiB log, no message", log(MiB)
    yield "1 MiB log, v5 in the middle", log(MiB // 2) + "\n" + V5 + "\n" + log(MiB // 2)
    yield "1 MiB log, v2 in the first line", V2 + "\n" + log(MiB)
    # Adversarial, 1 MiB: the slowest found for the screens, the clean-up and the finders.
    yield "random [a-p0-9 .;:()[]\\n]", "".join(rnd.choices("abcdefghij klmnop0123456789.;:()[]\n", k=MiB))
    yield "random printable ASCII", "".join(rnd.choices([chr(c) for c in range(32, 127)] + ["\n"], k=MiB))
    for piece in ("o", "a", "e", "x", " ", "\n", "\n\n \n", "\r\n", "\t", "\xa0", "1234567890", "&amp;", "&x",
                  "<br>", "\x1b[0;31mX\x1b[0m", "[0;31m", "> ", "MemoryError ", "MemoryError\n", "\nMemoryError x",
                  "CUDA out of memory. ", "Tried to allocate 20.00 MiB ", "GPU 0 has ", "Process 123 has ",
                  "(GPU 0; ", "out of memory ", "error: out of memory ", "CUDA error: out of memory\n",
                  "allocate memory ", "unable to mmap 1 bytes from file <", "failed to alloc ", "[enforce fail at ",
                  "THCudaCheck FAIL ", "DataLoader worker ", 'Traceback (most recent call last):\n  File "x.py"\n'):
        yield f"1 MiB of {piece!r}", fill(piece, MiB)
    for piece in ("o", "a", "e", "unable to mmap 1 bytes from file <", "failed to allocate ", "memory "):
        yield f"1 MiB of {piece!r}, v5 in the middle", middle(piece)
    near_misses = "\nMemoryError x Unable to allocate failed to alloc <b>İ alloc_failed "
    yield "1 MiB of mixed near misses", fill(near_misses, MiB)
    yield "1 MiB of 'xcuda out of memory', v5 in the middle", middle("xcuda out of memory ")
    # The whole-text clean-up path at its largest: 128 KiB with little markup, 32 KiB with a lot.
    yield "127 KiB of traceback frames", fill(FRAME, 127 * 1024)
    yield "127 KiB of 'GPU 0 has a total capacity of '", fill("GPU 0 has a total capacity of ", 127 * 1024)
    yield "32 KiB of distinct '&aN' entities", "".join(f"&a{i}" for i in range(20000))[: 32 * 1024]
    yield "32 KiB of '\\x01a'", fill("\x01a", 32 * 1024)


def load_parser(path):
    if path is None:
        from ipy_gpumem.oom.parse import parse_oom

        return parse_oom
    # Loaded as a module of the package, so its relative imports resolve as they would in place.
    import ipy_gpumem.oom  # noqa: F401

    spec = importlib.util.spec_from_file_location("ipy_gpumem.oom._bench_parse_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.parse_oom


def timed(parse, text, repeat):
    parse(text)  # warm-up: compiled patterns, caches
    gc.collect()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        report = parse(text)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), max(times), report


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--parser", default=None, help="path of another parse.py to time instead")
    parser.add_argument("--only", default=None, help="time only inputs whose name contains this")
    args = parser.parse_args()
    parse = load_parser(args.parser)
    print(f"parse_oom from {args.parser or 'ipy_gpumem.oom.parse'}; Python {platform.python_version()}, "
          f"{platform.machine()}, {os.cpu_count()} CPUs; {args.repeat} runs per input after one warm-up")
    print()
    print("| input | size | as | median | max | found |")
    print("|---|---:|---|---:|---:|---|")
    worst = (0.0, "")
    for name, text in inputs():
        if args.only and args.only not in name:
            continue
        for kind, value in (("str", text), ("bytes", text.encode("utf-8"))):
            if kind == "bytes" and len(value) > MiB:
                continue  # over 1 MiB as bytes: outside the target
            med, mx, report = timed(parse, value, args.repeat)
            found = "-" if report is None else report.kind
            size = f"{len(value) / 1024:.0f} KiB" if len(value) >= 1024 else f"{len(value)} B"
            print(f"| {name} | {size} | {kind} | {med * 1000:.2f} ms | {mx * 1000:.2f} ms | {found} |")
            worst = max(worst, (mx, f"{name} ({kind})"))
    print()
    print(f"Slowest call: {worst[0] * 1000:.2f} ms ({worst[1]}).")


if __name__ == "__main__":
    main()
