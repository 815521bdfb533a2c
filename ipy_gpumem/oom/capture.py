"""Capture the CUDA allocator's state at the moment it raises out-of-memory, through torch's OOM observer.

``torch._C._cuda_attach_out_of_memory_observer(cb)`` calls ``cb(device, alloc_size, limit,
device_free)`` inside the failing allocation, after the allocator released its lock and before the
error is raised, where ``limit`` is the per-process cap when a memory fraction is set, else the
device's total. An observer cannot be detached, so it is attached once per process and forwards
to whatever target is set now; unloading the extension just clears the target (the observer then
does nothing). The state lives in this module because ``%reload_ext`` reloads only the package's
top module, never this one.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, NamedTuple, Optional

from ..core.probes import counters_from_stats

__all__ = ["OomCapture", "attach", "detach", "attached"]


class OomCapture(NamedTuple):
    """The allocator at the failing allocation (bytes; None where unknown)."""

    t: float  # time.perf_counter()
    device: int
    requested: int
    limit: Optional[int]  # the memory-fraction cap, or the device's total
    device_free: Optional[int]  # free on the device, as the CUDA driver reported it
    allocated: Optional[int]  # torch's allocated bytes at that moment
    reserved: Optional[int]


_STATE = {"attached": False, "target": None}


def _observer(device, alloc, limit, device_free) -> None:
    target = _STATE["target"]
    if target is None:
        return
    try:
        # Reading the stats here is safe: the allocator released its lock before calling us.
        torch = sys.modules.get("torch")
        allocated = reserved = None
        stats_fn = getattr(getattr(torch, "_C", None), "_cuda_memoryStats", None)
        if stats_fn is not None:
            allocated, reserved, _, _ = counters_from_stats(stats_fn(int(device)))
        target(OomCapture(time.perf_counter(), int(device), int(alloc), int(limit) if limit else None,
                          int(device_free) if device_free is not None else None, allocated, reserved))
    except Exception:  # noqa: BLE001 - this runs inside torch's allocator: never raise there
        pass


def attach(target: Callable[[OomCapture], None]) -> bool:
    """Send captures to ``target``; attach torch's observer first if CUDA is up. False if it can't be."""
    torch = sys.modules.get("torch")  # never import torch on the user's behalf
    if torch is None:
        return False
    try:
        if not torch.cuda.is_initialized():
            return False
        attach_fn = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach_fn is None:
            return False
        if not _STATE["attached"]:
            attach_fn(_observer)
            _STATE["attached"] = True
    except Exception:  # noqa: BLE001 - a CPU build, an old torch: no capture, nothing broken
        return False
    _STATE["target"] = target
    return True


def detach() -> None:
    """Stop forwarding (the observer itself stays attached, doing nothing)."""
    _STATE["target"] = None


def attached() -> bool:
    return bool(_STATE["attached"] and _STATE["target"] is not None)
