"""The phase of a real out-of-memory in closure-style training is the innermost one (issue 29, Do 1 and 4).

torch.optim.LBFGS, Lightning's automatic and manual optimization and an accelerate loop each train a
real model on the CPU and fail for real in forward, backward or the optimizer's own update (the
address-space limit refuses one allocation there: ``tests/oom_closures.py``). Forward and backward
run inside ``optimizer.step``'s closure for LBFGS and Lightning, so an optimizer frame is in every
one of those tracebacks: the rule that read the outermost optimizer frame said "inside the optimizer
step [certain]" there. The scenarios run in one subprocess (the limit must not touch this one); the
frameworks that are not installed are skipped.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where oom_closures.py is
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc/self/status")]

_NEEDS = {"lbfgs": None, "lightning_auto": "lightning", "lightning_manual": "lightning", "accelerate": "accelerate"}
FRAMEWORKS = tuple(_NEEDS)
PHASES = ("forward", "backward", "update")
_PHASE = {"forward": "forward", "backward": "backward", "update": "step"}
# Which of them call forward and backward from a closure inside optimizer.step.
_CLOSURE = {"lbfgs", "lightning_auto", "lightning_manual"}


def _available(framework):
    module = _NEEDS[framework]
    return module is None or importlib.util.find_spec(module) is not None


@pytest.fixture(scope="module")
def results():
    names = [f"{fw}:{ph}" for fw in FRAMEWORKS if _available(fw) for ph in PHASES]
    proc = subprocess.run([sys.executable, os.path.join(HERE, "oom_closures.py"), *names], capture_output=True,
                          text=True, timeout=900, cwd=os.path.dirname(HERE))
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            data = json.loads(line[len("RESULT "):])
            out[data["scenario"]] = data
    assert proc.returncode == 0 and len(out) == len(names), proc.stderr[-3000:]
    return out


def _result(results, framework, phase):
    if not _available(framework):
        pytest.skip(f"{_NEEDS[framework]} is not installed")
    r = results[f"{framework}:{phase}"]
    assert r["failed"], f"{framework}:{phase} did not fail"
    assert r["errors"] == []
    return r


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("phase", PHASES)
def test_the_phase_is_the_innermost_one(results, framework, phase):
    r = _result(results, framework, phase)
    assert "DefaultCPUAllocator" in r["error"]  # a real allocator failure, not a raised stand-in
    assert r["phase"] == _PHASE[phase], (r["phase"], r["phase_frame"])
    first = r["text"].splitlines()[0]
    words = {"forward": "in the forward pass", "backward": "in the backward pass",
             "update": "in the optimizer's update"}[phase]
    assert first.startswith("Out of memory on the host (cpu): ") and words in first, first
    if framework in _CLOSURE or phase == "update":
        assert r["optimizer_frames"], "the optimizer's step is in the traceback"
    keys = {k: c for k, c, _t in r["findings"]}
    if phase == "update":
        # The optimizer's own update: its state, certain; nothing about activations or a batch search.
        assert "activations" not in keys and "batch_size" not in keys
        assert "del model" not in r["text"] and "del module" not in r["text"]
    else:
        # Forward and backward inside the closure: an optimizer frame is further out, and nothing may blame
        # the optimizer's step for certain (the rule that read the outermost frame did).
        assert keys.get("optimizer_state") != "certain"
        assert "inside the optimizer step" not in r["text"]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("phase", PHASES)
def test_a_process_limit_is_named_with_its_value(results, framework, phase):
    r = _result(results, framework, phase)
    name, value = r["limit"]
    assert name == "RLIMIT_AS"
    first = r["text"].splitlines()[0]
    assert "the address-space limit (RLIMIT_AS, ulimit -v) is" in first and "of RAM was still available" in first
    assert "Host RAM ran out" not in r["text"] and "more than was available" not in r["text"]
    assert ("process_limit", "certain") in {(k, c) for k, c, _t in r["findings"]}


@pytest.mark.parametrize("framework", [f for f in FRAMEWORKS if f != "lbfgs"])
def test_adams_state_is_what_the_step_needs(results, framework):
    """Adam's first step fails while making its buffers: the state to count is both buffers for every
    parameter with a gradient (256 MiB for the 128 MiB layer), not the part made when it failed."""
    r = _result(results, framework, "update")
    title = next(t for k, c, t in r["findings"] if k == "optimizer_state")
    assert title == "Adam's state needs two buffers the size of the weights: 256.06 MiB"
    assert ("optimizer_state", "certain") in {(k, c) for k, c, _t in r["findings"]}


def test_lbfgs_update_names_the_flat_gradient(results):
    r = _result(results, "lbfgs", "update")
    assert r["operation"][0] == "cat" and r["phase_frame"][1] == "_gather_flat_grad"
    assert ("operation", "certain") in {(k, c) for k, c, _t in r["findings"]}  # 128 MiB: the three grads' sum
