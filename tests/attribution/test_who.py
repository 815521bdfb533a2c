"""Tests for ``ipy_gpumem.attribution.who`` (``ipy_gpumem.who()``): exact attribution checked against real bytes freed on the CPU."""
from __future__ import annotations

import gc
import importlib
import inspect
import json
import subprocess
import sys
import types
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from ipy_gpumem.core.devices import HOST, Device, cuda  # noqa: E402
from ipy_gpumem.attribution.who import CATEGORIES, WhoReport, who  # noqa: E402
from ipy_gpumem.attribution.holders import HOLDER_KINDS, IPythonRefs, ipython_refs  # noqa: E402
from ipy_gpumem.attribution.view import who_view  # noqa: E402

# ``from ipy_gpumem import who`` is the package's lazy function, not this module.
who_module = importlib.import_module("ipy_gpumem.attribution.who")
storage_module = importlib.import_module("ipy_gpumem.tensors.storage")
from ipy_gpumem.tensors.torch_api import api as torch_api  # noqa: E402
from tests.conftest import EXACT_S  # noqa: E402
from live_storages import LiveStorages  # noqa: E402


# ---------------------------------------------------------------------------- helpers
def storage_bytes(tensors):
    """Bytes of the distinct storages behind ``tensors``, computed without who()."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def params_and_buffers(model):
    return list(model.parameters()) + list(model.buffers())


def grads(model):
    return [p.grad for p in model.parameters() if p.grad is not None]


def adam_state(optimizer):
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def holder_bytes(report, *names):
    return sum(row.bytes for row in report.holders if row.name in names)


def ipython_owns(*names):
    """IPython's references, as ``ipython_refs`` reports them for a shell that bound ``names``."""
    return IPythonRefs(frozenset(names))


def holder(report, name):
    rows = [row for row in report.holders if row.name == name]
    assert len(rows) == 1, (name, report.holders)
    return rows[0]


def really_freed(ns, *names):
    """Delete ``names`` from ``ns`` and return how many tracked bytes that released."""
    tracker = ns.pop("__tracker__")
    gc.collect()
    before = tracker.freed
    for name in names:
        del ns[name]
    gc.collect()
    return tracker.freed - before


# ---------------------------------------------------------------------------- scenarios
class MLP(nn.Module):
    def __init__(self, d_in=512, hidden=1024, d_out=10):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.LayerNorm(hidden),
            nn.GELU(), nn.Dropout(0.1), nn.Linear(hidden, d_out))

    def forward(self, x):
        return self.net(x)


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64),
            nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(torch.flatten(self.features(x), 1))


class ScaleSquare(torch.autograd.Function):
    """A custom Function keeping tensors both via save_for_backward and as ctx attributes."""

    @staticmethod
    def forward(ctx, x, w):
        y = x * w
        ctx.save_for_backward(x, w)
        ctx.y2 = y * 2  # kept alive by the node, not by save_for_backward
        return y * y

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g = g.unsqueeze(-1) if g.dim() < ctx.y2.dim() else g
        return g * ctx.y2 * w, (g * ctx.y2 * x).sum(0)


class CustomModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(256))
        self.lin = nn.Linear(256, 256)

    def forward(self, x):
        return ScaleSquare.apply(self.lin(x).tanh(), self.w).sum(1)


class ViewModel(nn.Module):
    """Its output's graph retains only a thin slice of a big activation: a view of it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(128, 4096)

    def forward(self, x):
        big = self.lin(x).relu()
        return big[:, :3].sin()  # SinBackward saves the slice, i.e. all of ``big``'s storage


def make_batch(kind, batch=64):
    if kind == "cnn":
        return torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    if kind == "transformer":
        return torch.randn(batch, 16, 64), torch.randn(batch, 16, 64)
    if kind == "custom":
        return torch.randn(batch, 256), torch.randn(batch)
    if kind == "view":
        return torch.randn(batch, 128), torch.randn(batch, 3)
    return torch.randn(batch, 512), torch.randint(0, 10, (batch,))


def make_model(kind):
    return {
        "mlp": MLP, "cnn": SmallCNN, "custom": CustomModel, "view": ViewModel,
        "transformer": lambda: nn.TransformerEncoderLayer(64, 4, 128, batch_first=True),
    }[kind]()


def loss_fn(kind, output, target):
    if kind in ("mlp", "cnn"):
        return nn.functional.cross_entropy(output, target)
    return nn.functional.mse_loss(output, target)


def seed_namespace(kind="mlp", batch=256):
    """The seed's Colab scenario at CPU scale.

    One full Adam training step, then the next iteration's forward: ``output`` and ``loss``
    stay in the namespace with their graph while the optimizer state and gradients exist. The
    returned namespace is the only owner of everything (no locals survive this function); a
    tracker of every storage created in the second forward rides along under ``__tracker__``.
    """
    torch.manual_seed(0)
    model = make_model(kind)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs, target = make_batch(kind, batch)
    loss = loss_fn(kind, model(inputs), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    del loss
    tracker = LiveStorages()
    with tracker:
        output = model(inputs)
        loss = loss_fn(kind, output, target)
    return {"model": model, "optimizer": optimizer, "inputs": inputs, "target": target,
            "output": output, "loss": loss, "lr": 1e-3, "__tracker__": tracker}


@pytest.fixture
def restore_last_exception():
    """Save and restore ``sys.last_*`` so a test can fake IPython's last traceback."""
    names = ("last_type", "last_value", "last_traceback", "last_exc")
    saved = {name: getattr(sys, name) for name in names if hasattr(sys, name)}
    yield
    for name in names:
        if name in saved:
            setattr(sys, name, saved[name])
        elif hasattr(sys, name):
            delattr(sys, name)


# ------------------------------------------------------------------------ exact numbers
def test_small_model_adam_exact_categories():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 30), nn.BatchNorm1d(30), nn.ReLU(), nn.Linear(30, 5))
    optimizer = torch.optim.Adam(model.parameters())
    x, y = torch.randn(8, 20), torch.randn(8, 5)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    ns = {"model": model, "optimizer": optimizer, "x": x, "y": y}

    report = who(ns, budget_s=EXACT_S)

    assert report.categories["parameters"] == storage_bytes(params_and_buffers(model))
    assert report.categories["gradients"] == storage_bytes(grads(model))
    assert report.categories["optimizer_state"] == storage_bytes(adam_state(optimizer))
    assert report.categories["other_tensors"] == storage_bytes([x, y])
    assert report.categories["retained_graphs"] == 0
    assert report.categories["ipython_caches"] == 0
    assert report.categories["unattributed"] is None
    assert holder(report, "model").category == "parameters"
    assert holder(report, "model (grads)").category == "gradients"
    assert holder(report, "optimizer").category == "optimizer_state"
    assert sum(row.bytes for row in report.holders) == report.total
    assert report.tensor_count == len(params_and_buffers(model)) + len(grads(model)) + len(
        adam_state(optimizer)) + 2


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer", "custom", "view"])
def test_seed_scenario_matches_what_del_really_frees(kind):
    ns = seed_namespace(kind)
    model, optimizer = ns["model"], ns["optimizer"]

    report = who(ns, budget_s=EXACT_S)

    assert report.categories["parameters"] == storage_bytes(params_and_buffers(model))
    assert report.categories["gradients"] == storage_bytes(grads(model))
    assert report.categories["optimizer_state"] == storage_bytes(adam_state(optimizer))
    own = storage_bytes([ns["output"], ns["loss"]])
    retained = report.categories["retained_graphs"]
    assert retained > 0
    del model, optimizer

    freed = really_freed(ns, "output", "loss")

    assert retained == pytest.approx(freed - own, rel=0.01)
    # The holder rows say the same: deleting both frees their own rows plus their graph rows.
    graph_rows = [row for row in report.holders if row.category == "retained_graphs"]
    assert {row.name for row in graph_rows} <= {
        "output (graph)", "loss (graph)", "output + loss (shared graph)"}
    assert holder_bytes(report, "output", "loss") + retained == pytest.approx(freed, rel=0.01)


@pytest.mark.slow
def test_seed_scenario_is_in_megabytes_and_exact_for_the_mlp():
    ns = seed_namespace("mlp", batch=512)
    report = who(ns, budget_s=EXACT_S)
    assert report.categories["retained_graphs"] > 4 * 2**20
    assert report.categories["optimizer_state"] == 2 * report.categories["gradients"] + 4 * len(
        list(ns["model"].parameters()))  # exp_avg + exp_avg_sq per parameter, float32 step
    freed = really_freed(ns, "output", "loss")
    assert holder_bytes(report, "output", "loss") + report.categories["retained_graphs"] == freed


@pytest.mark.slow
def test_deleting_only_loss_frees_its_own_graph_row():
    ns = seed_namespace("mlp")
    report = who(ns, budget_s=EXACT_S)
    loss_only = holder_bytes(report, "loss", "loss (graph)")
    freed = really_freed(ns, "loss")
    assert loss_only == freed


def test_retained_view_keeps_whole_storage():
    lin = nn.Linear(64, 1000)
    x = torch.randn(32, 64)

    def forward(op):
        big = lin(x)  # addmm saves its inputs, not its output
        return op(big[:, :2]).sum()

    # SinBackward saves its input: a 32x2 slice that keeps the whole 32x1000 storage alive.
    assert who({"lin": lin, "x": x, "out": forward(torch.sin)}, budget_s=EXACT_S).categories[
        "retained_graphs"] == 32 * 1000 * 4
    # ExpBackward saves only its (fresh, 32x2) result; the big storage is already gone.
    assert who({"lin": lin, "x": x, "out": forward(torch.exp)}, budget_s=EXACT_S).categories[
        "retained_graphs"] == 32 * 2 * 4


def test_custom_function_ctx_attributes_survive_backward():
    model = CustomModel()
    x = torch.randn(16, 256)
    out = model(x)
    loss = out.sum()
    before = who({"model": model, "x": x, "loss": loss}, budget_s=EXACT_S)
    loss.backward()
    after = who({"model": model, "x": x, "loss": loss}, budget_s=EXACT_S)
    # save_for_backward tensors are freed by backward; the ctx.y2 attribute is not.
    assert 0 < after.categories["retained_graphs"] < before.categories["retained_graphs"]
    assert after.categories["retained_graphs"] == 16 * 256 * 4


def test_after_backward_saved_tensors_are_not_counted_and_nothing_raises():
    ns = seed_namespace("mlp")
    ns.pop("__tracker__")
    ns["loss"].backward()
    report = who(ns, budget_s=EXACT_S)
    assert report.reason is None
    assert report.notes == ()
    assert report.categories["retained_graphs"] == 0


def test_saved_tensor_unpack_hooks_are_not_run():
    calls = []

    def pack(t):
        calls.append("pack")
        return ("packed", t)

    def unpack(packed):
        calls.append("unpack")
        return packed[1]

    x = torch.randn(100, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = x.exp().sin().sum()
    assert calls == ["pack", "pack"]
    report = who({"x": x, "y": y}, budget_s=EXACT_S)
    assert calls == ["pack", "pack"]
    # exp(x), saved by ExpBackward (result) and SinBackward (input), found inside the packs.
    assert report.categories["retained_graphs"] == 400


def test_orphan_leaf_kept_only_by_the_graph_is_retained():
    def make():
        w = torch.randn(1000, requires_grad=True)  # never stored in the namespace
        return w.sum()

    report = who({"loss": make()}, budget_s=EXACT_S)
    # AccumulateGrad keeps w alive. It is the user's tensor (what it is), not something autograd saved
    # (issue 29: roles follow what a tensor is), held by the graph of `loss`.
    assert report.categories["other_tensors"] == 4000 + 4 and report.categories["retained_graphs"] == 0
    graphs = [(h.kind, h.category, h.bytes) for h in report.holders if h.kind == "graph"]
    assert graphs == [("graph", "other_tensors", 4000)]


# --------------------------------------------------------------------- dedupe/precedence
def test_shared_storage_counted_once():
    base = torch.randn(100, 100)
    ns = {"a": base, "b": base.view(-1), "c": base[10:20], "lst": [base.t(), base],
          "d": {"k": base[0]}}
    report = who(ns, budget_s=EXACT_S)
    assert report.total == 40000
    assert report.tensor_count == 1
    assert holder(report, "a").bytes == 40000


def test_precedence_user_variable_beats_output_cache():
    x = torch.randn(50)
    report = who({"x": x, "Out": {3: x}, "_": x, "_3": x}, refs=ipython_owns("Out", "_", "_3"), budget_s=EXACT_S)
    assert report.categories["other_tensors"] == 200
    assert report.categories["ipython_caches"] == 0
    assert [row.name for row in report.holders] == ["x"]


def test_precedence_held_activation_is_other_tensor_not_graph():
    lin = nn.Linear(10, 500)
    x = torch.randn(20, 10)
    h = lin(x).relu()
    out = (h * h).sum()
    report = who({"lin": lin, "x": x, "h": h, "out": out}, budget_s=EXACT_S)
    assert holder(report, "h").category == "other_tensors"
    # h is saved by MulBackward and ReluBackward (result): held, so not retained graph.
    assert report.categories["retained_graphs"] == 0


def test_python_scalars_wrapped_as_tensors_are_retained():
    x = torch.randn(100, requires_grad=True)
    # MulBackward0 keeps the wrapped scalar 3.0 as a 0-dim float64 CPU tensor: 8 real bytes.
    assert who({"x": x, "y": (x * 3.0).sum()}, budget_s=EXACT_S).categories["retained_graphs"] == 8


def test_precedence_parameters_beat_everything():
    model = nn.Linear(10, 10)
    model(torch.randn(2, 10)).sum().backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.step()
    weight = model.weight
    ns = {"w": weight, "g": weight.grad, "opt": opt, "model": model,
          "sd": model.state_dict(), "Out": {1: weight}}
    report = who(ns, budget_s=EXACT_S)
    assert report.categories["parameters"] == storage_bytes(params_and_buffers(model))
    assert report.categories["gradients"] == storage_bytes(grads(model))
    assert report.categories["optimizer_state"] == storage_bytes(
        [s["momentum_buffer"] for s in opt.state.values()])
    assert report.categories["other_tensors"] == 0
    names = {row.name: row.category for row in report.holders}
    assert names == {"model": "parameters", "model (grads)": "gradients",
                     "opt": "optimizer_state"}


def test_larger_module_owns_shared_parameters_whatever_the_order():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
    report = who({"head": model[1], "model": model, "also": model[1]}, budget_s=EXACT_S)
    assert [(row.name, row.bytes) for row in report.holders] == [("model", 880)]


def test_module_tensor_attributes_and_submodule_paths():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("running", torch.zeros(4))
            self.mask = torch.ones(16)  # a plain attribute, neither parameter nor buffer

    model = nn.Sequential(Block(), Block())
    report = who({"model": model}, budget_s=EXACT_S)
    names = {row.name: (row.category, row.bytes) for row in report.holders}
    assert names == {"model": ("parameters", 2 * (80 + 16)),
                     "model.0.mask": ("other_tensors", 64), "model.1.mask": ("other_tensors", 64)}


def test_optimizer_alone_holds_params_and_grads():
    def make():
        model = nn.Linear(10, 10)
        model(torch.randn(2, 10)).sum().backward()
        return torch.optim.Adam(model.parameters())

    report = who({"opt": make()}, budget_s=EXACT_S)
    assert holder(report, "opt (params)").bytes == 440
    assert holder(report, "opt (grads)").bytes == 440
    assert report.categories["optimizer_state"] == 0  # no step yet


def test_graph_rows_split_exclusive_and_shared_parts():
    lin = nn.Linear(10, 1000)
    x = torch.randn(20, 10)
    h = lin(x).relu()  # saved by ReluBackward (result), SinBackward and CosBackward
    a = h.sin().sin()  # the inner sin's output is saved by a's outer SinBackward only
    b = h.cos()
    del h
    report = who({"lin": lin, "x": x, "a": a, "b": b}, budget_s=EXACT_S)
    rows = {row.name: row.bytes for row in report.holders
            if row.category == "retained_graphs"}
    assert rows == {"a + b (shared graph)": 80000, "a (graph)": 80000}


def test_held_input_of_the_last_op_is_not_retained():
    lin = nn.Linear(10, 1000)
    x = torch.randn(20, 10)
    out = lin(x).relu()
    loss = (out * out).mean()
    # MulBackward saves out twice and ReluBackward saves out: all held by the user.
    assert who({"lin": lin, "x": x, "out": out, "loss": loss}, budget_s=EXACT_S).categories[
        "retained_graphs"] == 0


# ------------------------------------------------------------------------ IPython caches
def test_output_caches_are_attributed_with_readable_names():
    t1, t2, t3 = torch.randn(10), torch.randn(20), torch.randn(30)
    ns = {"Out": {3: t1, 5: (t2, 1)}, "_oh": None, "_": t3, "_5": (t2, 1), "_i5": "t2, 1"}
    ns["_oh"] = ns["Out"]
    report = who(ns, refs=ipython_owns(*ns), budget_s=EXACT_S)
    assert report.categories["ipython_caches"] == 240
    assert report.categories["other_tensors"] == 0
    names = {row.name: row.bytes for row in report.holders}
    assert names == {"Out[3]": 40, "Out[5][0]": 80, "_": 120}
    rows = {row.expr: row for row in report.holders}
    assert (rows["Out[3]"].kind, rows["Out[3]"].roots, rows["Out[3]"].keys) == ("out_cache", ("Out",), (3,))
    assert (rows["Out[5][0]"].kind, rows["Out[5][0]"].keys) == ("out_cache", (5,))
    assert (rows["_"].kind, rows["_"].roots, rows["_"].keys) == ("underscore", ("_",), ())
    # The same names in a plain dict (no IPython said it bound them) are the user's variables.
    plain = who(ns, budget_s=EXACT_S)
    assert plain.categories["ipython_caches"] == 0 and plain.categories["other_tensors"] == 240
    assert {row.kind for row in plain.holders} == {"variable"}


def test_output_cache_graph_counts_as_ipython_cache():
    lin = nn.Linear(10, 1000)
    out = lin(torch.randn(20, 10)).relu().sum()
    report = who({"lin": lin, "Out": {7: out}}, refs=ipython_owns("Out"), budget_s=EXACT_S)
    assert report.categories["retained_graphs"] == 0
    graph = holder(report, "Out[7] (graph)")
    assert (graph.category, graph.kind, graph.roots, graph.expr, graph.keys) == (
        "ipython_caches", "graph", ("Out",), "Out[7]", (7,))
    assert report.categories["ipython_caches"] == 4 + 20 * 1000 * 4 + 20 * 10 * 4


def test_last_traceback_frames(restore_last_exception):
    def failing_step():
        activation = torch.randn(256)
        batch = [torch.randn(64), "label"]  # noqa: F841 - found through the frame
        model = nn.Linear(4, 4)  # noqa: F841 - only the traceback holds it
        raise RuntimeError(f"CUDA out of memory {activation.shape}")

    try:
        failing_step()
    except RuntimeError as exc:
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        if sys.version_info >= (3, 12):
            sys.last_exc = exc
    ns = {"x": torch.randn(8)}
    report = who(ns, budget_s=EXACT_S)
    names = {row.name: (row.category, row.bytes) for row in report.holders}
    assert names["last traceback: failing_step() local 'activation'"] == ("ipython_caches", 1024)
    assert names["last traceback: failing_step() local 'batch[0]'"] == ("ipython_caches", 256)
    local = holder(report, "last traceback: failing_step() local 'batch[0]'")
    assert (local.kind, local.frame, local.expr, local.roots) == ("traceback_local", "failing_step", "batch[0]", ())
    assert names["last traceback: failing_step() local 'model'"] == ("ipython_caches", 80)
    assert names["x"] == ("other_tensors", 32)
    assert report.categories["ipython_caches"] == 1024 + 256 + 80


def test_chained_exceptions_and_odd_exception_classes(restore_last_exception):
    class OddError(Exception):
        @property
        def __traceback__(self):  # who() reads BaseException's own field instead
            raise RuntimeError("odd")

        @property
        def __context__(self):
            raise RuntimeError("odd")

    def inner():
        first = torch.randn(10)  # noqa: F841
        raise KeyError("first")

    def outer():
        second = torch.randn(20)  # noqa: F841
        try:
            inner()
        except KeyError:
            raise OddError("second")  # noqa: B904 - chained through __context__ on purpose

    try:
        outer()
    except OddError as exc:
        for name in ("last_traceback", "last_exc"):
            if hasattr(sys, name):
                delattr(sys, name)
        sys.last_value = exc
    report = who({}, budget_s=EXACT_S)
    names = {row.name: row.bytes for row in report.holders}
    assert names == {"last traceback: outer() local 'second'": 80,
                     "last traceback: inner() local 'first'": 40}


@pytest.mark.slow
def test_real_ipython_shell(ip, restore_last_exception):
    """IPython's own output cache and last-traceback bookkeeping, read from ``user_ns``."""
    try:
        ip.run_cell("import torch\nwho_kept = torch.randn(1000)", store_history=True)
        shown = ip.run_cell("torch.randn(2000)", store_history=True)  # -> Out[n], _n and _
        ip.run_cell("def who_fail():\n    who_local = torch.randn(3000)\n    raise "
                    "RuntimeError('CUDA out of memory')\nwho_fail()", store_history=True)
        report = who(ip.user_ns, refs=ipython_refs(ip.user_ns, ip.user_ns_hidden, ip.displayhook), budget_s=EXACT_S)
        rows = {row.name: (row.category, row.bytes) for row in report.holders}
        assert rows["who_kept"] == ("other_tensors", 4000)
        assert rows[f"Out[{shown.execution_count}]"] == ("ipython_caches", 8000)
        assert rows["last traceback: who_fail() local 'who_local'"] == ("ipython_caches", 12000)
        assert report.reason is None
    finally:
        ip.user_ns.pop("who_kept", None)
        ip.displayhook.flush()  # what %reset out does: clears Out, _, __, ___ and _<n>


def test_last_value_only_is_enough(restore_last_exception):
    def fail():
        kept = torch.randn(100)  # noqa: F841
        raise ValueError("boom")

    for name in ("last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    try:
        fail()
    except ValueError as exc:
        sys.last_value = exc
    assert who({}, budget_s=EXACT_S).categories["ipython_caches"] == 400


# ---------------------------------------------------------------------------- devices
def test_device_filter_and_by_device():
    ns = {"x": torch.randn(10)}
    everything = who(ns, budget_s=EXACT_S)
    assert everything.by_device == {HOST: {**dict.fromkeys(CATEGORIES, 0), "other_tensors": 40}}
    assert everything.to_dict()["by_device"] == {"cpu": {**dict.fromkeys(CATEGORIES, 0), "other_tensors": 40}}
    assert everything.device is None and everything.holders[0].device == HOST
    for device in ("cpu", torch.device("cpu"), "CPU", "cpu:0", "host", HOST):
        report = who(ns, device=device, budget_s=EXACT_S)
        assert report.total == 40 and report.by_device is None and report.device == HOST
        assert report.to_dict()["device"] == "cpu"
    for device in ("cuda", "cuda:1", 0, torch.device("cuda:0"), "gpu"):
        report = who(ns, device=device, budget_s=EXACT_S)
        assert report.total == 0 and report.holders == ()
    assert who(ns, device=1, budget_s=EXACT_S).device == cuda(1) == Device("cuda", 1)
    for bad in ("not a device!", True, 1.5, -1):
        with pytest.raises(ValueError):
            who(ns, device=bad, budget_s=EXACT_S)


def test_cuda_storages_are_rounded_to_allocator_blocks():
    class FakeCudaStorage:
        device = torch.device("cuda:1")  # a device object; CUDA is not initialised

        def nbytes(self):
            return 1000

        def data_ptr(self):
            return 0x7F0000000000

    def walk(wanted):
        return storage_module.Storages(torch_api(torch), wanted)

    key, nbytes, dev = walk(None).entry(FakeCudaStorage())
    assert (key[1], nbytes, dev) == (0x7F0000000000, 1024, cuda(1))
    assert walk(cuda(0)).entry(FakeCudaStorage()) is storage_module.NOTHING
    assert walk(Device("cuda")).entry(FakeCudaStorage())[1] == 1024
    assert not torch.cuda.is_initialized()


def test_allocator_total_gives_unattributed():
    report = who({"x": torch.randn(25)}, allocator_total=1000, budget_s=EXACT_S)
    assert report.categories["unattributed"] == 900 and report.unattributed == 900
    assert "unattributed 900 bytes" in who_view(report).text


# ------------------------------------------------------------------------- robustness
class Hostile:
    def __getattribute__(self, name):
        raise RuntimeError("getattribute")

    def __getattr__(self, name):
        raise RuntimeError("getattr")

    def __len__(self):
        raise RuntimeError("len")

    def __iter__(self):
        raise RuntimeError("iter")

    def __eq__(self, other):
        raise RuntimeError("eq")

    def __hash__(self):
        raise RuntimeError("hash")

    def __repr__(self):
        raise RuntimeError("repr")

    def __bool__(self):
        raise RuntimeError("bool")


class HostileKey:
    """Hashable (by identity), but comparing or printing it raises."""

    __hash__ = object.__hash__

    def __eq__(self, other):
        raise RuntimeError("eq")

    def __repr__(self):
        raise RuntimeError("repr")


class GradFnProperty:
    @property
    def grad_fn(self):
        raise RuntimeError("grad_fn")

    @property
    def __class__(self):  # claims to be a tensor
        return torch.Tensor

    def untyped_storage(self):
        raise RuntimeError("untyped_storage")


class HostileDict(dict):
    def items(self):
        raise RuntimeError("items")

    def values(self):
        raise RuntimeError("values")

    def __iter__(self):
        raise RuntimeError("iter")

    def __getitem__(self, key):
        raise RuntimeError("getitem")


class HostileList(list):
    def __iter__(self):
        raise RuntimeError("iter")

    def __len__(self):
        raise RuntimeError("len")


class DictProperty:
    @property
    def __dict__(self):
        raise RuntimeError("__dict__")


class LazyModule(types.ModuleType):
    def __getattr__(self, name):
        raise RuntimeError(f"lazy import of {name}")


class RaisingTensor(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError("torch_function")


class Meta(type):
    def __getattribute__(cls, name):
        raise RuntimeError("meta getattribute")


class WithMeta(metaclass=Meta):
    pass


class Trainer:
    def __init__(self, model):
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self.history = [torch.randn(3)]


@pytest.mark.filterwarnings("ignore::UserWarning")  # nested/quantized "prototype" warnings
def test_hostile_namespace_never_raises():
    gen_items = [torch.randn(3)]

    def generator():
        yield from gen_items

    gen = generator()
    it = iter([torch.randn(5)])
    cycle_list = []
    cycle_list.append(cycle_list)
    cycle_dict = {}
    cycle_dict["self"] = cycle_dict
    nested = [[[[[[[[torch.randn(7)]]]]]]]]
    ns = {
        "hostile": Hostile(), "grad_fn_prop": GradFnProperty(),
        "hdict": HostileDict(a=torch.ones(2)),
        "hlist": HostileList([torch.ones(3)]), "dict_prop": DictProperty(),
        "lazy": LazyModule("lazy"), "raising": torch.ones(4).as_subclass(RaisingTensor),
        "meta": WithMeta(), "meta_cls": WithMeta, "gen": gen, "it": it, "cycle_list": cycle_list,
        "cycle_dict": cycle_dict, "keyed": {HostileKey(): torch.ones(6)}, "nested": nested,
        "huge": [0] * 1_000_000 + [torch.ones(8)], "set": {torch.ones(9)},
        "sparse": torch.eye(10).to_sparse(), "meta_t": torch.empty(1000, device="meta"),
        "empty": torch.empty(0), "nested_t": torch.nested.nested_tensor([torch.ones(2)]),
        "jagged": torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)],
                                             layout=torch.jagged),
        "config": types.SimpleNamespace(w=torch.ones(10)),
        "proxy": weakref.proxy(Trainer(nn.Linear(1, 1))),  # dead proxy: any access raises
        "live_proxy": weakref.proxy(Hostile), "ref": weakref.ref(Hostile),
        "trainer": Trainer(nn.Linear(3, 3)), "sys": sys, "fn": test_hostile_namespace_never_raises,
        "quant": torch.quantize_per_tensor(torch.ones(16), 0.1, 0, torch.qint8),
        3: torch.ones(100),  # a non-string key: not a variable
    }
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode():
            ns["fake"] = torch.empty(10_000)
    except Exception:  # pragma: no cover - FakeTensorMode moved
        pass

    report = who(ns, budget_s=EXACT_S)

    assert report.reason is None
    names = {row.name: row.bytes for row in report.holders}
    assert names["hdict['a']"] == 8  # read through dict's C methods: no user code ran
    assert names["hlist[0]"] == 12
    assert names["raising"] == 16
    assert names["keyed[<HostileKey>]"] == 24
    assert names["huge[1000000]"] == 32  # a million scalars are skipped in C, not capped
    assert any("deeper than 6" in note and "nested[0][0][0][0][0][0]" in note for note in report.notes)
    assert names["trainer.model"] == 48  # a plain object's attributes are walked too ...
    assert "trainer.optimizer (params)" not in names  # ... and the module outranks the optimizer
    assert names["trainer.history[0]"] == 12
    assert names["sparse"] == storage_bytes([ns["sparse"]._indices(), ns["sparse"]._values()])
    assert names["quant"] == 16
    assert names["jagged"] == 6 * 3 * 4 + 3 * 8  # the wrapper's _values and _offsets
    assert names["config.w"] == 40
    assert "meta_t" not in names and "empty" not in names and "fake" not in names
    assert inspect.getgeneratorstate(gen) == inspect.GEN_CREATED  # never started by who()
    assert len(list(it)) == 1  # never advanced by who()
    json.dumps(report.to_dict())
    who_view(report)
    repr(report)


def test_nested_checkpoint_dicts_are_found():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    ckpt = {"epoch": 3, "model_state_dict": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer_state_dict": {"state": {0: {"exp_avg": torch.zeros(32)}}}}
    report = who({"ckpt": ckpt}, budget_s=EXACT_S)
    names = {row.name: row.bytes for row in report.holders}
    assert names["ckpt['model_state_dict']['0.weight']"] == 128
    assert names["ckpt['optimizer_state_dict']['state'][0]['exp_avg']"] == 128
    assert report.categories["other_tensors"] == storage_bytes(
        list(ckpt["model_state_dict"].values())) + 128


def test_who_does_not_allocate_collect_or_touch_cuda(monkeypatch):
    ns = seed_namespace("cnn", batch=8)
    ns.pop("__tracker__")
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("gc.collect"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append("cuda.init"))
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: calls.append("_lazy_init"))
    tracker = LiveStorages()
    grads_before = [p.grad for p in ns["model"].parameters()]
    with tracker:
        report = who(ns, budget_s=EXACT_S)
    assert tracker.ops == 0 and calls == []
    assert gc.isenabled()  # the collector, paused during the walk, is running again
    assert [p.grad for p in ns["model"].parameters()] == grads_before
    assert report.categories["retained_graphs"] > 0


def test_disabled_collector_stays_disabled():
    gc.disable()
    try:
        who({"x": torch.ones(3)}, budget_s=EXACT_S)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_nonleaf_grad_is_not_read(recwarn):
    x = torch.randn(3, requires_grad=True)
    h = x * 2
    who({"x": x, "h": h}, budget_s=EXACT_S)
    assert not [w for w in recwarn if "not a leaf" in str(w.message)]


def test_retain_grad_nonleaf_grad_counts():
    x = torch.randn(30, requires_grad=True)
    h = x * 2
    h.retain_grad()
    h.sum().backward()
    report = who({"h": h, "x": x}, budget_s=EXACT_S)
    assert holder(report, "h (grad)").bytes == 120
    assert holder(report, "x (grad)").bytes == 120


def test_torch_not_imported_gives_empty_report():
    code = (
        "import sys, json; from ipy_gpumem.attribution.who import who; "
        "r = who({'a': 1, 'b': [1, 2]}, allocator_total=5); "
        "assert 'torch' not in sys.modules, 'who imported torch'; "
        "print(json.dumps(r.to_dict()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    data = json.loads(out.stdout)
    assert data["reason"] == "torch is not imported"
    assert all(data["categories"][name] == 0 for name in CATEGORIES)
    assert data["categories"]["unattributed"] == 5 and data["total"] == 0


def test_package_import_is_pure():
    code = ("import sys, ipy_gpumem.attribution.who; "
            "bad = [m for m in ('torch', 'IPython', 'plotly', 'ipywidgets') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_non_dict_namespace():
    assert who(["not", "a", "dict"], budget_s=EXACT_S).reason == "namespace is not a dict"


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_nesting_counts_each_reachable_storage_once(data):
    pool = [torch.randn(n) for n in (1, 5, 64, 300)]
    tensors = st.sampled_from(range(len(pool))).flatmap(
        lambda i: st.sampled_from([pool[i], pool[i][1:], pool[i].view(-1)]))
    leaves = st.one_of(tensors, st.integers(), st.text(max_size=3), st.none())
    values = st.recursive(
        leaves, lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.tuples(inner, inner),
            st.dictionaries(st.text(max_size=2), inner, max_size=4)), max_leaves=12)
    ns = data.draw(st.dictionaries(st.from_regex(r"[a-z]{1,3}", fullmatch=True), values,
                                   max_size=5))
    found = []

    def collect(value, depth):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif depth < who_module.MAX_DEPTH and isinstance(value, (list, tuple, dict)):
            for item in (value.values() if isinstance(value, dict) else value):
                collect(item, depth + 1)

    for value in ns.values():
        collect(value, 0)
    report = who(ns, budget_s=EXACT_S)
    assert report.total == report.categories["other_tensors"] == storage_bytes(found)
    assert sum(row.bytes for row in report.holders) == report.total


# ------------------------------------------------------------------------- the report
def _walk_referents(obj, seen, found):
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (torch.Tensor, torch.UntypedStorage, nn.Module)):
        found.append(type(obj))
        return
    if isinstance(obj, type) or type(obj).__name__ in ("builtin_function_or_method",):
        return
    for ref in gc.get_referents(obj):
        _walk_referents(ref, seen, found)


@pytest.mark.slow
def test_report_holds_no_tensor_references():
    ns = seed_namespace("mlp", batch=32)
    ns.pop("__tracker__")
    ns["Out"] = {1: ns["output"]}
    probe = weakref.ref(ns["output"])
    report = who(ns, budget_s=EXACT_S)
    found = []
    _walk_referents(report, set(), found)
    assert found == []
    for value in report.to_dict().values():
        assert isinstance(value, (dict, list, str, int, float, type(None)))
    del ns["output"], ns["Out"], ns["loss"]
    gc.collect()
    assert probe() is None
    assert report.total > 0  # the report is still alive


def test_report_data_and_text():
    ns = seed_namespace("mlp", batch=32)
    ns.pop("__tracker__")
    report = who(ns, allocator_total=10**9, budget_s=EXACT_S)
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert set(data["categories"]) == set(CATEGORIES) | {"unattributed"}
    assert data["total"] == report.total == sum(row.bytes for row in report.holders)
    assert data["holders"] == sorted(data["holders"], key=lambda row: -row["bytes"])
    assert all({"name", "category", "bytes", "device", "kind", "roots", "expr"} <= set(row) for row in data["holders"])
    assert all(row["device"] == "cpu" and row["kind"] in HOLDER_KINDS for row in data["holders"])
    assert data["complete"] is True and data["stopped"] is None
    text = who_view(report).text
    assert "optimizer state" in text and "model (grads)" in text and "MiB" in text
    assert "WhoReport(total=" in repr(report)
    assert isinstance(report, WhoReport) and report.elapsed_s > 0


def test_many_holders_are_summed_past_the_row_cap():
    ns = {"many": [torch.randn(i + 1) for i in range(700)]}
    report = who(ns, budget_s=EXACT_S)
    assert len(report.holders) == who_module.MAX_HOLDER_ROWS + 1
    assert report.holders[-1].name == "(200 smaller holders)"
    assert (report.holders[-1].kind, report.holders[-1].count) == ("rest", 200)
    assert sum(row.bytes for row in report.holders) == report.total == 4 * 700 * 701 // 2


# ------------------------------------------------------------------------- typed holders
def test_every_kind_of_holder_has_its_fields(restore_last_exception):
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    model(torch.randn(2, 8)).sum().backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.step()

    def orphan_optimizer():
        other = nn.Linear(4, 4)
        other(torch.randn(1, 4)).sum().backward()
        return torch.optim.Adam(other.parameters())

    x = torch.randn(16, requires_grad=True)
    (x * 2).sum().backward()
    lin = nn.Linear(8, 256)
    h = lin(torch.randn(4, 8)).relu()
    a, b = h.sin(), h.cos()
    del h
    shown = torch.ones(32)

    def failing():
        local = torch.ones(64)  # noqa: F841 - found through the frame
        raise RuntimeError("boom")

    try:
        failing()
    except RuntimeError as exc:
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
    ns = {"model": model, "optimizer": optimizer, "opt2": orphan_optimizer(), "x": x, "lin": lin,
          "a": a, "b": b, "batch": [torch.ones(8)], "Out": {3: shown}, "_": torch.ones(12), "_tmp": torch.ones(5)}
    report = who(ns, refs=ipython_owns("Out", "_"), budget_s=EXACT_S)
    by = {(h.kind, h.expr): h for h in report.holders}
    assert by[("module", "model")].roots == ("model",) and by[("module", "model")].category == "parameters"
    assert by[("module_grads", "model")].category == "gradients"
    assert by[("optimizer", "optimizer")].category == "optimizer_state"
    assert by[("optimizer_params", "opt2")].category == "parameters"
    assert by[("optimizer_grads", "opt2")].category == "gradients"
    assert (by[("grad", "x")].category, by[("grad", "x")].name) == ("gradients", "x (grad)")
    assert by[("variable", "batch[0]")].roots == ("batch",)
    assert by[("variable", "_tmp")].roots == ("_tmp",)  # spelled with "_", still the user's
    shared = next(h for h in report.holders if h.kind == "shared_graph")
    assert (shared.roots, shared.expr, shared.name) == (("a", "b"), "a + b", "a + b (shared graph)")
    assert by[("out_cache", "Out[3]")].keys == (3,) and by[("underscore", "_")].roots == ("_",)
    local = by[("traceback_local", "local")]
    assert (local.frame, local.roots, local.category) == ("failing", (), "ipython_caches")
    assert {h.kind for h in report.holders} <= set(HOLDER_KINDS)
    for h in report.holders:
        row = h.to_dict()
        assert (row["name"], row["category"], row["bytes"], row["device"], row["kind"]) == (
            h.name, h.category, h.bytes, h.device.label, h.kind)
        assert row["roots"] == list(h.roots) and row["expr"] == h.expr
    json.dumps(report.to_dict())


def test_ipythons_own_objects_are_skipped_and_the_users_names_are_walked(ip):
    """In a real shell: In/_ih/_dh/exit/quit/get_ipython are IPython's and skipped; `_tmp` is the user's."""
    try:
        ip.run_cell("import torch\n_tmp = torch.zeros(50)\nIn_copy = In", store_history=True)
        owned = ipython_refs(ip.user_ns, ip.user_ns_hidden, ip.displayhook)
        assert {"In", "_ih", "_dh", "exit", "quit", "get_ipython", "Out", "_oh"} <= owned.names
        assert not owned.owns("_tmp") and not owned.owns("In_copy")
        report = who(ip.user_ns, refs=owned, budget_s=EXACT_S)
        row = holder(report, "_tmp")
        assert (row.kind, row.category, row.roots, row.bytes) == ("variable", "other_tensors", ("_tmp",), 200)
        assert not any(h.roots and h.roots[0] in ("In", "_ih", "_dh", "exit", "quit", "get_ipython")
                       for h in report.holders)
    finally:
        ip.user_ns.pop("_tmp", None)
        ip.user_ns.pop("In_copy", None)


# ---------------------------------------------------------------------------- budgets
def test_a_visit_budget_stops_the_walk_and_names_what_it_left():
    ns = {"first": torch.ones(10), "model": nn.Linear(4, 4),
          "rows": [[torch.ones(1), {"k": torch.ones(2)}] for _ in range(3000)], "last": torch.ones(3)}
    full = who(ns, budget_s=EXACT_S)
    assert full.complete and full.stopped is None and full.to_dict()["complete"] is True
    report = who(ns, max_visits=100, budget_s=EXACT_S)
    assert not report.complete and "visit budget" in report.stopped
    assert report.notes[0].startswith("incomplete: stopped after examining 100 items")
    assert "not examined: the contents of 1 container at depth 0 (rows)" in report.notes[0]
    # The names themselves come first: every top-level tensor and module is counted.
    names = {h.name for h in report.holders}
    assert {"first", "model", "last"} <= names
    assert report.total < full.total
    data = report.to_dict()
    assert data["complete"] is False and data["stopped"] == report.stopped
    text = " ".join(who_view(report).text.split())
    assert "(incomplete)" in text and report.notes[0] in text


def test_a_time_budget_stops_the_walk():
    ns = {"loss": (nn.Linear(8, 8)(torch.randn(4, 8)) ** 2).sum(),
          "rows": [[torch.ones(1)] for _ in range(5000)]}
    report = who(ns, budget_s=0.0)
    assert not report.complete and "time budget" in report.stopped
    assert "autograd graphs" in report.notes[0] or "contents of" in report.notes[0]
    assert holder(report, "loss").bytes == 4  # the names were still examined


@pytest.mark.slow
def test_many_small_objects_are_cheap_and_complete():
    """1.5 million small objects (the issue's case) are walked completely, in C, well within the budget."""
    ns = {f"v{i}": (i if i % 3 else [i, str(i)] if i % 2 else {"a": i, "b": (i, None)}) for i in range(300_000)}
    ns["rows"] = [{"x": float(i), "tags": ["a", "b"]} for i in range(100_000)]
    ns["found"] = [{"deep": [torch.ones(4)]}]
    report = who(ns, budget_s=10.0)
    assert report.complete and holder(report, "found[0]['deep'][0]").bytes == 16
    assert report.elapsed_s < 5.0  # generous: a loaded CI machine; bench_who.py has the real numbers


@pytest.mark.slow
def test_a_giant_container_does_not_run_past_the_budget():
    ns = {"big": [0] * 3_000_000 + [torch.ones(4)], "x": torch.ones(2)}
    assert holder(who(ns, budget_s=10.0), "big[3000000]").bytes == 16  # found when there is time (a loaded machine)
    report = who(ns, budget_s=0.0)
    assert not report.complete and "(big)" in report.notes[0] and holder(report, "x").bytes == 8


def test_a_budget_that_stops_the_proofs_still_reads_every_name():
    """Past the budget the rest of the names are only sorted by kind, in C: a tensor bound last still counts,
    and the report says how many names that hold containers it did not examine."""
    ns = {f"r{i}": [i, str(i)] for i in range(50_000)}
    ns["last"] = torch.ones(3)
    report = who(ns, budget_s=0.0)
    assert holder(report, "last").bytes == 12 and not report.complete
    assert "not examined: 48,976 of the namespace's names (those that hold containers, past the first 1,024)" \
        in report.notes[0]
    assert who(ns, budget_s=10.0).complete


@pytest.mark.slow
def test_the_public_who_is_a_function_after_every_room_is_imported():
    """The room is not named ``who``: importing it can never replace ``ipy_gpumem.who()``."""
    code = ("import ipy_gpumem, torch, inspect\n"
            "import ipy_gpumem.attribution.who, ipy_gpumem.attribution.view, ipy_gpumem.free.release\n"
            "report = ipy_gpumem.who({'x': torch.ones(3)})\n"
            "print(type(report).__name__, report.total, inspect.isfunction(ipy_gpumem.who))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["WhoReport", "12", "True"]
