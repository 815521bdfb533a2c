"""Gather everything known when a cell fails with out-of-memory into one ``OomAnalysis`` (data, not display).

The sources, best first: the allocator's own numbers captured at the failing allocation (CUDA's
OOM observer), the error message, a reading taken now (probe, NVML's process list, host RAM),
who holds the memory (the user's variables and IPython's caches), the ledger of earlier cells,
and the failing traceback's frames. Pure assembly: no IPython import; the extension calls
:func:`analyse` from its post-cell hook and shows ``oom.panel.oom_panel(analysis)``.
"""
from __future__ import annotations

import os
import sys
import traceback as _traceback
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

from .diagnose import MemoryState, explain, host_state

__all__ = ["OomAnalysis", "analyse", "traceback_frames", "state_at_failure"]

#: Frames of the failing traceback handed to the diagnosis (innermost last).
MAX_FRAMES = 40


def traceback_frames(tb) -> tuple:
    """``((filename, function, source line), ...)`` of a traceback, innermost last; never raises."""
    if tb is None:
        return ()
    try:
        summary = _traceback.extract_tb(tb, limit=None)[-MAX_FRAMES:]
        return tuple((fs.filename, fs.name, fs.line or "") for fs in summary)
    except Exception:  # noqa: BLE001 - a broken frame must not cost the panel
        return ()


def state_at_failure(oom, probe=None, capture=None) -> MemoryState:
    """The failing device's memory: the allocator capture, then the message, then a reading now."""
    state = MemoryState.from_oom(oom)
    device = state.device
    if capture is not None and device in (f"cuda:{capture.device}", "cuda", "unknown"):
        used = None
        if capture.limit is not None and capture.device_free is not None and oom.allowed is None:
            used = max(0, capture.limit - capture.device_free)
        captured = MemoryState(
            device=f"cuda:{capture.device}",
            total=capture.limit if oom.allowed is None else None,
            allocated=capture.allocated,
            reserved=capture.reserved,
            used=used,
            source="allocator at OOM",
        )
        # The capture is exact and from the very moment; the message is rounded to 2 decimals.
        state = captured.merged(state)
    if state.device_type == "cpu" or oom.kind == "cpu":
        rss = probe.host.rss() if probe is not None else None
        state = state.merged(host_state(rss))
    elif probe is not None and state.index is not None:
        state = state.merged(_device_now(probe, state.index))
    return state


def _device_now(probe, index: int) -> MemoryState:
    """A reading of CUDA device ``index`` now, with NVML's process list (slow; only at an OOM)."""
    cuda, _ = probe.cuda.status()
    if cuda is None:
        return MemoryState(device=f"cuda:{index}")
    try:
        allocated, reserved, _, _ = probe.cuda.counters(index)
        used, total = probe.cuda.device_memory(index)
    except Exception:  # noqa: BLE001
        allocated = reserved = used = total = None
    processes, own = [], None
    try:
        uuid = probe.cuda.properties(index)[2]
        for pid, nbytes, name in probe.cuda.nvml.processes(index, uuid):
            if pid == os.getpid():
                own = nbytes
            else:
                processes.append((pid, nbytes, name))
    except Exception:  # noqa: BLE001
        pass
    return MemoryState(device=f"cuda:{index}", total=total, allocated=allocated, reserved=reserved, used=used,
                       process_used=own, processes=tuple(processes), source="probe after the error")


@dataclass(frozen=True)
class OomAnalysis:
    """Everything known about one out-of-memory failure: what the panel shows, as data.

    Attributes:
        oom: the parsed message (``OomReport``).
        state: the failing device's memory (``MemoryState``), best source first.
        who: who held the memory on that device (``WhoReport``), or None.
        findings: the ranked diagnosis (``Finding``s).
        records: the recent cell records the diagnosis looked at, oldest first.
        error_name: the exception's class name.
    """

    oom: Any
    state: MemoryState
    who: Any
    findings: Tuple[Any, ...]
    records: Tuple[Any, ...]
    error_name: str = ""


def analyse(oom, record, *, namespace: Optional[dict], records: Sequence[Any] = (), probe=None,
            capture=None, tb=None, env=None, who_fn=None) -> OomAnalysis:
    """Everything known about a cell that failed with ``oom`` (an ``OomReport``).

    Args:
        oom: the parsed message.
        record: the failing cell's ``CellRecord`` (its source, error name).
        namespace: the user's namespace, for who holds the memory (None skips that section).
        records: earlier records, oldest first.
        probe: the ``MemoryProbe``, for a reading now (device, NVML processes, host RAM).
        capture: an ``OomCapture`` from the allocator's observer, if one fired in this cell.
        tb: the failing traceback (``sys.last_traceback``).
        env: environment variables for the diagnosis (default ``os.environ``).
        who_fn: ``who(namespace, device=..., allocator_total=...)``; the attribution module's by default.
    """
    state = state_at_failure(oom, probe, capture)
    who_report = None
    if namespace is not None:
        if who_fn is None:
            from ..who.attribution import who as who_fn
        device = state.device if state.device not in ("", "unknown") else None
        if device is not None and device.split(":")[0] not in ("cuda", "cpu"):
            device = None  # mps/xpu tensors are counted with every device
        total = state.allocated if device is not None and device.startswith("cuda") else None
        try:
            who_report = who_fn(namespace, device=device, allocator_total=total)
        except Exception:  # noqa: BLE001 - the panel still explains the message without it
            who_report = None
    findings = explain(oom, state, who_report, records, failing_source=getattr(record, "source", "") or "",
                       traceback_frames=traceback_frames(tb), env=env if env is not None else os.environ,
                       modules=list(sys.modules))
    return OomAnalysis(oom, state, who_report, tuple(findings), tuple(records),
                       error_name=getattr(record, "error", "") or "")
