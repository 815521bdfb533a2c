"""Our CUDA logic against real data: OOM messages, memory_summary() tables, segment dicts and NVML readings copied from public threads.

Every number asserted here is one printed in a real thread (tests/fixtures/threads/, each file with
its repository, thread and URL), read by this file's own helpers (tests/thread_fixtures.py), never
a value our code produced earlier. The OOM messages go through ``parse_oom``, ``analyse`` and
``oom_panel`` as the live path runs them. The NVML part runs ``NvmlProbe`` against a stand-in
``pynvml`` module: a replay, because the device states (an idle A100 under an R510+ driver, a
P100 with gpustat's old bindings, a MIG 3g.40gb slice of an 80 GB card, an A100 split into three
2g.20gb slices) cannot be caused on this machine, which has no GPU. The values the replay returns
are real, copied from the named threads; the module object around them is the only fake, and it
raises for any value the thread does not give.
"""
from __future__ import annotations

import pytest

from ipy_gpumem import parse_oom
from ipy_gpumem.core.devices import cuda
from ipy_gpumem.core.memory import DeviceMemory
from ipy_gpumem.core.probes import NvmlProbe
from ipy_gpumem.oom.analysis import analyse, find_this_process
from ipy_gpumem.oom.panel import oom_panel

from thread_fixtures import (
    GiB, MiB, OOM_THREADS, ReplayDevice, gpustack_mig, load, nvitop_mig, replay_pynvml, rounding, summary_rows,
    to_bytes,
)

PYTHON = "/usr/bin/python3"


def _analysis(message: str):
    """The live path's analysis of a message alone: no namespace, no probe, a pid NVML never lists."""
    return analyse(parse_oom(message), None, namespace=None, env={}, modules=(), pid=1, executable=PYTHON)


def _gib(nbytes: float) -> str:
    """A size as torch prints it at or above 1 GiB (two decimals), for finding it in the panel's text."""
    return f"{nbytes / GiB:.2f} GiB"


# =============================================================================================
# 1. The messages: every figure parse_oom reads
# =============================================================================================

_FIELDS = [(name, field) for name in OOM_THREADS for field in load(name)["message_figures"]]


@pytest.mark.parametrize("name", OOM_THREADS)
def test_each_figure_is_written_in_its_message(name):
    # Guards the transcription: a figure that is not literally in the message is a typo here.
    thread = load(name)
    for figure in thread["message_figures"].values():
        assert figure in thread["message"], (name, figure)


@pytest.mark.parametrize("name, field", _FIELDS)
def test_parse_oom_reads_every_figure_of_the_message(name, field):
    thread = load(name)
    figure = thread["message_figures"][field]
    report = parse_oom(thread["message"])
    assert report is not None and report.kind == "cuda_allocator" and report.device_type == "cuda"
    if field == "gpu_index":
        assert report.gpu_index == int(figure)
        return
    if field.startswith("process_"):
        pid = int(field.split("_")[1])
        assert dict(report.other_processes) == {pid: pytest.approx(to_bytes(figure), abs=1)}
        assert report.process_in_use is None  # the message says "Process N", not "this process"
        return
    assert getattr(report, field) == pytest.approx(to_bytes(figure), abs=1)


def test_the_old_messages_have_no_figure_the_new_one_prints_and_vice_versa():
    old = parse_oom(load("pytorch-35901")["message"])
    new = parse_oom(load("mask2dit-4")["message"])
    assert old.reserved_unallocated is None and old.other_processes == () and old.process_in_use is None
    assert new.reserved_by_pytorch is None
    assert new.hints == ("expandable_segments",) and old.hints == ()


# =============================================================================================
# 2. pytorch/pytorch#35901: fragmentation, with memory_summary() and segment dicts
# =============================================================================================


def test_35901_the_request_is_the_segment_the_large_tensor_left_behind():
    thread = load("pytorch-35901")
    segment = thread["segments"][0]
    requested = parse_oom(thread["message"]).requested
    # The tensor freed after iteration 1 left one inactive block of exactly the size iteration 2 asks for.
    assert segment["blocks"] == [{"size": segment["total_size"], "state": "inactive"}]
    assert abs(segment["total_size"] - requested) <= rounding(thread["message_figures"]["requested"])
    # At the OOM the same segment (same address) is split with some blocks active: not releasable.
    split = thread["segments"][1]
    assert split["address"] == segment["address"] and split["active_size"] > 0
    assert any(b["state"].startswith("active") for b in split["blocks"])


def test_35901_panel_headline_and_layers_are_the_messages_numbers():
    thread = load("pytorch-35901")
    f = thread["message_figures"]
    a = _analysis(thread["message"])
    text = oom_panel(a).text
    assert text.splitlines()[0] == (f"Out of memory on cuda:0: tried to allocate {f['requested']} with {f['free']} free "
                                    f"({f['total']} total)")
    unallocated = to_bytes(f["reserved_by_pytorch"]) - to_bytes(f["allocated_by_pytorch"])
    outside = to_bytes(f["total"]) - to_bytes(f["free"]) - to_bytes(f["reserved_by_pytorch"])
    assert a.memory.reserved_unallocated == pytest.approx(unallocated, abs=2)
    assert a.memory.outside_pytorch == pytest.approx(outside, abs=2)
    legend = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ") and line.split()}
    assert f"{_gib(unallocated)}" in legend["▓"] and f["allocated_by_pytorch"] in legend["█"]
    assert f["free"] in legend["·"]
    shortfall = to_bytes(f["requested"]) - to_bytes(f["free"])
    assert f"the request: {shortfall / MiB:.2f} MiB more than free" in text


def test_35901_diagnosis_is_the_threads_fragmentation_in_the_message_and_in_the_summary():
    thread = load("pytorch-35901")
    f = thread["message_figures"]
    requested = to_bytes(f["requested"])
    # The thread's conclusion, from both of its texts: the cache holds more than the request.
    assert to_bytes(f["reserved_by_pytorch"]) - to_bytes(f["allocated_by_pytorch"]) > requested
    rows = summary_rows(thread["memory_summary"])
    cached = to_bytes(rows["GPU reserved memory"][0]) - to_bytes(rows["Allocated memory"][0])
    assert cached > requested
    a = _analysis(thread["message"])
    first = a.findings[0]
    assert first.key == "fragmentation" and "expandable_segments" in first.fix
    assert _gib(to_bytes(f["reserved_by_pytorch"]) - to_bytes(f["allocated_by_pytorch"])) in first.title
    # The card was in exclusive mode with nothing else on it: nothing to kill is offered.
    assert "kill" not in oom_panel(a).text


def test_35901_summary_is_another_run_than_the_message():
    # Documented in the fixture: compared for the conclusion only. Guard that it stays so.
    thread = load("pytorch-35901")
    rows = summary_rows(thread["memory_summary"])
    assert rows["Allocated memory"][0] == "1062 MB" and rows["GPU reserved memory"][0] == "12420 MB"
    message_reserved = to_bytes(thread["message_figures"]["reserved_by_pytorch"])
    assert abs(to_bytes(rows["GPU reserved memory"][0]) - message_reserved) > 0.1 * GiB
    # Its peak (4877 MB) is nowhere in the message, and the panel built from the message cannot show it.
    assert "4877" not in thread["message"]


# =============================================================================================
# 3. pytorch/pytorch#37250: memory outside PyTorch's allocator
# =============================================================================================


def test_37250_panel_says_the_memory_is_outside_pytorch():
    thread = load("pytorch-37250")
    f = thread["message_figures"]
    a = _analysis(thread["message"])
    text = oom_panel(a).text
    assert text.splitlines()[0] == (f"Out of memory on cuda:0: tried to allocate {f['requested']} with {f['free']} free "
                                    f"({f['total']} total)")
    outside = to_bytes(f["total"]) - to_bytes(f["free"]) - to_bytes(f["reserved_by_pytorch"])
    assert a.memory.outside_pytorch == pytest.approx(outside, abs=2)
    unallocated = to_bytes(f["reserved_by_pytorch"]) - to_bytes(f["allocated_by_pytorch"])
    assert unallocated < to_bytes(f["requested"])  # so fragmentation cannot be the story
    keys = [finding.key for finding in a.findings]
    assert "fragmentation" not in keys
    assert "outside PyTorch" in a.findings[0].title and _gib(outside) in a.findings[0].title


def test_37250_summary_of_the_smaller_run_stays_below_the_failing_one():
    thread = load("pytorch-37250")
    rows = summary_rows(thread["memory_summary"])
    assert "CUDA OOMs: 0" in thread["memory_summary"][3]
    peak = to_bytes(rows["Allocated memory"][1])
    assert peak < to_bytes(thread["message_figures"]["allocated_by_pytorch"])
    assert to_bytes(rows["Allocated memory"][0]) == 183578 * 1024


# =============================================================================================
# 4. Tianhao-Qi/Mask2DiT#4: the 2026 format; the listed process is this one
# =============================================================================================


def test_mask2dit_the_listed_process_is_this_process_by_the_messages_own_arithmetic():
    thread = load("mask2dit-4")
    f = thread["message_figures"]
    used = to_bytes(f["total"]) - to_bytes(f["free"])
    reserved = to_bytes(f["allocated_by_pytorch"]) + to_bytes(f["reserved_unallocated"])
    listed = to_bytes(f["process_76883"])
    # The text itself: the one listed process holds the whole device's use, and at least PyTorch's
    # reservation. It is the failing process under its host pid, not a neighbour.
    assert abs(listed - used) <= 3 * rounding(f["total"]) and listed >= reserved  # three rounded figures
    a = _analysis(thread["message"])
    assert a.memory.process_used == pytest.approx(listed, abs=1)
    assert a.memory.processes == () and a.maybe_own == ()
    text = oom_panel(a).text
    assert "kill" not in text and "76883" not in text
    # What is left for "others" (used - this process) is the three figures' rounding, nothing more.
    assert (a.memory.other_processes_bytes or 0) <= 3 * rounding(f["total"])


def test_mask2dit_panel_numbers_and_fragmentation():
    thread = load("mask2dit-4")
    f = thread["message_figures"]
    a = _analysis(thread["message"])
    text = oom_panel(a).text
    assert text.splitlines()[0] == (f"Out of memory on cuda:0: tried to allocate {f['requested']} with {f['free']} free "
                                    f"({f['total']} total)")
    assert a.memory.reserved_unallocated == pytest.approx(to_bytes(f["reserved_unallocated"]), abs=1)
    assert a.memory.allocated == pytest.approx(to_bytes(f["allocated_by_pytorch"]), abs=1)
    # reserved but unallocated (40.69 GiB) > request (35.60 GiB): the message's own hint, first.
    assert to_bytes(f["reserved_unallocated"]) > to_bytes(f["requested"])
    assert a.findings[0].key == "fragmentation" and "expandable_segments" in a.findings[0].fix
    assert f["reserved_unallocated"] in a.findings[0].title


# =============================================================================================
# 5. pytorch/pytorch#111729: "allowed" (a memory fraction of 1.0)
# =============================================================================================


def test_111729_allowed_equals_the_card_at_fraction_one_and_the_panel_uses_the_card():
    thread = load("pytorch-111729")
    f = thread["message_figures"]
    report = parse_oom(thread["message"])
    assert report.allowed == report.total == pytest.approx(to_bytes(f["total"]), abs=1)
    a = _analysis(thread["message"])
    assert oom_panel(a).text.splitlines()[0] == (
        f"Out of memory on cuda:{f['gpu_index']}: tried to allocate {f['requested']} with {f['free']} free "
        f"({f['total']} total)")
    assert a.memory.reserved_unallocated == pytest.approx(
        to_bytes(f["reserved_by_pytorch"]) - to_bytes(f["allocated_by_pytorch"]), abs=2)


# =============================================================================================
# 6. NVML v1 against v2: which "used" the probe reports
# =============================================================================================


def test_nvml_wrapper_57_a100_reports_v2_used_like_nvidia_smi_not_v1():
    thread = load("nvml-wrapper-57")
    v1, v2 = (to_bytes(thread["figures"][k], binary_mb=False) for k in ("v1_used", "v2_used"))
    for figure in thread["figures"].values():
        assert figure in thread["quote"]
    nvml = replay_pynvml([ReplayDevice("GPU-a100 (uuid not in the thread)", v1={"used": v1}, v2={"used": v2})])
    used, total = NvmlProbe(nvml, environ={}).memory(0, total=40 * GiB)  # torch's total: any; not read from NVML
    assert used == int(v2) and used != int(v1)
    assert total == 40 * GiB


@pytest.mark.parametrize("name", ["gpustat-130", "gpustat-141"])
def test_gpustat_idle_card_reads_as_nvidia_smi_shows_it_not_as_gpustat(name):
    thread = load(name)
    if name == "gpustat-130":
        gpustat = int(thread["gpustat"].split("|")[2].split("/")[0])  # "   103 / 16384 MB "
        smi = int(thread["nvidia_smi"][1].split("|")[2].split("MiB")[0])  # "      0MiB / 16384MiB "
        v1_used, v2_used = gpustat * MiB, smi * MiB
    else:
        assert thread["figures"]["v1_used"].replace("MB", "") in thread["quote"]
        v1_used, v2_used = to_bytes(thread["figures"]["v1_used"]), to_bytes(thread["figures"]["v2_used"])
    nvml = replay_pynvml([ReplayDevice("GPU-idle (uuid not in the thread)", v1={"used": v1_used},
                                       v2={"used": v2_used})])
    used, _ = NvmlProbe(nvml, environ={}).memory(0, total=16 * GiB)
    assert used == v2_used == 0 and v1_used > 0


def test_v1_fallback_on_a_driver_without_v2_gives_v2s_used_from_the_xmls_numbers():
    # gpustack's XML is an R575 reading with v2's split: total 81920, reserved 446, used 3703, free 77771 MiB.
    # v1 (NVML's docs) counts the reservation as used: used_v1 = total - free. A driver without v2 gives
    # only that; with torch's total = NVML's total - the reservation (the probe's stated assumption),
    # the probe's fallback must land on v2's used.
    xml = gpustack_mig()["gpu"]
    assert xml["total"] - xml["reserved"] - xml["used"] == xml["free"]  # the XML is consistent
    v1 = {"used": (xml["total"] - xml["free"]) * MiB, "total": xml["total"] * MiB}
    nvml = replay_pynvml([ReplayDevice("GPU-parent (uuid not in the source)", v1=v1, v2=None)], v2_supported=False)
    used, total = NvmlProbe(nvml, environ={}).memory(0, total=(xml["total"] - xml["reserved"]) * MiB)
    assert used == xml["used"] * MiB and total == (xml["total"] - xml["reserved"]) * MiB


# =============================================================================================
# 7. MIG: a slice is read by its own handle, never as the whole card
# =============================================================================================


def _gpustack_replay(v2_supported=True):
    xml = gpustack_mig()
    parent, mig = xml["gpu"], xml["mig"]

    def v2(u):
        return {k: u[k] * MiB for k in ("total", "reserved", "used", "free")}

    def v1(u):
        return {"used": (u["total"] - u["free"]) * MiB, "total": u["total"] * MiB, "free": u["free"] * MiB}

    devices = [ReplayDevice("GPU-standin-parent", v1=v1(parent), v2=v2(parent)),
               ReplayDevice("MIG-standin-3g40gb", v1=v1(mig), v2=v2(mig))]
    return replay_pynvml(devices, v2_supported=v2_supported), parent, mig


def test_gpustack_mig_slice_reads_its_own_298_mib_not_the_cards_3703():
    nvml, parent, mig = _gpustack_replay()
    # torch reports a MIG slice's UUID without the "MIG-" prefix; the probe finds it by that.
    used, total = NvmlProbe(nvml, environ={}).memory(0, uuid="standin-3g40gb", total=mig["total"] * MiB)
    assert used == mig["used"] * MiB and used != parent["used"] * MiB
    assert total == mig["total"] * MiB
    # Without v2 (older driver), v1's used on the slice: total - free, within nvidia-smi's 1 MiB rounding.
    nvml_v1, _, _ = _gpustack_replay(v2_supported=False)
    used_v1, _ = NvmlProbe(nvml_v1, environ={}).memory(0, uuid="standin-3g40gb", total=mig["total"] * MiB)
    assert abs(used_v1 - mig["used"] * MiB) <= 1 * MiB


def test_mig_slice_named_in_cuda_visible_devices_is_never_read_as_the_parent():
    nvml, parent, _ = _gpustack_replay()
    probe = NvmlProbe(nvml, environ={"CUDA_VISIBLE_DEVICES": "MIG-standin-3g40gb"})
    used, _ = probe.memory(0, total=40 * GiB)  # no UUID from torch: the probe declines rather than guess
    assert used != parent["used"] * MiB and (used, _) == (None, None)


def _nvitop_replay():
    table = nvitop_mig()
    gpu1_used, gpu1_total = table["gpus"][1]
    devices = [ReplayDevice("GPU-standin-gpu1", v2={"used": gpu1_used * MiB, "total": gpu1_total * MiB},
                            processes=[(pid, used * MiB, name) for gpu, _gi, pid, name, used in table["processes"]
                                       if gpu == 1])]
    for gpu, gi, used, total in table["migs"]:
        if gpu == 1:
            devices.append(ReplayDevice(f"MIG-standin-gi{gi}", v2={"used": used * MiB, "total": total * MiB},
                                        processes=[(pid, mem * MiB, name) for g, i, pid, name, mem
                                                   in table["processes"] if g == 1 and i == gi]))
    return replay_pynvml(devices), table


def test_nvitop_a100_three_slices_each_read_alone_and_summing_to_the_card():
    nvml, table = _nvitop_replay()
    probe = NvmlProbe(nvml, environ={})
    slices = [(gi, used, total) for gpu, gi, used, total in table["migs"] if gpu == 1]
    assert [gi for gi, _, _ in slices] == [3, 5, 6]
    readings = []
    for torch_index, (gi, used, total) in enumerate(slices):
        got, _ = probe.memory(torch_index, uuid=f"standin-gi{gi}", total=total * MiB)
        assert got == used * MiB  # the total returned is torch's (passed in), not NVML's: not checked here
        readings.append(got)
    # The table itself: the card's 24205 MiB are its three slices' use. We read slices, never the card.
    assert sum(readings) == table["gpus"][1][0] * MiB
    assert max(readings) < table["gpus"][1][0] * MiB


def test_nvitop_process_list_of_a_slice_is_that_slices_and_this_kernel_is_recognised():
    nvml, table = _nvitop_replay()
    probe = NvmlProbe(nvml, environ={})
    listed = probe.processes(0, uuid="standin-gi3")
    expected = [(pid, used * MiB, name) for gpu, gi, pid, name, used in table["processes"] if gpu == 1 and gi == 3]
    assert listed == expected and {pid for pid, _, _ in listed} == {34965, 42152}
    # test.py printed its own PID (42152): the OOM path takes that line out of "other processes".
    memory = DeviceMemory(device=cuda(0), processes=tuple(listed))
    memory, maybe_own = find_this_process(memory, (table["pid"],), PYTHON)
    assert memory.process_used == 149 * MiB and maybe_own == ()
    assert [p[0] for p in memory.processes] == [34965]


def test_the_replay_refuses_values_the_threads_do_not_give():
    nvml, _ = _nvitop_replay()
    # nvitop's table has no v1 reading: a probe that asked for it would get nothing, not a made-up value.
    used, total = NvmlProbe(nvml, environ={}).memory(0)  # no torch total: the v1 path
    assert (used, total) == (None, None)
