"""Complete a census change with what only a GPU's counters know: the allocator's cache, memory outside PyTorch, and tensors no name reaches.

A census counts the tensors the user's names reach; on a CUDA device torch's own counters say the
rest exactly: ``reserved - allocated`` is the caching allocator's "reserved but unallocated"
memory, ``used - reserved`` is outside PyTorch (the CUDA context, cuBLAS/cuDNN workspaces, other
processes), and ``allocated`` minus what the census found is held by tensors no name reaches
(inside a function still running, in C++ or in a closure). Host RSS has no such split, so the CPU
path reports the census alone.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional

from ..core.roles import TENSOR_ROLES, clean_table

__all__ = ["gpu_extras", "with_extras", "summed"]


def gpu_extras(dev, parts: Mapping) -> Dict[str, int]:
    """The GPU-only roles of one device's change (a ``DeviceRecord`` with deltas)."""
    out: Dict[str, int] = {}
    alloc, reserved, used = dev.allocated_delta, dev.reserved_delta, getattr(dev, "used_delta", None)
    if alloc is not None:
        found = sum(v for (d, role, _o), v in parts.items() if d == dev.label and role in TENSOR_ROLES)
        if alloc - found:
            out["other_tensors"] = alloc - found
    if alloc is not None and reserved is not None and reserved - alloc:
        out["allocator_cache"] = reserved - alloc
    if used is not None and reserved is not None and used - reserved:
        out["outside_pytorch"] = used - reserved
    return out


def with_extras(table: Mapping[str, Mapping[str, int]], extras: Optional[Mapping[str, Mapping[str, int]]]):
    """``table`` with each device's extras added (``other_tensors`` adds to the census's)."""
    out = {dev: dict(row) for dev, row in table.items()}
    for dev, row in (extras or {}).items():
        target = out.setdefault(dev, {})
        for role, value in row.items():
            target[role] = target.get(role, 0) + value
    return clean_table(out)


def summed(extras: Optional[Mapping[str, Mapping[str, int]]]) -> Dict[str, int]:
    """The extras of every device added up by role (what a sentence names: one figure per role)."""
    out: Dict[str, int] = {}
    for row in (extras or {}).values():
        for role, value in row.items():
            out[role] = out.get(role, 0) + value
    return {role: value for role, value in out.items() if value}
