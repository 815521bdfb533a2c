"""Tests for ``ipy_gpumem.oom.panel``: one list of parts as text and HTML, on the seed scenario, an absurd request and partial data."""
from __future__ import annotations

import html
import re
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from test_oom_rules import SEED, SEED_FRAMES, SEED_SOURCE, V5, Seed  # noqa: E402

from ipy_gpumem.core.devices import HOST, Device, cuda  # noqa: E402
from ipy_gpumem.core.memory import DeviceMemory  # noqa: E402
from ipy_gpumem.core.records import CellRecord, DeviceRecord, HostRecord  # noqa: E402
from ipy_gpumem.core.units import GiB, MiB, format_bytes  # noqa: E402
from ipy_gpumem.display.view import View  # noqa: E402
from ipy_gpumem.oom.analysis import OomAnalysis, analyse  # noqa: E402
from ipy_gpumem.oom.panel import BAR_WIDTH, memory_layers, oom_panel  # noqa: E402
from ipy_gpumem.oom.parse import parse_oom  # noqa: E402
from ipy_gpumem.oom.rules import explain  # noqa: E402
from ipy_gpumem.oom.rules.facts import cell_deltas  # noqa: E402
from ipy_gpumem.attribution.who import who  # noqa: E402
from tests.conftest import EXACT_S  # noqa: E402

HEADLINE = "Out of memory on cuda:0: tried to allocate 2.32 GiB with 182.75 MiB free (15.78 GiB total)"
_SEG_WIDTH = re.compile(r'class="gm-seg"[^>]*?width:([0-9.]+)%')


def analysis_of(oom, memory, who=None, earlier=(), failing=None, **kw):
    """An ``OomAnalysis`` built the way ``analyse`` builds one, with the frames given as strings."""
    kw.setdefault("env", {})
    kw.setdefault("modules", ())
    findings = explain(oom, memory, who, earlier, failing=failing, **kw)
    return OomAnalysis(oom, memory, who, tuple(findings), failing, tuple(cell_deltas(earlier, memory)),
                       tuple(kw.get("maybe_own", ())))


def seed_panel():
    seed = Seed(message=SEED)  # the user's own numbers: the bar is drawn from them
    earlier = [CellRecord(3, None, "model = model.to(device)", 0.0, 1.0,
                          devices=(DeviceRecord(0, allocated_before=2 * MiB, allocated_after=3769 * MiB),))]
    failing = CellRecord(7, None, SEED_SOURCE, 0.0, 9.0, error="RuntimeError",
                         devices=(DeviceRecord(0, allocated_before=3769 * MiB, allocated_after=12195 * MiB),))
    a = analysis_of(seed.oom, seed.memory, seed.who, earlier, failing, frames=SEED_FRAMES)
    return seed, a, oom_panel(a)


def bar_line(text):
    return next(line for line in text.splitlines() if line.startswith("["))


def test_seed_panel_text():
    seed, a, view = seed_panel()
    text = view.text
    lines = text.splitlines()
    assert lines[0] == HEADLINE
    assert "CUDA out of memory" not in text  # the traceback right above says it; the panel does not repeat it
    bar = bar_line(text)
    assert len(bar) == BAR_WIDTH + 2 and bar.endswith("]")
    # 11.91 of 15.78 GiB allocated: 45 of 60 characters; each layer drawn with its own character.
    assert bar.count("█") == 45 and bar.count("▓") == 9 and bar.count("▒") == 5 and bar.count("·") == 1
    assert "^ the request: 2.14 GiB more than free" in text
    for legend in ("█ allocated by PyTorch", "▓ reserved but unallocated", "▒ outside PyTorch", "· free"):
        assert legend in text
    for size in ("11.91 GiB", "2.35 GiB", "1.34 GiB", "182.75 MiB"):
        assert size in text
    assert "optimizer state" in text and "output + loss (shared graph)" in text  # who holds it
    assert "[3]" in text and "+3.68 GiB" in text  # earlier cells
    assert "[7]" not in text  # the failing cell is not an earlier cell
    positions = [text.index(f"{n}. {f.title}") for n, f in enumerate(a.findings, 1)]
    assert positions == sorted(positions)
    assert text.index("Who holds it") < text.index("What earlier cells") < text.index("Diagnosis")


def test_seed_panel_html():
    seed, a, view = seed_panel()
    page = view.html
    assert html.escape(HEADLINE) in page
    widths = [float(w) for w in _SEG_WIDTH.findall(page)]
    assert len(widths) == 4 and sum(widths) == pytest.approx(100.0, abs=0.01)
    m = seed.memory
    expected = [m.allocated, m.reserved_unallocated, m.outside_pytorch, m.free]
    assert widths == pytest.approx([100.0 * b / m.total for b in expected], abs=0.01)
    request = float(re.search(r'class="gm-request"[^>]*?width:([0-9.]+)%', page).group(1))
    assert request == pytest.approx(100.0 * seed.oom.requested / m.total, abs=0.01)
    titles = [page.index(html.escape(f.title)) for f in a.findings]
    assert titles == sorted(titles)
    # The first finding comes right after the (collapsed) who and cells sections.
    assert page.index("<details") < page.index("Diagnosis") < titles[0]
    assert "<script" not in page and "src=" not in page and "href=" not in page
    assert "<pre" in page and html.escape('os.environ["PYTORCH_CUDA_ALLOC_CONF"]') in page


def test_text_and_html_say_the_same_things():
    _, a, view = seed_panel()
    for f in a.findings:
        for said in (f.title, f.detail, f.fix, f"[{f.confidence}]"):
            assert html.escape(said) in view.html, said
            assert " ".join(said.split()) in " ".join(view.text.split()), said
    sizes = set(re.findall(r"[0-9]+\.[0-9]{2} [KMG]iB", view.text))
    assert sizes and all(s in view.html for s in sizes)


def test_view_protocol_and_data():
    _, a, view = seed_panel()
    assert isinstance(view, View) and view.data is a
    assert set(view._repr_mimebundle_()) == {"text/plain", "text/html"}


def test_user_content_is_escaped():
    seed = Seed()
    evil = "<script>alert(1)</script>"
    report = who(dict(seed.ns, d={evil: torch.zeros(256, 1024)}), budget_s=EXACT_S)
    assert any(evil in h.name for h in report.holders)
    oom = parse_oom(seed.oom.message + " " + evil)
    earlier = [CellRecord(2, None, f"x = 1  # {evil}", 0.0, 1.0,
                          devices=(DeviceRecord(0, allocated_before=0, allocated_after=GiB),))]
    a = analysis_of(oom, seed.memory, report, earlier, failing_source=f'ckpt = torch.load("{evil}.pt")')
    assert any(evil in f.snippet for f in a.findings)
    page = oom_panel(a).html
    assert "<script" not in page
    assert html.escape(evil) in page


def test_unknown_numbers_render_as_unknown():
    view = oom_panel(OomAnalysis(None, DeviceMemory(Device("cuda"))))
    assert view.text.startswith(
        "Out of memory on cuda: an allocation of unknown size failed with unknown free memory (total unknown)")
    assert "no bar (total capacity unknown)" in view.text and "unknown" in view.html
    assert 'class="gm-seg"' not in view.html
    assert "nothing specific found" in view.text


def test_a_message_that_is_only_probably_an_oom_says_so():
    # The parser's OomReport.confidence (a stand-in report: only the fields the headline reads).
    unsure = types.SimpleNamespace(requested=None, free=None, confidence="likely")
    view = oom_panel(OomAnalysis(unsure, DeviceMemory(cuda(0), total=16 * GiB)))
    assert view.text.startswith("Probably out of memory on cuda:0: an allocation of unknown size failed")
    sure = types.SimpleNamespace(requested=None, free=None, confidence="certain")
    assert oom_panel(OomAnalysis(sure, DeviceMemory(cuda(0)))).text.startswith("Out of memory on cuda:0")


def test_a_layer_with_unknown_bounds_merges_with_the_next():
    # cudaMallocAsync reports allocated and the device's free, but no reservation.
    msg = ("Allocation on device 0 would exceed allowed memory. (out of memory)\nCurrently allocated : 15.16 GiB\n"
           "Requested : 512.00 KiB\nDevice limit : 15.99 GiB\nFree (according to CUDA): 0 bytes\n")
    oom = parse_oom(msg)
    memory = DeviceMemory.from_message(oom)
    segments = memory_layers(memory)
    assert [s.label for s in segments] == [
        "allocated by PyTorch", "reserved but unallocated + outside PyTorch (CUDA context, other processes)", "free"]
    view = oom_panel(analysis_of(oom, memory))
    widths = [float(w) for w in _SEG_WIDTH.findall(view.html)]
    assert sum(widths) == pytest.approx(100.0, abs=0.01)
    assert "15.16 GiB" in view.text and "0 bytes" in view.text


def test_cpu_panel_from_a_real_failure():
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**60)
    oom = parse_oom(str(caught.value))
    earlier = [CellRecord(4, None, "x = torch.rand(8192, 8192)", 0.0, 1.0,
                          host=HostRecord(rss_before=500 * MiB, rss_after=756 * MiB))]
    a = analyse(oom, None, namespace=None, records=earlier, tb=caught.value.__traceback__, env={}, modules=())
    view = oom_panel(a)
    first, said = view.text.splitlines()[:2]
    # The answer first (issue 29): what asked, read from the failing line, and why it cannot fit; the
    # error's own numbers below it.
    assert first.startswith("Out of memory on the host (cpu): `torch.empty(2**60)` needs 4096.00 PiB; ")
    assert said.startswith("The error: tried to allocate 4096.00 PiB")
    assert "this process (RSS)" in view.text and "Δhost RSS" in view.text and "+256.00 MiB" in view.text
    if a.memory.total is not None:
        assert "more than the machine's" in first and "available" in said and "RAM)" in said
        assert sum(float(w) for w in _SEG_WIDTH.findall(view.html)) == pytest.approx(100.0, abs=0.01)


# ================================================================================ an absurd request (issue 8.12)


def absurd_panel():
    """The walkthrough's failure: the seed's model, Adam and kept graph, then a request no device can hold."""
    seed = Seed()
    msg = V5.format(req="2352.00 GiB", total="15.78 GiB", free="1.50 GiB", procs="", alloc="11.91 GiB",
                    unalloc="2.35 GiB")
    oom = parse_oom(msg)
    memory = DeviceMemory.from_message(oom)
    source = "batch_size = 4096\nimages = torch.empty(batch_size, 3, 224, 224 * 1024, device=device)"
    earlier = [CellRecord(2, None, "model = build().to(device)", 0.0, 1.0,
                          devices=(DeviceRecord(0, allocated_before=0, allocated_after=8 * GiB),)),
               CellRecord(3, None, "output = model(inputs)", 0.0, 1.0,
                          devices=(DeviceRecord(0, allocated_before=8 * GiB, allocated_after=11 * GiB),))]
    failing = CellRecord(5, None, source, 0.0, 1.0, error="OutOfMemoryError",
                         devices=(DeviceRecord(0, allocated_before=11 * GiB, allocated_after=11 * GiB + 5 * MiB),))
    frames = (("/tmp/ipykernel_1/123.py", "<module>", "images = torch.empty(batch_size, 3, 224, 224 * 1024, "
                                                      "device=device)"),)
    a = analysis_of(oom, memory, seed.who, earlier, failing, frames=frames)
    return a, oom_panel(a)


def test_absurd_request_is_stated_once():
    a, view = absurd_panel()
    answer, said, body = view.text.split("\n", 2)
    assert answer == "Out of memory on cuda:0: a 2.30 TiB allocation; that is more than all 15.78 GiB of cuda:0"
    assert said.startswith("The error: tried to allocate 2.30 TiB")
    assert "2.30 TiB" not in body and view.html.count("2.30 TiB") == 2  # the answer and the error's numbers only
    for rendering in (view.text, view.html):
        assert "2352.00 GiB" not in rendering  # what c10 prints, and no one reads at a glance
    assert "^" not in view.text and 'class="gm-request"' not in view.html  # no marker that cannot be to scale
    assert "out of memory. Tried" not in view.text  # the raw message is in the traceback above


def test_absurd_request_ranks_nothing_unrelated():
    a, view = absurd_panel()
    assert [f.key for f in a.findings] == ["request_exceeds_device"]
    assert "[likely]" not in view.text and "[possible]" not in view.text
    assert "No amount of freeing helps: the request alone is 149x all 15.78 GiB of cuda:0" in view.text
    assert "batch_size=4096 must shrink more than 149x" in " ".join(view.text.split())  # the failing line uses it
    assert "Adam" not in view.text.split("Diagnosis")[1]  # true, but it cannot make this request fit


def test_absurd_request_never_lists_the_failing_cell_as_earlier():
    a, view = absurd_panel()
    assert [rec.execution_count for rec, _d in a.earlier] == [2, 3]
    assert "[5]" not in view.text


def test_what_failed_is_said_not_hidden():
    _, a, _ = seed_panel()
    view = oom_panel(OomAnalysis(a.oom, a.memory, findings=a.findings, errors=("the fragmentation rule: KeyError: 'x'",)))
    assert "(ipy_gpumem could not use the fragmentation rule: KeyError: 'x'; the rest is complete)" in view.text


def test_a_process_that_may_be_this_kernel_is_never_offered_for_kill_in_the_panel():
    msg = V5.format(req="2.00 GiB", total="23.65 GiB", free="100.00 MiB",
                    procs="Process 4001 has 12.00 GiB memory in use. Process 4002 has 11.50 GiB memory in use. ",
                    alloc="10.50 GiB", unalloc="500.00 MiB")
    a = analyse(parse_oom(msg), None, namespace=None, env={}, modules=(), pid=12, executable="/usr/bin/python3")
    view = oom_panel(a)
    assert "one of these is this kernel" in view.text and "kill 400" not in view.text


sizes = st.one_of(st.none(), st.integers(min_value=0, max_value=2 * 80 * GiB))


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(device=st.sampled_from([cuda(0), HOST, Device("mps"), Device("cuda"), None]), total=sizes, allocated=sizes,
       reserved=sizes, used=sizes, process_used=sizes, requested=sizes)
def test_any_memory_renders(device, total, allocated, reserved, used, process_used, requested):
    memory = DeviceMemory(device, total=total, allocated=allocated, reserved=reserved, used=used,
                          process_used=process_used)
    findings = explain(None, memory, env={}, modules=(), requested=requested)
    view = oom_panel(OomAnalysis(None, memory, findings=tuple(findings)))
    assert view.text and view.html
    widths = [float(w) for w in _SEG_WIDTH.findall(view.html)]
    if widths:
        assert sum(widths) == pytest.approx(100.0, abs=0.01)
        assert len(bar_line(view.text)) == BAR_WIDTH + 2
    assert all(s.size is None or s.size >= 0 for s in memory_layers(memory))
    assert format_bytes(None) not in view.text.splitlines()[0] or requested is None


def test_a_rank_killed_by_sigkill_names_the_oom_killer():
    from ipy_gpumem.core.records import RankFailure

    oom = parse_oom("RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed.")
    killed = RankFailure(1, 4242, "torch.multiprocessing", "ProcessExitedException", signal="SIGKILL")
    exited = killed._replace(signal=None, exit_code=1)
    memory = DeviceMemory.host(None)
    text = " ".join(oom_panel(OomAnalysis(oom, memory, rank=killed)).text.split())
    assert "Rank 1 (pid 4242) was killed by SIGKILL" in text and "the kernel's OOM killer is the likely cause" in text
    assert "OOM killer" not in oom_panel(OomAnalysis(oom, memory, rank=exited)).text


def test_an_earlier_magic_cell_is_named_by_its_code():
    """A ``%%gpumem --lines`` (or ``%%time``) cell is named by the code under its header, in the table of
    earlier cells and in the finding that cites them: the header says nothing about what kept the memory."""
    seed = Seed(message=SEED)
    earlier = [CellRecord(3, None, "%%gpumem --lines\nmodel = model.to(device)", 0.0, 1.0,
                          devices=(DeviceRecord(0, allocated_before=2 * MiB, allocated_after=3769 * MiB),))]
    failing = CellRecord(7, None, SEED_SOURCE, 0.0, 9.0, error="RuntimeError",
                         devices=(DeviceRecord(0, allocated_before=3769 * MiB, allocated_after=12195 * MiB),))
    text = oom_panel(analysis_of(seed.oom, seed.memory, seed.who, earlier, failing, frames=SEED_FRAMES)).text
    assert "model = model.to(device)" in text and "%%gpumem --lines" not in text, text
