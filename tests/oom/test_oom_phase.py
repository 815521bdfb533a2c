"""The phase of a failing allocation is read from the frames nearest to it (issue 29, Do 1): hooks, nested modules, recomputation.

Real CPU allocator failures (a 4 TiB request the allocator refuses at once) placed where each case says;
the traceback's frames go through ``oom.stack.phase_of`` as the analysis reads them. Each case has an
outer frame that a rule reading the wrong frame would take (a module's forward around a backward hook,
an optimizer step around its closure, a backward around a recomputed forward).
"""
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from ipy_gpumem.oom.analysis import analyse, traceback_frames  # noqa: E402
from ipy_gpumem.oom.panel import oom_panel  # noqa: E402
from ipy_gpumem.oom.parse import parse_oom  # noqa: E402
from ipy_gpumem.oom.stack import phase_of  # noqa: E402

HUGE = 2 ** 40  # elements: 4 TiB of float32


def fails(fn):
    try:
        fn()
    except RuntimeError as exc:
        assert "DefaultCPUAllocator" in str(exc)
        return exc
    raise AssertionError("did not fail")


def phase(exc):
    return phase_of(traceback_frames(exc.__traceback__))


class Inner(nn.Module):
    def __init__(self, fail=False):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.fail = fail

    def forward(self, x):
        if self.fail:
            return torch.empty(HUGE)
        return self.fc(x)


class Outer(nn.Module):
    def __init__(self, fail=False):
        super().__init__()
        self.block = nn.Sequential(Inner(), Inner(fail))

    def forward(self, x):
        return self.block(x).relu()


def test_a_nested_modules_forward_is_the_innermost_frame():
    got, frame = phase(fails(lambda: Outer(fail=True)(torch.randn(2, 8))))
    assert got == "forward" and frame[1] == "forward" and "return torch.empty(HUGE)" in frame[2]


def test_a_forward_hook_is_the_forward_pass():
    model = Outer()
    model.block[1].register_forward_hook(lambda m, i, o: torch.empty(HUGE))
    got, _frame = phase(fails(lambda: model(torch.randn(2, 8))))
    assert got == "forward"


def test_a_tensor_hook_in_backward_is_the_backward_pass_not_the_forward_around_it():
    model = Outer()
    x = torch.randn(2, 8, requires_grad=True)

    def step():
        h = model(x)
        h.register_hook(lambda g: torch.empty(HUGE))  # runs inside autograd's engine
        h.sum().backward()

    got, _frame = phase(fails(step))
    assert got == "backward"


def test_a_forward_recomputed_by_checkpoint_is_the_backward_pass():
    from torch.utils.checkpoint import checkpoint

    block = Inner()
    x = torch.randn(2, 8, requires_grad=True)
    out = checkpoint(block, x, use_reentrant=False)
    block.fail = True  # the recomputation in backward now makes the failing allocation
    got, frame = phase(fails(lambda: out.sum().backward()))
    assert got == "backward" and frame[1] == "forward"


def test_a_closure_without_a_module_is_the_forward_pass_and_the_update_is_the_step():
    w = torch.zeros(8, requires_grad=True)
    optimizer = torch.optim.LBFGS([w], max_iter=1)

    def closure():
        optimizer.zero_grad()
        loss = (w * torch.empty(HUGE)[:8]).sum()  # the closure's own arithmetic, no module
        loss.backward()
        return loss

    exc = fails(lambda: optimizer.step(closure))
    got, frame = phase(exc)
    assert got == "forward" and frame[1] == "closure"
    assert any(f[0].endswith("lbfgs.py") for f in traceback_frames(exc.__traceback__))
    a = analyse(parse_oom(f"RuntimeError: {exc}"), None, namespace={"w": w, "optimizer": optimizer},
                tb=exc.__traceback__, env={}, modules=())
    assert "optimizer_state" not in {f.key for f in a.findings}
    assert "in the forward pass (test_oom_phase.py closure())" in oom_panel(a).text.splitlines()[0]
