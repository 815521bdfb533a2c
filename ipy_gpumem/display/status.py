"""``%gpumem status``: the memory of each device now, in torch's words, and the process's host RSS."""
from __future__ import annotations

from typing import Mapping, Optional, Sequence

from ..core.memory import DeviceMemory
from ..core.units import format_bytes
from .parts import Line, Span, Table, render
from .view import View

__all__ = ["status_view", "STATUS_HEADERS"]

STATUS_HEADERS = ("device", "allocated by PyTorch", "reserved but unallocated", "used outside PyTorch", "free", "total")


def status_view(memories: Sequence[DeviceMemory], host_rss: Optional[int], reason: Optional[str] = None,
                names: Optional[Mapping[int, str]] = None, notes: Sequence[str] = ()) -> View:
    """Per device, who has the memory now; and the process's host RSS. ``View.data`` is ``memories``.

    "used outside PyTorch" is the device's used memory minus what torch reserved: the CUDA
    context, other libraries (cuBLAS workspaces, NCCL) and other processes.
    """
    names = names or {}
    parts = []
    rows = []
    for mem in memories:
        name = names.get(mem.device.index) if mem.device is not None else None
        rows.append([mem.label + (f" ({name})" if name else ""), format_bytes(mem.allocated),
                     format_bytes(mem.reserved_unallocated), format_bytes(mem.outside_pytorch),
                     format_bytes(mem.free), format_bytes(mem.total)])
    if rows:
        parts.append(Table(STATUS_HEADERS, rows))
        if reason:  # devices named in GpuMemMagics.devices that could not be read
            parts.append(Line(f"({reason})"))
    else:
        parts.append(Line(f"No GPU in use: {reason or 'none found'}."))
    host = f"host: {format_bytes(host_rss)} resident (process RSS)" if host_rss is not None else "host: RSS unavailable"
    parts.append(Line(host))
    parts.extend(Line(Span(note, "dim")) for note in notes)
    return render(parts, data=list(memories))
