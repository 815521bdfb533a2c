"""Probes: real host RSS on this machine, and the CUDA/NVML branches against stand-ins.

There is no GPU here. The CUDA and NVML branches are driven by small stand-in modules (labelled
fakes) that return the shapes torch and nvidia-ml-py return; faults are injected the same way.
"""
import os
import subprocess
import sys
import types

import pytest

from ipy_gpumem.core.counters import counters_from_stats
from ipy_gpumem.core.devices import parse_visible_devices
from ipy_gpumem.core.probes import CudaProbe, HostProbe, MemoryProbe, NvmlProbe
from ipy_gpumem.core.procfs import HeldRead
from ipy_gpumem.core.units import MiB
from ipy_gpumem.tensors.torch_api import api as torch_api  # the adapter the extension wires in

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="procfs is Linux-only")


def _touch(nbytes):
    buf = bytearray(nbytes)  # bytearray(n) zero-fills, so every page becomes resident
    return buf


@linux
def test_rss_follows_a_real_allocation_to_the_page():
    probe = HostProbe()
    assert probe.backend == "procfs"
    before = probe.rss()
    buf = _touch(64 * MiB)
    after = probe.rss()
    assert 64 * MiB <= after - before <= 64 * MiB + 2 * MiB
    del buf
    assert probe.rss() < after - 32 * MiB  # large blocks are unmapped on free


@linux
def test_peak_resets_to_current_rss():
    probe = HostProbe()
    if not probe.can_reset_peak:
        pytest.skip("this kernel/container forbids /proc/self/clear_refs")
    buf = _touch(128 * MiB)
    del buf
    high = probe.peak_rss()
    assert high >= probe.rss() + 100 * MiB
    assert probe.reset_peak()
    assert probe.peak_rss() <= probe.rss() + 4 * MiB
    buf = _touch(96 * MiB)
    del buf
    assert probe.peak_rss() >= probe.rss() + 90 * MiB


def test_psutil_backend_agrees_with_procfs():
    psutil = pytest.importorskip("psutil")
    via_psutil = HostProbe(use_procfs=False)
    assert via_psutil.backend == "psutil"
    rss = via_psutil.rss()
    assert rss == pytest.approx(psutil.Process().memory_info().rss, rel=0.05)
    if sys.platform.startswith("linux"):
        assert HostProbe().rss() == pytest.approx(rss, rel=0.05)


class _RaisingPsutil:
    """Fault injection (fake): psutil that fails the way AccessDenied/NoSuchProcess do."""

    class Error(Exception):
        pass

    def __init__(self, fail_at="process"):
        self.fail_at = fail_at

    def Process(self):  # noqa: N802 - psutil's name
        if self.fail_at == "process":
            raise self.Error("access denied")
        outer = self

        class P:
            def memory_info(self):
                raise outer.Error("no such process")

        return P()


@pytest.mark.parametrize("fail_at", ["process", "memory_info"])
def test_psutil_raising_gives_none_not_an_exception(fail_at):
    probe = HostProbe(psutil_module=_RaisingPsutil(fail_at), use_procfs=False)
    assert probe.rss() is None
    assert probe.peak_rss() is None
    assert probe.reset_peak() is False
    if fail_at == "process":
        assert probe.reason.startswith("host memory unavailable")


@linux
def test_procfs_read_error_gives_none(monkeypatch):
    probe = HostProbe()

    def broken(*args):
        raise OSError(5, "I/O error")

    # A fake, labelled: a read of /proc/self/statm that fails cannot be caused from here. It is read
    # holding the GIL once ctypes is loaded (core.procfs), with os.pread before that.
    monkeypatch.setattr(os, "pread", broken)
    monkeypatch.setattr(HeldRead, "__call__", broken)
    assert probe.rss() is None
    assert probe.sample().rss is None


@linux
def test_a_held_read_reads_what_os_pread_reads(tmp_path):
    """libc's pread holding the GIL (ctypes is loaded here): the same bytes, a long file whole, errors as OSError."""
    import ctypes  # noqa: F401 - torch loads it in a real session; the held read is used once it is there

    short = HeldRead(16, 4096)
    path = tmp_path / "answer"
    path.write_bytes(b"12 34\n")
    fd = os.open(path, os.O_RDONLY)
    try:
        assert short(fd) == b"12 34\n"
        path.write_bytes(b"7" * 3000)  # longer than the held buffer: read whole
        assert short(fd) == b"7" * 3000
    finally:
        os.close(fd)
    with pytest.raises(OSError):
        short(fd)  # closed
    statm = os.open("/proc/self/statm", os.O_RDONLY)
    try:
        assert len(HeldRead(128)(statm).split()) == len(os.pread(statm, 128, 0).split()) == 7
    finally:
        os.close(statm)


@linux
def test_probe_reopens_after_fork():
    probe = HostProbe()
    probe.rss()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: allocate, then compare the probe with a fresh read of its own statm
        try:
            buf = _touch(80 * MiB)
            with open("/proc/self/statm") as fh:
                own = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            seen = probe.rss()
            os.write(w, f"{own} {seen} {len(buf)}".encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    own, seen, _ = map(int, os.read(r, 200).split())
    assert abs(seen - own) < 4 * MiB


def test_parse_visible_devices_like_cuda():
    assert parse_visible_devices(None) is None
    assert parse_visible_devices("") == []
    assert parse_visible_devices("3") == [3]
    assert parse_visible_devices("2,0") == [2, 0]
    assert parse_visible_devices("1, 2gpu, x") == [1, 2]
    assert parse_visible_devices("0,0") == []  # a repeat hides every device, as in CUDA
    assert parse_visible_devices("GPU-abc,GPU-def,7") == ["GPU-abc", "GPU-def"]
    assert parse_visible_devices("MIG-1234") == ["MIG-1234"]


def test_counters_from_nested_flat_and_empty_stats():
    nested = {"allocated_bytes": {"all": {"current": 10, "peak": 30}, "large_pool": {"current": 8}},
              "reserved_bytes": {"all": {"current": 20, "peak": 40}}, "num_ooms": 1}
    flat = {"allocated_bytes.all.current": 10, "allocated_bytes.all.peak": 30,
            "reserved_bytes.all.current": 20, "reserved_bytes.all.peak": 40}
    assert counters_from_stats(nested) == (10, 20, 30, 40)
    assert counters_from_stats(flat) == (10, 20, 30, 40)
    assert counters_from_stats({}) == (None, None, None, None)


def test_real_cpu_torch_says_it_has_no_cuda():
    torch = pytest.importorskip("torch")
    probe = MemoryProbe()
    sample = probe.sample()
    assert sample.devices == ()
    if torch.version.cuda is None:  # this machine's CPU wheel: CUDA will never appear
        assert sample.reason == "this torch build has no CUDA (a CPU-only build)"
    else:
        assert sample.reason == "CUDA not initialized yet"
    assert not torch.cuda.is_initialized()  # and we did not initialize it


def test_without_torch_nothing_is_imported():
    code = (
        "import sys; from ipy_gpumem.core.probes import MemoryProbe; s = MemoryProbe().sample();"
        "print(s.reason); print('torch' in sys.modules, 'pynvml' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "torch is not imported"
    assert out[1] == "False False"


def _fake_torch(stats_by_device, contexts=(0,), raise_in=None, uuid=None):
    """A stand-in torch module (fake: no GPU here) exposing the CUDA calls CudaProbe uses."""
    torch = types.ModuleType("torch")
    calls = []

    def maybe_raise(name):
        calls.append(name)
        if raise_in == name:
            raise RuntimeError(f"CUDA error: injected failure in {name}")

    class Props:
        def __init__(self, i):
            self.name, self.total_memory, self.uuid = f"Stand-in GPU {i}", 16 * 2**30, uuid

    cuda = types.SimpleNamespace(
        is_initialized=lambda: maybe_raise("is_initialized") or True,
        device_count=lambda: len(stats_by_device),
        current_device=lambda: 0,
        get_device_properties=lambda i: maybe_raise("props") or Props(i),
        reset_peak_memory_stats=lambda i: maybe_raise("reset") or calls.append(("reset", i)),
        mem_get_info=lambda i: maybe_raise("mem_get_info") or calls.append(("mem_get_info", i)) or (4 * 2**30, 16 * 2**30),
        memory_stats_as_nested_dict=lambda i: maybe_raise("stats") or stats_by_device[i],
    )
    torch.cuda = cuda
    torch._C = types.SimpleNamespace(
        _cuda_memoryStats=lambda i: maybe_raise("stats") or calls.append(("read", i)) or stats_by_device[i],
        _cuda_hasPrimaryContext=lambda i: i in contexts,
    )
    torch.calls = calls
    return torch


def _stats(allocated, reserved, peak_a=None, peak_r=None):
    return {"allocated_bytes": {"all": {"current": allocated, "peak": peak_a or allocated}},
            "reserved_bytes": {"all": {"current": reserved, "peak": peak_r or reserved}}}


class _NoNvml:
    """Fault injection (fake): nvidia-ml-py without a driver."""

    class NVMLError_LibraryNotFound(Exception):  # noqa: N801 - pynvml's name
        pass

    def nvmlInit(self):  # noqa: N802
        raise self.NVMLError_LibraryNotFound("NVML Shared Library Not Found")


def test_cuda_probe_reads_only_devices_with_a_context():
    torch = _fake_torch([_stats(1 * MiB, 2 * MiB), _stats(0, 0), _stats(5 * MiB, 8 * MiB, 9 * MiB, 10 * MiB)], contexts=(0, 2))
    probe = MemoryProbe(HostProbe(), CudaProbe(NvmlProbe(_NoNvml()), torch_module=torch, internals=torch_api))
    sample = probe.sample()
    assert [d.index for d in sample.devices] == [0, 2]
    d2 = sample.devices[1]
    assert (d2.allocated, d2.reserved, d2.peak_allocated, d2.peak_reserved) == (5 * MiB, 8 * MiB, 9 * MiB, 10 * MiB)
    # NVML is missing, so used/total come from cudaMemGetInfo on a device that has a context
    assert (d2.used, d2.total) == (12 * 2**30, 16 * 2**30)
    assert probe.cuda.nvml.reason == "NVML unavailable (NVMLError_LibraryNotFound)"
    probe.start(reset_peaks=True)
    # cuda:2's peak stands above its value: reset; cuda:0's is at its value: left alone; cuda:1 has
    # no context: never touched.
    assert ("reset", 2) in torch.calls and ("reset", 0) not in torch.calls and ("reset", 1) not in torch.calls


def test_devices_named_explicitly_are_read_only_with_a_context():
    # GpuMemMagics.devices = "0,1", -d cuda:1: reading cuda:1, which has no context, would create
    # one (cudaMemGetInfo, cudaMallocAsync's peak reset): hundreds of MiB the user never asked for.
    torch = _fake_torch([_stats(1 * MiB, 2 * MiB), _stats(0, 0), _stats(5 * MiB, 8 * MiB)], contexts=(0,))
    probe = MemoryProbe(HostProbe(), CudaProbe(NvmlProbe(_NoNvml()), torch_module=torch, internals=torch_api))
    sample, _, reset = probe.start([0, 1], reset_peaks=True)
    assert [d.index for d in sample.devices] == [0] and reset == frozenset({0})
    assert "cuda:1 not used by your code yet" in sample.reason
    assert not [call for call in torch.calls if isinstance(call, tuple) and call[1] == 1]  # never read, reset or probed
    sample, _, _ = probe.start([0, 7], reset_peaks=False)
    assert "cuda:7 does not exist (3 visible)" in sample.reason


@pytest.mark.parametrize("where", ["is_initialized", "stats", "props"])
def test_torch_raising_mid_session_never_escapes(where):
    torch = _fake_torch([_stats(1, 2)], raise_in=where)
    probe = MemoryProbe(HostProbe(), CudaProbe(NvmlProbe(_NoNvml()), torch_module=torch, internals=torch_api))
    sample = probe.sample()  # must not raise
    assert sample.devices == ()
    assert sample.reason
    assert sample.host.rss is None or sample.host.rss > 0


class _FakeNvml:
    """A stand-in nvidia-ml-py (fake: no driver here) with three devices."""

    class NVMLError(Exception):
        pass

    nvmlMemory_v2 = 0x02000028  # the struct version nvidia-ml-py passes for v2

    def __init__(self, fail_memory_after=None, uuids=None, v2=True):
        self.uuids = uuids or ["GPU-aaa111", "GPU-bbb222", "GPU-ccc333"]
        self.reads = 0
        self.fail_memory_after = fail_memory_after
        self.v2 = v2

    def nvmlInit(self):  # noqa: N802
        pass

    def nvmlShutdown(self):  # noqa: N802
        pass

    def nvmlDeviceGetCount(self):  # noqa: N802
        return 3

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802
        return ("h", i)

    def nvmlDeviceGetUUID(self, h):  # noqa: N802
        return self.uuids[h[1]].encode()

    def nvmlDeviceGetHandleByUUID(self, uuid):  # noqa: N802
        if uuid not in self.uuids:
            raise self.NVMLError("Not Found")
        return ("h", self.uuids.index(uuid))

    def nvmlDeviceGetMemoryInfo(self, h, version=None):  # noqa: N802
        self.reads += 1
        if self.fail_memory_after is not None and self.reads > self.fail_memory_after:
            raise self.NVMLError("GPU is lost")
        # v1 counts the driver's own 512 MiB reservation in used and total; v2 reports it apart.
        used = (h[1] + 1) * 2**30
        if version is None:
            return types.SimpleNamespace(used=used + 512 * 2**20, total=80 * 2**30 + 512 * 2**20)
        if not self.v2:
            raise self.NVMLError("Function Not Found")  # drivers before R510
        return types.SimpleNamespace(used=used, total=80 * 2**30 + 512 * 2**20, reserved=512 * 2**20,
                                     free=80 * 2**30 - used)

    def nvmlDeviceGetComputeRunningProcesses(self, h):  # noqa: N802
        return [types.SimpleNamespace(pid=4242, usedGpuMemory=3 * 2**30), types.SimpleNamespace(pid=77, usedGpuMemory=None)]

    def nvmlSystemGetProcessName(self, pid):  # noqa: N802
        if pid == 77:
            raise self.NVMLError("No permission")
        return b"python3"


@pytest.mark.parametrize("visible, torch_index, nvml_index", [
    (None, 1, 1), ("2,0", 0, 2), ("2,0", 1, 0), ("GPU-ccc,GPU-aaa", 0, 2), ("GPU-ccc,GPU-aaa", 1, 0), ("1", 3, None),
])
def test_nvml_maps_torch_indices_through_cuda_visible_devices(visible, torch_index, nvml_index):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    nvml = NvmlProbe(_FakeNvml(), environ=env)
    used, total = nvml.memory(torch_index)
    if nvml_index is None:
        assert (used, total) == (None, None)
    else:
        assert (used, total) == ((nvml_index + 1) * 2**30 + 512 * 2**20, 80 * 2**30 + 512 * 2**20)


def test_nvml_prefers_the_uuid_torch_reports():
    nvml = NvmlProbe(_FakeNvml(), environ={"CUDA_VISIBLE_DEVICES": "0"})
    assert nvml.memory(0, uuid="bbb222", total=80 * 2**30) == (2 * 2**30, 80 * 2**30)


def test_nvml_totals_agree_with_torch_with_or_without_the_v2_struct():
    # torch's total (and its OOM message's "total capacity") leaves out the driver's reservation;
    # NVML v1 counts it in used and total. One total everywhere: torch's, and used without it.
    torch_total = 80 * 2**30
    assert NvmlProbe(_FakeNvml(), environ={}).memory(1, total=torch_total) == (2 * 2**30, torch_total)
    assert NvmlProbe(_FakeNvml(v2=False), environ={}).memory(1, total=torch_total) == (2 * 2**30, torch_total)


def test_a_mig_slice_is_found_by_its_mig_uuid_and_never_replaced_by_the_whole_gpu():
    # torch reports a MIG slice's UUID without prefix; NVML names it MIG-<uuid>. Falling back to
    # the device at the same index would report the whole parent GPU and other tenants' processes.
    nvml = NvmlProbe(_FakeNvml(uuids=["GPU-aaa111", "MIG-slice7", "GPU-ccc333"]), environ={})
    assert nvml.memory(0, uuid="slice7", total=80 * 2**30) == (2 * 2**30, 80 * 2**30)
    assert nvml.processes(0, uuid="slice7") and nvml.handle(0) == ("h", 1)
    unknown = NvmlProbe(_FakeNvml(), environ={})
    assert unknown.memory(0, uuid="not-a-known-uuid", total=80 * 2**30) == (None, None)


def test_nvml_raising_mid_session_gives_none():
    nvml = NvmlProbe(_FakeNvml(fail_memory_after=1), environ={})
    assert nvml.memory(0) == (2**30 + 512 * 2**20, 80 * 2**30 + 512 * 2**20)
    assert nvml.memory(0) == (None, None)


def test_nvml_process_list_tolerates_missing_fields():
    nvml = NvmlProbe(_FakeNvml(), environ={})
    assert nvml.processes(0) == [(4242, 3 * 2**30, "python3"), (77, None, None)]


def test_nvml_without_driver_is_remembered_not_retried():
    class Counting(_NoNvml):
        tries = 0

        def nvmlInit(self):  # noqa: N802
            Counting.tries += 1
            super().nvmlInit()

    nvml = NvmlProbe(Counting(), environ={})
    for _ in range(5):
        assert nvml.memory(0) == (None, None)
    assert Counting.tries == 1


def test_real_nvml_on_this_machine_fails_cleanly():
    pytest.importorskip("pynvml")
    nvml = NvmlProbe()
    used, total = nvml.memory(0)
    if used is None:
        assert nvml.reason and nvml.reason.startswith("NVML unavailable")


@linux
def test_inherited_maxrss_floor_falls_back_to_vmhwm():
    """A Jupyter kernel inherits its launcher's max RSS in ru_maxrss; below it we read VmHWM."""
    probe = HostProbe()
    if not probe.can_reset_peak:
        pytest.skip("this kernel/container forbids /proc/self/clear_refs")
    probe._rusage_floor = 1 << 50  # as if the launcher had been enormous: getrusage is useless
    assert probe.reset_peak()
    after_reset = probe.rss_after_reset()
    assert after_reset == pytest.approx(probe.rss(), abs=2 * MiB)  # fell back to statm
    buf = _touch(64 * MiB)
    del buf
    peak = probe.peak_rss()  # from /proc/self/status VmHWM
    assert peak >= probe.rss() + 60 * MiB and peak < 1 << 50


@linux
def test_start_sample_resets_then_reads_cheaply():
    probe = MemoryProbe()
    sample, host_reset, reset_devices = probe.start(reset_peaks=True)
    assert host_reset is probe.host.can_reset_peak and reset_devices == frozenset()
    assert sample.host.rss == pytest.approx(probe.host.rss(), abs=2 * MiB)
    sample, host_reset, _ = probe.start(reset_peaks=False)
    assert host_reset is False and sample.host.peak_rss is None
