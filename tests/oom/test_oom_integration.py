"""Out-of-memory in a real shell and kernel: the user's error unchanged, then the panel; who; free."""
import gc
import re
import sys

import pytest
from IPython.utils.capture import capture_output

import ipy_gpumem
from ipy_gpumem.core.units import MiB

torch = pytest.importorskip("torch")

from conftest import run
from kernel_helpers import execute, outputs  # noqa: E402
from live_storages import LiveStorages  # noqa: E402 - exact live-byte accounting, shared with test_who

CPU_OOM = "torch.empty(2**60)"


@pytest.fixture(autouse=True)
def _clean(ip):
    ip.user_ns["torch"] = torch
    yield
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()


def panels(cap):
    return [o for o in cap.outputs if o.data.get("text/plain", "").startswith("Out of memory on")]


def test_real_cpu_oom_shows_the_error_then_the_panel(ip, gpumem):
    result, cap = run(ip, f"x_small = torch.ones(10)\n{CPU_OOM}")
    err = result.error_in_exec
    assert type(err).__name__ == "RuntimeError" and "DefaultCPUAllocator" in str(err)
    assert "DefaultCPUAllocator: can't allocate memory" in cap.stdout  # the user's traceback, as always
    shown = panels(cap)
    assert len(shown) == 1
    text, html = shown[0].data["text/plain"], shown[0].data["text/html"]
    # The answer first (issue 29): what asked, read from the failing line, and why it cannot fit; then the
    # error's own numbers.
    assert text.startswith("Out of memory on the host (cpu): `torch.empty(2**60)` needs 4096.00 PiB; that is more")
    assert text.splitlines()[1].startswith("The error: tried to allocate 4096.00 PiB")
    assert "Diagnosis" in text and "No amount of freeing helps" in text and "No amount of freeing helps" in html
    assert ipy_gpumem.last().error == "RuntimeError"


def test_the_panels_advice_holds_for_the_failure_at_hand(ip, gpumem, restore_user_ns):
    """Advice that holds (issue 17): no ``del x`` of a 64 MiB tensor for a MemoryError of unknown
    size, and no chunking snippet that concatenates the chunks back into a result that cannot exist."""
    _, cap = run(ip, "x = torch.zeros(16 * 2**20)\nraise MemoryError()")
    shown = panels(cap)
    assert len(shown) == 1
    text = shown[0].data["text/plain"]
    assert "del x" not in text and "`x`" not in text.split("Diagnosis")[-1]
    _, cap = run(ip, "y = torch.empty(int(4.6e12) // 4)")  # 4.6 TB of float32 on the host
    text = panels(cap)[0].data["text/plain"]
    assert "No amount of freeing helps" in text and "cannot exist" in text
    assert "torch.cat" not in text and "chunk" in text


def test_a_plain_error_gets_no_panel(ip, gpumem):
    result, cap = run(ip, "raise RuntimeError('CUDA error: device-side assert triggered')")
    assert result.error_in_exec is not None and panels(cap) == []


@pytest.mark.slow
def test_swallowed_by_time_still_explained(ip, gpumem):
    _, cap = run(ip, f"%%time\n{CPU_OOM}")
    assert len(panels(cap)) == 1


def test_panel_can_be_switched_off(ip, gpumem):
    gpumem.oom_panel = False
    _, cap = run(ip, CPU_OOM)
    assert panels(cap) == []


def test_user_text_is_escaped_in_the_panel(ip, gpumem):
    run(ip, "stash = {'<script>alert(1)</script>': torch.ones(1000)}")
    _, cap = run(ip, f"# <img src=x onerror=alert(1)>\n{CPU_OOM}")
    html = panels(cap)[0].data["text/html"]
    assert "<script>alert" not in html and "<img src=x" not in html
    assert "&lt;script&gt;" in html
    run(ip, "del stash")


@pytest.mark.slow
def test_seed_scenario_who_in_the_shell(ip, gpumem):
    """The seed at CPU scale: a model, Adam, one step, then the next forward keeping output and loss."""
    setup = (
        "from live_storages import LiveStorages\n"
        "model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),\n"
        "                            torch.nn.ReLU(), torch.nn.Linear(2048, 10))\n"
        "optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)\n"
        "inputs, targets = torch.randn(256, 1024), torch.randint(0, 10, (256,))\n"
        "loss = torch.nn.functional.cross_entropy(model(inputs), targets)\n"
        "optimizer.zero_grad(); loss.backward(); optimizer.step()\n"
        "__tracker__ = LiveStorages()\n"
        "with __tracker__:\n"
        "    output = model(inputs)\n"
        "    loss = torch.nn.functional.cross_entropy(output, targets)\n"
    )
    result, _ = run(ip, setup)
    assert result.success, result.error_in_exec
    ns = ip.user_ns
    report = ipy_gpumem.who()  # the running shell's namespace by default
    cats = report.categories
    params = sum(p.untyped_storage().nbytes() for p in ns["model"].parameters())
    grads = sum(p.grad.untyped_storage().nbytes() for p in ns["model"].parameters())
    state = sum(v.untyped_storage().nbytes() for s in ns["optimizer"].state.values() for v in s.values()
                if torch.is_tensor(v))
    assert (cats["parameters"], cats["gradients"], cats["optimizer_state"]) == (params, grads, state)
    with capture_output() as cap:
        ip.run_line_magic("gpumem", "who")
    assert "optimizer" in cap.outputs[0].data["text/plain"] and "retained graphs" in cap.outputs[0].data["text/plain"]
    # What deleting output and loss really frees (storages tracked since the forward), minus their own data
    tracker = ns.pop("__tracker__")
    own = ns["output"].untyped_storage().nbytes() + ns["loss"].untyped_storage().nbytes()
    gc.collect()
    before = tracker.freed
    del ns["output"], ns["loss"]
    gc.collect()
    freed = tracker.freed - before
    # (Counted over the rows rooted at these two names: the suite's shared shell may hold other
    # graphs that earlier tests left behind.)
    graphs = sum(h.bytes for h in report.holders
                 if h.category == "retained_graphs" and h.roots and set(h.roots) <= {"output", "loss"})
    assert graphs == pytest.approx(freed - own, rel=0.01)
    assert freed > 4 * MiB  # a real graph, not a rounding error
    run(ip, "del model, optimizer, inputs, targets")


@pytest.mark.slow
def test_free_releases_the_last_traceback_and_cached_outputs(ip, gpumem):
    keep = "keep = torch.ones(2**22)"  # 16 MiB held by a variable: must survive
    fail = ("def step():\n"
            "    big = torch.ones(2**26)\n"  # 256 MiB that only the failed call's frame holds
            f"    return {CPU_OOM}\n"
            "step()")
    run(ip, keep)
    run(ip, "torch.ones(2**24)")  # 64 MiB, only in Out
    result, _ = run(ip, fail)
    assert result.error_in_exec is not None
    gc.collect()
    dry = gpumem.run_mode("free --dry-run")
    assert "IPython's last error (RuntimeError)" in dry.text and "256.00 MiB" in dry.text
    assert "Out[" in dry.text and "64.00 MiB" in dry.text and "dry run" in dry.text
    assert dry.data.dry_run and dry.data.result is None and sys.last_traceback is not None  # nothing released
    rss_before = gpumem.probe.host.rss()
    with capture_output() as cap:
        ip.run_line_magic("gpumem", "free")
    shown = "\n".join(o.data["text/plain"] for o in cap.outputs)
    assert "ipy_gpumem free: done." in shown
    assert sys.last_traceback is None
    assert ip.user_ns["keep"].numel() == 2**22  # a user variable is never touched
    if sys.platform.startswith("linux"):
        assert rss_before - gpumem.probe.host.rss() >= 300 * MiB  # 256 + 64 MiB really given back
    run(ip, "del keep")


def test_who_and_free_bad_arguments(ip, gpumem):
    for line, words in (("who cuda:x", "unknown device"), ("who a b", "optional device"), ("free now", "--dry-run")):
        result, _ = run(ip, f"%gpumem {line}")
        assert type(result.error_in_exec).__name__ == "UsageError" and words in str(result.error_in_exec)


@pytest.mark.slow
@pytest.mark.compat
def test_kernel_cpu_oom_error_then_panel():
    nb = execute(["%load_ext ipy_gpumem", "import torch", CPU_OOM, "1/0", "%%time\n" + CPU_OOM])
    shown = [(o.output_type, o.get("data", {}).get("text/plain", o.get("ename", ""))[:300]) for o in nb.cells[2].outputs]
    assert shown[0][0] == "error" and nb.cells[2].outputs[0].ename == "RuntimeError", shown
    panels = [o for o in nb.cells[2].outputs[1:] if o.get("data", {}).get("text/plain", "").startswith("Out of memory")]
    assert len(panels) == 1, shown  # the panel, once
    # Anything else is the cell's own line (a busy machine's kernel may move RSS past the threshold while the
    # traceback is formatted), never a second panel or an error of ours.
    assert all(kind == "display_data" and re.match(r"\[\d+\] ", text) for kind, text in shown[1:]
               if not text.startswith("Out of memory")), shown
    panel = panels[0]["data"]
    assert panel["text/plain"].startswith("Out of memory on the host (cpu)") and "<div" in panel["text/html"]
    assert [o.output_type for o in nb.cells[3].outputs] == ["error"]  # a plain error: no panel
    assert any(o["data"]["text/plain"].startswith("Out of memory") for o in outputs(nb.cells[4], "display_data"))
