"""Which memory figures each accelerator torch knows keeps, since which torch, and what stands in where one is missing.

One table for CUDA, ROCm, Apple MPS, Intel XPU and torch's device-neutral ``torch.accelerator``:
for each figure the probes read (allocated, reserved, peak, device total, device used, other
processes) and each action ``%gpumem`` takes (empty the cache, reset the peak, a snapshot), the
public call that reads or does it, the first torch release that has it, and, where a device keeps
none, what is shown instead: a sampled peak on MPS (the highest value read), otherwise the words of
:meth:`Backend.missing`, never a zero. The sources of every row are in ``tests/fixtures/backends/SOURCES.md``.

:func:`detect` says which backend a torch build uses from build flags alone: it initializes no
device and imports nothing.
"""
from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Tuple

__all__ = ["FIGURES", "Counter", "Backend", "BACKENDS", "CUDA", "ROCM", "MPS", "XPU", "ACCELERATOR", "detect",
           "for_device_type", "torch_version", "at_least", "MPS_DEFAULT_HIGH_WATERMARK"]

#: The figures and actions of the table, in the order views list them.
FIGURES = ("allocated", "reserved", "peak", "reset_peak", "device_total", "device_used", "other_processes",
           "empty_cache", "snapshot")

#: ``PYTORCH_MPS_HIGH_WATERMARK_RATIO``'s default: MPS refuses an allocation once the process's
#: Metal allocations would pass this times Metal's recommended working set
#: (``aten/src/ATen/mps/MPSAllocator.h``, ``default_high_watermark_ratio``).
MPS_DEFAULT_HIGH_WATERMARK = 1.7


class Counter(NamedTuple):
    """One figure (or action) on one backend.

    Attributes:
        figure: one of :data:`FIGURES`.
        source: the public call that reads it (``"torch.mps.current_allocated_memory()"``); None
            where the backend keeps no such figure.
        since: the first torch release with ``source`` (``"2.0"``); None for a vendor library's call
            (NVML, amdsmi) or where nothing exists.
        stand_in: what is shown when ``source`` is None: ``"sampled"`` (the highest value read) or
            None (the figure is left out and :meth:`Backend.missing` says why).
        note: why, in a few words (shown in docs/usage.md's table and by :meth:`Backend.missing`).
    """

    figure: str
    source: Optional[str]
    since: Optional[str] = None
    stand_in: Optional[str] = None
    note: str = ""


class Backend(NamedTuple):
    """One accelerator as torch exposes it.

    Attributes:
        key: ``"cuda"``, ``"rocm"``, ``"mps"``, ``"xpu"`` or ``"accelerator"``.
        title: how docs/usage.md and the views name it ("Apple MPS").
        device_type: torch's device type (``"cuda"`` on ROCm too: a HIP build keeps torch.cuda's
            names); ``""`` for ``torch.accelerator``, which stands for whichever torch was built for.
        module: the torch module of its own calls (``"torch.mps"``).
        counters: one :class:`Counter` per figure of :data:`FIGURES`.
        alloc_env: the environment variable its out-of-memory message tells users to set.
        single_device: torch names it without an index (``mps``: one device per machine).
        since: the first torch release with the backend's memory calls.
    """

    key: str
    title: str
    device_type: str
    module: str
    counters: Tuple[Counter, ...]
    alloc_env: Optional[str] = None
    single_device: bool = False
    since: Optional[str] = None

    def counter(self, figure: str) -> Counter:
        """The row for ``figure`` (a :data:`FIGURES` name)."""
        for row in self.counters:
            if row.figure == figure:
                return row
        raise KeyError(f"{figure!r} is not a figure of the backend table: one of {', '.join(FIGURES)}")

    def has(self, figure: str, version: Optional[Tuple[int, int]] = None) -> bool:
        """True when the backend keeps ``figure`` (in torch ``version``, when given)."""
        row = self.counter(figure)
        if row.source is None:
            return False
        return version is None or row.since is None or at_least(version, row.since)

    def missing(self, figure: str) -> Optional[str]:
        """The words shown instead of a figure this backend does not keep; None when it keeps it.

        A sampled stand-in says so ("peak: the highest value sampled ..."); a figure nobody can
        read says "not available on ..." and why, so a view never shows a zero for it.
        """
        row = self.counter(figure)
        if row.source is not None:
            return None
        label = _LABELS.get(figure, figure)
        if row.stand_in == "sampled":
            return f"{label}: the highest value sampled ({row.note})"
        return f"{label} not available on {self.title}" + (f": {row.note}" if row.note else "")


_LABELS = {"allocated": "allocated", "reserved": "reserved", "peak": "peak", "reset_peak": "peak reset",
           "device_total": "device total", "device_used": "device used", "other_processes": "other processes",
           "empty_cache": "empty_cache()", "snapshot": "memory snapshot"}


def _c(figure: str, source: Optional[str], since: Optional[str] = None, stand_in: Optional[str] = None,
       note: str = "") -> Counter:
    return Counter(figure, source, since, stand_in, note)


#: NVIDIA CUDA: torch's caching allocator, NVML for the device.
CUDA = Backend("cuda", "CUDA", "cuda", "torch.cuda", (
    _c("allocated", "torch.cuda.memory_stats()['allocated_bytes.all.current']", "1.4"),
    _c("reserved", "torch.cuda.memory_stats()['reserved_bytes.all.current']", "1.4"),
    _c("peak", "torch.cuda.memory_stats()['allocated_bytes.all.peak']", "1.4"),
    _c("reset_peak", "torch.cuda.reset_peak_memory_stats()", "1.4"),
    _c("device_total", "torch.cuda.get_device_properties(i).total_memory", "1.0"),
    _c("device_used", "NVML nvmlDeviceGetMemoryInfo (nvidia-ml-py), else torch.cuda.mem_get_info()",
       note="all processes"),
    _c("other_processes", "NVML nvmlDeviceGetComputeRunningProcesses"),
    _c("empty_cache", "torch.cuda.empty_cache()", "1.0"),
    _c("snapshot", "torch.cuda.memory._snapshot()", "2.1"),
), alloc_env="PYTORCH_CUDA_ALLOC_CONF", since="1.4")

#: AMD ROCm: a HIP build keeps torch.cuda's counters; amdsmi (not NVML) sees the whole device.
ROCM = Backend("rocm", "ROCm", "cuda", "torch.cuda", (
    _c("allocated", "torch.cuda.memory_stats()['allocated_bytes.all.current'] (HIP build)", "1.4"),
    _c("reserved", "torch.cuda.memory_stats()['reserved_bytes.all.current'] (HIP build)", "1.4"),
    _c("peak", "torch.cuda.memory_stats()['allocated_bytes.all.peak'] (HIP build)", "1.4"),
    _c("reset_peak", "torch.cuda.reset_peak_memory_stats()", "1.4"),
    _c("device_total", "torch.cuda.get_device_properties(i).total_memory", "1.0"),
    _c("device_used", "amdsmi amdsmi_get_gpu_memory_usage(VRAM), else amdsmi_get_gpu_vram_usage (MiB), "
                      "else torch.cuda.mem_get_info()", note="all processes; the amdsmi module torch loaded"),
    _c("other_processes", "amdsmi amdsmi_get_gpu_process_list"),
    _c("empty_cache", "torch.cuda.empty_cache()", "1.0"),
    _c("snapshot", "torch.cuda.memory._snapshot()", "2.1"),
), alloc_env="PYTORCH_HIP_ALLOC_CONF", since="1.4")

#: Apple MPS: torch.mps keeps two counters and Metal's recommended working set; no peak, no stats
#: dict (torch.accelerator's generic stats reach MPS only from pytorch/pytorch#186748, merged after
#: the 2.13 branch cut: assumed 2.14).
MPS = Backend("mps", "MPS", "mps", "torch.mps", (
    _c("allocated", "torch.mps.current_allocated_memory()", "2.0", note="tensors only"),
    _c("reserved", "torch.mps.driver_allocated_memory()", "2.0",
       note="Metal driver's allocations for the process: the pool's cache and MPSGraph's too"),
    _c("peak", None, stand_in="sampled",
       note="torch.mps keeps no peak counter before torch.accelerator reaches MPS (2.14, assumed)"),
    _c("reset_peak", None, note="no peak counter to reset; the sampled peak starts again each cell"),
    _c("device_total", "torch.mps.recommended_max_memory()", "2.5",
       note="Metal's recommended working set; the out-of-memory limit is the high-watermark ratio "
            f"(PYTORCH_MPS_HIGH_WATERMARK_RATIO, default {MPS_DEFAULT_HIGH_WATERMARK}) times it"),
    _c("device_used", None, note="unified memory: the GPU uses the host's RAM (see host RSS)"),
    _c("other_processes", None, note="Metal lists no other processes"),
    _c("empty_cache", "torch.mps.empty_cache()", "2.0"),
    _c("snapshot", None, note="MPS records no allocator history"),
), alloc_env="PYTORCH_MPS_HIGH_WATERMARK_RATIO", single_device=True, since="2.0")

#: Intel XPU: torch.xpu mirrors torch.cuda's allocator counters; the device view needs Level Zero.
XPU = Backend("xpu", "XPU", "xpu", "torch.xpu", (
    _c("allocated", "torch.xpu.memory_stats()['allocated_bytes.all.current']", "2.5"),
    _c("reserved", "torch.xpu.memory_stats()['reserved_bytes.all.current']", "2.5"),
    _c("peak", "torch.xpu.memory_stats()['allocated_bytes.all.peak']", "2.5"),
    _c("reset_peak", "torch.xpu.reset_peak_memory_stats()", "2.5"),
    _c("device_total", "torch.xpu.get_device_properties(i).total_memory", "2.4"),
    _c("device_used", "torch.xpu.mem_get_info()", "2.6",
       note="all processes, through Level Zero's sysman (may need root or CAP_PERFMON; "
            "needs a SYCL 2025 build)"),
    _c("other_processes", None, note="torch.xpu lists no processes"),
    _c("empty_cache", "torch.xpu.empty_cache()", "2.4"),
    _c("snapshot", "torch.xpu.memory._snapshot()", "2.11"),
), alloc_env="PYTORCH_XPU_ALLOC_CONF", since="2.5")

#: torch.accelerator: the device-neutral calls, for whichever accelerator torch was built for.
ACCELERATOR = Backend("accelerator", "torch.accelerator", "", "torch.accelerator", (
    _c("allocated", "torch.accelerator.memory_stats()['allocated_bytes.all.current']", "2.9"),
    _c("reserved", "torch.accelerator.memory_stats()['reserved_bytes.all.current']", "2.9"),
    _c("peak", "torch.accelerator.memory_stats()['allocated_bytes.all.peak']", "2.9"),
    _c("reset_peak", "torch.accelerator.reset_peak_memory_stats()", "2.9"),
    _c("device_total", "torch.accelerator.get_memory_info()[1]", "2.10"),
    _c("device_used", "torch.accelerator.get_memory_info(): total - free", "2.10", note="all processes"),
    _c("other_processes", None, note="torch.accelerator lists no processes"),
    _c("empty_cache", "torch.accelerator.empty_cache()", "2.9"),
    _c("snapshot", None, note="torch.accelerator has no snapshot of its own"),
), since="2.9")

#: Every backend, by key.
BACKENDS: Dict[str, Backend] = {b.key: b for b in (CUDA, ROCM, MPS, XPU, ACCELERATOR)}


def for_device_type(kind: str) -> Backend:
    """The row for a torch device type: ``"cuda"`` (CUDA and ROCm read alike), ``"mps"``, ``"xpu"``;
    any other accelerator is ``torch.accelerator``'s."""
    return {"cuda": CUDA, "mps": MPS, "xpu": XPU}.get(kind, ACCELERATOR)


def torch_version(torch: Any) -> Optional[Tuple[int, int]]:
    """``(major, minor)`` of a torch module's ``__version__`` (``"2.13.0+cpu"`` -> ``(2, 13)``); None if unreadable."""
    text = str(getattr(torch, "__version__", "") or "")
    parts = text.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return None


def at_least(version: Tuple[int, int], since: str) -> bool:
    """True when ``version`` is ``since`` (``"2.10"``) or later.

    Examples:
        >>> at_least((2, 10), "2.9"), at_least((2, 9), "2.10")
        (True, False)
    """
    major, _, minor = since.partition(".")
    return tuple(version) >= (int(major), int(minor or 0))


def detect(torch: Any) -> Optional[Backend]:
    """The backend a torch build was made for, from build flags only; None for a CPU-only build.

    Reads ``torch.version.hip`` (ROCm), ``torch.accelerator.current_accelerator()`` (torch 2.6+:
    "the accelerator available at compilation time", a build flag that initializes nothing), then
    for older torch ``torch.version.cuda``, ``torch.backends.mps.is_built()`` and
    ``torch.version.xpu``. Never calls ``is_available()`` or ``device_count()``: on XPU and CUDA
    those may start the driver.
    """
    if torch is None:
        return None
    version = getattr(torch, "version", None)
    try:
        if getattr(version, "hip", None):
            return ROCM
    except Exception:  # noqa: BLE001 - a broken attribute is "not this one"
        pass
    accelerator = getattr(torch, "accelerator", None)
    current = getattr(accelerator, "current_accelerator", None)
    if current is not None:
        try:
            device = current()
            kind = getattr(device, "type", None) if device is not None else None
            if kind is not None:
                return {"cuda": CUDA, "mps": MPS, "xpu": XPU}.get(kind, ACCELERATOR)
            return None
        except Exception:  # noqa: BLE001 - fall back to the build flags of older torch
            pass
    try:
        if getattr(version, "cuda", None):
            return CUDA
        mps = getattr(getattr(torch, "backends", None), "mps", None)
        if mps is not None and mps.is_built():
            return MPS
        if getattr(version, "xpu", None):
            return XPU
    except Exception:  # noqa: BLE001
        return None
    return None
