"""Read memory counters (host RSS, torch's CUDA allocator, NVML) without importing torch or initializing CUDA.

Everything here is a cheap read that runs before and after every cell. Unavailability is a value,
not an exception: a probe that cannot read something returns None and says why in ``reason``.
The only state a probe ever changes is the peak counters (the kernel's RSS high-water mark and
torch's peak statistics), and only when asked: :meth:`MemoryProbe.start` with ``reset_peaks``,
:meth:`HostProbe.reset_peak`, :meth:`CudaProbe.reset_peak` (the extension asks only while
``track_peaks`` is on). A probe never creates a CUDA context: devices the user's code has not
touched are reported as such, never read.

The accelerator is whichever torch was built for (:mod:`.backends`): CUDA, and ROCm through the
same torch.cuda counters with amdsmi instead of NVML for the device view, are read here; Apple MPS,
Intel XPU and other ``torch.accelerator`` devices through the readers of :mod:`.accelerators`,
loaded only when torch is such a build.
"""
from __future__ import annotations

import os
import sys
import time
import weakref
from typing import NamedTuple, Optional, Sequence

from .counters import counters_from_stats
from .devices import device as _device, parse_visible_devices
from .procfs import HeldRead

__all__ = [
    "HostSample",
    "DeviceSample",
    "Sample",
    "HostProbe",
    "CudaProbe",
    "NvmlProbe",
    "MemoryProbe",
]


class HostSample(NamedTuple):
    """Process memory at one instant, in bytes (None where the platform cannot tell)."""

    rss: int | None
    #: Peak RSS since the last :meth:`HostProbe.reset_peak` (or since process start if the
    #: platform cannot reset it).
    peak_rss: int | None


class DeviceSample(NamedTuple):
    """One accelerator device at one instant, in bytes; ``index`` is torch's device index, ``type``
    torch's device type (``"cuda"``, also on ROCm; ``"mps"``, ``"xpu"``...).

    ``reserved`` is the caching allocator's reservation; on MPS (before torch.accelerator covers it)
    the Metal driver's allocations for the process. A figure the backend keeps none of is None
    (``ipy_gpumem.core.backends`` says which), never 0.
    """

    index: int
    allocated: int | None
    reserved: int | None
    peak_allocated: int | None
    peak_reserved: int | None
    #: Device-wide memory in use, all processes included (NVML, amdsmi, or cudaMemGetInfo); on MPS
    #: this process's Metal allocations, what its out-of-memory limit counts.
    used: int | None
    total: int | None
    type: str = "cuda"

    @property
    def device(self):
        """The :class:`~.devices.Device` (``cuda:0``, ``mps``, ``xpu:1``)."""
        return _device(self.type, self.index)


# ``NamedTuple(...)`` runs a Python ``__new__``; the readings taken after every cell are made in C.
_new = tuple.__new__


class Sample(NamedTuple):
    """Host and device memory at one instant (``time.perf_counter()`` seconds)."""

    t: float
    host: HostSample
    devices: tuple  # of DeviceSample, only devices torch has initialized
    #: Why ``devices`` is empty, e.g. "torch is not imported", "CUDA not initialized yet".
    reason: str | None = None


# --------------------------------------------------------------------------------------------
# Host memory
# --------------------------------------------------------------------------------------------

#: A high-water mark within this of the current RSS counts as "at the current RSS": the kernel's
#: per-CPU RSS counters are only that precise anyway.
PEAK_SLACK = 256 * 1024


class HostProbe:
    """Process RSS and its peak: /proc on Linux (about 1 us a read), psutil elsewhere.

    On Linux the per-cell peak comes from the kernel's RSS high-water mark (``VmHWM``, also what
    ``getrusage().ru_maxrss`` reports): writing ``5`` to ``/proc/self/clear_refs`` resets it to
    the current RSS, so the peak we read after a cell is the true peak during that cell, not a
    sampled one. That reset is the one side effect, and it is made only when asked.
    """

    def __init__(self, psutil_module=None, use_procfs: bool | None = None):
        self._pid = None
        self._reopen_pending = False
        self._statm = None  # fd of /proc/self/statm, kept open: a pread is 10x cheaper than open+read
        self._read_statm = HeldRead(128)  # and read holding the GIL (procfs.py says why)
        self._status = None  # fd of /proc/self/status, only when getrusage cannot give the peak
        self._clear_refs = None
        self._resource = None
        self._rusage_floor = 0  # ru_maxrss never reads below this (see _choose_peak_source)
        self._peak_source_chosen = False
        # True when the last paired reading found the high-water mark at the current RSS: then a
        # new span needs no reset (the costliest call here: it takes the mm write lock).
        self.peak_is_current = False
        self._page = 4096
        self._psutil = psutil_module
        self._process = None
        self._use_procfs = sys.platform.startswith("linux") if use_procfs is None else use_procfs
        self.can_reset_peak = False
        self.backend = None
        self.reason = None
        self._open()
        _watch_forks(self)

    def _open(self) -> None:
        self.close()
        self._pid = os.getpid()
        if self._use_procfs:
            try:
                self._statm = os.open("/proc/self/statm", os.O_RDONLY)
                self._page = os.sysconf("SC_PAGE_SIZE")
                self.backend = "procfs"
                self.reason = None
            except (OSError, ValueError, AttributeError):
                self._statm = None
            if self._statm is not None:
                try:
                    import resource  # stdlib, Unix only: getrusage reads the peak in ~1 us

                    self._resource = resource
                except ImportError:
                    self._resource = None
                try:
                    # Opening writes nothing: the high-water mark is reset only when a reset is asked
                    # for (track_peaks), never at load.
                    self._clear_refs = os.open("/proc/self/clear_refs", os.O_WRONLY)
                    self.can_reset_peak = True
                except OSError:  # some containers forbid it; peaks then come from samples
                    self._clear_refs = None
                    self.can_reset_peak = False
                return
        try:
            psutil = self._psutil
            if psutil is None:
                import psutil  # an install_requires dependency; only needed off Linux
            self._process = psutil.Process()
            self.backend = "psutil"
            self.reason = None
        except Exception as exc:  # noqa: BLE001 - any failure just means "unknown"
            self._process = None
            self.backend = None
            self.reason = f"host memory unavailable ({type(exc).__name__})"

    def close(self) -> None:
        """Release the file descriptors (on unload)."""
        for fd in (self._statm, self._clear_refs, self._status):  # noqa: B007
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._statm = self._clear_refs = self._status = None
        self._process = None
        self.can_reset_peak = False

    def _after_fork(self) -> None:
        # A child (DataLoader worker, a sealed estimate) inherits our /proc/self fds, which still
        # describe the parent: closed now, reopened when the child first reads (a child that never
        # reads, such as the sealed copy of an estimate, then opens nothing, and asks for nothing
        # its seal would have to refuse).
        if self._pid is not None and self._pid != os.getpid():
            self.close()
            self._reopen_pending = True

    def _reopen(self) -> bool:
        """After a fork, open this process's own /proc/self files on first use; True if it did."""
        if not self._reopen_pending:
            return False
        self._reopen_pending = False
        self._open()
        return True

    def rss(self) -> int | None:
        """Resident set size of this process, in bytes."""
        if self._statm is not None:
            try:
                return int(self._read_statm(self._statm).split(None, 2)[1]) * self._page
            except (OSError, ValueError, IndexError):
                return None
        if self._process is not None:
            try:
                return int(self._process.memory_info().rss)
            except Exception:  # noqa: BLE001 - psutil may raise anything from AccessDenied up
                return None
        return self.rss() if self._reopen() else None

    def peak_rss(self) -> int | None:
        """Peak RSS since the last reset (Linux, Windows), or None where the OS keeps none."""
        if self._statm is not None:
            try:
                value = self._resource.getrusage(self._resource.RUSAGE_SELF).ru_maxrss * 1024
                if value > self._rusage_floor:
                    return value
                return self._status_hwm()
            except (OSError, ValueError, AttributeError):
                return None
        if self._process is not None:
            try:
                info = self._process.memory_info()
                peak = getattr(info, "peak_wset", None)  # Windows; macOS keeps no resettable peak
                return None if peak is None else int(peak)
            except Exception:  # noqa: BLE001
                return None
        return self.peak_rss() if self._reopen() else None

    def rss_after_reset(self) -> int | None:
        """The RSS right after :meth:`reset_peak`: the reset high-water mark, one cheap syscall.

        A reset sets the high-water mark to the current RSS, so ``getrusage`` (about 1 us) reads
        the current RSS too, where a ``/proc/self/statm`` read costs 5-10x more in a busy kernel.
        """
        try:
            value = self._resource.getrusage(self._resource.RUSAGE_SELF).ru_maxrss * 1024
            if value > self._rusage_floor:
                return value
        except (OSError, ValueError, AttributeError):
            pass
        return self.rss()

    def _status_hwm(self) -> int | None:
        if self._status is None:
            self._status = os.open("/proc/self/status", os.O_RDONLY)
        text = os.pread(self._status, 8192, 0)
        start = text.index(b"VmHWM:") + 6
        return int(text[start:text.index(b"kB", start)]) * 1024

    def _choose_peak_source(self) -> None:
        # getrusage's ru_maxrss is ~10x cheaper than parsing /proc/self/status, and after a reset
        # it equals VmHWM, except that it never drops below the largest RSS the kernel remembered
        # at exec (signal->maxrss: a Jupyter kernel inherits its launcher's). That floor is
        # measured once, at the first reset (a reset is what makes it visible): above it getrusage
        # is exact, at it we read VmHWM itself.
        self._peak_source_chosen = True
        try:
            os.write(self._clear_refs, b"5")
            if self._resource is not None:
                via_rusage = self._resource.getrusage(self._resource.RUSAGE_SELF).ru_maxrss * 1024
                via_status = self._status_hwm()
                self._rusage_floor = via_rusage if via_rusage - via_status > 4 * 2**20 else 0
        except (OSError, ValueError):
            self._resource = None

    def reset_peak(self) -> bool:
        """Reset the kernel's RSS high-water mark to the current RSS; False if unsupported."""
        if self._clear_refs is None:
            return self.reset_peak() if self._reopen() else False
        try:
            if not self._peak_source_chosen:
                self._choose_peak_source()
            os.write(self._clear_refs, b"5")
            self.peak_is_current = True
            return True
        except OSError:
            self.can_reset_peak = False
            self._clear_refs = None
            return False

    def sample(self) -> HostSample:
        """Current RSS and peak RSS together (and whether the peak is at the current RSS)."""
        rss, peak = self.rss(), self.peak_rss()
        self.peak_is_current = rss is not None and peak is not None and peak - rss <= PEAK_SLACK
        return _new(HostSample, (rss, peak))



# One fork handler per process, however often the extension is loaded (os.register_at_fork cannot
# unregister): it reopens the /proc/self descriptors of every live HostProbe in the child.
_HOST_PROBES: "weakref.WeakSet[HostProbe]" = weakref.WeakSet()
_FORK_HANDLER = {"registered": False}


def _watch_forks(probe: HostProbe) -> None:
    _HOST_PROBES.add(probe)
    if not _FORK_HANDLER["registered"] and hasattr(os, "register_at_fork"):
        # Checked at fork time rather than with a getpid() on every read (this is the hot path).
        os.register_at_fork(after_in_child=_reopen_after_fork)
        _FORK_HANDLER["registered"] = True


def _reopen_after_fork() -> None:
    for probe in list(_HOST_PROBES):
        try:
            probe._after_fork()
        except Exception:  # noqa: BLE001 - a fork handler must never fail the fork
            pass


# --------------------------------------------------------------------------------------------
# CUDA devices
# --------------------------------------------------------------------------------------------

#: Why a CPU-only build of torch shows no CUDA device (it never will, unlike "not initialized yet").
CPU_ONLY = "this torch build has no CUDA (a CPU-only build)"


class NvmlProbe:
    """Device-wide used/total memory and the process list through NVML (``nvidia-ml-py``).

    NVML is initialized lazily, the first time a CUDA device is sampled, so loading the
    extension on a machine without a GPU costs nothing. A failure is remembered: NVML is not
    retried on every cell.
    """

    def __init__(self, pynvml_module=None, environ=None):
        self._pynvml = pynvml_module
        self._environ = os.environ if environ is None else environ
        self._state = "new"  # new | ok | failed
        self.reason = None
        self._handles: dict = {}

    def _init(self) -> bool:
        if self._state == "ok":
            return True
        if self._state == "failed":
            return False
        try:
            if self._pynvml is None:
                import pynvml  # provided by nvidia-ml-py

                self._pynvml = pynvml
            self._pynvml.nvmlInit()
            self._state = "ok"
            return True
        except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, ImportError, ...
            self._state = "failed"
            self.reason = f"NVML unavailable ({type(exc).__name__})"
            return False

    def handle(self, torch_index: int, uuid: str | None = None):
        """The NVML handle of torch's device ``torch_index``.

        By the UUID torch reports when it has one: a whole GPU is ``GPU-<uuid>`` to NVML, a MIG
        slice ``MIG-<uuid>``. A UUID that matches neither gives no handle (None), never the
        device at the same index: on a MIG slice that would be the whole parent GPU, with other
        tenants' memory and processes. Without a UUID (old torch), through CUDA_VISIBLE_DEVICES.
        """
        if torch_index in self._handles:
            return self._handles[torch_index]
        handle = None
        if self._init():
            if uuid:
                handle = self._handle_by_uuid(uuid)
            else:
                try:
                    handle = self._handle_by_visible_index(torch_index)
                except Exception:  # noqa: BLE001
                    handle = None
        self._handles[torch_index] = handle
        return handle

    def _handle_by_uuid(self, uuid: str):
        nvml = self._pynvml
        names = [uuid] if uuid.startswith(("GPU-", "MIG-")) else ["GPU-" + uuid, "MIG-" + uuid]
        for name in names:
            try:
                return nvml.nvmlDeviceGetHandleByUUID(name)
            except Exception:  # noqa: BLE001 - not this prefix: try the next
                continue
        return None

    def _handle_by_visible_index(self, torch_index: int):
        nvml = self._pynvml
        visible = parse_visible_devices(self._environ.get("CUDA_VISIBLE_DEVICES"))
        if visible is None:
            return nvml.nvmlDeviceGetHandleByIndex(torch_index)
        if torch_index >= len(visible):
            return None
        wanted = visible[torch_index]
        if isinstance(wanted, int):
            return nvml.nvmlDeviceGetHandleByIndex(wanted)
        if wanted.startswith("MIG-"):
            return None  # a MIG slice's memory comes from cudaMemGetInfo instead
        matches = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = nvml.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            if uuid.startswith(wanted):
                matches.append(h)
        return matches[0] if len(matches) == 1 else None

    def memory(self, torch_index: int, uuid: str | None = None, total: Optional[int] = None) -> tuple:
        """``(used, total)`` bytes for the whole device, or ``(None, None)``.

        NVML's v1 numbers count the memory the driver reserves for itself in both ``total`` and
        ``used``; torch's total (and the "total capacity" in its out-of-memory message) does not.
        So with ``total`` (torch's) given, ``used`` is the v2 struct's, which leaves the driver's
        reservation out, or v1's minus the difference of the two totals on drivers without v2,
        and the total returned is torch's: one total for the per-cell line, the chart and the
        OOM panel alike.
        """
        handle = self.handle(torch_index, uuid)
        if handle is None:
            return None, None
        nvml = self._pynvml
        version = getattr(nvml, "nvmlMemory_v2", None)
        if total is not None and version is not None:
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
                return int(info.used), int(total)
            except Exception:  # noqa: BLE001 - drivers before R510 have no v2: read v1 below
                pass
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
        except Exception:  # noqa: BLE001
            return None, None
        used, nvml_total = int(info.used), int(info.total)
        if total is None:
            return used, nvml_total
        return max(0, used - max(0, nvml_total - int(total))), int(total)

    def visible_count(self) -> Optional[int]:
        """How many devices CUDA will see (NVML's count through CUDA_VISIBLE_DEVICES), or None."""
        if not self._init():
            return None
        try:
            count = int(self._pynvml.nvmlDeviceGetCount())
        except Exception:  # noqa: BLE001
            return None
        visible = parse_visible_devices(self._environ.get("CUDA_VISIBLE_DEVICES"))
        if visible is None:
            return count
        if visible and isinstance(visible[0], int):
            return len([i for i in visible if i < count])
        return len(visible)

    def processes(self, torch_index: int, uuid: str | None = None) -> list:
        """``[(pid, bytes or None, name or None)]`` of compute processes (slow: ~5 ms; on demand only)."""
        handle = self.handle(torch_index, uuid)
        if handle is None:
            return []
        nvml = self._pynvml
        try:
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:  # noqa: BLE001
            return []
        out = []
        for proc in procs:
            used = getattr(proc, "usedGpuMemory", None)
            try:
                name = nvml.nvmlSystemGetProcessName(proc.pid)
                name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            except Exception:  # noqa: BLE001
                name = None
            out.append((int(proc.pid), None if used is None else int(used), name))
        return out

    def process_memory(self, pids) -> dict:
        """``{pid: {nvml index: bytes}}`` of the ``pids`` among every device's compute processes.

        For processes seen from outside (a launched rank): NVML's per-process use, context and
        cache included. Slow (~5 ms a device, the driver's global lock): callers poll it at a few
        Hz at most. Initializes NVML (never CUDA); {} without a driver. In a container NVML lists
        host pids, which match none of ours: then {} too.
        """
        wanted = set(pids)
        if not wanted or not self._init():
            return {}
        nvml = self._pynvml
        out: dict = {}
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception:  # noqa: BLE001
            return {}
        for index in range(count):
            try:
                procs = nvml.nvmlDeviceGetComputeRunningProcesses(nvml.nvmlDeviceGetHandleByIndex(index))
            except Exception:  # noqa: BLE001
                continue
            for proc in procs:
                used = getattr(proc, "usedGpuMemory", None)
                if proc.pid in wanted and used is not None:
                    out.setdefault(int(proc.pid), {})[index] = int(used)
        return out

    def shutdown(self) -> None:
        if self._state == "ok":
            try:
                self._pynvml.nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
        self._state = "new"
        self._handles.clear()


class CudaProbe:
    """torch's CUDA caching-allocator counters, read through ``sys.modules`` only.

    Never imports torch (it is the user's) and never initializes CUDA: until the user's own code
    has initialized it, every read returns a reason instead of numbers. ``torch.cuda.mem_get_info``
    is avoided on devices without a context because it would create one (hundreds of MiB).
    """

    def __init__(self, nvml: NvmlProbe | None = None, torch_module=None, internals=None, amdsmi=None):
        self._torch_override = torch_module
        self.nvml = nvml if nvml is not None else NvmlProbe()
        #: ROCm's device view (``accelerators.AmdsmiProbe``), made when a HIP build is first met.
        self.amdsmi = amdsmi
        self._rocm_for = None  # the torch module last checked for a HIP build...
        self._rocm = False  # ...and the answer
        #: The reader of a non-CUDA backend (``accelerators.Reader``) and the torch it was made for.
        self.reader = None
        self._reader_for = None
        #: ``internals(torch)`` -> torch's private fast paths (``tensors.torch_api.api``: the one
        #: adapter to torch's private names, which this foundation may not import); None: public APIs only.
        self.internals = internals
        self._props: dict = {}
        self._stats_fn = None
        self._cpu_only = None  # the torch module found to be a CPU-only build

    def _api(self):
        torch = self._torch()
        if self.internals is None or torch is None:
            return None
        try:
            return self.internals(torch)
        except Exception:  # noqa: BLE001
            return None

    def _built_with_cuda(self, torch) -> bool:
        """False for a CPU-only build (a build flag: reading it initializes nothing)."""
        api = self._api()
        if api is not None:
            return api.cuda_built()
        try:
            return bool(torch.backends.cuda.is_built())
        except Exception:  # noqa: BLE001
            return True

    def _torch(self):
        if self._torch_override is not None:
            return self._torch_override
        return sys.modules.get("torch")  # never import torch on the user's behalf

    def status(self):
        """``(handle, None)`` when the accelerator is up, else ``(None, reason)``.

        The handle is the ``torch.cuda`` module on CUDA and ROCm, the backend's reader
        (``accelerators.Reader``) on MPS, XPU and other ``torch.accelerator`` devices; either
        goes back to :meth:`device_indices`.
        """
        torch = self._torch()
        if torch is None:
            return None, "torch is not imported"
        if torch is self._cpu_only:  # asked after every cell: the answer for this torch never changes
            return None, CPU_ONLY
        if torch is self._reader_for:
            return self._reader_status()
        if self.reader is not None:  # another torch than the one the reader was made for
            self.reader = self._reader_for = None
        cuda = getattr(torch, "cuda", None)
        try:
            if cuda is None or not cuda.is_initialized():
                # A CPU-only build never initializes CUDA: say so, rather than "not yet".
                if not self._built_with_cuda(torch):
                    if self._find_reader(torch) is not None:
                        return self._reader_status()
                    self._cpu_only = torch
                    return None, CPU_ONLY
                return None, "CUDA not initialized yet"
        except Exception:  # noqa: BLE001 - a broken torch install must not break cells
            return None, "torch.cuda unavailable"
        if torch is not self._rocm_for:  # once per torch module: device_memory reads the flag
            self.is_rocm()
        return cuda, None

    def _find_reader(self, torch):
        """The reader for a torch built for MPS, XPU or another accelerator (once per torch module)."""
        from . import accelerators, backends  # only a non-CUDA build ever loads them

        self.reader = accelerators.reader_for(torch, backends.detect(torch))
        self._reader_for = torch if self.reader is not None else None
        return self.reader

    def _reader_status(self):
        try:
            reason = self.reader.reason()
        except Exception as exc:  # noqa: BLE001
            return None, f"{self.reader.backend.title} counters unavailable ({type(exc).__name__})"
        return (self.reader, None) if reason is None else (None, reason)

    @property
    def device_type(self) -> str:
        """torch's type of the devices this probe reads: ``"cuda"`` (ROCm too), ``"mps"``, ``"xpu"``..."""
        reader = self.reader
        return "cuda" if reader is None else reader.device_type

    @property
    def resets_peaks(self) -> bool:
        """False where the backend keeps no peak counter (MPS before torch.accelerator covers it):
        its peaks are then the highest values sampled, and :meth:`reset_peak` resets nothing."""
        reader = self.reader
        return True if reader is None else reader.resets_peaks

    def is_rocm(self) -> bool:
        """True for a ROCm (HIP) build of torch: a build flag, read once per torch module."""
        torch = self._torch_override if self._torch_override is not None else sys.modules.get("torch")
        if torch is not self._rocm_for:
            self._rocm_for = torch
            try:
                self._rocm = bool(getattr(getattr(torch, "version", None), "hip", None))
            except Exception:  # noqa: BLE001
                self._rocm = False
            if self._rocm and self.amdsmi is None:
                from .accelerators import AmdsmiProbe

                self.amdsmi = AmdsmiProbe()
        return self._rocm

    def device_count(self) -> Optional[int]:
        """How many CUDA devices this process can see, without initializing CUDA; None if unknown.

        With CUDA up, torch's count. Before that, NVML's (through CUDA_VISIBLE_DEVICES): calling
        torch.cuda.device_count() then would initialize the CUDA driver in this process.
        """
        cuda, _ = self.status()
        torch = self._torch()
        if torch is not None and torch is self._reader_for:
            try:
                return self.reader.device_count()
            except Exception:  # noqa: BLE001
                return None
        if cuda is not None:
            try:
                return int(cuda.device_count())
            except Exception:  # noqa: BLE001
                return None
        if torch is not None and not self._built_with_cuda(torch):
            return 0  # a CPU-only build: no CUDA device will ever exist in this process
        return self.nvml.visible_count()

    def device_indices(self, cuda) -> list:
        """torch indices of devices with a CUDA context (the ones the user's code touched); on
        another backend, the ones its reader finds in use (``cuda`` is then that reader)."""
        if cuda is self.reader and cuda is not None:
            return cuda.device_indices()
        count = cuda.device_count()
        api = self._api()
        has_context = api.cuda_has_context() if api is not None else None
        if has_context is None:
            # Older torch: the current device, plus any device whose allocator holds memory.
            current = cuda.current_device()
            return [i for i in range(count) if i == current or (self.counters(i)[1] or 0) > 0]
        return [i for i in range(count) if has_context(i)]

    def _nested_stats(self, index: int) -> dict:
        # The adapter's private call returns the nested dict directly (~7x cheaper than the
        # flattened torch.cuda.memory_stats, which rebuilds ~120 keys on every call).
        if self._stats_fn is None:
            api = self._api()
            self._stats_fn = api.cuda_stats() if api is not None else self._torch().cuda.memory_stats_as_nested_dict
        return self._stats_fn(index)

    def counters(self, index: int) -> tuple:
        """``(allocated, reserved, peak_allocated, peak_reserved)`` from the allocator (None where
        the backend keeps no such counter)."""
        if self.reader is not None:
            return self.reader.counters(index)
        stats = self._nested_stats(index)
        return counters_from_stats(stats)

    def reset_peak(self, index: int) -> None:
        """Reset the device's peak counters (nothing where the backend keeps none: :attr:`resets_peaks`)."""
        if self.reader is not None:
            self.reader.reset_peak(index)
            return
        self._torch().cuda.reset_peak_memory_stats(index)

    def properties(self, index: int) -> tuple:
        """``(name, total, uuid)`` for a device, cached (they never change); on MPS the total is
        its out-of-memory limit (high-watermark ratio times Metal's recommended working set)."""
        if self.reader is not None:
            return self.reader.properties(index)
        props = self._props.get(index)
        if props is None:
            p = self._torch().cuda.get_device_properties(index)
            uuid = getattr(p, "uuid", None)
            props = (str(p.name), int(p.total_memory), None if uuid is None else str(uuid))
            self._props[index] = props
        return props

    def device_memory(self, index: int) -> tuple:
        """``(used, total)`` device-wide: NVML first (amdsmi on ROCm), else cudaMemGetInfo (only ever
        called for a device that has a context, where it creates none); ``total`` is torch's in
        every case. Other backends answer through their reader."""
        if self.reader is not None:
            return self.reader.device_memory(index)
        name, total, uuid = self.properties(index)
        if self._rocm if self._rocm_for is not None else self.is_rocm():
            used, _ = self.amdsmi.memory(index, total)
        else:
            used, _ = self.nvml.memory(index, uuid, total)
        if used is not None:
            return used, total
        try:
            free, total2 = self._torch().cuda.mem_get_info(index)
            return int(total2) - int(free), int(total2)
        except Exception:  # noqa: BLE001
            return None, total

    def processes(self, index: int) -> list:
        """``[(pid, bytes or None, name or None)]`` of the processes on device ``index`` (slow: on
        demand only): NVML's, amdsmi's on ROCm, none on backends that list none."""
        if self.reader is not None:
            return self.reader.processes(index)
        if self.is_rocm():
            return self.amdsmi.processes(index)
        return self.nvml.processes(index, self.properties(index)[2])

    def empty_cache(self) -> bool:
        """The backend's ``empty_cache()`` when the user's code has started it; True if it ran.

        Asked for by the user only (``%gpumem free``): never otherwise, and never on a backend the
        user's code has not started.
        """
        handle, _reason = self.status()
        if handle is None:
            return False
        if handle is self.reader:
            return bool(self.reader.empty_cache())
        self._torch().cuda.empty_cache()
        return True

    def sample(self, indices: Sequence[int] | None = None, with_device_memory: bool = True):
        """``(tuple of DeviceSample, reason)`` for the devices with a CUDA context (of ``indices``).

        Devices named in ``indices`` that the user's code has not touched are not read: reading
        one (cudaMemGetInfo, and resetting the peaks of cudaMallocAsync's pool) would create a
        context of hundreds of MiB there. The reason then says which were left out.
        """
        if self._cpu_only is not None and self._torch_override is None and sys.modules.get("torch") is self._cpu_only:
            return (), CPU_ONLY  # asked after every cell: status()'s first answer, without its calls
        cuda, reason = self.status()
        if cuda is None:
            return (), reason
        live = self.device_indices(cuda)
        if indices is not None:
            wanted = list(indices)
            indices = [i for i in wanted if i in live]
            untouched = [i for i in wanted if i not in live]
            if untouched:
                count = self.device_count()
                missing = [i for i in untouched if count is not None and i >= count]
                idle = [i for i in untouched if i not in missing]
                parts = []
                kind = self.device_type
                if idle:
                    parts.append(", ".join(str(_device(kind, i)) for i in idle) + " not used by your code yet")
                if missing:
                    parts.append(", ".join(str(_device(kind, i)) for i in missing) + f" does not exist ({count} visible)")
                reason = "; ".join(parts)
        else:
            indices = live
        out = []
        for i in indices:
            allocated, reserved, peak_a, peak_r = self.counters(i)
            if with_device_memory:
                used, total = self.device_memory(i)
            else:
                used, total = None, self.properties(i)[1]
            out.append(DeviceSample(i, allocated, reserved, peak_a, peak_r, used, total)
                       if cuda is not self.reader else
                       DeviceSample(i, allocated, reserved, peak_a, peak_r, used, total, self.reader.device_type))
        return tuple(out), reason


# --------------------------------------------------------------------------------------------
# Both together
# --------------------------------------------------------------------------------------------


class MemoryProbe:
    """Host and accelerator probes behind one ``sample()``; what the recorder and sampler call."""

    def __init__(self, host: HostProbe | None = None, cuda: CudaProbe | None = None):
        self.host = host if host is not None else HostProbe()
        self.cuda = cuda if cuda is not None else CudaProbe()

    def sample(self, devices: Sequence[int] | None = None, with_device_memory: bool = True,
               with_peak: bool = True) -> Sample:
        """Read everything now. ``devices`` restricts the CUDA devices read (None: all initialized).

        ``with_peak=False`` skips the host peak (one syscall): a cell's starting sample needs none.
        """
        host = self.host
        sample_host = host.sample() if with_peak else HostSample(host.rss(), None)
        try:
            devs, reason = self.cuda.sample(devices, with_device_memory)
        except Exception as exc:  # noqa: BLE001 - torch raising must never cost the user a cell
            devs, reason = (), f"CUDA counters unavailable ({type(exc).__name__}: {exc})"
        return _new(Sample, (time.perf_counter(), sample_host, devs, reason))

    def start(self, devices: Sequence[int] | None = None, reset_peaks: bool = True):
        """The sample that opens a span (a cell, a line), resetting the peak counters if asked.

        Returns ``(sample, peak_rss_reset, reset_device_indices)``. Runs before every cell, so
        it does the fewest reads: the host reset is skipped when the last reading found the
        high-water mark at the current RSS (the mark then already counts from here, give or take
        ``PEAK_SLACK``), and after a reset one ``getrusage`` gives the RSS.
        """
        host = self.host
        if reset_peaks and host.peak_is_current:
            # The last reading left the high-water mark at the RSS: it already measures from here.
            host_reset, rss = True, host.rss()
        else:
            host_reset = reset_peaks and host.reset_peak()
            rss = host.rss_after_reset() if host_reset else host.rss()
        try:
            devs, reason = self.cuda.sample(devices)
        except Exception as exc:  # noqa: BLE001 - torch raising must never cost the user a cell
            devs, reason = (), f"CUDA counters unavailable ({type(exc).__name__}: {exc})"
        reset_devices = frozenset()
        # A backend without peak counters (MPS before torch.accelerator) has nothing to reset: its
        # peaks are the highest values read, so no device is counted as reset for this span.
        if reset_peaks and devs and self.cuda.resets_peaks:
            try:
                for dev in devs:
                    # A peak that stands at its value already measures from here: resetting it
                    # would only cost a call (and touch the user's counters for nothing).
                    if dev.peak_allocated != dev.allocated or dev.peak_reserved != dev.reserved:
                        self.cuda.reset_peak(dev.index)
                reset_devices = frozenset(dev.index for dev in devs)
            except Exception:  # noqa: BLE001 - peaks then come from samples
                reset_devices = frozenset()
        return Sample(time.perf_counter(), HostSample(rss, None), devs, reason), host_reset, reset_devices

    def close(self) -> None:
        self.host.close()
        self.cuda.nvml.shutdown()
