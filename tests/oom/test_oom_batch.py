"""The OOM panel only reads: none of the cell's code runs again, it costs under a second, and its batch finding says what is known.

What is known comes from data already there: an earlier ``%%gpumem --estimate`` of the cell
(``preflight.known``), earlier runs of it, its own ``%%gpumem`` record. Real shells, real tensors and
real CPU out-of-memory errors; CUDA failures are their messages, parsed.
"""
import gc
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from conftest import run  # noqa: E402
from test_oom_rules import V5  # noqa: E402

import ipy_gpumem  # noqa: E402
from ipy_gpumem.core.devices import cuda  # noqa: E402
from ipy_gpumem.core.memory import DeviceMemory  # noqa: E402
from ipy_gpumem.core.records import CellRecord, DeviceRecord, HostRecord  # noqa: E402
from ipy_gpumem.core.units import GiB, MiB, format_bytes, parse_bytes  # noqa: E402
from ipy_gpumem.oom.analysis import analyse  # noqa: E402
from ipy_gpumem.oom.batch import MARGIN, read_batch  # noqa: E402
from ipy_gpumem.oom.panel import oom_panel  # noqa: E402
from ipy_gpumem.oom.parse import parse_oom  # noqa: E402
from ipy_gpumem.oom.rules import explain, training  # noqa: E402
from ipy_gpumem.oom.rules.facts import Facts  # noqa: E402
from ipy_gpumem.preflight import known  # noqa: E402

# Names a test makes in the suite's shared shell are removed after it.
pytestmark = pytest.mark.usefixtures("restore_user_ns")

RAM = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
#: float32 elements per sample: an eighth of the machine's RAM, so a batch of 32 asks for 4x the RAM
PER_SAMPLE = RAM // 8 // 4

SETUP = f"""
import os, time
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(16, 16)
batch_size = 32
per_sample = {PER_SAMPLE}
"""


@pytest.fixture(autouse=True)
def _clean():
    known.forget()
    yield
    known.forget()
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()


def _panel(cap):
    shown = [o.data.get("text/plain", "") for o in cap.outputs]
    panels = [t for t in shown if t.startswith("Out of memory on")]
    assert len(panels) == 1, shown
    return panels[0]


def _flat(text):
    return " ".join(text.split())


def stand_in(total_needed, activations, device="cuda", start=None):
    """An estimate's result as ``preflight.known`` holds it: the fields the panel reads, nothing else."""
    return SimpleNamespace(peak_allocated=total_needed, total_needed=total_needed, device=device,
                           start_allocated=start, roles={device: {"activations": activations}})


# ================================================================================ the registry of estimates


def test_the_registry_keys_a_cell_by_its_body_and_keeps_the_last_64():
    est = stand_in(GiB, MiB)
    known.remember("%%gpumem --estimate T4\nout = model(x)\nloss  = out.sum()   \n", est)
    assert known.recall("out = model(x)\n\nloss = out.sum()") is est  # the real run: no header, other spacing
    assert known.recall("%%gpumem --lines\nout = model(x)\nloss = out.sum()") is est
    assert known.recall("out = model(x)\n    loss = out.sum()") is None  # indentation is meaning
    assert known.recall("") is None and known.recall("%%gpumem --estimate\n") is None
    for n in range(known.LIMIT):
        known.remember(f"y = {n}", n)
    assert known.recall("out = model(x)\nloss = out.sum()") is None  # the oldest went first
    assert known.recall("y = 0") == 0 and known.recall(f"y = {known.LIMIT - 1}") == known.LIMIT - 1


def test_the_registry_imports_nothing_heavy_and_nothing_above_it():
    code = ("import sys, ipy_gpumem\n"
            "before = set(sys.modules)\n"
            "import ipy_gpumem.preflight.known\n"
            "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] not in sys.stdlib_module_names))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['ipy_gpumem.preflight', 'ipy_gpumem.preflight.known']"  # the standard library only


# ================================================================================ nothing runs, and it is quick


@pytest.mark.slow
def test_the_panel_runs_none_of_the_cells_code(ip, gpumem, tmp_path):
    """A cell that logs, saves a checkpoint, counts and sleeps before its OOM: after the panel, all of it
    is exactly as the one real run left it, and the panel took less than a second."""
    log, ckpt = tmp_path / "train.log", tmp_path / "ckpt.pt"
    run(ip, SETUP + f"log_path, ckpt_path = {str(log)!r}, {str(ckpt)!r}\ncounter = 0\n")
    cell = ("counter += 1\n"
            "with open(log_path, 'a') as f:\n"
            "    f.write(f'step {counter}\\n')\n"
            "torch.save({'step': counter, 'weight': model.weight.detach().clone()}, ckpt_path)\n"
            "saved = (open(ckpt_path, 'rb').read(), os.stat(ckpt_path).st_mtime_ns)\n"
            "time.sleep(2)\n"
            "inputs = torch.randn(batch_size, 16)\n"
            "out = model(inputs)\n"
            "failed_at = time.perf_counter()\n"
            "scratch = torch.empty(batch_size, per_sample)   # 4x the machine's RAM\n")
    # An earlier estimate of this cell, for CUDA: the panel cites it, it does not re-run it.
    known.remember("%%gpumem --estimate T4\n" + cell, stand_in(6 * GiB, 4 * GiB))
    result, cap = run(ip, cell)
    elapsed = time.perf_counter() - ip.user_ns["failed_at"]
    err = result.error_in_exec
    assert type(err).__name__ == "RuntimeError" and "DefaultCPUAllocator" in str(err)
    panel = _panel(cap)
    assert elapsed < 1.0, elapsed  # the error, its traceback and the whole panel
    ns = ip.user_ns
    assert ns["counter"] == 1
    assert log.read_text() == "step 1\n"
    data, mtime = ns["saved"]
    assert ckpt.read_bytes() == data and os.stat(ckpt).st_mtime_ns == mtime
    assert torch.load(ckpt)["step"] == 1
    # What it said about the batch, from the estimate it was given (for CUDA: it does not answer for the host).
    flat = _flat(panel)
    assert ("An earlier `%%gpumem --estimate` of this cell predicted 6.00 GiB for cuda, which does not answer for "
            "the host") in flat
    assert "not even a batch of 1" not in flat.lower()


@pytest.mark.slow
def test_the_panel_costs_under_a_second_whatever_the_namespace_holds(ip, gpumem):
    """The seed scenario (a model, Adam after a step, the next forward's graph kept) next to a 5M-item
    list and a 1 GiB numpy array: analyse + oom_panel, as the extension calls them, in under a second of the
    process's CPU time (wall time on a machine that other processes load is theirs as much as ours; the
    walk's own budget is in wall time, so a loaded machine makes the panel say less, not take longer)."""
    np = pytest.importorskip("numpy")
    setup = (SETUP
             + "model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 10))\n"
               "optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)\n"
               "inputs, targets = torch.randn(256, 1024), torch.randint(0, 10, (256,))\n"
               "loss = nn.functional.cross_entropy(model(inputs), targets)\n"
               "optimizer.zero_grad(); loss.backward(); optimizer.step()\n"
               "output = model(inputs)\n"
               "loss = nn.functional.cross_entropy(output, targets)\n"
               "import numpy as np\n"
               "big_list = list(range(5_000_000))\n"
               "big_array = np.ones(2**27)   # 1 GiB\n")
    result, _ = run(ip, setup)
    assert result.success, result.error_in_exec
    assert ip.user_ns["big_array"].nbytes == GiB and isinstance(ip.user_ns["big_array"], np.ndarray)
    cell = "failed_at = time.process_time()\nscratch = torch.empty(batch_size, per_sample)\n"
    result, cap = run(ip, cell)
    end_to_end = time.process_time() - ip.user_ns["failed_at"]
    err = result.error_in_exec
    assert "DefaultCPUAllocator" in str(err)
    _panel(cap)
    assert end_to_end < 1.0, end_to_end
    began = time.process_time()
    analysis = analyse(parse_oom(str(err)), ipy_gpumem.last(), namespace=ip.user_ns,
                       records=ipy_gpumem.history()[-50:], probe=gpumem.probe, tb=err.__traceback__,
                       refs=gpumem.presenter.refs())
    view = oom_panel(analysis)
    seconds = time.process_time() - began
    assert seconds < 1.0, seconds
    assert view.text.startswith("Out of memory on the host") and analysis.who is not None
    assert analysis.who.categories["optimizer_state"] > 0  # who() saw the seed's objects


# ================================================================================ what the finding says, and from what


def test_an_earlier_estimate_names_the_batch_that_fits():
    """17.90 GiB predicted at batch 32, 12 GiB of it activations, against a T4 with another process on it."""
    msg = V5.format(req="2.00 GiB", total="15.78 GiB", free="100.00 MiB",
                    procs="Process 4242 has 300.00 MiB memory in use. ", alloc="14.00 GiB", unalloc="200.00 MiB")
    oom = parse_oom(msg)
    memory = DeviceMemory.from_message(oom)
    source = "batch_size = 32\nfor x, y in loader:\n    loss = model(x).sum()\n    loss.backward()\n    opt.step()\n"
    needed, acts = parse_bytes("17.90 GiB"), 12 * GiB
    known.remember("%%gpumem --estimate T4\n" + source, stand_in(needed, acts))
    failing = CellRecord(9, "c9", source, 0.0, 1.0, error="OutOfMemoryError")
    batch = read_batch(oom, memory, failing, [failing], namespace={})
    capacity = parse_bytes("15.78 GiB") - 300 * MiB
    best = int(32 * (1 - (needed - capacity * (1 - MARGIN)) / acts))
    assert batch.pinned and batch.size == 32 and batch.predicted.capacity == capacity
    assert batch.best == best and 0 < best < 32
    need = needed - round(acts * (1 - best / 32))
    assert need <= capacity * (1 - MARGIN) < need + acts / 32  # the largest batch that keeps the margin
    f = training.batch_size(Facts.build(oom, memory, failing=failing, env={}, modules=(), batch=batch))
    assert f.title == f"Batch {best} should fit, with about {format_bytes(capacity - need)} to spare " \
                      f"(batch 32 needs {format_bytes(needed)})"
    assert "of which 12.00 GiB activations" in f.detail and "less 300.00 MiB other processes use" in f.detail
    assert "about linearly" in f.detail and f"about {format_bytes(need)}" in f.detail
    assert best == 24 and f.fix == "Use a batch of 24; to keep the effective size 32, use 16 and accumulate " \
                                   "gradients over 2 batches (2 x 16 = 32)."  # 24 twice would be 48
    assert f.snippet.startswith(f"batch_size = {best}   # was 32") and "%%gpumem --estimate" in f.snippet
    # The activations finding points at it instead of a batch of its own.
    findings = explain(oom, memory, failing=failing, batch=batch, env={}, modules=(),
                       frames=(("/x/torch/nn/modules/linear.py", "forward", "return F.linear(x, w)"),))
    assert "batch_size" in [g.key for g in findings]


def test_an_estimate_without_a_stated_batch_gives_a_share_not_a_number():
    msg = V5.format(req="2.00 GiB", total="15.78 GiB", free="100.00 MiB", procs="", alloc="14.00 GiB",
                    unalloc="200.00 MiB")
    oom = parse_oom(msg)
    memory = DeviceMemory.from_message(oom)
    source = "out = model(inputs)\nout.sum().backward()\n"
    known.remember(source, stand_in(20 * GiB, 10 * GiB))
    ns = {"inputs": torch.zeros(64, 2)}  # read now: the estimate may have seen another batch
    batch = read_batch(oom, memory, CellRecord(3, None, source, 0.0, 1.0), namespace=ns)
    assert batch.size == 64 and not batch.pinned and batch.best is None and not batch.known
    f = training.batch_size(Facts.build(oom, memory, failing_source=source, env={}, modules=(), batch=batch))
    share = batch.predicted.share
    assert f.title == f"The batch must shrink to about {share:.0%} of the one estimated"
    assert f"`inputs` has 64 rows now: if it was the same when estimated, about batch {int(64 * share)}" in f.detail
    assert f.confidence == "possible"


def test_an_estimate_whose_fixed_part_does_not_fit_says_no_batch_does():
    msg = V5.format(req="2.00 GiB", total="15.78 GiB", free="100.00 MiB", procs="", alloc="14.00 GiB",
                    unalloc="200.00 MiB")
    oom = parse_oom(msg)
    memory = DeviceMemory.from_message(oom)
    source = "batch_size = 8\nloss = model(torch.randn(batch_size, 4096)).sum()\nloss.backward()\n"
    known.remember(source, stand_in(24 * GiB, 4 * GiB))
    batch = read_batch(oom, memory, CellRecord(3, None, source, 0.0, 1.0), namespace={})
    f = training.batch_size(Facts.build(oom, memory, failing_source=source, env={}, modules=(), batch=batch))
    assert f.title == "Not even a batch of 1 fits: 20.00 GiB does not grow with the batch"
    assert "no batch size makes it fit" in f.detail
    # And the same estimate that fits says the batch is not what ran out.
    known.remember(source, stand_in(12 * GiB, 4 * GiB))
    fits = read_batch(oom, memory, CellRecord(3, None, source, 0.0, 1.0), namespace={})
    g = training.batch_size(Facts.build(oom, memory, failing_source=source, env={}, modules=(), batch=fits))
    assert g.title == "The estimate of this cell said it fits: 12.00 GiB of 15.78 GiB"


def test_an_earlier_run_at_another_batch_size_is_cited(ip, gpumem):
    """The cell builds its own batch (``x = torch.randn(batch_size, 64)``): a batch of 2 ran, 32 fails.
    What ran is said; no batch is claimed from a model of the failure."""
    run(ip, SETUP)
    body = "x = torch.randn(batch_size, 64)\nscratch = torch.empty(batch_size, per_sample)\n"
    ok, _ = run(ip, "batch_size = 2\n" + body.replace("per_sample", "1024"))
    assert ok.success
    small = ipy_gpumem.last()
    ran, _ = run(ip, "batch_size = 2\n" + body)  # the same code at batch 2: 1/4 of the RAM, it runs
    if not ran.success:
        pytest.skip("this machine cannot hold a quarter of its RAM for the test")
    result, cap = run(ip, "batch_size = 32\n" + body)
    assert "DefaultCPUAllocator" in str(result.error_in_exec)
    flat = _flat(_panel(cap))
    label = ipy_gpumem.history()[-2].label
    assert f"The same code with batch_size = 2 ran without error at {label}" in flat
    assert "this run asks for batch 32" in flat
    assert "not even a batch of 1" not in flat.lower() and small.label not in flat


def test_a_lines_cell_says_what_it_had_measured(ip, gpumem):
    run(ip, SETUP + "model = nn.Sequential(nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 10))\n"
                    "inputs = torch.randn(2048, 256)\n")
    result, cap = run(ip, "%%gpumem --lines\nout = model(inputs)\nloss = out.sum()\n"
                          "scratch = torch.empty(batch_size, per_sample)\nloss.backward()\n")
    assert "DefaultCPUAllocator" in str(result.error_in_exec)
    flat = _flat(_panel(cap))
    acts = ipy_gpumem.last().lines[0].roles["cpu"]["activations"]
    assert acts > 0
    assert f"This run had kept {format_bytes(acts)} of activations by line 2 (measured)" in flat, flat
    assert "what the whole step needs is not measured" in flat


def test_the_same_code_ran_before_from_a_lower_start():
    """On a GPU: the same cell ran at [4] from 2 GiB allocated; this run started from 9 GiB."""
    msg = V5.format(req="3.00 GiB", total="15.78 GiB", free="1.00 GiB", procs="", alloc="13.50 GiB",
                    unalloc="200.00 MiB")
    oom = parse_oom(msg)
    memory = DeviceMemory.from_message(oom)
    source = "out = model(inputs)\nloss = out.sum()\nloss.backward()\n"
    before = CellRecord(4, "cell-a", source, 0.0, 1.0, peaks="per cell",
                        devices=(DeviceRecord(0, allocated_before=2 * GiB, peak_allocated=9 * GiB),))
    other = CellRecord(5, "cell-b", "keep = model(inputs)", 0.0, 1.0,
                       devices=(DeviceRecord(0, allocated_before=2 * GiB, allocated_after=9 * GiB),))
    failing = CellRecord(6, "cell-a", source, 0.0, 1.0, error="OutOfMemoryError",
                         devices=(DeviceRecord(0, allocated_before=9 * GiB, peak_allocated=13 * GiB),))
    batch = read_batch(oom, memory, failing, [before, other, failing], namespace={})
    assert batch.earlier.record is before and batch.earlier.same_code and batch.start == 9 * GiB
    f = training.batch_size(Facts.build(oom, memory, failing=failing, env={}, modules=(), batch=batch))
    assert f.title == "The same cell ran at [4]; this run started 7.00 GiB higher"
    assert "rose 7.00 GiB above its start of 2.00 GiB" in f.detail
    assert "what changed is what was held before it, if its inputs are the same size" in f.detail
    assert f.frees == 7 * GiB and f.confidence == "likely" and "%gpumem who" in f.snippet


def test_nothing_known_hands_over_the_command():
    msg = V5.format(req="2.00 GiB", total="15.78 GiB", free="100.00 MiB", procs="", alloc="14.00 GiB",
                    unalloc="200.00 MiB")
    oom = parse_oom(msg)
    memory = DeviceMemory.from_message(oom)

    def train_step(model, inputs):  # a plain function of the user's: the API can search its batch
        raise AssertionError("never called")

    ns = {"train_step": train_step, "model": object(), "inputs": torch.zeros(32, 8)}
    source = "train_step(model, inputs)\n"
    batch = read_batch(oom, memory, CellRecord(2, None, source, 0.0, 1.0), namespace=ns)
    assert batch.line == "%%gpumem --estimate" and batch.call == "ipy_gpumem.max_batch_size(train_step, model, inputs)"
    frames = (("/x/torch/nn/modules/linear.py", "forward", "return F.linear(x, w)"),)
    f = training.batch_size(Facts.build(oom, memory, failing_source=source, frames=frames, env={}, modules=(),
                                        batch=batch))
    assert f.title == "Find the batch that fits before running it again: %%gpumem --estimate"
    assert "Nothing recorded says how much this cell needs at a smaller batch" in f.detail
    assert "when you run it" in f.detail and "ipy_gpumem.max_batch_size(train_step, model, inputs)" in f.snippet
    # On cuda:1, "this GPU" would be the wrong card: the line names the failing device's capacity.
    on1 = DeviceMemory(cuda(1), total=parse_bytes("79.10 GiB"))
    assert read_batch(oom, on1, CellRecord(2, None, source, 0.0, 1.0), namespace=ns).line == \
        "%%gpumem --estimate 79.10GiB"


def test_only_plain_values_are_read_from_the_namespace():
    """A tensor subclass and a user class with a ``shape`` property are never touched: reading them
    could run the user's code."""
    calls = []

    class Watched(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(getattr(func, "__name__", str(func)))
            return super().__torch_function__(func, types, args, kwargs or {})

    class Batch:
        @property
        def shape(self):
            calls.append("shape")
            return (32, 8)

    class Size(int):
        pass

    msg = V5.format(req="2.00 GiB", total="15.78 GiB", free="100.00 MiB", procs="", alloc="14.00 GiB",
                    unalloc="200.00 MiB")
    oom = parse_oom(msg)
    memory = DeviceMemory.from_message(oom)
    source = "out = model(inputs, x, batch, bs)\n"
    ns = {"inputs": torch.zeros(16, 4).as_subclass(Watched), "x": Batch(), "batch": Batch(), "bs": Size(7)}
    calls.clear()
    batch = read_batch(oom, memory, CellRecord(2, None, source, 0.0, 1.0), namespace=ns)
    assert calls == [] and batch.size is None
    ns["inputs"] = torch.zeros(16, 4)
    assert read_batch(oom, memory, CellRecord(2, None, source, 0.0, 1.0), namespace=ns).size == 16


def test_the_analysis_never_calls_preflight_code_that_runs_a_step(monkeypatch):
    """Whatever the namespace and the cell, nothing on the panel's path estimates or runs a step."""
    import ipy_gpumem.preflight.cell as cell
    import ipy_gpumem.preflight.run as prun

    def forbidden(*args, **kwargs):
        raise AssertionError("the OOM panel ran a step")

    for module, name in ((prun, "estimate"), (cell, "run_cell"), (cell, "estimate_cell"), (cell, "cell_program")):
        monkeypatch.setattr(module, name, forbidden)
    exc = None
    try:
        torch.empty(2**60)
    except RuntimeError as caught:
        exc = caught
    ns = {"model": torch.nn.Linear(4, 4), "inputs": torch.zeros(32, 4), "batch_size": 32}
    failing = CellRecord(3, None, "out = model(inputs)\ny = torch.empty(2**60)", 0.0, 1.0, error="RuntimeError",
                         host=HostRecord(100 * MiB, 101 * MiB))
    a = analyse(parse_oom(str(exc)), failing, namespace=ns, records=[failing], tb=exc.__traceback__, env={},
                modules=())
    assert a.errors == () and a.batch is not None and a.batch.size == 32
    assert not os.path.exists(os.path.join(os.path.dirname(__file__), "..", "..", "ipy_gpumem", "oom", "fitting.py"))
