"""Capture the CUDA allocator's state at the moment it raises out-of-memory, through torch's OOM observer.

torch's out-of-memory observer (through the adapter, ``tensors.torch_api``) calls ``cb(device, alloc_size, limit,
device_free)`` inside the failing allocation, after the allocator released its lock and before the
error is raised, where ``limit`` is the per-process cap when a memory fraction is set, else the
device's total. Three facts shape this module:

* An observer cannot be detached, so it is attached once per process and forwards to whatever
  target is set now; unloading the extension just clears the target (the observer then does
  nothing). The state lives here because ``%reload_ext`` reloads only the package's top module.
* It can only be attached once CUDA is up, and the commonest first OOM happens in the very cell
  that brings CUDA up (``model.to("cuda")``). So before CUDA is up, :func:`watch` queues the
  attach with torch's lazy-call queue: torch runs it inside its own lazy initialization, before
  the user's first allocation. The queued call never raises (a raising queued call would break
  the user's CUDA initialization).
* Only the native caching allocator has observers; with ``cudaMallocAsync`` attaching raises. The
  backend is read from torch (the adapter's ``allocator_backend()``), not guessed from the
  environment, and the answer is remembered: nothing is retried on every cell.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, NamedTuple, Optional

from ..core.counters import counters_from_stats
from ..tensors.torch_api import api as torch_api

__all__ = ["OomCapture", "watch", "unwatch", "attached", "state", "describe"]


class OomCapture(NamedTuple):
    """The allocator at the failing allocation (bytes; None where unknown)."""

    t: float  # time.perf_counter()
    device: int
    requested: int
    limit: Optional[int]  # the memory-fraction cap, or the device's total
    device_free: Optional[int]  # free on the device, as the CUDA driver reported it
    allocated: Optional[int]  # torch's allocated bytes at that moment
    reserved: Optional[int]


# "new": nothing done; "queued": attach waits for CUDA's lazy init; "attached": observing;
# "unsupported": this torch/allocator has no observer (why in "reason").
_STATE = {"state": "new", "target": None, "reason": None}


def _observer(device, alloc, limit, device_free) -> None:
    target = _STATE["target"]
    if target is None:
        return
    try:
        # Reading the stats here is safe: the allocator released its lock before calling us.
        torch = sys.modules.get("torch")
        adapter = torch_api(torch) if torch is not None else None
        allocated = reserved = None
        if adapter is not None:
            allocated, reserved, _, _ = counters_from_stats(adapter.cuda_stats()(int(device)))
        target(OomCapture(time.perf_counter(), int(device), int(alloc), int(limit) if limit else None,
                          int(device_free) if device_free is not None else None, allocated, reserved))
    except BaseException:  # noqa: BLE001 - this runs inside torch's allocator: never raise there
        pass


def _attach_now(torch) -> None:
    """Attach the observer (CUDA is up). Never raises: it may run inside torch's lazy CUDA init."""
    try:
        adapter = torch_api(torch)
        backend = adapter.allocator_backend() or "native"
        if backend != "native":
            _STATE.update(state="unsupported", reason=f"the {backend} allocator has no out-of-memory observer")
            return
        attach_fn = adapter.attach_oom_observer()
        if attach_fn is None:
            _STATE.update(state="unsupported", reason="this torch has no out-of-memory observer")
            return
        attach_fn(_observer)
        _STATE["state"] = "attached"
    except BaseException as exc:  # noqa: BLE001
        _STATE.update(state="unsupported", reason=f"attaching failed ({type(exc).__name__}: {exc})")


def _queued_attach() -> None:
    # Called by torch inside _lazy_init, which turns any exception into DeferredCudaCallError
    # for the user: guarded twice over.
    try:
        torch = sys.modules.get("torch")
        if torch is not None and _STATE["state"] == "queued":
            _attach_now(torch)
    except BaseException:  # noqa: BLE001
        pass


def watch(target: Callable[[OomCapture], None]) -> bool:
    """Send captures to ``target`` from now on; attach (or queue the attach) if not done yet.

    Returns True when nothing more needs doing for this process (attached, queued until CUDA
    comes up, or unsupported), False when it should be tried again later (torch not imported).
    """
    _STATE["target"] = target
    status = _STATE["state"]
    if status != "new":
        return True
    torch = sys.modules.get("torch")  # never import torch on the user's behalf
    if torch is None:
        return False
    try:
        cuda = torch.cuda
        adapter = torch_api(torch)
        if not adapter.cuda_built():
            _STATE.update(state="unsupported", reason="this torch build has no CUDA")
            return True
        if cuda.is_initialized():
            _attach_now(torch)
            return True
        lazy_call = adapter.lazy_cuda_call()
        if lazy_call is None:
            return False  # an old torch: try again when CUDA is up
        _STATE["state"] = "queued"
        lazy_call(_queued_attach)
    except BaseException as exc:  # noqa: BLE001 - a broken torch must not break cells
        _STATE.update(state="unsupported", reason=f"{type(exc).__name__}: {exc}")
    return True


def unwatch(target=None) -> None:
    """Stop forwarding (to ``target`` only, if given); the observer itself stays, doing nothing."""
    if target is None or _STATE["target"] == target:
        _STATE["target"] = None


def attached() -> bool:
    """True while captures reach a target."""
    return _STATE["state"] == "attached" and _STATE["target"] is not None


def state() -> str:
    """``new``, ``queued``, ``attached`` or ``unsupported``."""
    return _STATE["state"]


def describe() -> Optional[str]:
    """One line on whether an out-of-memory will be captured, for ``%gpumem status``; None before torch."""
    status = _STATE["state"]
    if status == "attached":
        return "out-of-memory capture: on (the allocator's numbers at a failure go into the panel)"
    if status == "queued":
        return "out-of-memory capture: waiting for CUDA to come up (attached by torch's own initialization)"
    if status == "unsupported":
        return f"out-of-memory capture: unavailable ({_STATE['reason']}); the panel reads the error message instead"
    return None
