"""The foundations every room shares: device names, the memory model, first lines and the parts renderer."""
import pytest

from ipy_gpumem.core.devices import ALL_CUDA, HOST, Device, cuda, parse_device, parse_device_list
from ipy_gpumem.core.memory import DeviceMemory
from ipy_gpumem.core.probes import DeviceSample
from ipy_gpumem.core.text import clip, first_line
from ipy_gpumem.core.units import GiB, MiB
from ipy_gpumem.display.parts import Code, Details, Heading, Line, Numbered, Para, Raw, Span, Table, render


@pytest.mark.parametrize("given, expected", [
    ("cuda:1", Device("cuda", 1)), ("CUDA:0", cuda(0)), (" cuda ", ALL_CUDA), ("gpu", ALL_CUDA), ("all", ALL_CUDA),
    ("host", HOST), ("cpu", HOST), ("cpu:0", HOST), (3, cuda(3)), ("2", cuda(2)), ("mps", Device("mps")),
    ("xpu:1", Device("xpu", 1)), (cuda(4), cuda(4)),
])
def test_parse_device_reads_every_spelling(given, expected):
    assert parse_device(given) == expected


@pytest.mark.parametrize("bad", ["", "cuda:", "cuda:-1", -1, True, "²", "cuda:²", "0x1", "gpu zero", "cuda:1:2"])
def test_parse_device_refuses_what_is_not_a_device(bad):
    with pytest.raises(ValueError):
        parse_device(bad)


def test_device_labels_and_coverage():
    assert str(cuda(0)) == cuda(0).label == "cuda:0" and HOST.label == "cpu" and ALL_CUDA.label == "cuda"
    assert ALL_CUDA.covers(cuda(3)) and cuda(3).covers(cuda(3)) and not cuda(2).covers(cuda(3))
    assert not HOST.covers(cuda(0)) and HOST.is_host and cuda(1).is_cuda


@pytest.mark.parametrize("given, expected", [("all", None), ("", None), (None, None), ("0", (0,)),
                                             ("0, cuda:2", (0, 2)), ("1,0", (1, 0))])
def test_device_lists(given, expected):
    assert parse_device_list(given) == expected


@pytest.mark.parametrize("bad", ["0,0", "-1", "cuda", "host", "gpu zero", ",", "²"])
def test_device_lists_refuse_duplicates_negatives_and_words(bad):
    with pytest.raises(ValueError):
        parse_device_list(bad)


def test_memory_model_derives_each_figure_once():
    mem = DeviceMemory.from_sample(DeviceSample(0, 3 * GiB, 4 * GiB, 5 * GiB, 6 * GiB, 5 * GiB, 16 * GiB))
    assert mem.device == cuda(0) and mem.label == "cuda:0"
    assert mem.reserved_unallocated == GiB and mem.outside_pytorch == GiB and mem.free == 11 * GiB
    unknown = DeviceMemory(device=cuda(0), allocated=GiB)
    assert unknown.free is None and unknown.reserved_unallocated is None
    merged = unknown.merged(mem)
    assert merged.allocated == GiB and merged.reserved == 4 * GiB and merged.total == 16 * GiB
    assert DeviceMemory(reserved=1, allocated=2).reserved_unallocated == 0  # rounded numbers never go negative


def test_memory_from_a_capture_respects_a_memory_fraction():
    class Capture:
        device, requested, limit, device_free, allocated, reserved = 1, MiB, 8 * GiB, GiB, 6 * GiB, 7 * GiB

    whole = DeviceMemory.from_capture(Capture())
    assert whole.device == cuda(1) and whole.total == 8 * GiB and whole.used == 7 * GiB
    capped = DeviceMemory.from_capture(Capture(), capped=True)
    assert capped.total is None and capped.used is None and capped.allocated == 6 * GiB


def test_host_memory_reads_ram_and_rss():
    host = DeviceMemory.host()
    assert host.device == HOST and host.total and host.process_used and host.used is not None
    assert 0 < host.process_used < host.total


def test_first_line_and_clip():
    assert first_line("\n\n   y = x * 2   \nz") == "y = x * 2"
    assert first_line("") == "" and first_line(None) == ""
    assert clip("a   b\n c", None) == "a b c"
    assert clip("abcdef", 4) == "abc…" and len(clip("x" * 200, 80)) == 80


def test_parts_render_the_same_content_to_text_and_html():
    parts = [
        Heading("Diagnosis"),
        Line(Span("+1.00 GiB", "up"), " allocated ", Span("<script>", "code")),
        Para("word " * 40, indent="  "),
        Table(["holder", "bytes"], [["model", "1.00 GiB"], ["<b>x</b>", "2 bytes"]]),
        Details("Who holds it: model 1.00 GiB", [Para("body text")]),
        Numbered([[Line(Span("First", "bold")), Para("why"), Code("del x")]]),
        Raw("[###]", '<div class="bar"></div>'),
    ]
    view = render(parts, data={"answer": 42})
    assert view.data == {"answer": 42}
    text, html = view.text, view.html
    for shown in ("Diagnosis", "+1.00 GiB allocated <script>", "model", "1.00 GiB", "Who holds it", "body text",
                  "1. First", "   why", "del x", "[###]"):
        assert shown in text
    assert "&lt;script&gt;" in html and "<script>" not in html and "&lt;b&gt;x&lt;/b&gt;" in html
    assert "<details" in html and "<ol" in html and 'class="bar"' in html and "del x" in html
    assert max(len(line) for line in text.splitlines()) <= 100


def test_this_process_is_recognised_in_a_message_only_when_arithmetic_is_sure():
    class Report:  # the fields from_message reads, as a parsed message gives them
        kind, device_type, gpu_index, device = "cuda_allocator", "cuda", 0, "cuda:0"
        total, free, allocated_by_pytorch, reserved, process_in_use = 16 * GiB, 0, 9 * GiB, 10 * GiB, None
        max_allowed = other_allocations = None

    one = Report()
    one.other_processes = ((4001, 10 * GiB + 300 * MiB), (77, 5 * GiB))  # NVML listed us with host pids
    mem = DeviceMemory.from_message(one)
    assert mem.process_used == 10 * GiB + 300 * MiB and [p[0] for p in mem.processes] == [77]
    two = Report()
    two.other_processes = ((4001, 10 * GiB + 300 * MiB), (4002, 11 * GiB))  # either could be us
    mem = DeviceMemory.from_message(two)
    assert mem.process_used is None and [p[0] for p in mem.processes] == [4001, 4002]


def test_the_gpumem_line_is_read_into_a_typed_command():
    from ipy_gpumem.cell.commands import Command, CommandError, parse_command
    from ipy_gpumem.chart.views import TIERS

    assert parse_command("") == Command("status") and parse_command("HISTORY 3").limit == 3
    assert parse_command("chart Text").tier == "text" and parse_command("free --dry-run").dry_run
    assert parse_command("who cpu").device == HOST and parse_command("export ~/c.csv").path.endswith("/c.csv")
    for bad in ("history ²", "history x", "chart svg", "who a b", "free now", "export c.txt", "on now", "zap", '"open'):
        with pytest.raises(CommandError):
            parse_command(bad)
    from ipy_gpumem.cell import commands

    assert commands.TIERS == TIERS  # the parser and the chart agree on the kinds
