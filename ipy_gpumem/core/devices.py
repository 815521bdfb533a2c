"""Device names, read in one place: ``parse_device("cuda:1") == Device("cuda", 1)`` and ``str()`` back to ``"cuda:1"``.

Every device a user types (``-d cuda:1``, ``%gpumem who cpu``, ``c.GpuMemMagics.devices = "0,1"``),
every device a message names and every device a record or a chart series belongs to is a
:class:`Device`; code compares fields, never splits ``"cuda:N"`` strings.
"""
from __future__ import annotations

import re
from typing import NamedTuple, Optional, Tuple

__all__ = ["ACCELERATOR_TYPES", "Device", "HOST", "ALL_CUDA", "SINGLE_DEVICE_TYPES", "cuda", "device", "note_seen", "seen",
           "parse_device", "parse_device_list", "parse_visible_devices"]

#: Accelerator types a user may name (``-d``, ``--device``): CUDA (ROCm too: torch.cuda's names), Apple's
#: MPS, Intel's XPU, and those torch.accelerator reads (Gaudi's hpu, Meta's mtia, Ascend's npu).
ACCELERATOR_TYPES = ("cuda", "mps", "xpu", "hpu", "mtia", "npu")

#: Device types torch names without an index: one device per machine (``mps``, where a tensor's
#: device reads ``mps:0``).
SINGLE_DEVICE_TYPES = frozenset({"mps"})


class Device(NamedTuple):
    """A device as torch names it: ``type`` ("cuda", "cpu", "mps", "xpu", ...) and ``index``.

    ``index`` is None for "every device of that type" (``cuda``) and for the host (``cpu``:
    CPU tensors carry no index).
    """

    type: str
    index: Optional[int] = None

    @property
    def label(self) -> str:
        """``"cuda:0"``, ``"cuda"``, ``"cpu"``, ``"mps"``, ``"xpu:0"``: torch's own spelling (a
        single-device type such as ``mps`` goes without its index, as torch prints it)."""
        if self.index is None or self.type in SINGLE_DEVICE_TYPES:
            return self.type
        return f"{self.type}:{self.index}"

    @property
    def is_host(self) -> bool:
        return self.type == "cpu"

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    def covers(self, other: "Device") -> bool:
        """True when ``other`` is this device, or one of the devices this one stands for."""
        return self.type == other.type and (self.index is None or self.index == other.index)

    def __str__(self) -> str:
        return self.label


#: The host: process RSS and CPU tensors.
HOST = Device("cpu", None)
#: Every CUDA device.
ALL_CUDA = Device("cuda", None)

_CUDA = tuple(Device("cuda", i) for i in range(16))


def cuda(index: int) -> Device:
    """``Device("cuda", index)`` (shared instances for the usual indices)."""
    return _CUDA[index] if 0 <= index < len(_CUDA) else Device("cuda", int(index))


_SHARED: dict = {}


def device(kind: str, index: Optional[int]) -> Device:
    """The device of torch type ``kind`` and ``index`` (``device("xpu", 0)``): shared instances,
    ``cuda(index)`` for CUDA (ROCm too), :data:`HOST` for ``"cpu"``."""
    if kind == "cuda" and index is not None:
        return cuda(index)
    if kind == "cpu":
        return HOST
    key = (kind, index)
    found = _SHARED.get(key)
    if found is None:
        found = _SHARED[key] = Device(kind, None if index is None else int(index))
    return found


#: Device types a tensor of this process was found on (the tensors room notes each type the first
#: time it counts a storage there).
_SEEN: set = set()


def note_seen(kind: str) -> None:
    """Remember that a tensor of this process lives on a device of torch type ``kind``.

    The probes read a backend that has no "initialized" flag to ask (MPS before torch.accelerator
    covers it) only once this says the user's code has put a tensor there: reading its counters
    earlier would start its allocator, and with it fix the allocator's environment settings
    (``PYTORCH_MPS_HIGH_WATERMARK_RATIO``) before the user's code had a chance to set them.
    """
    _SEEN.add(kind)


def seen(kind: str) -> bool:
    """True once :func:`note_seen` was told of a tensor on a device of type ``kind``."""
    return kind in _SEEN


_SPEC = re.compile(r"^([a-z_][a-z0-9_]*)(?::([0-9]+))?$", re.ASCII)
_HOST_WORDS = ("host", "cpu")
_CUDA_WORDS = ("cuda", "gpu", "all")


def parse_device(value) -> Device:
    """Read a device: ``"cuda:1"``, ``"cuda"`` / ``"gpu"`` / ``"all"`` (every CUDA device), ``"host"`` or
    ``"cpu"``, ``"mps"``, ``"xpu:0"``, an int ``N`` (``cuda:N``), or a ``torch.device``.

    Raises:
        ValueError: ``value`` is not a device; the message says what is accepted.

    Examples:
        >>> parse_device("cuda:1"), parse_device(0), parse_device("host"), parse_device("CUDA")
        (Device(type='cuda', index=1), Device(type='cuda', index=0), Device(type='cpu', index=None), Device(type='cuda', index=None))
    """
    if isinstance(value, Device):
        return value
    if isinstance(value, bool):
        raise ValueError(f"not a device: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"not a device: {value!r} (device indices start at 0)")
        return cuda(value)
    text = str(value).strip().lower()  # a torch.device prints as "cuda:0" / "cuda" / "cpu"
    if text.isdecimal() and text.isascii():
        return cuda(int(text))
    match = _SPEC.match(text)
    if not match:
        raise ValueError(f"not a device: {value!r} (use cuda:N such as cuda:0, cuda for every GPU, or cpu)")
    kind, index = match.group(1), match.group(2)
    if kind in _HOST_WORDS:
        return HOST  # CPU storages carry no index: "cpu:0" is all of the CPU
    if kind in _CUDA_WORDS:
        kind = "cuda"
    return Device(kind, None if index is None else int(index))


def parse_device_list(text) -> Optional[Tuple[int, ...]]:
    """Accelerator device indices from ``"all"`` (None: every device the user's code initialized),
    ``"0,1"``, ``"cuda:0, cuda:1"``, ``"xpu:1"`` or ``"mps"`` (its one device, 0).

    The indices are torch's for the one accelerator a process uses (CUDA, ROCm, XPU or MPS).

    Raises:
        ValueError: an entry is not an accelerator device index, or one appears twice.

    Examples:
        >>> parse_device_list("all"), parse_device_list("0, cuda:2"), parse_device_list("xpu:1"), parse_device_list("mps")
        (None, (0, 2), (1,), (0,))
    """
    text = "all" if text is None else str(text).strip().lower()
    if text in ("all", ""):
        return None
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            device = parse_device(part)
        except ValueError:
            raise ValueError(f"{part!r} is not a CUDA device: use 'all' or indices like '0,1'") from None
        if device.type in SINGLE_DEVICE_TYPES and device.index is None:
            device = Device(device.type, 0)
        if device.is_host or device.index is None:
            raise ValueError(f"{part!r} is not one CUDA device: use 'all' or indices like '0,1'")
        if device.index in out:
            raise ValueError(f"{device} is listed twice")
        out.append(device.index)
    if not out:
        raise ValueError(f"{text!r} names no device: use 'all' or indices like '0,1'")
    return tuple(out)


def parse_visible_devices(value: str | None) -> list | None:
    """Read ``CUDA_VISIBLE_DEVICES`` as CUDA does: ints, or ``GPU-``/``MIG-`` UUID prefixes.

    Returns None when the variable is unset (all devices visible, torch index == NVML index).

    Examples:
        >>> parse_visible_devices("2,0"), parse_visible_devices("GPU-8d1,GPU-77"), parse_visible_devices(None)
        ([2, 0], ['GPU-8d1', 'GPU-77'], None)
        >>> parse_visible_devices("1,-1,3")  # a negative index ends the list, as in CUDA
        [1]
    """
    if value is None:
        return None
    items = [item.strip() for item in value.split(",")]
    if items and (items[0].startswith("GPU-") or items[0].startswith("MIG-")):
        prefix = items[0][:4]
        out = []
        for item in items:
            if not item.startswith(prefix) or item in out:
                break
            out.append(item)
        return out
    indices: list = []
    for item in items:
        digits = ""
        for ch in item:
            if ch.isdigit():
                digits += ch
            else:
                break
        if not digits:
            break
        index = int(digits)
        if index in indices:  # a repeated ordinal makes CUDA see no device at all
            return []
        indices.append(index)
    return indices
