"""Our OOM logic against real data: out-of-memory messages, memory_summary() tables and segment dicts copied from public threads.

Every number asserted here is one printed in a real thread (tests/fixtures/threads/, each file with
its repository, thread and URL), read by the tests' own helpers (tests/thread_fixtures.py), never
a value our code produced earlier. The OOM messages go through ``parse_oom``, ``analyse`` and
``oom_panel`` as the live path runs them. The NVML readings of the same threads are
tests/core/test_nvml_threads.py's.
"""
from __future__ import annotations

import pytest

from ipy_gpumem import parse_oom
from ipy_gpumem.oom.analysis import analyse
from ipy_gpumem.oom.panel import oom_panel

from thread_fixtures import GiB, MiB, OOM_THREADS, load, rounding, summary_rows, to_bytes

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
