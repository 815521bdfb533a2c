"""The one count of every tensor (the ``tensors`` room): storages of every kind, what graphs keep, every kind of holder, and the census, who() and the estimate's registration agreeing with an exact count to the byte."""
import dataclasses
import functools
import gc
import importlib
import sys
import textwrap
import types
import warnings

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from ipy_gpumem.attribution.who import who  # noqa: E402
from ipy_gpumem.preflight.world import FakeWorld  # noqa: E402
from ipy_gpumem.tensors import census, kinds  # noqa: E402
from ipy_gpumem.tensors.storage import Storages  # noqa: E402
from ipy_gpumem.tensors.torch_api import DEPENDENCIES, api  # noqa: E402
from ipy_gpumem.tensors.walk import Walk  # noqa: E402
from tests.conftest import EXACT_S  # noqa: E402



def nbytes(*tensors):
    """The exact bytes of the distinct storages behind ``tensors``, counted independently of the room."""
    seen = {}
    for t in tensors:
        if t.layout == torch.sparse_coo:
            parts = (t._indices(), t._values())
        elif t.layout == torch.sparse_csr:
            parts = (t.crow_indices(), t.col_indices(), t.values())
        elif t.is_nested and t.layout == torch.jagged:
            parts = (t.values(), t.offsets())
        else:
            parts = (t,)
        for p in parts:
            st = p.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        if t.is_quantized and t.qscheme() == torch.per_channel_affine:
            for p in (t.q_per_channel_scales(), t.q_per_channel_zero_points()):
                seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


def storage_bytes(t):
    return sum(n for _key, n, _dev in Storages(api()).entries(t))


# -- storages of every kind ----------------------------------------------------------------------
def test_every_kind_of_tensor_counts_its_own_memory_once():
    base = torch.randn(64, 64)
    coo = torch.randn(50, 50).relu().to_sparse()
    csr = torch.eye(100).to_sparse_csr()
    nested = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)])
    jagged = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], layout=torch.jagged)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.randn(1000), 0.1, 0, torch.qint8)
        qc = torch.quantize_per_channel(torch.randn(10, 100), torch.rand(10) + 0.1, torch.zeros(10, dtype=torch.long),
                                        0, torch.qint8)
    assert storage_bytes(base) == 64 * 64 * 4
    assert storage_bytes(base[3:7]) == 64 * 64 * 4  # a view is its base's storage
    assert storage_bytes(coo) == nbytes(coo) > 0 and storage_bytes(csr) == nbytes(csr) > 0
    assert storage_bytes(nested) == (3 + 5) * 8 * 4  # the strided nested tensor's buffer
    assert storage_bytes(jagged) == nbytes(jagged) > (3 + 5) * 8 * 4  # values and offsets
    assert storage_bytes(q) == 1000
    assert storage_bytes(qc) == 1000 + 10 * 8 + 10 * 8  # data, float64 scales, int64 zero points
    assert storage_bytes(torch.empty(10, device="meta")) == 0
    # the census and who() agree with the exact count on all of them at once
    ns = {"base": base, "view": base[3:7], "coo": coo, "csr": csr, "nested": nested, "jagged": jagged, "q": q, "qc": qc}
    exact = nbytes(base, coo, csr, nested, jagged, q, qc)
    snap = census.take(ns, caches=False, user_modules=False, budget_s=EXACT_S)
    assert sum(snap.parts.values()) == exact and snap.complete
    assert who(ns, budget_s=EXACT_S).total == exact


def test_tied_weights_and_shared_storages_count_once():
    emb = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    ns = {"model": model, "alias": emb.weight, "again": [emb.weight, emb.weight[0]]}
    snap = census.take(ns, caches=False, user_modules=False, budget_s=EXACT_S)
    assert snap.role_bytes("parameters") == 100 * 16 * 4
    assert sum(snap.parts.values()) == 100 * 16 * 4


# -- what autograd keeps alive -------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))


def test_checkpointing_of_both_kinds_keeps_its_inputs_and_they_are_counted():
    from torch.utils.checkpoint import checkpoint

    model = _mlp()
    for reentrant in (False, True):
        x = torch.randn(32, 64, requires_grad=True)
        h = x.clone()  # the region's input (clone saves nothing): only the checkpoint keeps it
        out = checkpoint(model, h, use_reentrant=reentrant)
        del h
        snap = census.take({"model": model, "x": x, "out": out}, caches=False, user_modules=False, budget_s=EXACT_S)
        acts = snap.role_bytes("activations")
        # the input of the region (32 x 64 floats) is kept, nothing inside the region is; the
        # reentrant kind also keeps the CPU random state it restores for the recomputation
        kept = 32 * 64 * 4 + (torch.get_rng_state().nbytes if reentrant else 0)
        assert acts == kept, (reentrant, acts, kept)
        assert who({"model": model, "x": x, "out": out}, budget_s=EXACT_S).categories["retained_graphs"] == acts


def test_save_on_cpu_payloads_and_custom_function_context_are_counted():
    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.extra = torch.ones(1000)  # kept with the graph, even after backward
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    x = torch.randn(100, requires_grad=True)
    y = Keep.apply(x)
    snap = census.take({"x": x, "y": y}, caches=False, user_modules=False, budget_s=EXACT_S)
    assert snap.role_bytes("activations") == 1000 * 4
    w = torch.randn(64, 64, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():
        z = (torch.randn(32, 64) @ w).relu()
    snap = census.take({"w": w, "z": z}, caches=False, user_modules=False, budget_s=EXACT_S)
    assert snap.role_bytes("activations") >= 32 * 64 * 4  # the packed copies of what matmul saved


# -- every kind of holder ---------------------------------------------------------------------------
@dataclasses.dataclass
class Record:
    data: object
    note: str = ""


@dataclasses.dataclass(slots=True)
class Slotted:
    data: object


class WithSlots:
    __slots__ = ("a", "b")

    def __init__(self, a):
        self.a = a


class Cache:
    store = []


class Holder:
    history = []


def _mutable_default(x, seen=[]):  # noqa: B006 - the holder under test
    seen.append(x)


@pytest.fixture
def helper_module(tmp_path, monkeypatch):
    """A module of the user's own, written to a file and imported (as ``import helpers`` would)."""
    (tmp_path / "ipg_helpers.py").write_text(textwrap.dedent("""
        import torch
        CACHE = []

        def remember(t):
            CACHE.append(t)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("ipg_helpers")
    yield module
    sys.modules.pop("ipg_helpers", None)


def _held_out_namespace(helper_module):
    """A namespace holding tensors through every kind of holder, and the exact bytes it holds."""
    mb = 1 << 20
    t = [torch.full((mb // 4 + k,), float(k)) for k in range(16)]  # 1 MiB (+ a little) each, all distinct
    model = _mlp()
    model.cache = [t[0]]  # a plain attribute of a module
    hook_tensor = t[1]
    handle = model.register_forward_hook(lambda m, a, o, _t=hook_tensor: None)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    many = [torch.zeros(1024) for _ in range(10_000)]  # 10,000 tensors: no cut at 4,096
    Cache.store.append(t[2])  # a class attribute, the class bound by name
    Holder.history.append(t[3])  # a class attribute reached only through an instance
    _mutable_default(t[4])  # a mutable default argument
    helper_module.remember(t[5])  # a list in a module of the user's, reached through its function

    def make_step(kept):
        def step():
            return kept.sum()
        return step

    out = {"logits": t[7], "hidden": (t[8],)}
    ns = {
        "model": model, "opt": opt, "handle": handle,
        "lst": [t[6]], "nested": {"a": [{"b": (out,)}]},
        "ns_obj": types.SimpleNamespace(x=t[9]), "rec": Record(t[10]), "slotted": Slotted(t[11]),
        "slots": WithSlots(t[12]), "Cache": Cache, "holder": Holder(), "_mutable_default": _mutable_default,
        "remember": helper_module.remember, "step": make_step(t[13]), "part": functools.partial(max, t[14]),
        "many": many,
    }
    tensors = list(t[:15]) + many + list(model.parameters()) + [p.grad for p in model.parameters()]
    tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return ns, nbytes(*tensors), handle


@pytest.mark.slow
def test_a_namespace_holding_tensors_through_every_kind_of_holder_is_counted_exactly(helper_module):
    ns, exact, handle = _held_out_namespace(helper_module)
    try:
        snap = census.take(ns, caches=False, budget_s=60.0)  # exactness, not speed: a loaded machine took 0.5 s
        assert snap.complete, snap.left_out
        assert sum(snap.parts.values()) == exact
        report = who(ns, budget_s=EXACT_S)
        assert report.complete and report.total == exact
        # the estimate's registration of what exists (the world it would fake) counts the same bytes
        world = FakeWorld(api(), None, [], namespace=ns)
        world.substitute()
        keys = {}
        for tensor, _role in world.existing:
            for key, n, _dev in Storages(api()).entries(tensor):
                keys[key] = n
        assert sum(keys.values()) == exact
        # who() names each holder as Python
        exprs = {h.expr for h in report.holders}
        for expr in ("model.cache", "Cache.store", "type(holder).history", "_mutable_default.__defaults__",
                     "ns_obj.x", "rec.data", "slotted.data", "slots.a", "part.args", "lst",
                     "step.__closure__[0].cell_contents"):
            assert any(e.startswith(expr) for e in exprs), (expr, sorted(exprs)[:40])
        assert any(h.kind == "module_global" and "CACHE" in h.expr for h in report.holders)
        assert snap.role_bytes("other_tensors", owner="many") == 10_000 * 4096  # every one of the 10,000
    finally:
        handle.remove()
        Cache.store.clear()
        Holder.history.clear()
        _mutable_default.__defaults__[0].clear()


def test_a_budget_that_runs_out_says_what_it_left_out():
    ns = {f"v{i}": [torch.zeros(4) for _ in range(200)] for i in range(200)}
    snap = census.take(ns, budget_s=0.0005, caches=False, user_modules=False)
    assert not snap.complete and snap.left_out and "stopped" in snap.left_out[0]
    assert sum(snap.parts.values()) < 200 * 200 * 16


@pytest.mark.slow
def test_a_million_ints_are_proven_once_then_rechecked_a_slice_at_a_time():
    big = list(range(1_000_000))
    ns = {"big": big, "x": torch.zeros(10)}
    walk = Walk(api(), ns, caches=False, user_modules=False, budget_s=EXACT_S)
    walk.run()
    first = walk.visits
    walk = Walk(api(), ns, caches=False, user_modules=False, budget_s=EXACT_S)
    walk.run()
    assert first >= 900_000 and walk.visits < 100_000  # the second walk re-checks a slice
    big[500_000] = torch.ones(3)  # a tensor slipped into the middle, same length
    found = False
    for _ in range(len(big) // kinds.RECHECK + 2):  # the rotating re-check reaches it within a full turn
        snap = census.take(ns, caches=False, user_modules=False, budget_s=EXACT_S)
        if snap.role_bytes("other_tensors", owner="big") == 12:
            found = True
            break
    assert found
    big[500_000] = 0
    gc.collect()


def test_every_private_torch_name_is_in_the_adapter_and_exists_in_this_torch():
    a = api()
    assert a.tensor_base is not None and a.storage_base is not None and a.saved_tensor is not None
    assert a.saved_has_data and a.saved_has_unpack_hook and a.dispatch_mode is not None
    assert a.graph_task_id() == -1 and not a.in_backward()
    assert len(DEPENDENCIES) >= 15 and all(d.fallback for d in DEPENDENCIES)


@pytest.mark.slow
def test_a_proof_a_budget_stops_is_taken_up_by_the_next_walk():
    """A structure larger than one budget (300,000 small records) is proven over a few counts, never
    from scratch each time: every count is marked incomplete until the proof is done, then they are complete."""
    rows = [{"id": i, "tags": ["a", "b"]} for i in range(300_000)]
    ns = {"rows": rows, "x": torch.zeros(10)}
    states = []
    for _ in range(400):
        snap = census.take(ns, budget_s=0.02, caches=False, user_modules=False)
        states.append(snap.complete)
        assert snap.role_bytes("other_tensors", owner="x") == 40  # the names come first, whatever the budget
        if snap.complete:
            break
    assert states[0] is False and states[-1] is True, states[:5]
    assert census.take(ns, budget_s=0.02, caches=False, user_modules=False).complete  # remembered


@pytest.mark.slow
def test_many_instances_of_a_class_that_holds_nothing_are_proven_together():
    """A million instances of a notebook's class: proven by their own attributes in C, not one by one (a class
    with a method that closes over a tensor is still walked, and found)."""
    code = textwrap.dedent("""
        class Record:
            def __init__(self, key):
                self.key = key
            def double(self):
                return 2 * self.key
    """)
    module = types.ModuleType("__main__")
    exec(compile(code, "<cell>", "exec"), module.__dict__)
    Record = module.Record
    Record.__module__ = "__main__"
    records = {i: Record(i) for i in range(100_000)}
    walk = Walk(api(), {"records": records}, caches=False, user_modules=False, budget_s=30.0)
    walk.run()
    assert walk.complete and walk.visits < 2_000_000 and len(walk.p_parent) < 100  # no path per record

    hidden = torch.ones(5)
    Record.extra = staticmethod(lambda: hidden)  # now the class holds a tensor: found through an instance
    snap = census.take({"records": records}, budget_s=120.0, caches=False, user_modules=False)
    assert snap.complete and snap.role_bytes("other_tensors", owner="records") == 20, snap.left_out
