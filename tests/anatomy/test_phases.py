"""PhaseWatcher on real CPU training: the phases, peaks and roles of a loop written in a function, the hooks gone
afterwards, nothing kept alive."""
from __future__ import annotations

import gc
import time
import weakref

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from ipy_gpumem.anatomy.phases import PhaseWatcher  # noqa: E402
from ipy_gpumem.core.roles import clean_table  # noqa: E402
from tests.conftest import EXACT_S  # noqa: E402


# -- an exact stand-in for the caller's `read` ------------------------------------------------------
class StorageCounter(TorchDispatchMode):
    """Bytes of the storages created while it is on and still alive: every op's outputs are
    registered by a weak storage reference, and expired ones are dropped before each sum, so
    ``current`` and ``peak`` are exact at op granularity (what one op frees inside itself is not seen)."""

    def __init__(self):
        super().__init__()
        self.live = {}  # data pointer -> (weak storage ref, bytes)
        self.peak = 0
        self.reads = 0

    def current(self) -> int:
        expired = torch.UntypedStorage._expired
        for ptr in [p for p, (w, _n) in self.live.items() if expired(w)]:
            torch.UntypedStorage._free_weak_ref(self.live.pop(ptr)[0])
        return sum(n for _w, n in self.live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.current()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.data_ptr() and st.data_ptr() not in self.live:
                    self.live[st.data_ptr()] = (st._weak_ref(), st.nbytes())
        self.peak = max(self.peak, self.current())
        return out

    def read(self):
        """What PhaseWatcher asks for: (time, {device: (current, peak since the last read)})."""
        self.reads += 1
        cur = self.current()
        peak, self.peak = max(self.peak, cur), cur
        return time.perf_counter(), {"cpu": (cur, peak)}

    def close(self):
        for w, _n in self.live.values():
            torch.UntypedStorage._free_weak_ref(w)
        self.live.clear()


# -- a stand-in census (the real one, ipy_gpumem.anatomy.census, is tested below when present) -----
class _Snap:
    def __init__(self, parts):
        self.parts = parts

    @property
    def totals(self):
        out = {}
        for (dev, role), n in self.parts.items():
            out.setdefault(dev, {})[role] = out.get(dev, {}).get(role, 0) + n
        return clean_table(out)

    def diff(self, before):
        parts = dict(self.parts)
        for key, n in before.parts.items():
            parts[key] = parts.get(key, 0) - n
        return _Snap({k: v for k, v in parts.items() if v})

    @property
    def table(self):
        return self.totals


def standin_census(modules, optimizers, tensors):
    """Stand-in: each storage once, first role wins (parameters, gradients, optimizer state, other
    tensors, then what the graphs of those tensors saved = activations)."""
    parts, seen, roots = {}, set(), []

    def count(t, role):
        try:
            st = t.untyped_storage()
        except Exception:  # noqa: BLE001
            return
        key = (st.data_ptr(), str(t.device))
        if key not in seen:
            seen.add(key)
            parts[(str(t.device), role)] = parts.get((str(t.device), role), 0) + st.nbytes()

    params = [p for _n, m in modules for p in m.parameters()]
    params += [p for _n, o in optimizers for g in o.param_groups for p in g["params"]]
    for p in params:
        count(p, "parameters")
    for p in params:
        if p.grad is not None:
            count(p.grad, "gradients")
    for _n, o in optimizers:
        for state in o.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    count(v, "optimizer_state")
    for _n, t in tensors:
        count(t, "other_tensors")
        if getattr(t, "grad_fn", None) is not None:
            roots.append(t.grad_fn)
    visited = set()
    while roots:
        node = roots.pop()
        if id(node) in visited:
            continue
        visited.add(id(node))
        roots.extend(n for n, _ in node.next_functions if n is not None)
        for attr in dir(node):
            if attr.startswith("_raw_saved_"):
                try:
                    raw = getattr(node, attr)
                    for item in raw if isinstance(raw, (list, tuple)) else (raw,):
                        count(item.data, "activations")
                except Exception:  # noqa: BLE001 - released by backward
                    pass
    return _Snap(parts)


def real_census():
    census = pytest.importorskip("ipy_gpumem.tensors.census")
    return lambda modules, optimizers, tensors: census.take(
        extra=list(modules) + list(optimizers) + list(tensors), user_modules=False, budget_s=EXACT_S)


CENSUSES = {"stand-in": lambda: standin_census, "real": real_census}


# -- the user's code: a loop written in a function, not in the cell ---------------------------------
def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def train_one_epoch(model, opt, data, set_to_none=False):
    for x in data:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)


def param_bytes(model):
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def global_hooks():
    from torch.nn.modules import module as m
    from torch.optim import optimizer as o

    dicts = (m._global_forward_pre_hooks, m._global_forward_hooks, m._global_forward_hooks_always_called,
             m._global_forward_hooks_with_kwargs, m._global_backward_hooks, m._global_backward_pre_hooks,
             o._global_optimizer_pre_hooks, o._global_optimizer_post_hooks)
    return [dict(d) for d in dicts]


def watch(fn, *args, census=standin_census, **kwargs):
    counter = StorageCounter()
    watcher = PhaseWatcher(counter.read, census, **kwargs)
    before = global_hooks()
    with counter:
        watcher.start()
        try:
            fn(*args)
        finally:
            watcher.stop()
    counter.close()
    assert global_hooks() == before
    return watcher, counter


def roles(phase, role):
    return (phase["roles"] or {}).get("cpu", {}).get(role, 0)


# -- acceptance ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", sorted(CENSUSES))
def test_a_training_function_gives_its_phases_peaks_and_roles(which):
    census = CENSUSES[which]()
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = [torch.randn(128, 32) for _ in range(3)]
    w, counter = watch(train_one_epoch, model, opt, data, census=census)

    assert w.reason is None
    got = [(p["phase"], p["step"]) for p in w.phases]
    assert got == [(k, s) for s in (1, 2, 3) for k in ("forward", "backward", "optimizer_step", "zero_grad")]
    by = {(p["phase"], p["step"]): p for p in w.phases}
    pbytes = param_bytes(model)
    n_params = len(list(model.parameters()))
    hidden = 128 * 64 * 4  # the ReLU's saved result, the one activation of this MLP

    for step in (1, 2):
        fwd, bwd = by["forward", step], by["backward", step]
        assert roles(fwd, "activations") >= hidden  # activations grow in forward
        assert roles(fwd, "parameters") == 0
        assert roles(bwd, "activations") == -roles(fwd, "activations")  # and backward releases them
        assert fwd["peak"]["cpu"] >= roles(fwd, "activations") and fwd["delta"]["cpu"] > 0
        assert bwd["peak"]["cpu"] > 0
    assert roles(by["backward", 1], "gradients") == pbytes  # created on step 1 ...
    assert roles(by["backward", 2], "gradients") == 0  # ... kept (zeroed in place) on step 2
    # Adam's exp_avg and exp_avg_sq (2x the parameters) and one float32 step counter per parameter.
    assert roles(by["optimizer_step", 1], "optimizer_state") == 2 * pbytes + 4 * n_params
    assert by["optimizer_step", 1]["delta"]["cpu"] >= 2 * pbytes
    assert roles(by["optimizer_step", 2], "optimizer_state") == 0
    assert by["zero_grad", 1]["roles"] is not None and roles(by["zero_grad", 1], "gradients") == 0
    # detail_steps=2: step 3 is not censused
    assert all(p["roles"] is None for p in w.phases if p["step"] == 3)

    s = w.summary()
    assert list(s) == ["forward", "backward", "optimizer_step", "zero_grad"]
    assert s["optimizer_step"]["count"] == 3
    assert s["optimizer_step"]["first"]["cpu"]["optimizer_state"] == 2 * pbytes + 4 * n_params
    assert s["forward"]["peak"]["cpu"] == max(p["peak"]["cpu"] for p in w.phases if p["phase"] == "forward")
    assert s["backward"]["steady"]["cpu"].get("gradients", 0) == 0
    import json

    assert json.loads(json.dumps(s)) == s
    assert counter.reads <= 2 * len(w.phases) + 1  # one reading per boundary, not per op


def test_zero_grad_set_to_none_before_forward_frees_gradients():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [torch.randn(16, 32) for _ in range(3)]

    def loop(model, opt, data):
        for x in data:
            opt.zero_grad()  # set_to_none=True, first in the loop
            model(x).sum().backward()
            opt.step()

    w, _ = watch(loop, model, opt, data)
    kinds = [(p["phase"], p["step"]) for p in w.phases]
    assert kinds == [("forward", 1), ("backward", 1), ("optimizer_step", 1), ("zero_grad", 1),
                     ("forward", 2), ("backward", 2), ("optimizer_step", 2), ("zero_grad", 2),
                     ("forward", 3), ("backward", 3), ("optimizer_step", 3)]
    zg = [p for p in w.phases if p["phase"] == "zero_grad"]
    assert roles(zg[0], "gradients") == -param_bytes(model)
    assert zg[0]["delta"]["cpu"] <= -param_bytes(model)
    # set_to_none: every step's backward creates the gradients again
    assert [roles(p, "gradients") for p in w.phases if p["phase"] == "backward"][:2] == [param_bytes(model)] * 2


def test_zero_grad_is_recognised_on_a_deep_model_from_a_sample_of_its_gradients():
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(20)])  # 40 parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w, _ = watch(train_one_epoch, model, opt, [torch.randn(2, 8) for _ in range(2)])
    assert [p["phase"] for p in w.phases].count("zero_grad") == 2
    w, _ = watch(train_one_epoch, model, opt, [torch.randn(2, 8) for _ in range(2)], True)
    zg = [p for p in w.phases if p["phase"] == "zero_grad"]
    assert len(zg) == 2 and roles(zg[0], "gradients") == -param_bytes(model)


def test_gradient_clipping_between_backward_and_step_is_not_zero_grad():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loop(model, opt, data):
        for x in data:
            model(x).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # rewrites every gradient in place
            opt.step()
            opt.zero_grad(set_to_none=False)

    w, _ = watch(loop, model, opt, [torch.randn(4, 32) for _ in range(2)])
    assert [p["phase"] for p in w.phases] == ["forward", "backward", "optimizer_step", "zero_grad"] * 2


def test_the_bench_loop_zero_grad_between_forward_and_backward_and_census_every_tenth():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 64)

    def loop(model, opt, x):
        for _ in range(12):
            out = model(x)
            loss = out.square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    w, _ = watch(loop, model, opt, x)
    first = [p["phase"] for p in w.phases if p["step"] == 2]
    assert first == ["forward", "zero_grad", "backward", "optimizer_step"]
    assert [p["phase"] for p in w.phases if p["step"] == 1] == ["forward", "backward", "optimizer_step"]
    censused = sorted({p["step"] for p in w.phases if p["roles"] is not None})
    assert censused == [1, 2, 10]
    assert len([p for p in w.phases if p["phase"] == "forward"]) == 12


def test_inference_loop_counts_outermost_forwards_only():
    model = mlp()
    data = [torch.randn(4, 32) for _ in range(3)]

    def infer(model, data):
        with torch.no_grad():
            return [model(x) for x in data]

    w, _ = watch(infer, model, data)
    assert [(p["phase"], p["step"]) for p in w.phases] == [("forward", 1), ("forward", 2), ("forward", 3)]
    assert w.layers == []


# -- hooks, errors, lifetimes -------------------------------------------------------------------------
def test_hooks_are_removed_when_the_function_raised():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept = {}

    def broken(model, opt):
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        kept["out"] = model(torch.randn(4, 32))  # a graph still alive after the cell
        model(torch.randn(4, 31))  # shape error inside forward

    counter = StorageCounter()
    w = PhaseWatcher(counter.read, standin_census)
    before = global_hooks()
    with counter, pytest.raises(RuntimeError):
        w.start()
        try:
            broken(model, opt)
        finally:
            w.stop()
    assert global_hooks() == before
    assert w.phases[-1]["phase"] == "forward" and w.phases[-1].get("incomplete") is True
    n = len(w.phases)
    with counter:
        kept["out"].sum().backward()  # the grad_fn pre-hook left on the kept graph was removed
    assert len(w.phases) == n
    w.stop()  # idempotent
    counter.close()


def test_an_internal_error_never_reaches_the_user_and_stops_watching():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    def read():
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("probe broke\nsecond line")
        return time.perf_counter(), {"cpu": (0, 0)}

    w = PhaseWatcher(read)
    before = global_hooks()
    w.start()
    try:
        train_one_epoch(model, opt, [torch.randn(4, 32) for _ in range(2)])
    finally:
        w.stop()
    assert global_hooks() == before
    assert w.reason.startswith("phases stopped in backward pre-hook: ValueError: probe broke")
    assert "\n" not in w.reason
    assert len(calls) == 3  # nothing read after the failure
    assert [p["phase"] for p in w.phases] == ["forward"]


@pytest.mark.slow
def test_no_tensor_or_graph_is_kept_alive():
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    ns = {}
    counter = StorageCounter()
    w = PhaseWatcher(counter.read, standin_census)
    with counter:
        w.start()
        ns["x"] = torch.randn(8, 32)
        ns["out"] = model(ns["x"])
        ns["loss"] = ns["out"].square().mean()
        refs = [weakref.ref(ns["x"]), weakref.ref(ns["out"]), weakref.ref(ns["loss"])]
        ns["loss"].backward()
        opt.step()
        ns["out2"] = model(ns["x"])  # a graph never run backward
        refs.append(weakref.ref(ns["out2"]))
        ns.clear()  # the cell's names are deleted while still watching
        gc.collect()
        assert [r() for r in refs] == [None] * 4
        w.stop()
    counter.close()
    assert len(w.phases) == 4


def test_in_place_ops_on_module_outputs_still_work():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.act = torch.nn.ReLU(inplace=True)  # in-place on a submodule's output
            self.out = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.out(self.act(self.lin(x)))

    def run(model, x):
        out = model(x)
        out.add_(1)  # the user's in-place op on a module output
        out.mul_(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    x = torch.randn(4, 8)
    torch.manual_seed(1)
    plain = run(Block(), x)
    torch.manual_seed(1)
    model = Block()
    result = {}
    w, _ = watch(lambda: result.setdefault("grads", run(model, x)))
    assert all(torch.equal(a, b) for a, b in zip(plain, result["grads"]))
    assert [p["phase"] for p in w.phases] == ["forward", "backward"]


# -- layers ---------------------------------------------------------------------------------------------
class WideInTheMiddle(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.narrow = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh())
        self.wide = torch.nn.Sequential(torch.nn.Linear(32, 4096), torch.nn.Tanh())
        self.head = torch.nn.Sequential(torch.nn.Linear(4096, 64), torch.nn.Sigmoid())

    def forward(self, x):
        return self.head(self.wide(self.narrow(x)))


def test_layers_name_the_wide_layer_first():
    model = WideInTheMiddle()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w, _ = watch(train_one_epoch, model, opt, [torch.randn(32, 16) for _ in range(2)])
    names = [name for name, _ in w.layers]
    assert names[0] == "wide"
    assert dict(w.layers)["wide"] == 32 * 4096 * 4  # Tanh's saved result (the Linear's input is the caller's)
    assert set(names) == {"wide", "narrow", "head"}


def test_layers_look_inside_a_single_wrapper():
    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = WideInTheMiddle()

        def forward(self, x):
            return self.backbone(x)

    model = Wrapper()
    w, _ = watch(lambda: model(torch.randn(8, 16)).sum().backward())
    assert w.layers[0] == ("backbone.wide", 8 * 4096 * 4)


def test_start_without_torch_modules_and_stop_twice_are_harmless():
    w = PhaseWatcher(lambda: (0.0, {}))
    before = sum(map(len, global_hooks()))
    w.stop()
    w.start()
    once = sum(map(len, global_hooks()))
    w.start()  # idempotent: one set of hooks
    assert once > before and sum(map(len, global_hooks())) == once
    w.stop()
    w.stop()
    assert sum(map(len, global_hooks())) == before
    assert w.phases == [] and w.summary() == {} and w.layers == []


def test_a_long_loop_keeps_a_bounded_list_and_counts_every_phase(monkeypatch):
    from ipy_gpumem.anatomy import phases

    monkeypatch.setattr(phases, "MAX_PHASES", 20)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w, _ = watch(train_one_epoch, model, opt, [torch.randn(2, 4)] * 25, True)
    listed = w.phases
    assert 20 <= len(listed) < 40 and {p["step"] for p in listed[20:]} <= {10, 20}
    s = w.summary()
    assert s["forward"]["count"] == 25 and s["zero_grad"]["count"] == 25
    assert s["forward"]["peak"]["cpu"] >= max(p["peak"]["cpu"] for p in listed if p["phase"] == "forward")
