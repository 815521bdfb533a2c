"""Every accelerator torch knows (CUDA, ROCm, MPS, XPU, torch.accelerator), tested without the hardware.

The counters and messages are recordings from public sources (``tests/fixtures/backends/``, cited in
its SOURCES.md); the torch modules are labelled FAKES (``backend_fakes``) with the calls of the torch
version they stand for. None of these backends was run on its hardware here: this machine has a
CPU build of torch and no GPU.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, where backend_fakes.py is

from backend_fakes import (  # noqa: E402
    Calls, FakeAccelerator, FakeAmdsmi, FakeCudaModule, FakeMps, FakeXpu, Refused, RefusingNvml, fake_torch,
    fixture, nested, props,
)

from ipy_gpumem.core import backends, devices  # noqa: E402
from ipy_gpumem.core.accelerators import AmdsmiProbe, MpsReader, mps_limit  # noqa: E402
from ipy_gpumem.core.backends import ACCELERATOR, BACKENDS, CUDA, FIGURES, MPS, ROCM, XPU, detect  # noqa: E402
from ipy_gpumem.core.devices import Device, device, parse_device, parse_device_list  # noqa: E402
from ipy_gpumem.core.memory import DeviceMemory  # noqa: E402
from ipy_gpumem.core.probes import CudaProbe, HostProbe, MemoryProbe, NvmlProbe  # noqa: E402
from ipy_gpumem.core.units import GiB, MiB  # noqa: E402

MPS_FIX = fixture("mps.json")
XPU_FIX = fixture("xpu.json")
ROCM_FIX = fixture("rocm.json")
ACC_FIX = fixture("accelerator.json")


@pytest.fixture
def no_mps_seen(monkeypatch):
    """Each test starts with no MPS tensor noted (the note is process-wide)."""
    monkeypatch.setattr(devices, "_SEEN", set())


def probe_for(torch, **kwargs):
    return MemoryProbe(HostProbe(), CudaProbe(torch_module=torch, **kwargs))


# ----------------------------------------------------------------------------------------------
# the table
# ----------------------------------------------------------------------------------------------


def test_the_table_has_every_figure_for_every_backend_and_words_instead_of_zeros():
    assert set(BACKENDS) == {"cuda", "rocm", "mps", "xpu", "accelerator"}
    for backend in BACKENDS.values():
        assert [row.figure for row in backend.counters] == list(FIGURES), backend.key
        for row in backend.counters:
            words = backend.missing(row.figure)
            if row.source is None:
                assert words and ("not available on" in words or "sampled" in words), (backend.key, row)
                assert "0 bytes" not in words
            else:
                assert words is None
                assert row.since is None or backends.at_least((9, 99), row.since)
    assert MPS.missing("peak").startswith("peak: the highest value sampled")
    assert MPS.missing("device_used").startswith("device used not available on MPS: unified memory")
    assert XPU.missing("other_processes") == "other processes not available on XPU: torch.xpu lists no processes"
    with pytest.raises(KeyError):
        CUDA.counter("temperature")


def test_the_table_gates_figures_by_torch_version():
    assert not MPS.has("device_total", (2, 4)) and MPS.has("device_total", (2, 5))
    assert not XPU.has("device_used", (2, 5)) and XPU.has("device_used", (2, 6))
    assert not ACCELERATOR.has("allocated", (2, 8)) and ACCELERATOR.has("allocated", (2, 9))
    assert not ACCELERATOR.has("device_total", (2, 9)) and ACCELERATOR.has("device_total", (2, 10))
    assert ROCM.device_type == CUDA.device_type == "cuda" and ROCM.alloc_env == "PYTORCH_HIP_ALLOC_CONF"
    assert backends.torch_version(sys.modules["torch"]) >= (2, 0)
    assert backends.torch_version(fake_torch((2, 4), mps_built=True)) == (2, 4)


@pytest.mark.parametrize("version, flags, expected", [
    ((2, 13), dict(cuda="12.8", accelerator_type="cuda"), "cuda"),
    ((2, 13), dict(hip="6.4", accelerator_type="cuda"), "rocm"),
    ((2, 3), dict(hip="6.0"), "rocm"),
    ((2, 13), dict(mps_built=True, accelerator_type="mps"), "mps"),
    ((2, 4), dict(mps_built=True), "mps"),
    ((2, 5), dict(xpu_flag="20250000"), "xpu"),
    ((2, 13), dict(accelerator_type="npu"), "accelerator"),
    ((2, 4), dict(cuda="12.1"), "cuda"),
    ((2, 13), dict(), None),
    ((2, 4), dict(), None),
])
def test_detect_reads_build_flags_and_starts_nothing(version, flags, expected):
    torch = fake_torch(version, **flags)
    found = detect(torch)
    assert (found.key if found is not None else None) == expected
    # the fakes refuse is_available()/device_count(): reaching here means none was called


def test_detect_on_this_machines_real_torch_says_cpu_only():
    assert detect(sys.modules["torch"]) is None and detect(None) is None


# ----------------------------------------------------------------------------------------------
# devices: torch's own names
# ----------------------------------------------------------------------------------------------


def test_device_names_are_torchs_own():
    assert device("mps", 0).label == "mps" == Device("mps").label
    assert device("xpu", 1).label == "xpu:1" and device("cuda", 0).label == "cuda:0"
    assert device("cpu", None) is devices.HOST and device("xpu", 1) is device("xpu", 1)
    assert parse_device("mps").covers(device("mps", 0))
    assert parse_device_list("mps") == (0,) and parse_device_list("xpu:1, xpu:0") == (1, 0)
    with pytest.raises(ValueError):
        parse_device_list("cpu")


# ----------------------------------------------------------------------------------------------
# MPS
# ----------------------------------------------------------------------------------------------


def mps_torch(version=(2, 13), allocated=0, driver=0, recommended=int(17.760009765625 * GiB), generic=None):
    """A FAKE MPS build; ``generic`` is torch.accelerator's memory_stats on MPS (None: raises, as
    before torch routes MPS through it)."""
    calls = Calls()
    stats = generic if generic is not None else RuntimeError(
        "Device mps doesn't support device allocator")  # the gap of pytorch/pytorch#167447
    accelerator = FakeAccelerator(version, "mps", stats=stats, calls=calls) if version >= (2, 6) else None
    return fake_torch(version, mps_built=True, accelerator_type="mps", accelerator=accelerator,
                      mps=FakeMps(version, allocated, driver, recommended, calls=calls))


def test_mps_is_not_read_before_the_users_code_puts_a_tensor_there(no_mps_seen):
    torch = mps_torch()
    sample = probe_for(torch).sample()
    assert sample.devices == () and sample.reason == "MPS not used by your code yet"
    # nothing of torch.mps was called: its first call would start the allocator and fix
    # PYTORCH_MPS_HIGH_WATERMARK_RATIO before the user's code could set it
    assert [c for c in torch.mps.calls.names() if c.startswith("mps.")] == []


def test_mps_counters_limit_and_names_once_a_tensor_lives_there(no_mps_seen):
    limits = MPS_FIX["limits"]
    torch = mps_torch(allocated=4 * MiB, driver=9 * 2**20, recommended=int(limits["recommended_max_memory_gib"] * GiB))
    devices.note_seen("mps")
    probe = probe_for(torch)
    (dev,) = probe.sample().devices
    assert dev.type == "mps" and dev.device.label == "mps" and dev.index == 0
    assert (dev.allocated, dev.reserved, dev.used) == (4 * MiB, 9 * 2**20, 9 * 2**20)
    assert dev.peak_allocated is None and dev.peak_reserved is None  # no counter: never a zero
    # the limit: PYTORCH_MPS_HIGH_WATERMARK_RATIO (1.7) times Metal's recommended working set, as the
    # allocator's own limit read in pytorch/pytorch#189215 shows (30.19 GiB for 17.76 GiB)
    assert abs(dev.total - limits["high_watermark_limit_gib"] * GiB) < MiB
    memory = DeviceMemory.from_sample(dev)
    assert memory.label == "mps" and memory.free == dev.total - 9 * 2**20


def test_mps_peaks_are_sampled_not_reset(no_mps_seen):
    torch = mps_torch(allocated=GiB, driver=2 * GiB)
    devices.note_seen("mps")
    probe = probe_for(torch)
    _sample, _host_reset, reset_devices = probe.start()
    assert reset_devices == frozenset() and probe.cuda.resets_peaks is False
    assert "accelerator.reset_peak_memory_stats" not in torch.mps.calls.names()


def test_mps_environment_ratio_and_old_torch(no_mps_seen, monkeypatch):
    assert mps_limit(10 * GiB, {"PYTORCH_MPS_HIGH_WATERMARK_RATIO": "1.0"}) == 10 * GiB
    assert mps_limit(10 * GiB, {"PYTORCH_MPS_HIGH_WATERMARK_RATIO": "0.0"}) is None  # no limit at all
    assert mps_limit(10 * GiB, {"PYTORCH_MPS_HIGH_WATERMARK_RATIO": "high"}) is None
    devices.note_seen("mps")
    (dev,) = probe_for(mps_torch((2, 4), allocated=1, driver=2)).sample().devices  # no recommended_max_memory
    assert dev.total is None and dev.allocated == 1


def test_mps_through_torch_accelerator_where_torch_routes_it_there(no_mps_seen):
    """torch with pytorch/pytorch#186748 (assumed 2.14): exact peaks, reset through torch.accelerator,
    and the allocator's own 'started' answer instead of the tensors' note."""
    stats = dict(ACC_FIX["memory_stats"])
    torch = mps_torch((2, 14), allocated=1, driver=3 * GiB, generic=stats)
    probe = probe_for(torch)
    (dev,) = probe.sample().devices
    assert dev.type == "mps" and dev.allocated == stats["allocated_bytes.all.current"]
    assert dev.reserved == stats["reserved_bytes.all.current"] and dev.peak_allocated == stats["allocated_bytes.all.peak"]
    assert dev.used == 3 * GiB  # the limit still counts the driver's allocations
    assert probe.cuda.resets_peaks is True
    probe.start()
    assert torch.accelerator.impl.resets == 0  # peaks at their values: nothing to reset
    torch.accelerator.impl.stats = dict(stats, **{"allocated_bytes.all.peak": 2 * stats["allocated_bytes.all.peak"]})
    _s, _h, reset = probe.start()
    assert reset == frozenset({0}) and torch.accelerator.impl.resets == 1


def test_mps_generic_stats_before_the_allocator_starts_mean_not_used_yet(no_mps_seen):
    torch = mps_torch((2, 14), generic={})
    assert probe_for(torch).sample().reason == "MPS not used by your code yet"


# ----------------------------------------------------------------------------------------------
# XPU
# ----------------------------------------------------------------------------------------------


def xpu_torch(version=(2, 13), initialized=True, mem_info=None):
    rec = XPU_FIX["counters"]
    dev = XPU_FIX["device"]
    xpu = FakeXpu(version, initialized=initialized,
                  stats={0: nested(rec["memory_allocated"], rec["memory_reserved"])},
                  props=props(dev["name"], dev["total_memory_mib"] * MiB, "d47ef340-79ec-b1ea-0000-000000000001"),
                  mem_info=mem_info)
    return fake_torch(version, xpu_flag="20250000", accelerator_type="xpu", xpu=xpu)


def test_xpu_waits_for_its_runtime_then_reads_the_recorded_counters():
    torch = xpu_torch(initialized=False)
    probe = probe_for(torch)
    sample = probe.sample()
    assert sample.devices == () and sample.reason == "XPU not initialized yet"
    assert probe.cuda.device_count() is None  # counting before XPU is up could start SYCL
    torch.xpu.initialized = True
    (dev,) = probe.sample().devices
    rec, info = XPU_FIX["counters"], XPU_FIX["device"]
    assert dev.device.label == "xpu:0" and (dev.allocated, dev.reserved) == (rec["memory_allocated"], rec["memory_reserved"])
    assert dev.total == info["total_memory_mib"] * MiB
    assert probe.cuda.properties(0)[0] == "Intel(R) Data Center GPU Max 1550"


def test_xpu_device_view_from_mem_get_info_and_a_failure_is_not_retried():
    rec = XPU_FIX["mem_get_info"]
    total = XPU_FIX["device"]["total_memory_mib"] * MiB
    torch = xpu_torch(mem_info=(rec["free_before"], total))
    probe = probe_for(torch)
    (dev,) = probe.sample().devices
    assert dev.used == total - rec["free_before"]
    # pytorch/pytorch#161381: the free memory did not move after a 1 GiB tensor; shown as read
    torch.xpu.info = (rec["free_after_1gib_tensor"], total)
    assert probe.sample().devices[0].used == total - rec["free_after_1gib_tensor"]
    torch.xpu.info = RuntimeError("torch.xpu.mem_get_info requires PyTorch to be built with SYCL 2025")
    assert probe.sample().devices[0].used is None
    asked = torch.xpu.calls.names().count("xpu.mem_get_info")
    probe.sample()
    assert torch.xpu.calls.names().count("xpu.mem_get_info") == asked


def test_xpu_on_torch_2_5_has_counters_but_no_device_view():
    (dev,) = probe_for(xpu_torch((2, 5))).sample().devices
    assert dev.allocated == XPU_FIX["counters"]["memory_allocated"] and dev.used is None
    assert XPU.missing("device_used") is None and not XPU.has("device_used", (2, 5))


# ----------------------------------------------------------------------------------------------
# ROCm
# ----------------------------------------------------------------------------------------------


def rocm_torch(free_total=None):
    dev = ROCM_FIX["device"]
    total = int(191.98 * GiB)
    cuda = FakeCudaModule(initialized=True, stats={0: nested(int(5.01 * GiB), int(5.01 * GiB))},
                          props=props(dev["name"], total, None), mem_info=free_total)
    return fake_torch((2, 13), hip="6.4", accelerator_type="cuda", cuda_module=cuda), total


def test_rocm_reads_torch_cuda_counters_and_amdsmi_not_nvml(monkeypatch):
    torch, total = rocm_torch()
    amd = ROCM_FIX["amdsmi"]
    smi = FakeAmdsmi(["gpu0"], vram_usage_mb=amd["vram_usage_mb"], processes=[amd["process"]])
    monkeypatch.setitem(sys.modules, "amdsmi", smi)  # the copy torch.cuda loaded on a ROCm build
    probe = probe_for(torch, nvml=NvmlProbe(pynvml_module=RefusingNvml()))
    (dev,) = probe.sample().devices
    assert dev.device.label == "cuda:0" and probe.cuda.properties(0)[0] == "AMD Instinct MI300X"
    assert dev.used == amd["vram_usage_mb"]["vram_used"] * 2**20  # MB, as torch itself reads it
    assert dev.total == total and probe.cuda.is_rocm()
    assert probe.cuda.processes(0) == [(4242, amd["process"]["memory_usage"]["vram_mem"], "python3")]
    assert ROCM.counter("device_used").source.startswith("amdsmi")


def test_rocm_prefers_amdsmi_bytes_and_maps_hip_visible_devices(monkeypatch):
    torch, total = rocm_torch()
    smi = FakeAmdsmi(["gpu0", "gpu1"], usage_bytes=[111, 222])
    monkeypatch.setitem(sys.modules, "amdsmi", smi)
    probe = AmdsmiProbe(environ={"HIP_VISIBLE_DEVICES": "1"})
    assert probe.memory(0, total) == (222, total)  # torch's 0 is HIP's 1
    before_64 = AmdsmiProbe(amdsmi_module=FakeAmdsmi(["a", "b"], usage_bytes=[1, 2], enumeration=False),
                            environ={"HIP_VISIBLE_DEVICES": "1"})
    assert before_64.memory(0) == (None, None)  # no hip_id to map with: never another card's memory


def test_rocm_without_amdsmi_falls_back_to_mem_get_info(monkeypatch):
    torch, total = rocm_torch(free_total=(int(1.32 * GiB), int(191.98 * GiB)))
    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
    (dev,) = probe_for(torch, nvml=NvmlProbe(pynvml_module=RefusingNvml())).sample().devices
    assert dev.used == int(191.98 * GiB) - int(1.32 * GiB)


# ----------------------------------------------------------------------------------------------
# torch.accelerator and torch without it
# ----------------------------------------------------------------------------------------------


def test_another_accelerator_through_torch_accelerator():
    stats = dict(ACC_FIX["memory_stats"])
    for version, used in (((2, 9), None), ((2, 10), 3 * GiB)):
        accelerator = FakeAccelerator(version, "npu", stats={}, memory_info=(13 * GiB, 16 * GiB))
        torch = fake_torch(version, accelerator_type="npu", accelerator=accelerator)
        probe = probe_for(torch)
        assert probe.sample().reason == "npu not used by your code yet"
        accelerator.impl.stats = stats
        (dev,) = probe.sample().devices
        assert dev.device.label == "npu:0" and dev.allocated == stats["allocated_bytes.all.current"]
        assert dev.used == used


@pytest.mark.parametrize("version", [(2, 4), (2, 6), (2, 8)])
def test_torch_without_accelerator_memory_calls_still_works(version, no_mps_seen):
    """torch 2.4-2.8: no torch.accelerator (2.4, 2.5) or one without memory calls (2.6-2.8)."""
    torch = mps_torch(version, allocated=5, driver=7)
    assert not hasattr(getattr(torch, "accelerator", None), "memory_stats")
    devices.note_seen("mps")
    (dev,) = probe_for(torch).sample().devices
    assert (dev.allocated, dev.reserved, dev.type) == (5, 7, "mps")
    xpu = xpu_torch((2, 5)) if version < (2, 6) else xpu_torch(version)
    assert probe_for(xpu).sample().devices[0].allocated == XPU_FIX["counters"]["memory_allocated"]
    npu = fake_torch(version, accelerator_type="npu")
    reason = probe_for(npu).sample().reason
    assert reason == ("npu: this torch has no torch.accelerator memory calls (torch 2.9+)" if version >= (2, 6)
                      else "this torch build has no CUDA (a CPU-only build)")


def test_this_machines_cpu_torch_is_unchanged():
    sample = MemoryProbe().sample()
    assert sample.devices == () and sample.reason == "this torch build has no CUDA (a CPU-only build)"


# ----------------------------------------------------------------------------------------------
# out-of-memory messages: what each backend's message says about its device
# ----------------------------------------------------------------------------------------------


def _memory(message):
    from ipy_gpumem.oom.parse import parse_oom

    report = parse_oom(message)
    assert report is not None, message
    return report, DeviceMemory.from_message(report)


@pytest.mark.parametrize("entry", MPS_FIX["messages"], ids=lambda e: e["source"][:40])
def test_mps_messages_state_the_high_watermark_limit(entry):
    report, memory = _memory(entry["message"])
    assert memory.label == "mps" and memory.total == report.max_allowed
    assert memory.used == report.allocated_by_pytorch + report.other_allocations
    if entry["ram_gib"]:
        # Metal's recommended working set is max allowed / 1.7: two thirds of RAM up to 16 GB,
        # three quarters on the 64 GB Mac (the default ratio of the table, checked on real limits)
        recommended = report.max_allowed / backends.MPS_DEFAULT_HIGH_WATERMARK / GiB
        share = recommended / entry["ram_gib"]
        assert min(abs(share - 2 / 3), abs(share - 3 / 4)) < 0.01, (share, entry["source"])


@pytest.mark.parametrize("entry", XPU_FIX["messages"] + ROCM_FIX["messages"], ids=lambda e: e["source"][:40])
def test_xpu_and_rocm_messages_name_torchs_device(entry):
    report, memory = _memory(entry["message"])
    if "XPU" in entry["message"]:
        assert memory.label == "xpu:0" and report.kind == "xpu"
    else:
        assert memory.label == "cuda:0" and report.kind == "hip"
    assert memory.total == report.total and memory.total is not None


# ----------------------------------------------------------------------------------------------
# every view, in a real IPython shell, through a FAKE MPS torch (the recorded driver series)
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def mps_shell(ip, gpumem, no_mps_seen, restore_user_ns):
    """The extension on the test shell reading a FAKE MPS build (the real torch stays imported for the
    rest of the extension); the fake's torch.mps is ``fake_mps`` in the namespace."""
    from conftest import run

    series = MPS_FIX["driver_series"]
    torch = mps_torch(allocated=series["after_empty_cache"] * 2**20, driver=series["before_training"] * 2**20)
    devices.note_seen("mps")
    real = gpumem.probe
    gpumem.probe = probe_for(torch)
    ip.user_ns["fake_mps"] = torch.mps
    run(ip, "pass")
    try:
        yield torch, run
    finally:
        gpumem.probe = real


def test_the_cell_line_lines_and_history_name_mps(ip, mps_shell):
    from conftest import texts

    torch, run = mps_shell
    series = MPS_FIX["driver_series"]
    grown = (series["after_one_epoch"] - series["before_training"]) * 2**20
    res, cap = run(ip, f"fake_mps.allocated += {grown}\nfake_mps.driver += {grown}")
    assert res.success
    line = " ".join(texts(cap) + [cap.stdout])
    assert "mps +13.36 GiB allocated" in line and "cuda" not in line, line
    import ipy_gpumem

    last = ipy_gpumem.history()[-1]
    (dev,) = last.devices
    assert dev.label == "mps" and dev.type == "mps" and dev.allocated_delta == grown
    assert last.peaks == "sampled" or dev.peak_allocated >= dev.allocated_after  # no counter reset on MPS
    res, cap = run(ip, f"%%gpumem --lines\nfake_mps.allocated -= {grown}\nfake_mps.driver -= {grown}\nx = 1")
    assert res.success
    report = " ".join(texts(cap) + [cap.stdout])
    assert "mps allocated" in report and "Δallocated" in report and "-13.36 GiB" in report, report


def test_gpumem_free_empties_the_mps_cache(ip, mps_shell):
    from conftest import texts

    torch, run = mps_shell
    series = MPS_FIX["driver_series"]
    torch.mps.driver = series["after_one_epoch"] * 2**20
    res, cap = run(ip, "%gpumem free")
    assert res.success and ("mps.empty_cache",) in torch.mps.calls
    text = " ".join(" ".join(texts(cap) + [cap.stdout]).split())
    assert "the MPS allocator's cache (torch.mps.empty_cache():" in text, text
    assert "mps reserved" in text and "52.00 MiB" in text


def test_gpumem_free_leaves_an_unused_mps_alone(ip, gpumem, no_mps_seen, restore_user_ns):
    from conftest import run

    torch = mps_torch(allocated=0, driver=0)
    real = gpumem.probe
    gpumem.probe = probe_for(torch)
    try:
        res, _cap = run(ip, "%gpumem free")
    finally:
        gpumem.probe = real
    assert res.success and [c for c in torch.mps.calls.names() if c.startswith("mps.")] == []


def test_mps_status_leaves_unknown_figures_blank_not_zero(no_mps_seen):
    devices.note_seen("mps")
    (dev,) = probe_for(mps_torch(allocated=GiB, driver=3 * GiB)).sample().devices
    memory = DeviceMemory.from_sample(dev)
    assert memory.outside_pytorch is None  # one driver figure: not split into pool and the rest
    assert memory.reserved_unallocated == 2 * GiB and memory.free == dev.total - 3 * GiB


def test_the_tensors_room_notes_each_device_type_it_meets(no_mps_seen, monkeypatch):
    from ipy_gpumem.tensors import storage

    monkeypatch.setattr(storage, "_DEVICES", {("cpu", None): devices.HOST})
    assert not devices.seen("mps")
    assert storage.device_of("mps", 0) == Device("mps", 0)
    assert devices.seen("mps") and not devices.seen("xpu")


def test_the_chart_names_each_series_by_torchs_device(no_mps_seen):
    from ipy_gpumem.chart.timeline import Timeline
    from ipy_gpumem.core.probes import DeviceSample, HostSample, Sample

    timeline = Timeline()
    for t, allocated in ((0.0, GiB), (0.5, 3 * GiB)):
        timeline.add(Sample(t, HostSample(100 * MiB, None),
                            (DeviceSample(0, allocated, 4 * GiB, None, None, 4 * GiB, int(30.19 * GiB), "mps"),
                             DeviceSample(1, allocated, 2 * GiB, None, None, None, 64 * GiB, "xpu"))))
    snap = timeline.snapshot()
    labels = {f"{key.device.label} {key.quantity}" for key in snap.keys}
    assert {"mps allocated", "mps reserved", "mps used", "xpu:1 allocated", "xpu:1 reserved"} <= labels
    assert Device("mps", 0) in snap.devices() and not any(d.type == "cuda" for d in snap.devices())


@pytest.mark.parametrize("entry, device_label, limit", [
    (MPS_FIX["messages"][0], "mps", "18.13 GiB"),
    (XPU_FIX["messages"][0], "xpu:0", "5.65 GiB"),
    (ROCM_FIX["messages"][0], "cuda:0", "191.98 GiB"),
], ids=["mps", "xpu", "rocm"])
def test_the_oom_panel_reads_each_backends_real_message(ip, gpumem, restore_user_ns, entry, device_label, limit):
    """The real messages raised in a real shell: the panel follows the user's traceback, names the
    device as torch does and states the limit the message gives (MPS: its high-watermark limit)."""
    from conftest import run, texts

    message = entry["message"].split("Error: ", 1)[-1]
    ip.user_ns["message"] = message
    res, cap = run(ip, "import torch\nraise torch.OutOfMemoryError(message)")
    assert not res.success and isinstance(res.error_in_exec, sys.modules["torch"].OutOfMemoryError)
    panel = " ".join(" ".join(texts(cap) + [cap.stdout]).split())
    assert f"Out of memory on {device_label}" in panel and limit in panel, panel[:600]
    if device_label == "mps":
        assert "PYTORCH_MPS_HIGH_WATERMARK_RATIO" in panel and "max allowed" in panel


@pytest.mark.slow
def test_estimate_names_non_nvidia_devices():
    """MI300X, an Intel Max 1550 and an M3 Max 36GB as ``gpu=``: their usable memory from the
    recordings (MI300X's 191.98 GiB messages, the Max 1550's 65,520 MiB), the M3 Max's assumed."""
    import ipy_gpumem
    from ipy_gpumem.preflight.gpus import GPUS, cublas_workspace, fixed_costs, resolve_gpu

    torch = sys.modules["torch"]
    assert resolve_gpu("AMD Instinct MI300X") is GPUS["MI300X"]
    assert resolve_gpu("Intel(R) Data Center GPU Max 1550").capacity == XPU_FIX["device"]["total_memory_mib"] * MiB
    assert abs(GPUS["MI300X"].capacity - int(191.98 * GiB)) < 2 * MiB
    m3 = resolve_gpu("M3 Max 36GB")
    assert m3.capacity == 27 * GiB and fixed_costs(m3) == {} and cublas_workspace(m3) == 0
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 256)

    def step(model, opt, x):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    est = ipy_gpumem.estimate(step, model, opt, x, device="cuda", gpu="M3 Max 36GB")
    for name in ("M3 Max 36GB", "MI300X", "Max 1550"):
        fit = est.fits(name)
        assert fit.fits and fit.capacity == GPUS[name].capacity
