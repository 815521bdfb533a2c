"""Real CUDA: exact allocator deltas through the extension, and fixture capture for the CPU tests.

Marked ``gpu``: skipped without a CUDA device. With ``IPY_GPUMEM_CAPTURE=path`` set they also
write what they saw (memory_stats dicts, device names, timings) to ``path``, to be committed as a
fixture when a GPU is lent; the CPU tests check the CUDA paths against the real captures already in
``tests/fixtures/`` (allocator snapshots under ``snapshots/``, OOM threads and NVML readings under
``threads/``, each with its source).
"""
import json
import os
import time

import pytest
from IPython.utils.capture import capture_output

import ipy_gpumem

pytestmark = pytest.mark.gpu
MiB = 2**20


def _capture(name, data):
    where = os.environ.get("IPY_GPUMEM_CAPTURE")
    if where:
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, name), "w") as fh:
            json.dump(data, fh, indent=1, default=str)


def test_first_cuda_cell_and_exact_allocated_deltas(ip, gpumem):
    import torch

    ip.user_ns["torch"] = torch
    with capture_output():
        ip.run_cell("x = torch.empty(256 * 2**20, dtype=torch.uint8, device='cuda')", store_history=True)
    rec = ipy_gpumem.last()
    dev = rec.devices[0]
    assert dev.allocated_before == 0 and dev.allocated_delta == 256 * MiB
    assert dev.reserved_after >= 256 * MiB and dev.total == torch.cuda.get_device_properties(0).total_memory
    assert dev.used_after is not None and dev.used_after >= dev.reserved_after
    with capture_output() as cap:
        ip.run_cell("y = torch.empty(512 * 2**20, dtype=torch.uint8, device='cuda'); del y", store_history=True)
    dev = ipy_gpumem.last().devices[0]
    assert dev.allocated_delta == 0 and dev.peak_increase == 512 * MiB
    assert "(peak +512.00 MiB)" in cap.outputs[0].data["text/plain"]
    _capture("record_first_cuda_cells.json", [r.to_dict() for r in ipy_gpumem.history()[-2:]])
    _capture("memory_stats_nested.json", torch._C._cuda_memoryStats(0))
    props = torch.cuda.get_device_properties(0)
    _capture("device.json", {"name": props.name, "total_memory": props.total_memory, "uuid": str(getattr(props, "uuid", "")),
                             "torch": torch.__version__, "cuda": torch.version.cuda})
    ip.user_ns.pop("x")


def test_lines_on_cuda_are_exact(ip, gpumem):
    import torch

    ip.user_ns["torch"] = torch
    src = ("%%gpumem --lines -o rec\n"
           "a = torch.empty(64 * 2**20, dtype=torch.uint8, device='cuda')\n"
           "for i in range(3):\n"
           "    b = torch.empty(32 * 2**20, dtype=torch.uint8, device='cuda')\n"
           "    del b\n"
           "del a\n")
    with capture_output():
        ip.run_cell(src, store_history=True)
    by = {ln.lineno: ln.devices[0] for ln in ip.user_ns["rec"].lines}
    assert by[2].allocated_delta == 64 * MiB
    assert by[4].allocated_delta == 3 * 32 * MiB and by[4].peak_increase == 32 * MiB
    assert by[5].allocated_delta == -3 * 32 * MiB
    assert by[6].allocated_delta == -64 * MiB
    _capture("record_lines.json", ip.user_ns["rec"].to_dict())


def test_one_sample_per_device_is_cheap():
    import torch

    from ipy_gpumem.core.probes import MemoryProbe

    torch.zeros(1, device="cuda")
    probe = MemoryProbe()
    for _ in range(100):
        probe.cuda.counters(0)
        probe.cuda.device_memory(0)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        probe.cuda.counters(0)
    counters_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(n):
        probe.cuda.device_memory(0)
    nvml_us = (time.perf_counter() - t0) / n * 1e6
    _capture("timings.json", {"counters_us": counters_us, "device_memory_us": nvml_us, "nvml": probe.cuda.nvml.reason})
    assert counters_us + nvml_us < 200  # the benchmark reports the real figure; this catches regressions


def test_real_cuda_oom_is_parsed_explained_and_captured(ip, gpumem):
    import torch

    from ipy_gpumem import parse_oom

    ip.user_ns["torch"] = torch
    torch.cuda.set_per_process_memory_fraction(0.05, 0)
    try:
        src = ("keep = torch.empty(int(torch.cuda.get_device_properties(0).total_memory * 0.03), dtype=torch.uint8, device='cuda')\n"
               "big = torch.empty(int(torch.cuda.get_device_properties(0).total_memory * 0.04), dtype=torch.uint8, device='cuda')")
        with capture_output() as cap:
            result = ip.run_cell(src, store_history=True)
        err = result.error_in_exec
        assert isinstance(err, torch.OutOfMemoryError)
        oom = parse_oom(str(err))
        assert oom.kind == "cuda_allocator" and oom.allowed is not None and oom.requested is not None
        panels = [o for o in cap.outputs if o.data.get("text/plain", "").startswith("Out of memory on cuda:0")]
        assert len(panels) == 1
        assert "allocator at OOM" in panels[0].data["text/plain"]  # the observer's capture was used
        _capture("real_cuda_oom.json", {"message": str(err), "parsed": oom.to_dict(),
                                         "panel": panels[0].data["text/plain"]})
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
        ip.user_ns.pop("keep", None)


def test_the_first_cuda_cells_oom_is_captured(tmp_path):
    """CUDA comes up in the very cell that runs out of memory: the observer, queued through torch's
    lazy init, must already be attached (a fresh process: CUDA must not be up before the cell)."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "from IPython.utils.capture import capture_output\n"
        "ip = InteractiveShell.instance()\n"
        "ip.user_ns['torch'] = torch\n"
        "ip.run_line_magic('load_ext', 'ipy_gpumem')\n"
        "ip.run_cell('x = 1', store_history=True)\n"
        "assert not torch.cuda.is_initialized()\n"
        "with capture_output() as cap:\n"
        "    ip.run_cell('big = torch.empty(2**60, dtype=torch.uint8, device=\"cuda\")', store_history=True)\n"
        "panels = [o.data['text/plain'] for o in cap.outputs if o.data.get('text/plain', '').startswith('Out of memory')]\n"
        "print(len(panels), 'allocator at OOM' in (panels[0] if panels else ''))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.stdout.split()[-2:] == ["1", "True"], out.stdout + out.stderr


def test_nvml_and_torch_agree_on_the_total(ip, gpumem):
    """One total for the per-cell line, the chart and the OOM message: torch's (NVML v1 counts the
    driver's reservation in its own total and used)."""
    import torch

    torch.zeros(1, device="cuda")
    sample = gpumem.probe.sample([0])
    dev = sample.devices[0]
    assert dev.total == torch.cuda.get_device_properties(0).total_memory
    free, total = torch.cuda.mem_get_info(0)
    assert total == dev.total
    assert abs((total - free) - dev.used) < 256 * MiB  # NVML's used (v2) and cudaMemGetInfo's agree
    _capture("nvml_vs_torch.json", {"torch_total": dev.total, "used_nvml": dev.used, "used_cuda": total - free,
                                     "nvml": gpumem.probe.cuda.nvml.reason})


def test_trace_records_the_cell_and_names_its_lines(ip, gpumem):
    import torch

    torch.ones(1, device="cuda")  # CUDA up: --trace never initializes it
    ip.run_cell("import torch")
    before = torch._C._cuda_isHistoryEnabled()
    with capture_output():
        ip.run_cell("%%gpumem --trace\nkeep = torch.empty(64 * 2**20, dtype=torch.uint8, device='cuda')\n"
                    "tmp = torch.empty(32 * 2**20, dtype=torch.uint8, device='cuda'); del tmp", store_history=True)
    assert torch._C._cuda_isHistoryEnabled() == before
    snap = torch.cuda.memory._snapshot()
    from ipy_gpumem.snapshots import read_snapshot

    path = os.path.join(os.environ.get("IPY_GPUMEM_CAPTURE", "/tmp"), "trace_cell.pickle")
    with capture_output():
        ip.run_cell(f"%%gpumem --trace {path}\nkeep2 = torch.empty(16 * 2**20, dtype=torch.uint8, device='cuda')",
                    store_history=True)
    report = read_snapshot(path)
    assert report.replay().check.ok
    grown = report.to_dict()["peak_allocated"] - report.to_dict()["start"]["allocated"]
    assert 16 * MiB <= grown <= 17 * MiB  # one block: the request, or a cached range's rest of at most 1 MiB
    del snap
    ip.run_cell("del keep, keep2")


def test_a_traced_out_of_memory_gets_one_panel_from_the_recording(ip, gpumem):
    """The real path of what tests/snapshots/test_snapshots.py checks with a stand-in recorder: a cell that
    asks for more than the card under ``--trace``: one panel, its numbers the recorded ones."""
    import torch

    from ipy_gpumem.core.units import format_bytes

    torch.ones(1, device="cuda")
    ip.run_cell("import torch")
    too_much = torch.cuda.get_device_properties(0).total_memory + 2**30
    path = os.path.join(os.environ.get("IPY_GPUMEM_CAPTURE", "/tmp"), "trace_oom.pickle")
    with capture_output() as cap:
        result = ip.run_cell(f"%%gpumem --trace {path}\nbig = torch.empty({too_much}, dtype=torch.uint8, device='cuda')",
                             store_history=True)
    assert type(result.error_in_exec).__name__ == "OutOfMemoryError"
    texts = [o.data.get("text/plain", "") for o in cap.outputs]
    panels = [t for t in texts if t.startswith("Out of memory on cuda:0")]
    assert len(panels) == 1 and sum("Diagnosis" in t for t in texts) == 1
    from ipy_gpumem.snapshots import read_snapshot

    recorded = read_snapshot(path).recorded_ooms(0)[-1]
    assert "Recorded at the failure (the cell's allocator trace)" in panels[0]
    assert f"tried to allocate {format_bytes(recorded.requested)} with {format_bytes(recorded.device_free)} free" in panels[0]
    assert f"the failing allocation: In [{result.execution_count}], line 2" in panels[0]
    _capture("trace_oom_panel.txt", {"panel": panels[0]})


# ---------------------------------------------------------------------------------------------
# Several processes on CUDA (issue 20): torch's counters inside forked ranks, NVML from outside, NCCL
# ---------------------------------------------------------------------------------------------

CUDA_RANKS = '''
import os
import torch
import torch.distributed as dist

def work(rank, world, port, backend, big):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    device = rank % torch.cuda.device_count()
    torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world)
    keep = torch.empty((512 if rank == big else 64) * 2**20, dtype=torch.uint8, device="cuda")
    t = torch.ones(1024, device="cuda" if backend == "nccl" else "cpu")
    dist.all_reduce(t)
    dist.barrier()
    dist.destroy_process_group()
    return int(keep.numel())
'''


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_cells(tmp_path, world, backend, how):
    (tmp_path / "cuda_ranks.py").write_text(CUDA_RANKS)
    launch = (f"mp.start_processes(cuda_ranks.work, args=({world}, {_free_port()}, '{backend}', 1), nprocs={world}, "
              f"start_method='{how}')")
    return ["import json, os, sys, torch.multiprocessing as mp\nsys.path.insert(0, os.getcwd())\nimport cuda_ranks",
            launch,
            "import ipy_gpumem, torch\nprint(json.dumps(ipy_gpumem.history()[-1].to_dict()['ranks']))\n"
            "print(torch.cuda.is_initialized())"]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["fork", "spawn"])
def test_cuda_ranks_report_device_memory_without_initializing_cuda_in_the_kernel(tmp_path, how):
    """Two ranks on cuda:0 with gloo: forked ranks report torch's own counters (512 MiB for rank 1),
    spawned ones NVML's per-process use; the kernel never initializes CUDA (a fork after that fails)."""
    import torch

    from kernel_helpers import execute, plain, outputs

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    nb = execute(_rank_cells(tmp_path, 2, "gloo", how), extensions=["ipy_gpumem"], cwd=str(tmp_path), timeout=240)
    assert outputs(nb.cells[1], "error") == [], plain(nb.cells[1])
    printed = plain(nb.cells[2])[0].splitlines()
    ranks = json.loads(printed[0])
    assert printed[1] == "False"  # the kernel itself never touched CUDA
    assert [r["rank"] for r in ranks] == [0, 1]
    big = ranks[1]
    if how == "fork":  # recorded inside: torch's counters, exact
        (dev,) = big["devices"]
        assert dev["peak_allocated"] - dev["allocated_before"] >= 512 * MiB
    else:  # from outside: NVML's per-process use, the CUDA context included
        assert big["devices"], big
        assert max(d.get("used_after") or 0 for d in big["devices"]) >= 512 * MiB
    _capture(f"ranks_{how}.json", ranks)


@pytest.mark.slow
def test_nccl_ranks_on_two_gpus(tmp_path):
    import torch

    from kernel_helpers import execute, plain, outputs

    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank: this machine has fewer than 2")
    nb = execute(_rank_cells(tmp_path, 2, "nccl", "spawn"), extensions=["ipy_gpumem"], cwd=str(tmp_path), timeout=240)
    assert outputs(nb.cells[1], "error") == [], plain(nb.cells[1])
    ranks = json.loads(plain(nb.cells[2])[0].splitlines()[0])
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["devices"] for r in ranks)
