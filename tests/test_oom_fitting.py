"""The OOM panel's batch-size finding: a real CPU OOM in a shell whose failing cell is re-estimated on fake tensors (the batch that fits), the fallback line when it cannot be, the time budget, nothing run for real."""
import gc
import os
import sys

import pytest

torch = pytest.importorskip("torch")

from conftest import run  # noqa: E402

from ipy_gpumem.core.memory import DeviceMemory  # noqa: E402
from ipy_gpumem.oom.fitting import fit_batch  # noqa: E402

# Names a test makes in the suite's shared shell are removed after it.
pytestmark = pytest.mark.usefixtures("restore_user_ns")

RAM = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
#: float32 elements per sample: an eighth of the machine's RAM, so a batch of 32 asks for 4x the RAM
PER_SAMPLE = RAM // 8 // 4

SETUP = f"""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(16, 16)
inputs = torch.randn(32, 16)
per_sample = {PER_SAMPLE}
steps_run = 0
"""
STEP = """steps_run += 1
out = model(inputs)
scratch = torch.empty(inputs.shape[0], per_sample)
loss = out.sum() + scratch.sum()
loss.backward()
"""


@pytest.fixture(autouse=True)
def _clean():
    yield
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)
    gc.collect()


def _panel(cap):
    shown = [o.data.get("text/plain", "") for o in cap.outputs]
    return next(t for t in shown if t.startswith("Out of memory on"))


def test_a_real_cpu_oom_names_the_batch_that_fits(ip, gpumem):
    run(ip, SETUP)
    weight = ip.user_ns["model"].weight.detach().clone()
    result, cap = run(ip, STEP)
    err = result.error_in_exec
    assert type(err).__name__ == "RuntimeError" and "DefaultCPUAllocator" in str(err)
    assert ip.user_ns["steps_run"] == 1  # the real run, once; the estimates ran on fakes
    assert torch.equal(ip.user_ns["model"].weight, weight) and ip.user_ns["model"].weight.grad is None
    panel = _panel(cap)
    # batch b needs about b/8 of the RAM per run, and the estimate runs the cell twice as re-running it
    # does: the first run's `scratch` is alive while the second makes its own. What is available now
    # decides the largest batch that fits.
    available = DeviceMemory.host().free
    expected = available // (2 * PER_SAMPLE * 4)
    line = next(ln for ln in panel.splitlines() if "Batch 32 needs" in ln)
    best = int(line.split("; ")[1].split()[0])
    assert abs(best - expected) <= 1 and 1 <= best < 32, (line, expected)
    assert "fits with" in line and "to spare" in line
    assert "nothing ran for real" in panel and f"Use a batch of {best}" in panel


def test_fit_batch_on_the_host_directly():
    ns = {}
    exec(SETUP, ns)
    memory = DeviceMemory.host()
    fit = fit_batch(STEP, ns, memory)
    assert fit.known and fit.name == "inputs" and fit.size == 32, fit
    assert fit.needed > RAM * 3 and 0 < fit.best < 32 and fit.spare >= 0
    assert fit.best_needed <= fit.capacity < fit.best_needed + 2 * PER_SAMPLE * 4 + (64 << 20)
    assert fit.seconds < 5 and ns["steps_run"] == 0
    assert fit.sentence().startswith("batch 32 needs ") and f"; {fit.best} fits with " in fit.sentence()


def test_the_fallback_line_when_the_step_cannot_be_estimated(ip, gpumem):
    run(ip, SETUP)
    # nonzero() has a data-dependent size: no fake run can get past it
    result, cap = run(ip, "idx = inputs.nonzero()\n" + STEP)
    assert type(result.error_in_exec).__name__ == "RuntimeError"
    panel = _panel(cap)
    assert "Find the batch that fits before running it: %%gpumem --estimate" in panel
    assert "line 1" in panel  # why: the line the fake run stopped at
    assert ip.user_ns["steps_run"] == 1


def test_the_budget_and_what_cannot_be_identified():
    ns = {}
    exec(SETUP, ns)
    memory = DeviceMemory.host()
    slow = fit_batch(STEP, ns, memory, budget_s=0.0)
    assert not slow.known and "longer than 0 s" in slow.reason and slow.line == "%%gpumem --estimate"
    assert not fit_batch("y = 1\n", ns, memory).known  # no input tensor
    assert "magic" in fit_batch("%time y = 1\n", ns, memory).reason
    assert not fit_batch(STEP, None, memory).known
    assert not fit_batch(STEP, ns, DeviceMemory()).known  # capacity unknown
    assert ns["steps_run"] == 0
