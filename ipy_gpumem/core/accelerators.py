"""Read Apple MPS, Intel XPU and other ``torch.accelerator`` devices, and AMD's device view (amdsmi), without starting any.

Each reader answers the questions :class:`~ipy_gpumem.core.probes.CudaProbe` asks of torch.cuda
(is it up, which devices, the four allocator counters, name and total, device-wide use, empty the
cache) for one backend of :mod:`.backends`, through torch's public calls only. A reader never starts
what the user's code has not: XPU is read once ``torch.xpu.is_initialized()``; MPS, which has no
such flag, once torch.accelerator says its allocator is up (torch that routes MPS through it) or
once a tensor of this process was found there (:func:`~ipy_gpumem.core.devices.seen`), because its
first read would create the allocator and fix ``PYTORCH_MPS_HIGH_WATERMARK_RATIO`` for the process.

Unavailability is a value here too: a figure a backend does not keep is None (the table says why),
never a zero.
"""
from __future__ import annotations

import os
import sys
from typing import Any, List, Optional, Tuple

from . import backends as _backends
from .counters import counters_from_stats
from .devices import parse_visible_devices, seen as _seen

__all__ = ["Reader", "MpsReader", "XpuReader", "GenericReader", "AmdsmiProbe", "reader_for", "mps_limit"]


class Reader:
    """What a probe asks of one non-CUDA backend. ``torch`` is the user's module (never imported here).

    Attributes:
        backend: its row of the backend table.
        device_type: torch's device type (``"mps"``, ``"xpu"``, ...).
        resets_peaks: the backend keeps peak counters that :meth:`reset_peak` resets; False means
            peaks come from samples (the recorder's highest readings), never from a counter.
    """

    backend = _backends.ACCELERATOR
    device_type = ""
    resets_peaks = True

    def __init__(self, torch: Any):
        self.torch = torch
        self._props: dict = {}

    def reason(self) -> Optional[str]:
        """None when the user's code uses the backend (it can be read), else why not, in words."""
        raise NotImplementedError

    def device_count(self) -> Optional[int]:
        """Devices of this backend, without starting any; None when that cannot be told yet."""
        return None

    def device_indices(self) -> List[int]:
        """Indices of the devices the user's code uses."""
        raise NotImplementedError

    def counters(self, index: int) -> tuple:
        """``(allocated, reserved, peak_allocated, peak_reserved)``; None where the backend keeps none."""
        raise NotImplementedError

    def reset_peak(self, index: int) -> None:
        """Reset the peak counters (nothing where the backend keeps none)."""

    def properties(self, index: int) -> tuple:
        """``(name or None, total bytes or None, uuid or None)``, cached."""
        raise NotImplementedError

    def device_memory(self, index: int) -> tuple:
        """``(used, total)`` device-wide (all processes); Nones where the backend cannot tell."""
        return None, self.properties(index)[1]

    def processes(self, index: int) -> list:
        """Other processes on the device: none of these backends lists them."""
        return []

    def empty_cache(self) -> bool:
        """The backend's ``empty_cache()`` when its allocator is up; True if it ran."""
        return False


def _flat_stats(torch: Any, index: int) -> dict:
    return dict(torch.accelerator.memory_stats(index))


def mps_limit(recommended: Optional[int], environ=None) -> Optional[int]:
    """The MPS out-of-memory limit: ``PYTORCH_MPS_HIGH_WATERMARK_RATIO`` (default 1.7) times Metal's
    recommended working set; None when the ratio is 0 (no limit) or unreadable.

    The allocator reads the variable once, when it starts: a value set later in the session has
    no effect, and neither does ``torch.mps.set_per_process_memory_fraction`` show here (torch
    keeps no public getter for it).

    Examples:
        >>> mps_limit(16 * 2**30, {}) == int(1.7 * 16 * 2**30), mps_limit(2**30, {"PYTORCH_MPS_HIGH_WATERMARK_RATIO": "0.0"})
        (True, None)
    """
    if recommended is None:
        return None
    environ = os.environ if environ is None else environ
    text = environ.get("PYTORCH_MPS_HIGH_WATERMARK_RATIO")
    try:
        ratio = _backends.MPS_DEFAULT_HIGH_WATERMARK if text is None else float(text)
    except ValueError:
        return None
    return None if ratio <= 0 else int(ratio * recommended)


class MpsReader(Reader):
    """Apple MPS: ``torch.mps``'s two counters, or torch.accelerator's stats where torch routes MPS
    through them (then with exact peaks); Metal's recommended working set for the limit."""

    backend = _backends.MPS
    device_type = "mps"

    def __init__(self, torch: Any, environ=None):
        super().__init__(torch)
        self._environ = os.environ if environ is None else environ
        self._generic: Optional[bool] = None  # torch.accelerator's stats work on MPS here
        self._in_use = False  # an allocator once started stays started: asked until then only

    @property
    def resets_peaks(self) -> bool:  # type: ignore[override]
        return bool(self._generic)

    def _generic_stats(self) -> Optional[dict]:
        """torch.accelerator's stats for MPS ({} before its allocator starts); None where this
        torch does not route MPS through them (before 2.14, assumed) or has no such call (< 2.9)."""
        if self._generic is False:
            return None
        accelerator = getattr(self.torch, "accelerator", None)
        if getattr(accelerator, "memory_stats", None) is None:
            self._generic = False
            return None
        try:
            stats = _flat_stats(self.torch, 0)
        except Exception:  # noqa: BLE001 - "doesn't support device allocator": this torch's MPS is not there
            self._generic = False
            return None
        if stats:
            self._generic = True
        return stats

    def reason(self) -> Optional[str]:
        if self._in_use:
            return None
        stats = self._generic_stats()
        if stats or _seen("mps"):
            self._in_use = True
            return None
        return "MPS not used by your code yet"

    def device_count(self) -> Optional[int]:
        return 1

    def device_indices(self) -> List[int]:
        return [0]

    def counters(self, index: int) -> tuple:
        if self._generic is None:
            self._generic_stats()
        if self._generic:
            return counters_from_stats(_flat_stats(self.torch, 0))
        mps = self.torch.mps
        return int(mps.current_allocated_memory()), int(mps.driver_allocated_memory()), None, None

    def reset_peak(self, index: int) -> None:
        if self._generic:
            self.torch.accelerator.reset_peak_memory_stats(0)

    def properties(self, index: int) -> tuple:
        props = self._props.get(0)
        if props is None:
            recommended = getattr(self.torch.mps, "recommended_max_memory", None)  # torch 2.5+
            total = mps_limit(int(recommended()) if recommended is not None else None, self._environ)
            props = self._props[0] = (_apple_chip_name(), total, None)
        return props

    def device_memory(self, index: int) -> tuple:
        """``(this process's Metal allocations, the limit)``: on unified memory the limit an MPS
        allocation fails at counts this process's driver allocations only."""
        return int(self.torch.mps.driver_allocated_memory()), self.properties(index)[1]

    def empty_cache(self) -> bool:
        if self.reason() is not None:
            return False
        self.torch.mps.empty_cache()
        return True


def _apple_chip_name() -> Optional[str]:
    """"Apple M3 Max" from the kernel (``sysctlbyname``, no process started); None elsewhere."""
    if sys.platform != "darwin":
        return None
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        size = ctypes.c_size_t(0)
        name = b"machdep.cpu.brand_string"
        if libc.sysctlbyname(name, None, ctypes.byref(size), None, 0) != 0 or not 0 < size.value < 256:
            return None
        buf = ctypes.create_string_buffer(size.value)
        if libc.sysctlbyname(name, buf, ctypes.byref(size), None, 0) != 0:
            return None
        return buf.value.decode(errors="replace").strip() or None
    except Exception:  # noqa: BLE001 - a name is a nicety
        return None


class XpuReader(Reader):
    """Intel XPU: torch.xpu's allocator counters (torch.cuda's shape), ``mem_get_info`` for the device."""

    backend = _backends.XPU
    device_type = "xpu"

    def __init__(self, torch: Any):
        super().__init__(torch)
        self._mem_info_failed = False

    def reason(self) -> Optional[str]:
        xpu = getattr(self.torch, "xpu", None)
        if xpu is None:
            return "torch.xpu unavailable"
        return None if xpu.is_initialized() else "XPU not initialized yet"

    def device_count(self) -> Optional[int]:
        # Before XPU is up, torch.xpu.device_count() may start the SYCL runtime (when Level Zero's
        # sysman cannot count): unknown until the user's code starts it.
        if self.reason() is not None:
            return None
        return int(self.torch.xpu.device_count())

    def device_indices(self) -> List[int]:
        """The current device, and any whose allocator holds memory (torch.xpu tells no more)."""
        xpu = self.torch.xpu
        current = xpu.current_device()
        return [i for i in range(xpu.device_count()) if i == current or (self.counters(i)[1] or 0) > 0]

    def counters(self, index: int) -> tuple:
        xpu = self.torch.xpu
        nested = getattr(xpu, "memory_stats_as_nested_dict", None)
        if nested is not None:
            return counters_from_stats(nested(index))
        return counters_from_stats(dict(xpu.memory_stats(index)))

    def reset_peak(self, index: int) -> None:
        self.torch.xpu.reset_peak_memory_stats(index)

    def properties(self, index: int) -> tuple:
        props = self._props.get(index)
        if props is None:
            p = self.torch.xpu.get_device_properties(index)
            uuid = getattr(p, "uuid", None)
            props = self._props[index] = (str(p.name), int(p.total_memory), None if uuid is None else str(uuid))
        return props

    def device_memory(self, index: int) -> tuple:
        """``mem_get_info`` (torch 2.6+, a SYCL 2025 build, Level Zero's sysman): tried until it
        fails once, then the total alone."""
        total = self.properties(index)[1]
        if self._mem_info_failed:
            return None, total
        try:
            free, total2 = self.torch.xpu.mem_get_info(index)
            return max(0, int(total2) - int(free)), int(total2)
        except Exception:  # noqa: BLE001 - old torch, an old compiler, no sysman rights
            self._mem_info_failed = True
            return None, total

    def empty_cache(self) -> bool:
        if self.reason() is not None:
            return False
        self.torch.xpu.empty_cache()
        return True


class GenericReader(Reader):
    """Any other accelerator through ``torch.accelerator`` (torch 2.9+ for the stats, 2.10+ for
    ``get_memory_info``): read once its allocator is up (``memory_stats()`` is ``{}`` before)."""

    backend = _backends.ACCELERATOR

    def __init__(self, torch: Any, device_type: str):
        super().__init__(torch)
        self.device_type = device_type
        self._mem_info_failed = False

    def _stats(self, index: int) -> dict:
        if getattr(getattr(self.torch, "accelerator", None), "memory_stats", None) is None:
            return {}
        return _flat_stats(self.torch, index)

    def reason(self) -> Optional[str]:
        if getattr(getattr(self.torch, "accelerator", None), "memory_stats", None) is None:
            return f"{self.device_type}: this torch has no torch.accelerator memory calls (torch 2.9+)"
        try:
            return None if self._stats(0) else f"{self.device_type} not used by your code yet"
        except Exception as exc:  # noqa: BLE001
            return f"{self.device_type} counters unavailable ({type(exc).__name__})"

    def device_count(self) -> Optional[int]:
        if self.reason() is not None:
            return None
        return int(self.torch.accelerator.device_count())

    def device_indices(self) -> List[int]:
        return [i for i in range(self.device_count() or 0) if self._stats(i)]

    def counters(self, index: int) -> tuple:
        return counters_from_stats(self._stats(index))

    def reset_peak(self, index: int) -> None:
        self.torch.accelerator.reset_peak_memory_stats(index)

    def _memory_info(self, index: int) -> Optional[Tuple[int, int]]:
        info = getattr(self.torch.accelerator, "get_memory_info", None)  # torch 2.10+
        if info is None or self._mem_info_failed:
            return None
        try:
            free, total = info(index)
            return int(free), int(total)
        except Exception:  # noqa: BLE001 - a backend without getMemoryInfo
            self._mem_info_failed = True
            return None

    def properties(self, index: int) -> tuple:
        props = self._props.get(index)
        if props is None:
            name = None
            try:
                module = getattr(self.torch, self.device_type, None)
                name = str(module.get_device_properties(index).name)
            except Exception:  # noqa: BLE001 - a name is a nicety
                pass
            info = self._memory_info(index)
            props = self._props[index] = (name, None if info is None else info[1], None)
        return props

    def device_memory(self, index: int) -> tuple:
        info = self._memory_info(index)
        if info is None:
            return None, self.properties(index)[1]
        free, total = info
        return max(0, total - free), total

    def empty_cache(self) -> bool:
        if self.reason() is not None:
            return False
        self.torch.accelerator.empty_cache()
        return True


def reader_for(torch: Any, backend: Optional[_backends.Backend]) -> Optional[Reader]:
    """The reader of a non-CUDA ``backend`` (:func:`~.backends.detect`'s answer); None for CUDA,
    ROCm (torch.cuda's own path) and a CPU-only build."""
    if backend is None or backend.key in ("cuda", "rocm"):
        return None
    if backend is _backends.MPS:
        return MpsReader(torch)
    if backend is _backends.XPU:
        return XpuReader(torch)
    try:
        kind = torch.accelerator.current_accelerator().type
    except Exception:  # noqa: BLE001
        return None
    return GenericReader(torch, str(kind))


class AmdsmiProbe:
    """Device-wide memory and processes of AMD GPUs through amdsmi, the ROCm counterpart of NVML.

    Only the ``amdsmi`` module torch itself loaded is used (``sys.modules``): a ROCm build of torch
    imports it when ``torch.cuda`` loads, through a hook that keeps a single copy of
    ``libamd_smi.so`` in the process; importing it again here could load a second one. Without it,
    this reads nothing and the probe falls back to ``torch.cuda.mem_get_info`` on devices that
    already have a context.
    """

    def __init__(self, amdsmi_module=None, environ=None):
        self._amdsmi = amdsmi_module
        self._environ = os.environ if environ is None else environ
        self._state = "new"  # new | ok | failed
        self.reason: Optional[str] = None
        self._handles: dict = {}

    def _module(self):
        return self._amdsmi if self._amdsmi is not None else sys.modules.get("amdsmi")

    def _init(self) -> bool:
        if self._state != "new":
            return self._state == "ok"
        smi = self._module()
        if smi is None:
            self.reason = "amdsmi not loaded by torch"
            return False  # not remembered: torch may load it later
        try:
            smi.amdsmi_init()
            self._state = "ok"
        except Exception as exc:  # noqa: BLE001 - AmdSmiLibraryException, no driver...
            self._state, self.reason = "failed", f"amdsmi unavailable ({type(exc).__name__})"
        return self._state == "ok"

    def _visible(self) -> Optional[list]:
        for name in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
            value = self._environ.get(name)
            if value is not None:
                return parse_visible_devices(value)
        return None

    def handle(self, torch_index: int):
        """The amdsmi handle of torch's (HIP's) device ``torch_index``, or None.

        HIP's index is mapped as torch does: through ``HIP_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES``
        to a physical HIP id, then to the handle whose ``amdsmi_get_gpu_enumeration_info`` reports that
        ``hip_id`` (ROCm 6.4+). Without that information only an unambiguous case is read (one GPU,
        or nothing hidden), never a guess that could report another card's memory.
        """
        if torch_index in self._handles:
            return self._handles[torch_index]
        found = None
        if self._init():
            smi = self._module()
            try:
                handles = list(smi.amdsmi_get_processor_handles())
                visible = self._visible()
                if visible is not None and visible and not isinstance(visible[0], int):
                    visible = None if len(handles) == 1 else []  # UUIDs: not mapped here
                physical = torch_index if visible is None else (visible[torch_index] if torch_index < len(visible)
                                                               else None)
                by_hip = {}
                for h in handles:
                    try:
                        info = smi.amdsmi_get_gpu_enumeration_info(h)
                        if "hip_id" in info:
                            by_hip[int(info["hip_id"])] = h
                    except Exception:  # noqa: BLE001 - before ROCm 6.4
                        pass
                if physical is not None:
                    if by_hip:
                        found = by_hip.get(physical)
                    elif len(handles) == 1 or (visible is None and physical < len(handles)):
                        found = handles[physical] if physical < len(handles) else None
            except Exception:  # noqa: BLE001
                found = None
        self._handles[torch_index] = found
        return found

    def memory(self, torch_index: int, total: Optional[int] = None) -> tuple:
        """``(used, total)`` bytes of the whole device (every process), ``total`` torch's when given.

        ``amdsmi_get_gpu_memory_usage(handle, VRAM)`` gives bytes; older amdsmi only
        ``amdsmi_get_gpu_vram_usage``, whose ``vram_used`` is in MB (torch multiplies it by 2**20).
        """
        handle = self.handle(torch_index)
        if handle is None:
            return None, None
        smi = self._module()
        kind = getattr(getattr(smi, "AmdSmiMemoryType", None), "VRAM", None)
        try:
            if kind is not None and hasattr(smi, "amdsmi_get_gpu_memory_usage"):
                used = int(smi.amdsmi_get_gpu_memory_usage(handle, kind))
                if total is None and hasattr(smi, "amdsmi_get_gpu_memory_total"):
                    total = int(smi.amdsmi_get_gpu_memory_total(handle, kind))
                return used, total
        except Exception:  # noqa: BLE001 - try the older call
            pass
        try:
            usage = smi.amdsmi_get_gpu_vram_usage(handle)
            used = int(usage["vram_used"]) * 2**20
            return used, (int(usage["vram_total"]) * 2**20 if total is None else total)
        except Exception:  # noqa: BLE001
            return None, None

    def processes(self, torch_index: int) -> list:
        """``[(pid, VRAM bytes or None, name or None)]`` of the processes on the device (slow: on demand)."""
        handle = self.handle(torch_index)
        if handle is None:
            return []
        smi = self._module()
        try:
            listed = smi.amdsmi_get_gpu_process_list(handle)
        except Exception:  # noqa: BLE001
            return []
        out = []
        for item in listed:
            info = item
            if not isinstance(info, dict):  # amdsmi before 6.1 lists handles: ask each one
                try:
                    info = smi.amdsmi_get_gpu_process_info(handle, item)
                except Exception:  # noqa: BLE001
                    continue
            try:
                pid = int(info["pid"])
            except (KeyError, TypeError, ValueError):
                continue
            usage = info.get("memory_usage") or {}
            vram = usage.get("vram_mem") if isinstance(usage, dict) else None
            name = info.get("name")
            out.append((pid, None if vram is None else int(vram),
                        None if name in (None, "", "N/A") else str(name)))
        return out
