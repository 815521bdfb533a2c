"""Tests for ``ipy_gpumem.oom.analysis``: the state at failure, this kernel among NVML's processes, and the assembled ``OomAnalysis``.

CUDA paths run on labelled fakes (no GPU here): a scripted allocator (conftest's ``FakeCuda``), a
fake NVML process list, and real out-of-memory messages; the host path runs on a real torch
allocation failure and this machine's /proc.
"""
from __future__ import annotations

import os
import sys
import types

import pytest

torch = pytest.importorskip("torch")

from conftest import FakeCuda, ScriptedCudaProbe  # noqa: E402
from test_oom_rules import SEED, V5, Seed  # noqa: E402

from ipy_gpumem.core.devices import HOST, cuda  # noqa: E402
from ipy_gpumem.core.memory import DeviceMemory  # noqa: E402
from ipy_gpumem.core.records import CellRecord, DeviceRecord, HostRecord  # noqa: E402
from ipy_gpumem.core.units import GiB, MiB, format_bytes, parse_bytes  # noqa: E402
from ipy_gpumem.oom import rules  # noqa: E402
from ipy_gpumem.oom.analysis import OomAnalysis, analyse, find_this_process, memory_at_failure, traceback_frames  # noqa: E402
from ipy_gpumem.oom.capture import OomCapture  # noqa: E402
from ipy_gpumem.oom.parse import parse_oom  # noqa: E402
from ipy_gpumem.attribution.holders import Holder  # noqa: E402

PYTHON = "/usr/bin/python3.11"


class FakeNvml:
    """NVML's compute-process list, scripted (a fake: no driver here). Host pids, as in a container."""

    def __init__(self, processes=()):
        self.list = list(processes)
        self.calls = 0

    def processes(self, index, uuid=None):
        self.calls += 1
        return list(self.list)


def gpu_probe(allocated, reserved, processes=(), total=16 * GiB, used_extra=512 * MiB):
    """A probe whose CUDA side is a scripted fake allocator and a fake NVML (no host side: not read for CUDA)."""
    cuda_probe = ScriptedCudaProbe(FakeCuda([(allocated, reserved)], total=total, used_extra=used_extra))
    cuda_probe.nvml = FakeNvml(processes)
    return types.SimpleNamespace(host=None, cuda=cuda_probe)


def real_cpu_oom():
    try:
        torch.empty(2**60)
    except RuntimeError as exc:
        return exc
    raise AssertionError("torch.empty(2**60) did not fail")


# ================================================================================ the state at failure


def test_host_failure_merges_the_message_with_this_machines_ram():
    oom = parse_oom(str(real_cpu_oom()))
    memory, maybe_own = memory_at_failure(oom)
    assert memory.device == HOST and maybe_own == ()
    assert memory.source == "OOM message + probe"
    if sys.platform.startswith("linux"):
        assert memory.total > memory.used > 0 and memory.process_used > 0  # /proc/meminfo and statm, read now


def test_the_capture_wins_over_the_rounded_message():
    oom = parse_oom(SEED)
    exact = OomCapture(t=0.0, device=0, requested=oom.requested, limit=16 * GiB - 7,
                       device_free=190 * MiB + 3, allocated=12_788_000_000, reserved=15_311_000_000)
    memory, _ = memory_at_failure(oom, capture=exact, pid=1, executable=PYTHON)
    assert memory.device == cuda(0)
    assert (memory.allocated, memory.reserved, memory.total) == (12_788_000_000, 15_311_000_000, 16 * GiB - 7)
    assert memory.free == 190 * MiB + 3
    assert memory.source == "allocator at OOM"  # the message had nothing the capture lacked


def test_a_capture_from_another_device_is_ignored():
    oom = parse_oom(SEED)  # GPU 0
    other = OomCapture(0.0, 1, 1, 8 * GiB, 0, 1, 1)
    memory, _ = memory_at_failure(oom, capture=other, pid=1, executable=PYTHON)
    assert memory == DeviceMemory.from_message(oom)


def test_a_capped_capture_gives_no_total():
    msg = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 5.00 GiB. GPU 0 has a total capacity of "
           "15.78 GiB of which 9.00 GiB is free. Including non-PyTorch memory, this process has 6.00 GiB memory in "
           "use. 4.00 GiB allowed; Of the allocated memory 3.00 GiB is allocated by PyTorch, and 1.00 GiB is "
           "reserved by PyTorch but unallocated.")
    oom = parse_oom(msg)
    capped = OomCapture(0.0, 0, 5 * GiB, limit=4 * GiB, device_free=9 * GiB, allocated=3 * GiB, reserved=4 * GiB)
    memory, _ = memory_at_failure(oom, capture=capped, pid=1, executable=PYTHON)
    assert memory.total == parse_bytes("15.78 GiB")  # the cap is not the device's size
    assert memory.free == parse_bytes("9.00 GiB")


def test_a_reading_now_fills_what_the_message_lacks():
    # cudaMallocAsync's message has no reservation; the probe reads it now (fake allocator).
    msg = ("Allocation on device 0 would exceed allowed memory. (out of memory)\nCurrently allocated : 15.16 GiB\n"
           "Requested : 512.00 KiB\nDevice limit : 15.99 GiB\nFree (according to CUDA): 0 bytes\n")
    probe = gpu_probe(15 * GiB, 15 * GiB + 512 * MiB, processes=[(77, 900 * MiB, "ollama")])
    memory, maybe_own = memory_at_failure(parse_oom(msg), probe, pid=1, executable=PYTHON)
    assert memory.allocated == parse_bytes("15.16 GiB")  # the message's number stays
    assert memory.reserved == 15 * GiB + 512 * MiB  # the reading fills the gap
    assert memory.processes == ((77, 900 * MiB, "ollama"),) and maybe_own == ()
    assert memory.source == "OOM message + probe after the error"
    assert probe.cuda.nvml.calls == 1


def test_a_failing_probe_costs_the_reading_not_the_analysis():
    probe = gpu_probe(0, 0)
    probe.cuda.sample = lambda indices=None, with_device_memory=True: 1 / 0
    probe.cuda.nvml.processes = lambda index, uuid=None: 1 / 0
    memory, _ = memory_at_failure(parse_oom(SEED), probe, pid=1, executable=PYTHON)
    assert memory == DeviceMemory.from_message(parse_oom(SEED))


# ================================================================================ this kernel among NVML's processes


def test_this_kernel_by_its_pid_is_not_another_process():
    probe = gpu_probe(12 * GiB, 14 * GiB, processes=[(os.getpid(), 14 * GiB + 300 * MiB, PYTHON),
                                                     (4242, 512 * MiB, "python3")])
    memory, maybe_own = memory_at_failure(parse_oom(SEED), probe)
    assert memory.process_used == 14 * GiB + 300 * MiB
    assert memory.processes == ((4242, 512 * MiB, "python3"),) and maybe_own == ()


def test_in_a_container_the_only_process_that_can_hold_the_reservation_is_this_kernel():
    # Host pids (labelled fake): os.getpid() matches no line; only one line can hold 11.00 GiB reserved.
    msg = V5.format(req="2.00 GiB", total="23.65 GiB", free="100.00 MiB",
                    procs="Process 4001 has 11.50 GiB memory in use. Process 4002 has 11.90 GiB memory in use. ",
                    alloc="10.50 GiB", unalloc="500.00 MiB")
    probe = gpu_probe(0, 0, processes=[(4001, parse_bytes("11.50 GiB"), "/usr/bin/python3.11"),
                                       (4002, parse_bytes("11.90 GiB"), "/usr/local/bin/ollama")])
    memory, maybe_own = memory_at_failure(parse_oom(msg), probe, pid=12, executable=PYTHON)
    assert memory.process_used == parse_bytes("11.50 GiB")  # ollama cannot be this interpreter
    assert [p[0] for p in memory.processes] == [4002] and maybe_own == ()


def test_in_a_container_two_kernels_that_fit_are_each_maybe_this_kernel():
    # The message's arithmetic alone would keep the larger line as this process and offer the
    # other one for kill; with two python kernels that both fit, neither can be told apart.
    msg = V5.format(req="2.00 GiB", total="23.65 GiB", free="100.00 MiB",
                    procs="Process 4001 has 12.00 GiB memory in use. Process 4002 has 11.50 GiB memory in use. ",
                    alloc="10.50 GiB", unalloc="500.00 MiB")
    oom = parse_oom(msg)
    assert DeviceMemory.from_message(oom).process_used is None  # core does not guess either
    memory, maybe_own = memory_at_failure(oom, pid=12, executable=PYTHON)
    assert sorted(maybe_own) == [4001, 4002] and memory.process_used is None
    facts = rules.Facts.build(oom, memory, env={}, modules=(), maybe_own=maybe_own)
    f = rules.device.other_processes(facts)
    assert "kill" not in f.snippet and "one of these is this kernel" in f.detail
    # This kernel's own share outside PyTorch is only bounded: by the larger line less the reservation.
    g = rules.device.cuda_context_and_libraries(facts)
    bound = format_bytes(12 * GiB - parse_bytes("10.50 GiB") - 500 * MiB)
    assert g.title == f"Up to {bound} of this process's cuda:0 memory is outside PyTorch's allocator"
    assert g.confidence == "possible"


def test_when_torch_found_this_process_every_listed_line_is_another():
    sample = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity "
              "of 23.65 GiB of which 10.00 MiB is free. Process 3893521 has 11.50 GiB memory in use. Including "
              "non-PyTorch memory, this process has 12.10 GiB memory in use. Of the allocated memory 11.00 GiB is "
              "allocated by PyTorch, and 500.00 MiB is reserved by PyTorch but unallocated.")
    memory, maybe_own = memory_at_failure(parse_oom(sample), pid=12, executable=PYTHON)
    assert memory.process_used == parse_bytes("12.10 GiB")
    assert [p[0] for p in memory.processes] == [3893521] and maybe_own == ()


def test_a_known_name_that_differs_rules_a_process_out_and_an_unknown_one_does_not():
    memory = DeviceMemory(cuda(0), reserved=4 * GiB, processes=(
        (1, 5 * GiB, "python3"), (2, 6 * GiB, None), (3, 7 * GiB, "[Not Found]"), (4, 8 * GiB, "llama-server"),
        (5, 1 * GiB, "python3")))  # 5 is too small to hold the reservation
    out, maybe_own = find_this_process(memory, own_pids=(99,), executable="/opt/venv/bin/python")
    assert sorted(maybe_own) == [1, 2, 3] and out is memory


def test_the_host_has_no_process_list_to_read():
    memory = DeviceMemory(HOST, processes=((1, GiB, "python3"),))
    assert find_this_process(memory, (99,), PYTHON) == (memory, ())


# ================================================================================ the assembled analysis


def test_analyse_a_real_cpu_failure_with_real_records_and_who():
    exc = real_cpu_oom()
    keep = torch.ones(1024, 1024)
    records = [CellRecord(1, None, "import torch", 0.0, 1.0, host=HostRecord(30 * MiB, 232 * MiB)),
               CellRecord(2, None, "keep = torch.ones(1024, 1024)", 0.0, 1.0, host=HostRecord(232 * MiB, 236 * MiB))]
    failing = CellRecord(3, None, "torch.empty(2**60)", 0.0, 1.0, error="RuntimeError",
                         host=HostRecord(236 * MiB, 242 * MiB))
    a = analyse(parse_oom(str(exc)), failing, namespace={"keep": keep}, records=records + [failing],
                tb=exc.__traceback__, env={}, modules=())
    assert isinstance(a, OomAnalysis) and a.failing is failing and a.errors == ()
    assert a.who.total == keep.untyped_storage().nbytes()
    assert [rec.execution_count for rec, _d in a.earlier] == [1, 2]  # never the failing cell
    assert a.earlier[0][1] == 202 * MiB
    if a.memory.total:  # this machine's RAM is known: the request is impossible
        assert [f.key for f in a.findings] == ["request_exceeds_device"]


def test_the_failing_cell_is_left_out_by_identity_or_by_its_execution_count():
    oom = parse_oom(SEED)
    failing = CellRecord(7, None, "optimizer.step()", 0.0, 1.0, error="OutOfMemoryError")
    copy = CellRecord(7, None, "optimizer.step()", 0.0, 1.0, error="OutOfMemoryError",
                      devices=(DeviceRecord(0, allocated_before=0, allocated_after=GiB),))
    earlier = CellRecord(6, None, "x = torch.ones(2**28, device='cuda')", 0.0, 1.0,
                         devices=(DeviceRecord(0, allocated_before=0, allocated_after=GiB),))
    a = analyse(oom, failing, namespace=None, records=[earlier, copy], env={}, modules=(), pid=1, executable=PYTHON)
    assert [rec for rec, _d in a.earlier] == [earlier]


def test_who_is_asked_about_the_failing_device_with_the_allocators_total():
    calls = []

    def fake_who(namespace, device=None, allocator_total=None, **kw):
        calls.append((device, allocator_total, kw))
        return None

    oom = parse_oom(SEED)
    analyse(oom, None, namespace={}, who_fn=fake_who, env={}, modules=(), pid=1, executable=PYTHON)
    analyse(oom, None, namespace={}, who_fn=fake_who, refs="refs", env={}, modules=(), pid=1, executable=PYTHON)
    assert calls == [(cuda(0), oom.allocated_by_pytorch, {}), (cuda(0), oom.allocated_by_pytorch, {"refs": "refs"})]
    mps = parse_oom("RuntimeError: MPS backend out of memory (MPS allocated: 9.57 GiB, other allocations: 8.35 GiB, "
                    "max allowed: 27.20 GiB). Tried to allocate 10.00 GiB on private pool.")
    analyse(mps, None, namespace={}, who_fn=fake_who, env={}, modules=())
    assert calls[-1][:2] == (None, None)  # MPS storages: every device counted, no allocator total


def test_a_failing_who_or_rule_costs_only_its_own_part(monkeypatch):
    def broken_who(namespace, **kw):
        raise RuntimeError("who broke")

    def broken_rule(facts):
        raise ValueError("rule broke")

    monkeypatch.setattr(rules, "RULES", (broken_rule,) + rules.RULES)
    seed = Seed()
    a = analyse(seed.oom, None, namespace=seed.ns, who_fn=broken_who, env={}, modules=(), pid=1, executable=PYTHON)
    assert a.who is None
    assert a.errors == ("who(): RuntimeError: who broke", "the broken_rule rule: ValueError: rule broke")
    assert "fragmentation" in [f.key for f in a.findings]


def test_analyse_the_seed_with_its_traceback_and_holders():
    seed = Seed()
    a = analyse(seed.oom, None, namespace=seed.ns, who_fn=lambda ns, **kw: seed.who, env={}, modules=(),
                pid=1, executable=PYTHON)
    keys = [f.key for f in a.findings]
    # No traceback here: the optimizer is found by its share of the memory, the kept graph by its holder.
    assert {"optimizer_state", "graphs_kept", "fragmentation"} <= set(keys) and "request_exceeds_device" not in keys


def test_traceback_frames_of_a_real_failure():
    exc = real_cpu_oom()
    frames = traceback_frames(exc.__traceback__)
    assert frames[-1][0] == __file__ and frames[-1][1] == "real_cpu_oom" and "torch.empty(2**60)" in frames[-1][2]
    assert traceback_frames(None) == ()


def test_typed_holders_reach_the_rules():
    seed = Seed()
    assert seed.who.holders and all(isinstance(h, Holder) for h in seed.who.holders)
    facts = rules.Facts.build(seed.oom, seed.memory, seed.who, env={}, modules=())
    assert facts.model_names == ("model",)
    assert [h.roots for h in facts.holders_of("shared_graph", "graph")][0][:2] == ("output", "loss")
