"""Each figure of the real out-of-memory threads and NVML readings (tests/fixtures/threads) as the text gives it and as we read or show it, as a markdown table.

The OOM messages run through ``parse_oom``, ``analyse`` and ``oom_panel`` as the live path runs them
(no namespace, no probe); the NVML readings through ``NvmlProbe`` against the replay of
``tests/thread_fixtures.py`` (real values, a stand-in ``pynvml`` module: there is no GPU here).
A figure the thread gives and we do not use is listed as "not used".

    python benchmarks/bench_real_threads.py
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from ipy_gpumem import parse_oom  # noqa: E402
from ipy_gpumem.core.devices import cuda  # noqa: E402
from ipy_gpumem.core.memory import DeviceMemory  # noqa: E402
from ipy_gpumem.core.probes import NvmlProbe  # noqa: E402
from ipy_gpumem.oom.analysis import analyse, find_this_process  # noqa: E402
from ipy_gpumem.oom.panel import oom_panel  # noqa: E402
from thread_fixtures import (  # noqa: E402
    GiB, MiB, OOM_THREADS, ReplayDevice, gpustack_mig, load, nvitop_mig, replay_pynvml, rounding, summary_rows,
    to_bytes,
)

ROWS = []


def row(thread, figure, text, ours, ok):
    verdict = {True: "match", False: "**mismatch**", None: "not used"}[ok]
    ROWS.append((thread, figure, str(text), str(ours), verdict))


def as_written(nbytes, like: str) -> str:
    """``nbytes`` in the unit and decimals of the figure ``like`` ("10.84 GiB")."""
    if nbytes is None:
        return "none"
    number, unit = like.split()
    decimals = len(number.split(".")[1]) if "." in number else 0
    factor = {"GiB": GiB, "MiB": MiB, "KiB": 1024, "B": 1}[unit]
    return f"{nbytes / factor:.{decimals}f} {unit}"


def analysis_of(message):
    return analyse(parse_oom(message), None, namespace=None, env={}, modules=(), pid=1, executable="/usr/bin/python3")


def oom_threads():
    for name in OOM_THREADS:
        thread = load(name)
        f = thread["message_figures"]
        report = parse_oom(thread["message"])
        for field, figure in f.items():
            if field == "gpu_index":
                row(name, "GPU index", figure, report.gpu_index, report.gpu_index == int(figure))
                continue
            if field.startswith("process_"):
                pid = int(field.split("_")[1])
                got = dict(report.other_processes).get(pid)
                row(name, f"Process {pid}", figure, as_written(got, figure),
                    got is not None and abs(got - to_bytes(figure)) <= 1)
                continue
            got = getattr(report, field)
            row(name, field, figure, as_written(got, figure), got is not None and abs(got - to_bytes(figure)) <= 1)
        a = analysis_of(thread["message"])
        headline = oom_panel(a).text.splitlines()[0]
        gpu = f.get("gpu_index", "0")
        expected = (f"tried to allocate {f['requested']} with {f['free']} free ({f['total']} total)")
        row(name, "panel headline", expected, headline.split(": ", 1)[1], headline ==
            f"Out of memory on cuda:{gpu}: {expected}")
        if "reserved_by_pytorch" in f:
            reserved = to_bytes(f["reserved_by_pytorch"])
        else:
            reserved = to_bytes(f["allocated_by_pytorch"]) + to_bytes(f["reserved_unallocated"])
        unalloc = reserved - to_bytes(f["allocated_by_pytorch"])
        unit = "0.00 GiB" if unalloc >= GiB else "0.00 MiB"
        row(name, "reserved but unallocated (bar)", f"{as_written(unalloc, unit)} (reserved - allocated)",
            as_written(a.memory.reserved_unallocated, unit), abs(a.memory.reserved_unallocated - unalloc) <= 2)
        outside = to_bytes(f["total"]) - to_bytes(f["free"]) - reserved
        row(name, "outside PyTorch (bar)", f"{outside / GiB:.2f} GiB (total - free - reserved)",
            as_written(a.memory.outside_pytorch, "0.00 GiB"), abs(a.memory.outside_pytorch - outside) <= 2)
        first = a.findings[0] if a.findings else None
        if name == "pytorch-35901" or name == "mask2dit-4":
            row(name, "first finding", "fragmentation (reserved but unallocated > request)",
                f"{first.key} [{first.confidence}]: {first.title}", first.key == "fragmentation")
        elif name == "pytorch-37250":
            row(name, "first finding", "memory outside the allocator (the title's complaint)",
                f"{first.key} [{first.confidence}]: {first.title}", "outside PyTorch" in first.title)
        else:
            row(name, "first finding", "not fragmentation: reserved - allocated < request",
                f"{first.key} [{first.confidence}]: {first.title}", first.key != "fragmentation")
        if name == "mask2dit-4":
            listed = to_bytes(f["process_76883"])
            used = to_bytes(f["total"]) - to_bytes(f["free"])
            row(name, "Process 76883 is", f"this process: holds {used / GiB:.2f} GiB (total - free) "
                f">= reserved {reserved / GiB:.2f} GiB", f"this process ({as_written(a.memory.process_used, '0.00 GiB')}); "
                f"others listed: {len(a.memory.processes)}; 'kill' in panel: {'kill' in oom_panel(a).text}",
                abs(a.memory.process_used - listed) <= 1 and not a.memory.processes)
        if name == "pytorch-35901":
            seg = thread["segments"][0]["total_size"]
            row(name, "segment left by the large tensor", f"{seg} B", f"requested {report.requested} B",
                abs(seg - report.requested) <= rounding(f["requested"]))
            rows = summary_rows(thread["memory_summary"])
            cached = to_bytes(rows["GPU reserved memory"][0]) - to_bytes(rows["Allocated memory"][0])
            row(name, "summary: reserved - allocated > request", f"{rows['GPU reserved memory'][0]} - "
                f"{rows['Allocated memory'][0]} = {cached / GiB:.2f} GiB > {f['requested']}",
                "same conclusion (fragmentation)", cached > to_bytes(f["requested"]) and first.key == "fragmentation")
            row(name, "summary: peak allocated", rows["Allocated memory"][1],
                "no memory_summary is read; the panel's peak is the failing cell's own record", None)
            row(name, "summary: cudaMalloc retries / OOMs", "1 / 1", "not read", None)
            row(name, "segment dicts: inactive split", "11643387904 B block split, 499214336 B active",
                "not read (the rule infers it from reserved - allocated > request)", None)
        if name == "pytorch-37250":
            rows = summary_rows(thread["memory_summary"])
            row(name, "summary (smaller run): peak allocated", rows["Allocated memory"][1],
                "not read; below the failing run's 5.68 GiB, as it must be", None)


def nvml():
    t = load("nvml-wrapper-57")
    v1, v2 = (to_bytes(t["figures"][k], binary_mb=False) for k in ("v1_used", "v2_used"))
    lib = replay_pynvml([ReplayDevice("GPU-a100", v1={"used": v1}, v2={"used": v2})])
    used, _ = NvmlProbe(lib, environ={}).memory(0, total=40 * GiB)
    row("nvml-wrapper-57", "A100 idle: used", f"v1 {t['figures']['v1_used']}, v2 {t['figures']['v2_used']} "
        "(= nvidia-smi)", f"{used / 1e6:.1f}MB (v2)", used == int(v2))
    for name in ("gpustat-130", "gpustat-141"):
        t = load(name)
        if name == "gpustat-130":
            v1_used = int(t["gpustat"].split("|")[2].split("/")[0]) * MiB
            v2_used = int(t["nvidia_smi"][1].split("|")[2].split("MiB")[0]) * MiB
        else:
            v1_used, v2_used = to_bytes(t["figures"]["v1_used"]), to_bytes(t["figures"]["v2_used"])
        lib = replay_pynvml([ReplayDevice("GPU-idle", v1={"used": v1_used}, v2={"used": v2_used})])
        used, _ = NvmlProbe(lib, environ={}).memory(0, total=16 * GiB)
        row(name, "idle card: used", f"gpustat (v1) {int(v1_used) // MiB} MiB, nvidia-smi (v2) {int(v2_used) // MiB} MiB",
            f"{used // MiB} MiB", used == v2_used)
    xml = gpustack_mig()
    parent, mig = xml["gpu"], xml["mig"]

    def v2_of(u):
        return {k: u[k] * MiB for k in ("total", "reserved", "used", "free")}

    def v1_of(u):
        return {"used": (u["total"] - u["free"]) * MiB, "total": u["total"] * MiB}

    for supported in (True, False):
        lib = replay_pynvml([ReplayDevice("GPU-parent", v1=v1_of(parent), v2=v2_of(parent)),
                             ReplayDevice("MIG-slice", v1=v1_of(mig), v2=v2_of(mig))], v2_supported=supported)
        used, total = NvmlProbe(lib, environ={}).memory(0, uuid="slice", total=mig["total"] * MiB)
        row("gpustack XML (MIG 3g.40gb)", f"slice used, driver {'with' if supported else 'without'} v2",
            f"{mig['used']} MiB (card: {parent['used']} MiB)", f"{used / MiB:.0f} MiB",
            abs(used - mig["used"] * MiB) <= (0 if supported else MiB))
    lib = replay_pynvml([ReplayDevice("GPU-parent", v1=v1_of(parent), v2=None)], v2_supported=False)
    used, _ = NvmlProbe(lib, environ={}).memory(0, total=(parent["total"] - parent["reserved"]) * MiB)
    row("gpustack XML (card)", "v1 fallback, torch total = total - reserved",
        f"v2 used {parent['used']} MiB (v1 {parent['total'] - parent['free']} MiB)", f"{used // MiB} MiB",
        used == parent["used"] * MiB)
    lib = replay_pynvml([ReplayDevice("GPU-parent", v2=v2_of(parent)), ReplayDevice("MIG-slice", v2=v2_of(mig))])
    used, _ = NvmlProbe(lib, environ={"CUDA_VISIBLE_DEVICES": "MIG-slice"}).memory(0, total=40 * GiB)
    row("gpustack XML (MIG 3g.40gb)", "slice by CUDA_VISIBLE_DEVICES, no UUID", f"{mig['used']} MiB",
        "none (left to cudaMemGetInfo), never the card's", used is None)
    table = nvitop_mig()
    gpu1_used, gpu1_total = table["gpus"][1]
    devices = [ReplayDevice("GPU-gpu1", v2={"used": gpu1_used * MiB, "total": gpu1_total * MiB})]
    slices = [(gi, used, total) for gpu, gi, used, total in table["migs"] if gpu == 1]
    for gi, used, total in slices:
        devices.append(ReplayDevice(f"MIG-gi{gi}", v2={"used": used * MiB, "total": total * MiB},
                                    processes=[(pid, mem * MiB, pname) for g, i, pid, pname, mem in table["processes"]
                                               if g == 1 and i == gi]))
    probe = NvmlProbe(replay_pynvml(devices), environ={})
    readings = []
    for index, (gi, used, total) in enumerate(slices):
        got, got_total = probe.memory(index, uuid=f"gi{gi}", total=total * MiB)
        readings.append(got)
        row("nvitop PR #8 (A100, MIG)", f"GI {gi} used", f"{used}MiB", f"{got // MiB}MiB", got == used * MiB)
    row("nvitop PR #8 (A100, MIG)", "slice total", f"{slices[0][2]}MiB",
        "not read from NVML: the probe reports torch's total for the device (get_device_properties)", None)
    row("nvitop PR #8 (A100, MIG)", "sum of slices = card", f"{gpu1_used}MiB", f"{sum(readings) // MiB}MiB",
        sum(readings) == gpu1_used * MiB)
    listed = probe.processes(0, uuid="gi3")
    expected = [(pid, mem, pname) for g, i, pid, pname, mem in table["processes"] if g == 1 and i == 3]
    row("nvitop PR #8 (A100, MIG)", "GI 3 processes", ", ".join(f"{p} {n} {m}MiB" for p, m, n in expected),
        ", ".join(f"{p} {n} {m // MiB}MiB" for p, m, n in listed),
        [(p, m * MiB, n) for p, m, n in expected] == listed)
    memory, _ = find_this_process(DeviceMemory(device=cuda(0), processes=tuple(listed)), (table["pid"],),
                                  "/usr/bin/python3")
    row("nvitop PR #8 (A100, MIG)", f"this process (PID: {table['pid']})", "149MiB, the rest another process",
        f"{memory.process_used // MiB}MiB; others {[p[0] for p in memory.processes]}",
        memory.process_used == 149 * MiB and [p[0] for p in memory.processes] == [34965])


def main():
    oom_threads()
    nvml()
    print("| thread | figure | in the thread | we read / show | |")
    print("|---|---|---|---|---|")
    for r in ROWS:
        print("| " + " | ".join(cell.replace("|", "\\|") for cell in r) + " |")
    counts = {v: sum(1 for r in ROWS if r[4] == v) for v in ("match", "**mismatch**", "not used")}
    print(f"\n{counts['match']} match, {counts['**mismatch**']} mismatch, {counts['not used']} given by a thread "
          "and not used.")


if __name__ == "__main__":
    main()
