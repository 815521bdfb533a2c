"""One device's memory, one model: allocated, reserved, used and total, with free and the rest derived once.

A :class:`DeviceMemory` is built from whatever source knows the numbers: a probe reading
(:meth:`DeviceMemory.from_sample`), the allocator at the failing allocation
(:meth:`~DeviceMemory.from_capture`), a parsed out-of-memory message
(:meth:`~DeviceMemory.from_message`) or the host's RAM (:meth:`~DeviceMemory.host`), and sources
are combined with :meth:`~DeviceMemory.merged`. ``%gpumem status``, the OOM panel's bar, ``%gpumem
free`` and the chart's numbers all read the derived figures from here, so "free", "reserved but
unallocated" and "outside PyTorch" are computed in exactly one way.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

from .devices import HOST, Device, device as _device, parse_device
from .units import MiB

__all__ = ["DeviceMemory", "Process"]

#: ``(pid, bytes or None, name or None)`` of a process using the device.
Process = Tuple[int, Optional[int], Optional[str]]


def _sub(a: Optional[int], b: Optional[int]) -> Optional[int]:
    """``a - b`` clamped at 0 (rounded message numbers can make a true 0 slightly negative)."""
    if a is None or b is None:
        return None
    return max(0, int(a) - int(b))


@dataclass(frozen=True)
class DeviceMemory:
    """One device's memory at one moment, in bytes (None where unknown).

    Attributes:
        device: the device (``cuda(0)``, ``HOST``, ``Device("mps")``, ``Device("xpu", 0)``...), None
            when nobody said.
        total: capacity (host: physical RAM; MPS: the high-watermark limit, "max allowed", which
            by default exceeds Metal's recommended working set 1.7 times).
        allocated: bytes in live tensors, as PyTorch counts them ("allocated").
        reserved: the caching allocator's reservation: allocated plus "reserved but unallocated".
        used: device-wide bytes in use by every process (host: total minus available).
        process_used: this process's bytes (CUDA: NVML's or the message's "this process has";
            host: RSS).
        processes: OTHER processes on the device, ``(pid, bytes or None, name or None)``.
        source: where the numbers came from, e.g. ``"OOM message"``, ``"allocator at OOM"``.
    """

    device: Optional[Device] = None
    total: Optional[int] = None
    allocated: Optional[int] = None
    reserved: Optional[int] = None
    used: Optional[int] = None
    process_used: Optional[int] = None
    processes: Tuple[Process, ...] = ()
    source: str = ""

    # -- derived figures: defined here and nowhere else ----------------------------------------

    @property
    def free(self) -> Optional[int]:
        """``total - used``: what the driver (or the OS) could still hand out."""
        return _sub(self.total, self.used)

    @property
    def reserved_unallocated(self) -> Optional[int]:
        """Bytes the caching allocator holds but no tensor uses ("reserved but unallocated")."""
        return _sub(self.reserved, self.allocated)

    @property
    def outside_pytorch(self) -> Optional[int]:
        """``used - reserved``: the CUDA context, other libraries and other processes together.

        None on MPS when both are the Metal driver's one figure (torch.mps keeps no other): how
        much of it is outside PyTorch's pool cannot be told, which is not the same as none.
        """
        if self.device is not None and self.device.type == "mps" and self.used == self.reserved:
            return None
        return _sub(self.used, self.reserved)

    @property
    def non_pytorch_in_process(self) -> Optional[int]:
        """``process_used - reserved``: this process's CUDA context, cuBLAS/cuDNN, other libraries."""
        return _sub(self.process_used, self.reserved)

    @property
    def other_processes_bytes(self) -> Optional[int]:
        """Bytes other processes hold: the listed ones, else ``used - process_used``, else None."""
        listed = [b for _pid, b, _name in self.processes if b is not None]
        if listed:
            return sum(listed)
        return _sub(self.used, self.process_used)

    @property
    def label(self) -> str:
        """``"cuda:0"``, ``"cpu"``; ``"unknown"`` when no source named the device."""
        return "unknown" if self.device is None else self.device.label

    @property
    def is_host(self) -> bool:
        return self.device is not None and self.device.is_host

    # -- sources ---------------------------------------------------------------------------------

    @classmethod
    def from_sample(cls, sample: Any, source: str = "probe") -> "DeviceMemory":
        """From a probe's ``DeviceSample`` (index, allocated, reserved, ..., used, total, type).

        On MPS ``reserved`` and ``used`` are both this process's Metal allocations and ``total``
        its out-of-memory limit, so ``free`` is what the process may still allocate before MPS
        refuses, as in its message ("max allowed" minus "MPS allocated" and "other allocations").
        """
        return cls(device=_device(getattr(sample, "type", "cuda"), sample.index), total=sample.total,
                   allocated=sample.allocated, reserved=sample.reserved, used=sample.used, source=source)

    @classmethod
    def from_capture(cls, capture: Any, capped: bool = False) -> "DeviceMemory":
        """From torch's out-of-memory observer (an ``OomCapture``): exact, and from the very moment.

        ``limit`` is the per-process cap when a memory fraction is set, else the device's total;
        with ``capped`` (the message said a cap is set) it is not the device's total, so neither
        ``total`` nor ``used`` can be read from it.
        """
        used = None
        if not capped and capture.limit is not None and capture.device_free is not None:
            used = max(0, int(capture.limit) - int(capture.device_free))
        return cls(device=_device("cuda", capture.device), total=None if capped else capture.limit,
                   allocated=capture.allocated, reserved=capture.reserved, used=used, source="allocator at OOM")

    @classmethod
    def from_message(cls, report: Any) -> "DeviceMemory":
        """Everything an out-of-memory message (an ``OomReport``) says about its device.

        ``used`` is ``total - free``, so ``free`` gives back the message's number exactly. When
        NVML listed this very process as ``Process N`` (in a container NVML reports host pids, so
        torch cannot tell its own line), the line is recognised by arithmetic and becomes
        ``process_used`` instead of another process.
        """
        total, used, allocated = report.total, None, report.allocated_by_pytorch
        if report.kind == "mps":
            # MPS: "max allowed" is the limit that failed; "other allocations" are this process's
            # non-tensor Metal buffers.
            total = report.max_allowed
            if allocated is not None and report.other_allocations is not None:
                used = allocated + report.other_allocations
        elif total is not None and report.free is not None:
            used = max(0, total - report.free)
        reserved = report.reserved
        process_used = report.process_in_use
        others: List[Process] = [(pid, nbytes, None) for pid, nbytes in report.other_processes]
        if process_used is None and others:
            own = _own_line(others, reserved, used)
            if own is not None:
                process_used = others.pop(own)[1]
        device = None
        if report.device_type is not None:
            try:
                device = parse_device(report.device)
            except ValueError:
                device = Device(report.device_type, report.gpu_index)
        return cls(device=device, total=total, allocated=allocated, reserved=reserved, used=used,
                   process_used=process_used, processes=tuple(others), source="OOM message")

    @classmethod
    def host(cls, rss: Optional[int] = None) -> "DeviceMemory":
        """The host's RAM (device ``cpu``), read with the standard library.

        Args:
            rss: this process's resident set size; read from ``/proc/self/statm`` when None (Linux).
        """
        total = available = None
        try:
            page = os.sysconf("SC_PAGE_SIZE")
            total = page * os.sysconf("SC_PHYS_PAGES")
            available = _meminfo_available()
            if available is None:
                available = page * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # not POSIX, or the name is unknown here
            pass
        if rss is None:
            rss = _statm_rss()
        used = None if total is None or available is None else max(0, total - available)
        return cls(device=HOST, total=total, used=used, process_used=rss, source="probe")

    def merged(self, other: "DeviceMemory") -> "DeviceMemory":
        """This memory with every unknown filled from ``other`` (this one's numbers win)."""
        changes: Dict[str, Any] = {}
        for name in ("total", "allocated", "reserved", "used", "process_used"):
            if getattr(self, name) is None and getattr(other, name) is not None:
                changes[name] = getattr(other, name)
        processes = _merge_processes(self.processes, other.processes)
        if processes != self.processes:
            changes["processes"] = processes
        if changes and other.source and other.source not in self.source:
            changes["source"] = f"{self.source} + {other.source}" if self.source else other.source
        if self.device is None and other.device is not None:
            changes["device"] = other.device
        return replace(self, **changes) if changes else self


def _merge_processes(mine: tuple, theirs: tuple) -> tuple:
    """Processes by pid: unknown bytes and names filled from ``theirs``, its extra pids appended."""
    by_pid = {pid: (b, name) for pid, b, name in theirs}
    out = [(pid, b if b is not None else by_pid.get(pid, (None, None))[0],
            name if name is not None else by_pid.get(pid, (None, None))[1]) for pid, b, name in mine]
    known = {pid for pid, _b, _n in mine}
    out.extend(p for p in theirs if p[0] not in known)
    return tuple(out)


def _own_line(others: List[Process], reserved: Optional[int], used: Optional[int]) -> Optional[int]:
    """Index of the listed process that must be this one, or None.

    This process holds at least ``reserved``. If ``reserved`` plus every listed process exceeds
    what the whole device uses, one listed line is this process counted twice: the one line that
    can hold ``reserved``. When several could, arithmetic cannot tell which, and guessing would
    offer the user's own kernel as "another process" to kill: none is picked.
    """
    if reserved is None or used is None:
        return None
    listed = sum(b for _pid, b, _n in others if b is not None)
    slack = 16 * MiB + used // 100  # two-decimal rounding in the message
    if reserved + listed <= used + slack:
        return None
    fits = [i for i, (_pid, b, _n) in enumerate(others) if b is not None and b + slack >= reserved]
    return fits[0] if len(fits) == 1 else None


def _meminfo_available() -> Optional[int]:
    # MemAvailable counts reclaimable page cache; SC_AVPHYS_PAGES does not and looks far too low.
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _statm_rss() -> Optional[int]:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
