"""Whether a device the user named (``-d``, ``%gpumem who --device``) can be measured in this process, and if not why, in one line."""
from __future__ import annotations

import sys
from typing import Optional

from .devices import SINGLE_DEVICE_TYPES, Device

__all__ = ["device_problem", "accelerator_words"]


def accelerator_words(kind: str, rocm: bool = False) -> str:
    """``"CUDA"``, ``"ROCm"``, ``"MPS"``, ``"XPU"``: how a message names an accelerator of torch type ``kind``."""
    return "ROCm" if rocm else kind.upper()


def device_problem(device: Optional[Device], probe) -> Optional[str]:
    """Why ``device`` cannot be measured here (another accelerator's, or one that does not exist), or None.

    ``probe`` is the accelerator's probe (``core.probes.CudaProbe``). The accelerator a process uses is
    known once torch is imported (a build flag and the backend's reader: nothing is initialized); before
    that only a CUDA index is checked, against NVML's count.
    """
    if device is None or device.is_host:
        return None
    count = None
    if "torch" in sys.modules:
        probe.status()  # chooses the backend's reader: flags only, it initializes nothing
        kind = probe.device_type
        count = probe.device_count()
        if device.type != kind:
            if not count:
                return f"this process sees no {accelerator_words(device.type)} device"
            example = kind if kind in SINGLE_DEVICE_TYPES else f"{kind}:0"
            return (f"this process's accelerator is {accelerator_words(kind, probe.is_rocm())}, "
                    f"not {accelerator_words(device.type)} (-d {example})")
    elif device.is_cuda:
        count = probe.device_count()
    if device.index is None or count is None or device.index < count:
        return None
    words = accelerator_words(device.type, device.is_cuda and "torch" in sys.modules and probe.is_rocm())
    return f"{device} does not exist: this process sees {count} {words} device{'s' if count != 1 else ''}"
