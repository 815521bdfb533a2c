"""FAKES of torch's per-backend modules (this machine has a CPU build of torch and no GPU), labelled as such.

Each fake has only the calls the torch version it stands for has (``version`` gates them: a torch
2.4 has no ``torch.accelerator``, a 2.4 MPS build no ``recommended_max_memory``...), records every
call, and refuses the calls that would start a device (``is_available``, ``device_count`` before
initialization): a test then fails where a probe would have started one. The numbers they return
are the recordings of ``tests/fixtures/backends/`` (see its SOURCES.md).
"""
import json
import os
from types import SimpleNamespace

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "backends")


def fixture(name):
    with open(os.path.join(FIXTURES, name), encoding="utf-8") as f:
        return json.load(f)


def at_least(version, since):
    return tuple(version) >= since


class Refused(AssertionError):
    """A fake's call that would have started a device (or asked the driver) was made."""


class Calls(list):
    def names(self):
        return [name for name, *_ in self]


class FakeMps:
    """FAKE ``torch.mps``: two counters and Metal's recommended working set (2.5+)."""

    def __init__(self, version, allocated=0, driver=0, recommended=None, calls=None):
        self.calls = calls if calls is not None else Calls()
        self.allocated, self.driver = allocated, driver
        self._recommended = recommended
        if at_least(version, (2, 5)):
            self.recommended_max_memory = self._recommended_max_memory

    def current_allocated_memory(self):
        self.calls.append(("mps.current_allocated_memory",))
        return self.allocated

    def driver_allocated_memory(self):
        self.calls.append(("mps.driver_allocated_memory",))
        return self.driver

    def _recommended_max_memory(self):
        self.calls.append(("mps.recommended_max_memory",))
        return self._recommended

    def empty_cache(self):
        self.calls.append(("mps.empty_cache",))
        self.driver = self.allocated

    def is_available(self):
        raise Refused("torch.mps.is_available() creates the Metal device")

    def device_count(self):
        raise Refused("torch.mps.device_count() creates the Metal device")


class _Accelerator:
    def __init__(self, device_type, stats, memory_info, count, calls):
        self.calls, self.device_type, self.stats, self.info, self.count = calls, device_type, stats, memory_info, count
        self.resets = 0

    def current_accelerator(self, check_available=False):
        if check_available:
            raise Refused("current_accelerator(check_available=True) asks the driver")
        self.calls.append(("accelerator.current_accelerator",))
        return None if self.device_type is None else SimpleNamespace(type=self.device_type, index=None)

    def device_count(self):
        self.calls.append(("accelerator.device_count",))
        return self.count

    def is_available(self):
        raise Refused("torch.accelerator.is_available() may start the driver")

    def memory_stats(self, index=None):
        self.calls.append(("accelerator.memory_stats", index))
        if isinstance(self.stats, Exception):
            raise self.stats
        return dict(self.stats or {})

    def reset_peak_memory_stats(self, index=None):
        self.calls.append(("accelerator.reset_peak_memory_stats", index))
        self.resets += 1

    def empty_cache(self):
        self.calls.append(("accelerator.empty_cache",))

    def get_memory_info(self, index=None):
        self.calls.append(("accelerator.get_memory_info", index))
        if isinstance(self.info, Exception):
            raise self.info
        return self.info


def FakeAccelerator(version, device_type, stats=None, memory_info=None, count=1, calls=None):
    """FAKE ``torch.accelerator`` with the calls of ``version``: 2.6+ current_accelerator and
    device_count, 2.9+ the memory calls, 2.10+ get_memory_info.

    ``stats`` is what ``memory_stats(i)`` returns (``{}`` until the allocator starts), or an
    exception instance to raise (torch 2.9-2.13 on MPS: its allocator is no DeviceAllocator).
    The state is on ``.impl``.
    """
    impl = _Accelerator(device_type, stats, memory_info, count, calls if calls is not None else Calls())
    names = ["current_accelerator", "device_count", "is_available"]
    if at_least(version, (2, 9)):
        names += ["memory_stats", "reset_peak_memory_stats", "empty_cache"]
    if at_least(version, (2, 10)):
        names += ["get_memory_info"]
    return SimpleNamespace(impl=impl, **{name: getattr(impl, name) for name in names})


def nested(allocated, reserved, peak_allocated=None, peak_reserved=None):
    """torch's nested ``memory_stats_as_nested_dict`` shape."""
    return {"allocated_bytes": {"all": {"current": allocated, "peak": allocated if peak_allocated is None
                                        else peak_allocated}},
            "reserved_bytes": {"all": {"current": reserved, "peak": reserved if peak_reserved is None
                                       else peak_reserved}}}


class FakeXpu:
    """FAKE ``torch.xpu`` (2.5+ counters, 2.6+ ``mem_get_info``)."""

    def __init__(self, version, initialized=True, stats=None, props=None, mem_info=None, calls=None):
        self.calls = calls if calls is not None else Calls()
        self.initialized, self.stats, self.props, self.info = initialized, stats or {}, props, mem_info
        self.resets = 0
        if at_least(version, (2, 6)):
            self.mem_get_info = self._mem_get_info

    def is_initialized(self):
        return self.initialized

    def _need_init(self, what):
        if not self.initialized:
            raise Refused(f"torch.xpu.{what} before initialization starts the SYCL runtime")

    def device_count(self):
        self._need_init("device_count()")
        return max(1, len(self.stats))

    def current_device(self):
        self._need_init("current_device()")
        return 0

    def memory_stats_as_nested_dict(self, index=None):
        self.calls.append(("xpu.memory_stats_as_nested_dict", index))
        return self.stats.get(index, {}) if self.initialized else {}

    def reset_peak_memory_stats(self, index=None):
        self.calls.append(("xpu.reset_peak_memory_stats", index))
        self.resets += 1

    def get_device_properties(self, index=None):
        self._need_init("get_device_properties()")
        return self.props

    def _mem_get_info(self, index=None):
        self._need_init("mem_get_info()")
        self.calls.append(("xpu.mem_get_info", index))
        if isinstance(self.info, Exception):
            raise self.info
        return self.info

    def empty_cache(self):
        self.calls.append(("xpu.empty_cache",))

    def is_available(self):
        raise Refused("torch.xpu.is_available() may start the SYCL runtime")


class FakeCudaModule:
    """FAKE ``torch.cuda`` of a ROCm (HIP) or CUDA build."""

    def __init__(self, initialized=True, stats=None, props=None, mem_info=None, calls=None):
        self.calls = calls if calls is not None else Calls()
        self.initialized, self.stats, self.props, self.info = initialized, stats or {}, props, mem_info

    def is_initialized(self):
        return self.initialized

    def device_count(self):
        return len(self.stats)

    def current_device(self):
        return 0

    def memory_stats_as_nested_dict(self, index=None):
        self.calls.append(("cuda.memory_stats_as_nested_dict", index))
        return self.stats.get(index, {})

    def reset_peak_memory_stats(self, index=None):
        self.calls.append(("cuda.reset_peak_memory_stats", index))

    def get_device_properties(self, index=None):
        return self.props

    def mem_get_info(self, index=None):
        self.calls.append(("cuda.mem_get_info", index))
        return self.info

    def empty_cache(self):
        self.calls.append(("cuda.empty_cache",))


def fake_torch(version, *, cuda=None, hip=None, xpu_flag=None, mps_built=False, accelerator_type=None,
               mps=None, xpu=None, cuda_module=None, accelerator=None):
    """A FAKE torch module of ``version`` ((2, 13)) built for one backend; torch.accelerator from 2.6."""
    calls = Calls()
    torch = SimpleNamespace(__version__=f"{version[0]}.{version[1]}.0+fake", calls=calls)
    torch.version = SimpleNamespace(cuda=cuda, hip=hip, xpu=xpu_flag)
    torch.backends = SimpleNamespace(cuda=SimpleNamespace(is_built=lambda: bool(cuda or hip)),
                                     mps=SimpleNamespace(is_built=lambda: mps_built))
    torch.cuda = cuda_module if cuda_module is not None else FakeCudaModule(initialized=False)
    if mps is not None:
        torch.mps = mps
    if xpu is not None:
        torch.xpu = xpu
    if at_least(version, (2, 6)):
        torch.accelerator = accelerator if accelerator is not None else FakeAccelerator(version, accelerator_type)
    return torch


def props(name, total, uuid=None):
    return SimpleNamespace(name=name, total_memory=total, uuid=uuid)


class FakeAmdsmi:
    """FAKE ``amdsmi`` in the shapes of ROCm/amdsmi's py-interface (see SOURCES.md); with ``usage_bytes``
    it has ``amdsmi_get_gpu_memory_usage`` (bytes), without it only ``amdsmi_get_gpu_vram_usage`` (MB)."""

    def __init__(self, handles, vram_usage_mb=None, usage_bytes=None, processes=(), enumeration=True, calls=None):
        self.calls = calls if calls is not None else Calls()
        self.handles = list(handles)
        self.vram, self.usage, self.procs, self.enumeration = vram_usage_mb, usage_bytes, list(processes), enumeration
        if usage_bytes is not None:
            self.AmdSmiMemoryType = SimpleNamespace(VRAM="VRAM")
            self.amdsmi_get_gpu_memory_usage = self._memory_usage

    def _memory_usage(self, handle, kind):
        self.calls.append(("amdsmi_get_gpu_memory_usage", handle, kind))
        return self.usage[self.handles.index(handle)]

    def amdsmi_init(self, *args):
        self.calls.append(("amdsmi_init",))

    def amdsmi_get_processor_handles(self):
        return list(self.handles)

    def amdsmi_get_gpu_enumeration_info(self, handle):
        if not self.enumeration:
            raise RuntimeError("AMDSMI_STATUS_NOT_SUPPORTED (before ROCm 6.4)")
        return {"hip_id": self.handles.index(handle)}

    def amdsmi_get_gpu_vram_usage(self, handle):
        self.calls.append(("amdsmi_get_gpu_vram_usage", handle))
        return dict(self.vram)

    def amdsmi_get_gpu_process_list(self, handle):
        self.calls.append(("amdsmi_get_gpu_process_list", handle))
        return [dict(p) for p in self.procs]


class RefusingNvml:
    """FAKE pynvml whose every call fails the test: ROCm must never be read through NVML."""

    def __getattr__(self, name):
        raise Refused(f"NVML called on ROCm: {name}")
