"""Inside the sealed child: the scratch a CPU kernel takes from torch's allocator for the time of its call, which no operator hands out and so no dispatch-level count sees.

Measured with torch's profiler (every allocation of the CPU allocator, ``profile_memory=True``)
against the storage tracker, in torch 2.13's x86-64 build with MKL on an AVX-512 CPU: a bfloat16
matrix multiply (``mm``, ``addmm``: a linear layer under CPU autocast) computes through MKL's
bf16 x bf16 -> fp32 GEMM into an fp32 buffer of its whole output, 4 bytes an element plus 128; a
batched one (``bmm``, ``baddbmm``: attention scores, ``einsum``) takes that buffer for one matrix
of the batch at a time. fp32 and fp16 multiplies take none. oneDNN's convolutions take a scratchpad
per intra-op thread (tens of KiB a thread, the same at every batch size), which is not counted. Without it, a bf16 step whose peak falls inside its largest linear
layer (an MLP's, at a large batch) was estimated 18% under what the process allocated at 8x the
batch, while exact at 1x: the buffer grows with the batch (``tests/preflight/test_estimate_batch.py``).
"""
from __future__ import annotations

import contextlib
import platform
from typing import Iterator

__all__ = ["GEMMS", "BATCHED", "gemm_scratch", "CpuScratch", "cpu_emulation", "applies"]

#: The multiplies that take the buffer for their whole output, and those that take it a matrix at a time.
GEMMS = frozenset(("mm", "addmm"))
BATCHED = frozenset(("bmm", "baddbmm"))


def applies(api) -> bool:
    """Whether this build takes MKL's bf16 GEMM (an x86-64 build with MKL), where the buffer was measured."""
    try:
        mkl = bool(api.torch.backends.mkl.is_available())
    except Exception:  # noqa: BLE001
        mkl = False
    return mkl and platform.machine().lower() in ("x86_64", "amd64")


def gemm_scratch(name: str, out, bfloat16) -> int:
    """Bytes of the fp32 buffer a bf16 multiply ``name`` takes for the time of its call (0 for others)."""
    if getattr(out, "dtype", None) != bfloat16 or out.numel() == 0:
        return 0
    if name in GEMMS:
        return out.numel() * 4 + 128
    if name in BATCHED and out.dim() == 3 and out.shape[0] > 0:
        return out.numel() // int(out.shape[0]) * 4 + 128
    return 0


class CpuScratch:
    """An ``after_op`` hook: a multiply's buffer, taken after its output and given back at once."""

    def __init__(self, tracker, torch):
        self.tracker = tracker
        self.bfloat16 = torch.bfloat16

    def __call__(self, func, out=None) -> None:
        name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
        if name in GEMMS or name in BATCHED:
            size = gemm_scratch(name, out, self.bfloat16)
            if size:
                self.tracker.release(self.tracker.allocate(size))


@contextlib.contextmanager
def cpu_emulation(api, tracker) -> Iterator[bool]:
    """The CPU kernels' scratch for one run (where it was measured); yields whether it is counted."""
    if not applies(api):
        yield False
        return
    tracker.after_op = CpuScratch(tracker, api.torch)
    try:
        yield True
    finally:
        tracker.after_op = None
