"""Our NVML logic against real data: NVML readings copied from public threads.

Every number asserted here is one printed in a real thread (tests/fixtures/threads/, each file with
its repository, thread and URL), read by the tests' own helpers (tests/thread_fixtures.py), never
a value our code produced earlier. These tests run ``NvmlProbe`` against a stand-in
``pynvml`` module: a replay, because the device states (an idle A100 under an R510+ driver, a
P100 with gpustat's old bindings, a MIG 3g.40gb slice of an 80 GB card, an A100 split into three
2g.20gb slices) cannot be caused on this machine, which has no GPU. The values the replay returns
are real, copied from the named threads; the module object around them is the only fake, and it
raises for any value the thread does not give. The out-of-memory messages of the same threads are
tests/oom/test_oom_threads.py's.
"""
from __future__ import annotations

import pytest

from ipy_gpumem.core.devices import cuda
from ipy_gpumem.core.memory import DeviceMemory
from ipy_gpumem.core.probes import NvmlProbe
from ipy_gpumem.oom.analysis import find_this_process

from thread_fixtures import GiB, MiB, ReplayDevice, gpustack_mig, load, nvitop_mig, replay_pynvml, to_bytes

PYTHON = "/usr/bin/python3"


# =============================================================================================
# 1. NVML v1 against v2: which "used" the probe reports
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
# 2. MIG: a slice is read by its own handle, never as the whole card
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
