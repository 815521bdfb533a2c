"""estimate() and max_batch_size(): the user's objects are untouched, errors name the line, globals are faked, phases and roles add up, GPUs resolve, the batch search lands on the boundary."""
import copy
import json
import types

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

import ipy_gpumem  # noqa: E402
from ipy_gpumem.preflight.gpus import GPUS, cublas_workspace, resolve_gpu  # noqa: E402
from ipy_gpumem.preflight.result import EstimateError  # noqa: E402

MiB = 1 << 20


def _mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    return model, opt, x, y


def step(model, opt, x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    print("loss", loss.item())
    return loss


def _snapshot(model, opt, x, y):
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "ptrs": [p.data_ptr() for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "state": copy.deepcopy(opt.state_dict()),
        "training": [m.training for m in model.modules()],
        "rng": torch.random.get_rng_state(),
        "x": x.clone(), "y": y.clone(),
    }


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(i, j) for i, j in zip(a, b))
    return a == b


@pytest.mark.slow
def test_the_users_objects_are_bitwise_unchanged(capsys):
    model, opt, x, y = _mlp()
    step(model, opt, x, y)  # real state: grads and optimizer state exist
    model.eval()
    model[0].train()
    before = _snapshot(model, opt, x, y)
    est = ipy_gpumem.estimate(step, model, opt, x, y, device="cpu")
    after = _snapshot(model, opt, x, y)
    for key in before:
        assert _same(before[key], after[key]), key
    assert est.peak_allocated > est.start_allocated > 0
    assert capsys.readouterr().out.count("loss") == 1  # only the real call printed
    assert any(".item()" in n for n in est.notes) and any("printed" in n for n in est.notes)


@pytest.mark.slow
def test_globals_and_closures_are_faked_not_used():
    model, opt, x, y = _mlp()
    g = {"model": model, "opt": opt, "x": x, "y": y, "F": F}
    code = "def train():\n    opt.zero_grad()\n    F.cross_entropy(model(x), y).backward()\n    opt.step()\n"
    exec(code, g)
    before = _snapshot(model, opt, x, y)
    est = ipy_gpumem.estimate(g["train"], device="cpu")
    assert all(_same(before[k], v) for k, v in _snapshot(model, opt, x, y).items())
    params = sum(p.numel() * 4 for p in model.parameters())
    assert est.roles["cpu"]["optimizer_state"] >= 2 * params

    def make():
        m, o, xx, yy = model, opt, x, y

        def inner():
            o.zero_grad()
            F.cross_entropy(m(xx), yy).backward()
            o.step()
        return inner
    est2 = ipy_gpumem.estimate(make(), device="cpu")
    assert est2.peak_allocated == est.peak_allocated
    assert all(p.grad is None for p in model.parameters()) and not opt.state


@pytest.mark.slow
def test_a_data_dependent_shape_is_an_estimate_error_naming_the_line():
    model, opt, x, y = _mlp()

    def bad(model, x):
        keep = torch.nonzero(x > 0)  # the size depends on the values
        return model(x[keep[:, 0]]).sum()
    with pytest.raises(EstimateError) as info:
        ipy_gpumem.estimate(bad, model, x, device="cpu")
    assert "torch.nonzero(x > 0)" in str(info.value) and info.value.line is not None


HIDDEN = torch.ones(4)


def _helper(x):
    return x * HIDDEN.sum()  # a tensor of this module, reached through the step's function


@pytest.mark.slow
def test_tensors_of_the_users_modules_are_reached():
    def uses_helper(x):
        return _helper(x)
    est = ipy_gpumem.estimate(uses_helper, torch.randn(4), device="cpu")
    assert est.start_allocated >= 2 * 16 and torch.equal(HIDDEN, torch.ones(4))


@pytest.mark.slow
def test_a_real_tensor_out_of_reach_is_reported_with_its_line_not_mixed_in():
    import logging

    logging.getLogger("ipg-test").hidden = torch.ones(4)  # a library's object: not the user's to walk

    def uses_logger(x):
        return x * logging.getLogger("ipg-test").hidden.sum()
    try:
        with pytest.raises(EstimateError) as info:
            ipy_gpumem.estimate(uses_logger, torch.randn(4), device="cpu")
        assert "logging.getLogger" in str(info.value) and "real tensor" in str(info.value)
    finally:
        del logging.getLogger("ipg-test").hidden


@pytest.mark.slow
def test_phases_roles_and_dict():
    model, opt, x, y = _mlp()
    est = ipy_gpumem.estimate(step, model, opt, x, y, device="cuda", gpu="T4")
    names = [(p["phase"], p["step"]) for p in est.phases]
    for phase in ("zero_grad", "forward", "backward", "optimizer_step"):
        assert (phase, 1) in names and (phase, 2) in names, names
    roles = est.roles["cuda:0"]
    tensor_bytes = sum(v for k, v in roles.items() if k not in ("allocator_cache", "outside_pytorch"))
    assert tensor_bytes == est.peak_allocated
    assert est.peak_reserved >= est.peak_allocated and est.peak_allocated % 512 == 0
    assert est.peak_reserved % (2 * MiB) == 0
    assert est.total_needed == est.peak_reserved + sum(est.fixed_costs.values())
    assert set(est.fixed_costs) == {"cuda_context"} and est.cublas_workspaces == 2 * cublas_workspace(GPUS["T4"])
    d = json.loads(json.dumps(est.to_dict()))
    assert d["peak_allocated"] == est.peak_allocated and d["phases"][0]["phase"] == "zero_grad"
    assert est.modules and est.modules[0]["activations"] >= est.modules[-1]["activations"]
    assert est.fits("T4") and not est.fits(100 * MiB)


def test_gpu_names_resolve():
    assert resolve_gpu("T4").capacity == GPUS["T4"].capacity
    assert resolve_gpu("a100-80").name == "A100-80" and resolve_gpu("H100").name == "H100-80"
    assert resolve_gpu(16 * 2 ** 30).capacity == 16 * 2 ** 30
    assert resolve_gpu("24 GiB").capacity == 24 * 2 ** 30
    with pytest.raises(ValueError):
        resolve_gpu("GTX 9999")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError):
            resolve_gpu("this GPU")


def wide_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def wide_step(model, opt, x):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


@pytest.mark.slow
def test_max_batch_size_lands_on_the_boundary():
    """A batch here adds 30 KiB, and the allocator reserves in 2 MiB steps: the least room a size fits in
    is a staircase on which a secant creeps (the search took 15 estimates). Each allocation grows
    linearly, so two estimates say where the step stops fitting, and two more confirm it."""
    model, opt = wide_mlp()
    x = torch.randn(8, 1024)
    cap = 900 * MiB
    best = ipy_gpumem.max_batch_size(wide_step, model, opt, x, gpu=cap)
    assert isinstance(best, int) and best > 8
    assert best.tried[int(best)][0] and not best.tried[int(best) + 1][0]
    assert len(best.tried) == 4, sorted(best.tried)  # 8, 16, the boundary and the size above it
    assert x.shape == (8, 1024)
    # From a batch that does not fit, the same: two sizes down, then the boundary's two.
    again = ipy_gpumem.max_batch_size(wide_step, model, opt, torch.randn(60000, 1024), gpu=cap)
    assert int(again) == int(best) and len(again.tried) == 4, sorted(again.tried)


@pytest.mark.slow
def test_each_allocation_grows_linearly_with_the_batch():
    """What the search stands on: the events of two estimates give a third size's events exactly, and
    the least room a run fits in is what the allocator model fits it in, to its precision."""
    from ipy_gpumem.preflight.allocator import replay
    from ipy_gpumem.preflight.batch import Growth, least_room

    model, opt = wide_mlp()
    runs = {n: ipy_gpumem.estimate(wide_step, model, opt, torch.randn(n, 1024), gpu="T4").events for n in (8, 16, 40)}
    growth = Growth.of(8, runs[8], 16, runs[16])
    assert growth is not None and growth.events(40) == runs[40]
    assert Growth.of(8, runs[8], 16, runs[16][:-1]) is None  # not the same allocations: no growth
    room, close = least_room(runs[40])
    assert replay(runs[40], capacity=room, series=False).oom_at is None
    assert replay(runs[40], capacity=room - close, series=False).oom_at is not None


@pytest.mark.slow
def test_a_step_that_allocates_otherwise_at_larger_batches_still_lands_on_the_boundary():
    """Above 4096 rows the step runs in chunks, so the estimates above and below do not make the same
    allocations (as a kernel that picks another algorithm at another size): the growth of batches 8 and 16
    names a size that is chunked, a secant through the least room each size fits in moves on from there,
    and the search still ends on a size that fits beside one that does not."""
    model, opt = wide_mlp()

    def chunked(model, opt, x):
        opt.zero_grad()
        out = torch.cat([model(part) for part in x.split(4096)]) if x.shape[0] > 4096 else model(x)
        out.pow(2).mean().backward()
        opt.step()
    best = ipy_gpumem.max_batch_size(chunked, model, opt, torch.randn(8, 1024), gpu=900 * MiB)
    assert best > 4096 and best.tried[int(best)][0] and not best.tried[int(best) + 1][0]
    assert len(best.tried) <= 16, sorted(best.tried)


def test_importing_the_room_leaves_the_public_function_a_function():
    """The room is ``preflight``: a subpackage named ``estimate`` would replace ipy_gpumem.estimate on import."""
    import subprocess
    import sys

    code = ("import ipy_gpumem, ipy_gpumem.preflight.run, ipy_gpumem.preflight.batch, types\n"
            "print(type(ipy_gpumem.estimate) is types.FunctionType, type(ipy_gpumem.max_batch_size) is types.FunctionType)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"], out.stdout + out.stderr
    assert isinstance(ipy_gpumem.estimate, types.FunctionType)
