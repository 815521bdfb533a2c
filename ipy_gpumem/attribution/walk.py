"""The walk behind ``who()``: every tensor reachable from a namespace, level by level, within a budget.

The walk visits the namespace breadth first: every name, then what those names' containers hold,
one level deeper at a time, down to :data:`MAX_DEPTH`. Most of a namespace is scalars, strings and
containers of them. Those are recognised in C, a whole group of containers of one type at a time
(``set(map(type, chain.from_iterable(...)))``, see :meth:`Walk.inert`), without a Python step per
object, so a million small variables cost a few hundred milliseconds. Only what can hold a
tensor gets a *path* (its parent, the step from it and the top-level order), and a path becomes
text (``batch[0]``, ``trainer.model``) only if it ends up in the report.

Each tensor storage is *claimed* by every holder that reaches it; the best claim wins (see
:meth:`Walk.claim`), so the order of the walk never changes the result, only what a budget
leaves out. The work is done in order of importance, so that a budget that runs out costs the
least useful part: the names themselves and IPython's references, then the autograd graphs of
the tensors found so far, then the contents of containers, then the graphs found in them.

Nothing here imports torch, calls user code (every read goes through a builtin type's own C
method or descriptor), allocates tensors, or keeps a reference after :meth:`Walk.run`'s report
was built.
"""
from __future__ import annotations

import sys
import time
import types
from collections import deque
from itertools import chain, compress, islice, repeat
from operator import is_, is_not, itemgetter, not_
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

from ..core.devices import Device
from ..core.text import clip
from .claims import (CACHES, CATEGORIES, GRAD, GRADIENTS, GRAPH, GRAPHS, MODULE, MODULE_GRADS, OPT_GRADS, OPT_PARAMS,
                     OPTIM, OPTIMIZER, OTHER, PARAMETERS, ROLE_KINDS, VAR)
from .graphs import MORE, GraphNode, GraphRoot, GraphWalk
from .holders import Holder, IPythonRefs

__all__ = ["CATEGORIES", "MAX_DEPTH", "MAX_VISITS", "MAX_HOLDER_ROWS", "CUDA_BLOCK_BYTES", "Walk"]


MAX_DEPTH = 4  # containers/attributes below a name, e.g. ckpt['a']['b']['c']['d']
MAX_VISITS = 10_000_000  # items examined in all containers together (the deterministic budget)
MAX_ITEMS = 10_000  # submodules of one module, parameters of one optimizer, locals of one frame
MAX_HOLDER_ROWS = 500  # holder rows kept; the rest are summed into one row per category and device
_BULK = 64  # containers larger than this have their children sorted by type in C first
_GROUP = 1024  # containers of one type tested together for "holds only scalars"
_TENSORS = 1 << 14  # tensors read in bulk between two looks at the clock
_SLICE = 1 << 16  # items scanned in C between two looks at the clock
# The budget covers the report too: turning claims into rows takes about this long per claim
# (0.8 us measured on a loaded 2-core machine), so the walk stops early enough to leave it time.
_REPORT_S_PER_CLAIM = 1e-6

# The CUDA caching allocator hands out blocks whose size is the request rounded up to a
# multiple of kMinBlockSize (512 bytes); ``torch.cuda.memory_allocated`` sums block sizes, so
# we round CUDA storages the same way for the numbers to add up. (Large blocks are carved out
# of 2 MiB/20 MiB segments; the rest of a segment is "reserved", not "allocated".)
CUDA_BLOCK_BYTES = 512

# How an object is walked, decided once per type. _SKIP is 0 so that "kind" reads as a truth value.
_SKIP, _TENSOR, _PARAM, _MODULE, _OPTIM, _DICT, _SEQ, _OBJECT = range(8)
# How a path continues from its parent: ``[key]`` or ``.key``; or what kind of root it is.
ITEM, ATTR, NAME, OUT, UNDER, LOCAL = range(6)
_ROOT_KINDS = {NAME: "variable", OUT: "out_cache", UNDER: "underscore", LOCAL: "traceback_local"}

_SCALAR_TYPES = (
    int, float, complex, bool, str, bytes, bytearray, type(None), range, slice,
    type(Ellipsis), type(NotImplemented), memoryview,
)
# Objects with a ``__dict__`` that must not be walked: code, frames, classes and friends.
_OPAQUE_TYPES = (
    type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
    types.CodeType, types.FrameType, types.TracebackType, types.GeneratorType,
    types.CoroutineType, types.AsyncGeneratorType, BaseException, property, staticmethod,
    classmethod,
)
_SEQ_BASES = (list, tuple, set, frozenset, deque)
# Packages whose objects are the session's machinery, not the user's data. Walking them would
# find the user namespace again (e.g. ``exit._ip.user_ns``) under misleading names.
_SKIP_PACKAGES = frozenset((
    "IPython", "ipykernel", "traitlets", "jupyter_client", "jupyter_core", "zmq", "tornado",
    "ipywidgets", "plotly", "matplotlib", "asyncio", "logging", "threading", "concurrent",
    "multiprocessing", "socket", "ssl", "subprocess", "ipy_gpumem", "comm", "debugpy",
))
_EXC_TRACEBACK = BaseException.__dict__["__traceback__"]
_EXC_CAUSE = BaseException.__dict__["__cause__"]
_EXC_CONTEXT = BaseException.__dict__["__context__"]
_C_DESCRIPTORS = (types.GetSetDescriptorType, types.MemberDescriptorType)
_NOTHING: tuple = ()  # storage_entry: a storage that owns no memory we count
_UNDERSCORES = ("_", "__", "___")
_OUT_NAMES = ("Out", "_oh")
_FIRST = itemgetter(0)
_GONE = object()  # a name deleted while the walk ran


def key_text(key: Any) -> str:
    """How a dict key reads in a path: ``['w']``, ``[3]``, or ``[<Foo>]``; no user ``__repr__`` runs."""
    if type(key) in (str, int, float, bool) or key is None:
        return clip(repr(key), 60)
    return f"<{type(key).__name__}>"


class _Local(NamedTuple):
    """The key of a traceback local's root path: the frame's function and the local's name."""

    frame: str
    name: str


class _Tier:
    """One pass of attribution: the user's variables, or IPython's references (whose claims all
    count as ``ipython_caches``). Each has its own seen-set, graph roots and graph nodes."""

    def __init__(self, caches: bool, namespace_id: int):
        self.caches = caches
        self.graph_category = CACHES if caches else GRAPHS
        self.seen: Dict[int, int] = {namespace_id: -1}  # id -> depth it was opened at
        self.levels: List[List[Tuple[int, Any, int]]] = [[] for _ in range(MAX_DEPTH + 1)]
        self.roots: List[GraphRoot] = []  # tensors with a graph
        self.spread = 0  # roots[:spread] are in ``nodes``
        self.nodes: Dict[int, GraphNode] = {}  # by id(node)
        self.owners_of: Dict[Any, tuple] = {}


class Walk(GraphWalk):
    """One walk over a namespace; holds references to the user's objects only until :meth:`run` returns.

    After :meth:`run`, the results are plain values: :attr:`claims` (storage key -> winning
    claim, whose last two fields are the storage's bytes and Device), the notes, and
    :meth:`holder` turns a claim into a :class:`Holder`.
    """

    def __init__(self, torch: Any, namespace: dict, wanted: Optional[Device], refs: Optional[IPythonRefs],
                 budget_s: float, max_visits: int, start: float, errors: Tuple[Any, ...] = ()):
        self.torch = torch
        self.namespace = namespace
        self.wanted = wanted
        self.refs = refs
        self.errors_kept = errors  # exceptions/tracebacks IPython keeps besides sys.last_*
        self.budget_s = budget_s
        self.deadline = start + budget_s
        self.max_visits = max_visits
        tensor_base = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase  # < 2.1
        # Read tensor state through TensorBase's C descriptors so that neither a subclass's
        # Python overrides nor __torch_function__ run, and ``.grad`` is read only on leaves
        # (on non-leaves it warns).
        self.untyped_storage = tensor_base.untyped_storage
        self.get_grad_fn = tensor_base.grad_fn.__get__
        self.get_grad = tensor_base.grad.__get__
        self.get_is_leaf = tensor_base.is_leaf.__get__
        self.get_retains_grad = tensor_base.retains_grad.__get__
        self.get_layout = tensor_base.layout.__get__
        self.get_is_cpu = tensor_base.is_cpu.__get__
        self.tensor_type = torch.Tensor
        storage_base = getattr(torch._C, "StorageBase", None)
        try:  # the C descriptors behind UntypedStorage's device, nbytes() and data_ptr()
            self.storage_device = storage_base.__dict__["device"].__get__
            self.storage_nbytes = storage_base.__dict__["nbytes"]
            self.storage_ptr = storage_base.__dict__["data_ptr"]
        except Exception:  # pragma: no cover - another torch: every tensor takes the careful path
            self.storage_device = None
        nn_module = sys.modules.get("torch.nn.modules.module")
        parameter = sys.modules.get("torch.nn.parameter")
        optimizer = sys.modules.get("torch.optim.optimizer")
        function = sys.modules.get("torch.autograd.function")
        self.module_type = getattr(nn_module, "Module", None)
        self.parameter_type = getattr(parameter, "Parameter", None)
        self.optimizer_type = getattr(optimizer, "Optimizer", None)
        self.cfunction_type = getattr(function, "BackwardCFunction", None)
        saved_tensor = getattr(getattr(torch._C, "_autograd", None), "SavedTensor", None)
        self.saved_tensor_type = saved_tensor
        # SavedTensor.data (torch >= 2.4 or so) reads what was saved without running
        # saved-tensor unpack hooks (which may recompute activations or copy CPU-offloaded
        # ones back to the GPU). Older torch only offers ``_saved_*``, which unpacks.
        self.raw_data = saved_tensor is not None and hasattr(saved_tensor, "data")

        self.kinds: Dict[type, int] = dict.fromkeys(_SCALAR_TYPES, _SKIP)
        self.skip_types = set(_SCALAR_TYPES)  # the types whose kind is _SKIP, for tests in C
        self.seq_base: Dict[type, type] = {}
        self.seq_iter: Dict[type, Any] = {}
        self.dict_desc: Dict[type, Any] = {}
        self.node_info: Dict[type, Tuple[Tuple[str, ...], bool, bool]] = {}
        self.devices: Dict[Tuple[str, Optional[int]], Device] = {}
        self.torch_devices: Dict[Any, Device] = {}  # torch.device -> Device, for devices already seen
        self.host = self.devices[("cpu", None)] = Device("cpu", None)
        self.plain_tensor_types = {torch.Tensor} | ({self.parameter_type} if self.parameter_type else set())

        # storage key -> its best claim: (category, priority, depth, weight, order, role, ref,
        # bytes, Device); the smallest wins, and the last two ride along for the report. The key
        # is (id of the Device, data_ptr): two ints hash faster than a tuple holding a Device,
        # and each Device is one object per walk. ``sizes`` keeps (bytes, Device) of the
        # storages that autograd graphs save, until their claims are made.
        self.claims: Dict[Tuple[int, int], tuple] = {}
        self.sizes: Dict[Tuple[int, int], Tuple[int, Device]] = {}
        # Paths, one entry each in four parallel lists: parent path (-1 for a root), the step
        # from the parent (ITEM/ATTR) or the kind of root (NAME/OUT/UNDER/LOCAL), the key
        # (a dict key, an index, an attribute, a name; a _Local for a traceback local),
        # and the order of the root (namespace order, the last tie-break between claims).
        self.p_parent: List[int] = []
        self.p_step: List[int] = []
        self.p_key: List[Any] = []
        self.p_order: List[int] = []
        self.order = 0
        self.visits = 0
        self.tiers = (_Tier(False, id(namespace)), _Tier(True, id(namespace)))
        self.local_orders: set = set()  # orders of traceback locals, walked one level deep by design

        self.stopped: Optional[str] = None  # why a budget stopped the walk, in words
        self.unexamined: List[str] = []  # what the walk did not look at because of it
        self.notes: List[str] = []
        self.too_deep = 0
        self.too_deep_path = -1
        self.errors: List[str] = []
        self.error_count = 0
        self._exprs: Dict[int, Tuple[int, str]] = {}

    # ----------------------------------------------------------------- driver
    def no_torch_function(self) -> Any:
        """A context that keeps tensor subclasses' ``__torch_function__`` from running."""
        ctx = getattr(self.torch._C, "DisableTorchFunctionSubclass", None)
        if ctx is None:  # pragma: no cover - torch < 2.0
            ctx = getattr(self.torch._C, "DisableTorchFunction", None)
        return ctx() if ctx is not None else _NullContext()

    def run(self) -> None:
        """Walk in order of importance (see the module docstring), then drop every reference."""
        variables, caches = self.tiers
        try:
            self.top_variables(variables)
            self.top_caches(caches)
            self.graphs()
            for depth in range(MAX_DEPTH + 1):
                for tier in self.tiers:
                    self.open_level(tier, depth)
            self.graphs()
            self.claim_graphs()
        finally:
            for tier in self.tiers:
                tier.levels = []
                tier.roots = [root._replace(fn=None) for root in tier.roots]  # no graph node kept
                tier.nodes = {}
            self.namespace = None
            self.errors_kept = ()

    def out_of_budget(self) -> bool:
        """True once the time or visit budget is spent (and from then on)."""
        if self.stopped is not None:
            return True
        if self.visits >= self.max_visits:
            self.stopped = f"stopped after examining {self.max_visits:,} items (the visit budget)"
        elif time.perf_counter() + len(self.claims) * _REPORT_S_PER_CLAIM >= self.deadline:
            self.stopped = f"stopped after {self.budget_s:g} s (the time budget)"
        return self.stopped is not None

    def path(self, parent: int, step: int, key: Any, order: int) -> int:
        """A new path: ``key`` reached from ``parent`` by ``step``."""
        self.p_parent.append(parent)
        self.p_step.append(step)
        self.p_key.append(key)
        self.p_order.append(order)
        return len(self.p_parent) - 1

    def root(self, tier: _Tier, step: int, key: Any, value: Any, kind: int, depth: int, parent: int = -1) -> None:
        """A named value under its own order number; nothing it holds can make the walk raise."""
        if kind >= _DICT and self.scalars_only(value, kind):
            return  # most containers in a namespace: no path, no order number, nothing to open
        self.order += 1
        pid = self.path(parent, step, key, self.order)
        if step == LOCAL:
            self.local_orders.add(self.order)
        try:
            self.visit(tier, value, kind, pid, depth, self.order)
        except Exception as exc:
            self.error(pid, exc)

    def error(self, pid: int, exc: BaseException) -> None:
        """Remember that the object at path ``pid`` could not be examined (as text only)."""
        self.error_count += 1
        if len(self.errors) < 3:
            try:
                text = clip(str(exc), 80)
            except Exception:  # an exception whose __str__ raises
                text = "?"
            self.errors.append(f"{self.label(pid)}: {type(exc).__name__}: {text}")

    # ------------------------------------------------------------ the roots
    def top_variables(self, tier: _Tier) -> None:
        """The namespace's names: every one is the user's variable except those IPython bound."""
        ns = self.namespace
        # Two C calls instead of a million (name, value) tuples; each suspect is checked against
        # the namespace below, so a name another thread rebinds in between is never mislabelled.
        names, values = list(dict.keys(ns)), list(dict.values(ns))
        self.visits += len(values)
        # Values at depth 0 hold tensors at most MAX_DEPTH levels below them.
        positions = self.suspects(values, MAX_DEPTH + 1) if len(names) == len(values) else range(len(values))
        owned = self.refs.names if self.refs is not None else ()
        kinds, classify, root = self.kinds, self.classify, self.root
        for count, position in enumerate(positions):
            if count and not count & 1023 and self.out_of_budget():  # the first names always count
                first = names[position] if position < len(names) else "?"
                self.unexamined.append(f"{len(positions) - count:,} of the namespace's names (from "
                                       f"{first if type(first) is str else key_text(first)} on)")
                return
            name = names[position] if position < len(names) else None
            if type(name) is not str or name in owned:
                continue
            value = dict.get(ns, name, _GONE)
            if value is _GONE:
                continue
            kind = kinds.get(type(value))
            if kind is None:
                kind = classify(type(value))
            if kind:
                root(tier, NAME, name, value, kind, 0)

    def top_caches(self, tier: _Tier) -> None:
        """IPython's own references: its output cache, ``_``/``__``/``___``/``_N``, the last error's frames.

        Only names that ``refs`` says IPython bound count; the last error is read from ``sys``.
        """
        ns, refs = self.namespace, self.refs
        if refs is not None and refs.names:
            walked = set()
            for name in _OUT_NAMES:
                cache = dict.get(ns, name) if refs.owns(name) else None
                if not isinstance(cache, dict) or id(cache) in walked:
                    continue
                walked.add(id(cache))
                self.order += 1
                out = self.path(-1, OUT, name, self.order)
                for key, value in list(dict.items(cache)):
                    kind = self.kind_of(value)
                    if kind:
                        self.root(tier, ITEM, key, value, kind, 0, parent=out)
            numbered = sorted((int(n[1:]), n) for n in refs.names
                              if n[:1] == "_" and n[1:].isdecimal() and n[1:].isascii())
            for name in [n for n in _UNDERSCORES if refs.owns(n)] + [n for _, n in numbered]:
                value = dict.get(ns, name)
                kind = self.kind_of(value)
                if kind:
                    self.root(tier, UNDER, name, value, kind, 0)
        self.walk_tracebacks(tier)

    def walk_tracebacks(self, tier: _Tier) -> None:
        """Locals of the frames of the last exception's traceback (and chained exceptions), and of
        the other errors IPython keeps that the caller passed."""
        tracebacks = []
        exceptions = [getattr(sys, "last_exc", None), getattr(sys, "last_value", None)]
        for kept in (getattr(sys, "last_traceback", None),) + tuple(self.errors_kept):
            if isinstance(kept, types.TracebackType):
                tracebacks.append(kept)
            elif isinstance(kept, BaseException):
                exceptions.append(kept)
        seen_exc = set()
        while exceptions and len(seen_exc) < 8:
            exc = exceptions.pop(0)
            if not isinstance(exc, BaseException) or id(exc) in seen_exc:
                continue
            seen_exc.add(id(exc))
            # BaseException's own C getters: an exception class's properties never run.
            tb = _EXC_TRACEBACK.__get__(exc)
            if isinstance(tb, types.TracebackType):
                tracebacks.append(tb)
            exceptions.extend((_EXC_CAUSE.__get__(exc), _EXC_CONTEXT.__get__(exc)))
        seen_frames = set()
        for tb in tracebacks:
            steps = 0
            while isinstance(tb, types.TracebackType) and steps < 1000:
                steps += 1
                frame = tb.tb_frame
                tb = tb.tb_next
                if id(frame) in seen_frames:
                    continue
                seen_frames.add(id(frame))
                try:
                    self.frame_locals(tier, frame)
                except Exception as exc:
                    self.errors.append(f"traceback frame {frame.f_code.co_name}: {type(exc).__name__}")
                    self.error_count += 1

    def frame_locals(self, tier: _Tier, frame: types.FrameType) -> None:
        """One frame's locals: tensors, modules, optimizers, and one level into containers."""
        f_locals = frame.f_locals
        if f_locals is frame.f_globals or f_locals is self.namespace:
            return  # a cell's module-level frame: its "locals" are the user namespace itself
        items = list(dict.items(f_locals)) if isinstance(f_locals, dict) else list(f_locals.items())
        function = frame.f_code.co_name
        for name, value in items[:MAX_ITEMS]:
            kind = self.kind_of(value)
            if kind and type(name) is str:
                self.root(tier, LOCAL, _Local(function, name), value, kind, MAX_DEPTH - 1)

    # ------------------------------------------------------------- classify
    def kind_of(self, value: Any) -> int:
        """How ``value`` is walked, decided by its type (never by ``__class__``)."""
        kind = self.kinds.get(type(value))
        return self.classify(type(value)) if kind is None else kind

    def is_tensor(self, value: Any) -> bool:
        """True for real tensors (by type, never by ``__class__``)."""
        kind = self.kind_of(value)
        return kind == _TENSOR or kind == _PARAM

    def classify(self, tp: type) -> int:
        """Decide once per type how its instances are walked."""
        try:
            kind = self._classify(tp)
        except Exception:
            kind = _SKIP
        self.kinds[tp] = kind
        if kind == _SKIP:
            self.skip_types.add(tp)
        return kind

    def _classify(self, tp: type) -> int:
        if issubclass(tp, self.tensor_type):
            if self.parameter_type is not None and issubclass(tp, self.parameter_type):
                return _PARAM
            return _TENSOR
        if self.module_type is not None and issubclass(tp, self.module_type):
            return _MODULE
        if self.optimizer_type is not None and issubclass(tp, self.optimizer_type):
            return _OPTIM
        if issubclass(tp, dict):
            return _DICT
        for base in _SEQ_BASES:
            if issubclass(tp, base):
                # The base's C methods: a subclass's Python __iter__/__len__ never run.
                self.seq_base[tp] = base
                self.seq_iter[tp] = base.__iter__
                return _SEQ
        if issubclass(tp, _OPAQUE_TYPES) or issubclass(tp, _SCALAR_TYPES):
            return _SKIP
        module = type.__dict__["__module__"].__get__(tp)
        if not isinstance(module, str) or module.partition(".")[0] in _SKIP_PACKAGES:
            return _SKIP
        desc = self._dict_descriptor(tp)
        if desc is None:
            return _SKIP
        self.dict_desc[tp] = desc
        return _OBJECT

    @staticmethod
    def _dict_descriptor(tp: type) -> Any:
        """The C ``__dict__`` getter of ``tp``, or None if instances have no plain ``__dict__``.

        A class may define ``__dict__`` as a property (proxies do); then we stay out.
        """
        for klass in type.__dict__["__mro__"].__get__(tp):
            desc = type.__dict__["__dict__"].__get__(klass).get("__dict__")
            if desc is not None:
                # C getters only (classes' getset, SimpleNamespace's member); a Python
                # property named __dict__ would be user code.
                return desc if type(desc) in _C_DESCRIPTORS else None
        return None

    def instance_dict(self, obj: Any) -> Optional[dict]:
        """``obj.__dict__`` read through the C descriptor (no ``__getattr__``), or None."""
        tp = type(obj)
        desc = self.dict_desc.get(tp)
        if desc is None:
            desc = self._dict_descriptor(tp)
            if desc is None:
                return None
            self.dict_desc[tp] = desc
        try:
            value = desc.__get__(obj, tp)
        except Exception:
            return None
        return value if isinstance(value, dict) else None

    def values_of(self, obj: Any, kind: int) -> Any:
        """An iterator over what container ``obj`` holds, through builtin C methods only; None if unreadable."""
        if kind == _DICT:
            return dict.values(obj)
        if kind == _SEQ:
            return self.seq_iter[type(obj)](obj)
        attrs = self.instance_dict(obj)
        return None if attrs is None else dict.values(attrs)

    def scalars_only(self, obj: Any, kind: int) -> bool:
        """True when container ``obj`` holds only values of skipped types (one C pass)."""
        try:
            values = self.values_of(obj, kind)
            return values is None or self.skip_types.issuperset(map(type, values))
        except Exception:  # changed size during iteration (another thread): look item by item
            return False

    def inert(self, tp: type, group: List[Any], levels: int) -> bool:
        """True when no container in ``group`` (all of type ``tp``) holds anything but scalars
        within ``levels`` levels: ``levels=1`` looks at their items, ``2`` also inside those.

        All in C (``chain.from_iterable`` of the builtin C iterators, ``map(type, ...)``), so a
        million small records cost a few passes over memory instead of a Python step each.
        """
        found: set = set()
        try:
            children = self.children(tp, group)
            self.visits += len(group)
            # Types only, without holding the children (listing them, and dropping the list, would
            # touch every object twice more). A slice at a time, with a look at the clock between
            # slices: a list of fifty million ints must not stall the kernel either.
            while True:
                found.update(map(type, islice(children, _SLICE)))
                following = next(children, _GONE)
                if following is _GONE:
                    break
                found.add(type(following))
                self.visits += _SLICE
                if self.out_of_budget():
                    return False  # not proven empty: the caller's walk reports it as not examined
            others = found.difference(self.skip_types)
            if not others:
                return True
            if levels <= 1:
                return False
            values = list(self.children(tp, group))  # something else is there: look closer
        except Exception:  # an odd instance: let the item-by-item path look at each one
            return False
        tps = list(map(type, values))
        for other in others:
            kind = self.kinds.get(other)
            if kind is None:
                kind = self.classify(other)
            if not kind:
                continue
            if kind < _DICT or not self.inert(other, list(compress(values, map(is_, tps, repeat(other)))), levels - 1):
                return False
        return True

    def children(self, tp: type, group: List[Any]) -> Iterator[Any]:
        """What the containers in ``group`` (all of type ``tp``) hold, chained, through C iterators only."""
        kind = self.kinds[tp]
        if kind == _DICT:
            return chain.from_iterable(map(dict.values, group))
        if kind == _SEQ:
            return chain.from_iterable(map(self.seq_iter[tp], group))
        return chain.from_iterable(map(dict.values, map(self.dict_desc[tp].__get__, group)))

    def suspects(self, values: List[Any], levels: int) -> List[int]:
        """Positions of ``values`` that may hold a tensor within ``levels`` levels, in order.

        Scalars are dropped by type; containers are tested in groups of one type (``_GROUP`` at
        a time) with :meth:`inert`, so only groups that hold something are walked item by item.
        """
        tps = list(map(type, values))
        kinds, classify = self.kinds, self.classify
        for tp in set(tps):  # every type gets a kind first, so that kinds.get never answers None below
            if tp not in kinds:
                classify(tp)
        # One pass keeps what is not a scalar; the per-type passes then run over that rest only.
        positions = list(compress(range(len(values)), map(kinds.__getitem__, tps)))
        rest = list(map(tps.__getitem__, positions))
        kept: List[int] = []
        for tp in set(rest):
            mine = list(compress(positions, map(is_, rest, repeat(tp))))
            if kinds[tp] < _DICT:
                kept.extend(mine)
                continue
            if len(mine) > _GROUP and self.inert(tp, list(map(values.__getitem__, mine)), levels):
                continue  # the usual case, in one go: a million records of scalars
            for start in range(0, len(mine), _GROUP):
                chunk = mine[start:start + _GROUP]
                if not self.inert(tp, list(map(values.__getitem__, chunk)), levels):
                    kept.extend(chunk)
        kept.sort()
        return kept

    # ------------------------------------------------------------- visiting
    def visit(self, tier: _Tier, obj: Any, kind: int, pid: int, depth: int, order: int) -> None:
        """Attribute what ``obj`` (at path ``pid``) holds; containers wait for their level."""
        if kind <= _PARAM:
            self.held_tensor(tier, obj, kind == _PARAM, pid, depth, order)
        elif kind == _MODULE:
            self.module(tier, obj, pid, depth, order)
        elif kind == _OPTIM:
            self.optimizer(tier, obj, pid, depth, order)
        elif tier.seen.get(id(obj), MAX_DEPTH + 1) > depth:
            tier.levels[depth].append((pid, obj, kind))

    def open_level(self, tier: _Tier, depth: int) -> None:
        """Open the containers reached at ``depth`` (or, at ``MAX_DEPTH``, count those left closed)."""
        level = tier.levels[depth]
        tier.levels[depth] = []
        if not level:
            return
        if depth >= MAX_DEPTH:
            self.count_too_deep(tier, level)
            return
        if len(level) > _BULK:  # drop, in C, the groups whose contents are all scalars
            level = list(map(level.__getitem__, self.suspects(list(map(itemgetter(1), level)),
                                                                MAX_DEPTH - depth + 1)))
        seen = tier.seen
        for index, (pid, obj, kind) in enumerate(level):
            if not index & 255 and self.out_of_budget():
                self.not_opened(level[index:], depth)
                for deeper in range(depth + 1, MAX_DEPTH):
                    self.not_opened(tier.levels[deeper], deeper)
                    tier.levels[deeper] = []
                return
            if seen.get(id(obj), MAX_DEPTH + 1) <= depth:
                continue  # reached twice; opened already (also breaks cycles)
            seen[id(obj)] = depth
            try:
                self.open(tier, pid, obj, kind, depth)
            except Exception as exc:
                self.error(pid, exc)

    def not_opened(self, level: List[Tuple[int, Any, int]], depth: int) -> None:
        if level:
            many = len(level) > 1
            self.unexamined.append(f"the contents of {len(level):,} container{'s' if many else ''} at depth "
                                   f"{depth} ({'e.g. ' if many else ''}{self.label(level[0][0])})")

    def open(self, tier: _Tier, pid: int, obj: Any, kind: int, depth: int) -> None:
        """Visit what one container holds, one level down; skipped types never take a Python step."""
        if kind == _OBJECT:
            attrs = self.instance_dict(obj)
            if attrs is None:
                return
            obj, kind, step = attrs, _DICT, ATTR
        else:
            step = ITEM
        kinds, classify, skip_types = self.kinds, self.classify, self.skip_types
        if kind == _DICT:
            self.visits += dict.__len__(obj)
            if skip_types.issuperset(map(type, dict.values(obj))):
                return
            items = list(dict.items(obj))
            values: Any = None
        else:
            values = list(self.seq_iter[type(obj)](obj))
            self.visits += len(values)
            if skip_types.issuperset(map(type, values)):
                return
            items = None
        size = len(items if values is None else values)
        if size <= _BULK:
            pairs: Any = enumerate(values) if items is None else items
        else:
            # Children sorted by type in C, whole groups of scalar-only records dropped at once.
            if values is None:
                values = list(map(itemgetter(1), items))
            positions = self.suspects(values, MAX_DEPTH - depth)
            if len(positions) > _BULK and self.storage_device is not None:
                # Plain tensors (a list of a million of them) are read in bulk through C descriptors.
                plain = list(map(self.plain_tensor_types.__contains__,
                                 map(type, map(values.__getitem__, positions))))
                bulk = list(compress(positions, plain))
                if len(bulk) > _BULK:
                    for start in range(0, len(bulk), _TENSORS):
                        part = bulk[start:start + _TENSORS]
                        keys = part if items is None else list(map(_FIRST, map(items.__getitem__, part)))
                        if self.out_of_budget():
                            self.unexamined.append(f"{len(bulk) - start:,} tensors in {self.label(pid)} and "
                                                   "what follows them there")
                            return
                        if not self.held_tensors(tier, pid, step, keys, list(map(values.__getitem__, part)),
                                                 depth + 1):
                            return  # it said what it left
                    positions = list(compress(positions, map(not_, plain)))
            if not positions:
                return
            if items is None:
                pairs = zip(positions, map(values.__getitem__, positions))
            else:
                pairs = map(items.__getitem__, positions)
        order = self.p_order[pid]
        seen, child_depth, scalars_only = tier.seen, depth + 1, self.scalars_only
        for count, (key, value) in enumerate(pairs):
            if count & 4095 == 4095 and self.out_of_budget():
                self.unexamined.append(f"the rest of {self.label(pid)} ({size:,} items)")
                return
            tp = type(value)
            kind = kinds.get(tp)
            if kind is None:
                kind = classify(tp)
            if not kind:
                continue
            if kind >= _DICT:
                if seen.get(id(value), MAX_DEPTH + 1) <= child_depth:
                    continue
                # Exact builtins iterate in C without user code: test them inline, the rest by type.
                if tp is list or tp is tuple:
                    if skip_types.issuperset(map(type, value)):
                        continue
                elif tp is dict:
                    if skip_types.issuperset(map(type, dict.values(value))):
                        continue
                elif scalars_only(value, kind):
                    continue
            cpid = self.path(pid, step, key, order)
            try:
                self.visit(tier, value, kind, cpid, child_depth, order)
            except Exception as exc:
                self.error(cpid, exc)

    def count_too_deep(self, tier: _Tier, level: List[Tuple[int, Any, int]]) -> None:
        """Containers at ``MAX_DEPTH`` that hold more than scalars: said in a note, not opened.

        Traceback locals go one level deep by design; theirs are not counted.
        """
        local_orders, seen = self.local_orders, tier.seen
        for pid, obj, kind in level:
            if id(obj) in seen or self.p_order[pid] in local_orders or self.scalars_only(obj, kind):
                continue
            seen[id(obj)] = MAX_DEPTH
            self.too_deep += 1
            if self.too_deep_path < 0:
                self.too_deep_path = pid

    # ------------------------------------------------------- tensors, modules
    def held_tensor(self, tier: _Tier, t: Any, is_param: bool, pid: int, depth: int, order: int) -> None:
        """A tensor a holder reaches: its data, its ``.grad``, and its graph as a root."""
        if is_param:
            self.claim(tier, t, PARAMETERS, 2, depth, order, VAR, pid)
        else:
            self.claim(tier, t, OTHER, 0, depth, order, VAR, pid)
        self.tensor_extras(tier, t, 2, depth, order, pid, GRAD)

    def held_tensors(self, tier: _Tier, pid: int, step: int, keys: List[Any], tensors: List[Any], depth: int) -> bool:
        """Many plain tensors held by one container (``keys`` under path ``pid``): what
        :meth:`held_tensor` does for each, with the storages read by ``map`` over C descriptors.

        Returns False when the budget ran out (the rest is then named in ``unexamined``).
        """
        count, order = len(tensors), self.p_order[pid]
        first = len(self.p_parent)  # one path per tensor, made in bulk: first + i
        self.p_parent.extend(repeat(pid, count))
        self.p_step.extend(repeat(step, count))
        self.p_key.extend(keys)
        self.p_order.extend(repeat(order, count))
        try:
            storages = list(map(self.untyped_storage, tensors))
            nbytes = list(map(self.storage_nbytes, storages))
            ptrs = list(map(self.storage_ptr, storages))
            fns = list(map(self.get_grad_fn, tensors))
            if all(map(self.get_is_cpu, tensors)):  # the usual case: no torch.device object per tensor
                devices: List[Optional[Device]] = [self.host] * count
                unique = {self.host}
            else:
                devices = [self.torch_devices.get(d) or self.device_of(d) for d in map(self.storage_device, storages)]
                unique = set(devices)
        except Exception:  # a sparse or odd tensor among them: one at a time, each guarded
            devices = nbytes = ptrs = [None] * count
            fns = None
        params = list(map(is_, map(type, tensors), repeat(self.parameter_type)))
        claims, wanted = self.claims, self.wanted
        other, param = (CACHES, CACHES) if tier.caches else (OTHER, PARAMETERS)
        careful: List[int] = []
        if fns is not None and self.claim_plainly(devices, unique, nbytes, ptrs, params, other, depth, order, first):
            devices = []  # all claimed: nothing for the loop below
        for index, (dev, size, ptr, is_param) in enumerate(zip(devices, nbytes, ptrs, params)):
            if index & 4095 == 4095 and self.out_of_budget():
                self.unexamined.append(f"the rest of {self.label(pid)} ({count - index:,} tensors)")
                return False
            if dev is None or not size or size < 0 or not ptr:
                careful.append(index)  # meta, empty, sparse, a wrapper, or a device not met yet
                continue
            if wanted is not None and not wanted.covers(dev):
                continue
            if dev.type == "cuda":
                size = -(-size // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
            claim = (param, 2, depth, 0, order, VAR, first + index, size, dev) if is_param else (
                other, 0, depth, 0, order, VAR, first + index, size, dev)
            key = (id(dev), ptr)
            old = claims.get(key)
            if old is None or claim < old:
                claims[key] = claim
        careful_set = set(careful)
        for index in compress(range(count), map(is_not, fns or (), repeat(None))):  # tensors with a graph
            if index not in careful_set:
                t = tensors[index]
                tier.roots.append(GraphRoot(first + index, order, fns[index]))
                if self.get_retains_grad(t):
                    grad = self.get_grad(t)
                    if grad is not None:
                        self.claim(tier, grad, GRADIENTS, 2, depth, order, GRAD, first + index)
        # ``.grad`` of leaves only: reading it on a non-leaf warns.
        leaves = list(compress(range(count), map(is_, fns or (), repeat(None))))
        for index, grad in zip(leaves, map(self.get_grad, map(tensors.__getitem__, leaves))):
            if grad is not None and index not in careful_set:
                self.claim(tier, grad, GRADIENTS, 2, depth, order, GRAD, first + index)
        for index in careful:
            try:
                self.visit(tier, tensors[index], self.kinds[type(tensors[index])], first + index, depth, order)
            except Exception as exc:
                self.error(first + index, exc)
        return True

    def claim_plainly(self, devices: List[Optional[Device]], unique: set, nbytes: List[int], ptrs: List[int],
                      params: List[bool], category: int, depth: int, order: int, first: int) -> bool:
        """The common case of :meth:`held_tensors` with no Python step per tensor: no Parameter,
        every storage real (on a known device, not empty), every device wanted. False (nothing
        claimed) when any of that is not so; the caller then goes tensor by tensor."""
        if any(params) or not all(ptrs) or min(nbytes, default=1) <= 0:
            return False
        for dev in unique:
            if dev is None or (self.wanted is not None and not self.wanted.covers(dev)):
                return False
        if any(dev.type == "cuda" for dev in unique):
            nbytes = [-(-n // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES if d.type == "cuda" else n
                      for n, d in zip(nbytes, devices)]
        keys = list(zip(map(id, devices), ptrs))
        new = list(zip(repeat(category), repeat(0), repeat(depth), repeat(0), repeat(order), repeat(VAR),
                       range(first, first + len(keys)), nbytes, devices))
        claims = self.claims
        old = list(map(claims.setdefault, keys, new))
        for index in compress(range(len(keys)), map(is_not, old, new)):  # already claimed: the best wins
            if new[index] < old[index]:
                claims[keys[index]] = new[index]
        return True

    def tensor_extras(self, tier: _Tier, t: Any, priority: int, depth: int, order: int, pid: int,
                      grad_role: int, weight: int = 0) -> None:
        """Claim ``t.grad`` (leaves and retain_grad only) and queue ``t``'s graph."""
        fn = self.get_grad_fn(t)
        if fn is not None:
            tier.roots.append(GraphRoot(pid, order, fn))
            if not self.get_retains_grad(t):
                return
        grad = self.get_grad(t)
        if grad is not None:
            self.claim(tier, grad, GRADIENTS, priority, depth, order, grad_role, pid, weight)

    def module(self, tier: _Tier, module: Any, pid: int, depth: int, order: int) -> None:
        """An ``nn.Module``: parameters and buffers, their grads, and tensor attributes.

        Reads ``_parameters``/``_buffers``/``_modules`` straight from each instance dict, so
        an overridden ``parameters()`` or ``__getattr__`` never runs. When two variables hold
        modules sharing parameters (``model`` and ``head = model.fc``), the larger module gets
        them: deleting ``head`` frees nothing.
        """
        key = id(module)
        if tier.seen.get(key, MAX_DEPTH + 1) <= depth:
            return
        tier.seen[key] = depth
        tensors: List[Any] = []
        stack = [("", module)]
        walked = {key}
        while stack:
            prefix, mod = stack.pop()
            attrs = self.instance_dict(mod)
            if attrs is None:
                continue
            for slot in ("_parameters", "_buffers"):
                slot_dict = dict.get(attrs, slot)
                if isinstance(slot_dict, dict):
                    tensors.extend(t for t in list(dict.values(slot_dict)) if t is not None and self.is_tensor(t))
            for name, value in list(dict.items(attrs)):  # plain tensor attributes (``self.mask = ...``)
                if type(name) is str and self.is_tensor(value):
                    self.held_tensor(tier, value, False, self.path(pid, ATTR, prefix + name, order), depth, order)
            children = dict.get(attrs, "_modules")
            if not isinstance(children, dict):
                continue
            for child_name, child in list(dict.items(children)):
                if child is None or id(child) in walked or self.kind_of(child) != _MODULE:
                    continue
                if len(walked) >= MAX_ITEMS:
                    self.notes.append(f"only the first {MAX_ITEMS:,} submodules of {self.label(pid)} were examined")
                    stack.clear()
                    break
                walked.add(id(child))
                stack.append((f"{prefix}{child_name}.", child))
        weight = -len(tensors)
        for t in tensors:
            self.claim(tier, t, PARAMETERS, 0, depth, order, MODULE, pid, weight)
            self.tensor_extras(tier, t, 0, depth, order, pid, MODULE_GRADS, weight)

    def optimizer(self, tier: _Tier, opt: Any, pid: int, depth: int, order: int) -> None:
        """An optimizer: its ``state`` tensors, and the parameters of its ``param_groups``."""
        attrs = self.instance_dict(opt)
        if attrs is None:
            return
        state = dict.get(attrs, "state")
        if isinstance(state, dict):
            for count, per_param in enumerate(list(dict.values(state))):
                if count >= MAX_ITEMS * 10:
                    self.notes.append(f"only the state of the first {MAX_ITEMS * 10:,} parameters of "
                                      f"{self.label(pid)} was examined")
                    break
                values = list(dict.values(per_param)) if isinstance(per_param, dict) else [per_param]
                for value in values:
                    if self.is_tensor(value):
                        self.claim(tier, value, OPTIMIZER, 0, depth, order, OPTIM, pid)
        groups = dict.get(attrs, "param_groups")
        if isinstance(groups, list):
            for group in list(groups):
                params = dict.get(group, "params") if isinstance(group, dict) else None
                if not isinstance(params, list):
                    continue
                for p in list(params):
                    if self.is_tensor(p):
                        self.claim(tier, p, PARAMETERS, 1, depth, order, OPT_PARAMS, pid)
                        self.tensor_extras(tier, p, 1, depth, order, pid, OPT_GRADS)

    # ------------------------------------------------------------- storages
    def storages(self, t: Any) -> List[Tuple[Tuple[int, int], int, Device]]:
        """``[(key, bytes, device)]`` of the storages behind ``t`` (none if meta/empty/filtered out)."""
        try:
            entry = self.storage_entry(self.untyped_storage(t))
        except Exception:  # sparse layouts and some wrapper subclasses have no storage
            entry = None
        if entry is None:
            return self.component_storages(t)
        return [] if entry is _NOTHING else [entry]

    def storage_entry(self, storage: Any) -> Any:
        """One storage's ``(key, allocator-rounded size, device)``.

        Returns ``_NOTHING`` for storages that own no memory here (meta/fake, empty, or on
        another device than asked for) and None for storages that cannot be read (the
        "storage" of a wrapper subclass), whose inner tensors are then looked at.
        """
        try:
            device = storage.device
            dtype, index = device.type, device.index
            if dtype == "meta":  # meta and fake tensors own no memory
                return _NOTHING
            nbytes = storage.nbytes()
            if nbytes <= 0:
                return _NOTHING
            ptr = storage.data_ptr()
        except Exception:
            return None
        if not ptr:
            return None
        dev = self.devices.get((dtype, index))
        if dev is None:
            dev = self.devices[(dtype, index)] = Device(dtype, index)
        if self.wanted is not None and not self.wanted.covers(dev):
            return _NOTHING
        if dtype == "cuda":
            nbytes = -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
        return (id(dev), ptr), nbytes, dev

    def device_of(self, device: Any) -> Optional[Device]:
        """Our :class:`Device` for a ``torch.device`` (None for meta: it owns no memory), remembered."""
        try:
            dtype, index = device.type, device.index
        except Exception:
            return None
        if dtype == "meta":
            return None
        dev = self.devices.get((dtype, index))
        if dev is None:
            dev = self.devices[(dtype, index)] = Device(dtype, index)
        self.torch_devices[device] = dev
        return dev

    def component_storages(self, t: Any) -> List[Tuple[Tuple[int, int], int, Device]]:
        """Storages of a sparse tensor's indices and values, or of a wrapper's inner tensors."""
        torch = self.torch
        try:
            layout = self.get_layout(t)
            if layout == torch.sparse_coo:
                parts = (t._indices(), t._values())
            elif layout in (getattr(torch, "sparse_csr", None), getattr(torch, "sparse_bsr", None)):
                parts = (t.crow_indices(), t.col_indices(), t.values())
            elif layout in (getattr(torch, "sparse_csc", None), getattr(torch, "sparse_bsc", None)):
                parts = (t.ccol_indices(), t.row_indices(), t.values())
            else:  # jagged nested tensors, DTensor, float8...: wrappers of real tensors
                return self.wrapper_storages(t)
        except Exception:
            return []
        out = []
        for part in parts:
            try:
                entry = self.storage_entry(self.untyped_storage(part))
            except Exception:
                continue
            if entry:
                out.append(entry)
        return out

    def wrapper_storages(self, t: Any) -> List[Tuple[Tuple[int, int], int, Device]]:
        """Storages of the tensors a wrapper subclass keeps as attributes (``_values``...)."""
        attrs = self.instance_dict(t)
        out: List[Tuple[Tuple[int, int], int, Device]] = []
        if attrs is None:
            return out
        for value in list(dict.values(attrs))[:64]:
            if value is not t and self.is_tensor(value):
                try:
                    entry = self.storage_entry(self.untyped_storage(value))
                except Exception:
                    continue  # a wrapper inside a wrapper: rare enough to leave out
                if entry:
                    out.append(entry)
        return out

    def claim(self, tier: _Tier, t: Any, category: int, priority: int, depth: int, order: int, role: int,
              ref: Any, weight: int = 0) -> None:
        """Offer ``t``'s storages to a holder; the best claim per storage wins.

        Claims compare as tuples: category (the precedence), then priority (a module over an
        optimizer's param list over a bare Parameter), then depth (``x`` over ``batch[0]``),
        then weight (the larger module), then namespace order; role and path only make ties
        deterministic. Everything IPython's references reach counts as ``ipython_caches``.
        """
        if tier.caches:
            category = CACHES
        claims = self.claims
        for key, nbytes, dev in self.storages(t):
            claim = (category, priority, depth, weight, order, role, ref, nbytes, dev)
            old = claims.get(key)
            if old is None or claim < old:
                claims[key] = claim

    # ------------------------------------------------------ paths to holders
    def expr(self, pid: int) -> Tuple[int, str]:
        """``(root path, Python expression)`` of path ``pid``: ``batch[0]``, ``trainer.model``, ``Out[3]``."""
        cached = self._exprs.get(pid)
        if cached is not None:
            return cached
        parts = []
        node = pid
        while self.p_step[node] <= ATTR:  # ITEM or ATTR: a step below a root
            key = self.p_key[node]
            if self.p_step[node] == ITEM:
                parts.append(f"[{key_text(key)}]")
            else:
                parts.append(f".{key}" if type(key) is str else f".<{type(key).__name__}>")
            node = self.p_parent[node]
        key = self.p_key[node]
        base = key.name if self.p_step[node] == LOCAL else key
        result = self._exprs[pid] = (node, base + "".join(reversed(parts)))
        return result

    def label(self, pid: int) -> str:
        """How path ``pid`` reads in a note."""
        root, text = self.expr(pid)
        if self.p_step[root] == LOCAL:
            return f"last traceback: {self.p_key[root].frame}() local {text!r}"
        return text

    def root_facts(self, pid: int) -> Tuple[str, Tuple[str, ...], str, Tuple[Any, ...]]:
        """``(kind of root, roots, frame, output-cache keys)`` of the holder at path ``pid``."""
        root, _ = self.expr(pid)
        step, key = self.p_step[root], self.p_key[root]
        if step == LOCAL:
            return "traceback_local", (), key.frame, ()
        if step == OUT:
            entry = pid
            while self.p_parent[entry] != root:
                entry = self.p_parent[entry]
            return "out_cache", (key,), "", (self.p_key[entry],)
        return _ROOT_KINDS[step], (key,), "", ()

    def holder(self, category: int, role: int, ref: Any, dev: Device, nbytes: int) -> Holder:
        """The typed row for the ``nbytes`` on ``dev`` that claims of ``(category, role, ref)`` won."""
        if role == GRAPH:
            return self.graph_holder(category, ref, dev, nbytes)
        root_kind, roots, frame, keys = self.root_facts(ref)
        _, text = self.expr(ref)
        kind = root_kind if role == VAR else ROLE_KINDS[role]
        return Holder(kind, CATEGORIES[category], dev, nbytes, roots=roots, expr=text, frame=frame, keys=keys)

    def graph_holder(self, category: int, owners: tuple, dev: Device, nbytes: int) -> Holder:
        """The row of the bytes that only the graphs of the roots ``owners`` keep alive."""
        tier = self.tiers[1] if category == CACHES else self.tiers[0]
        more = owners[-1] == MORE
        exprs: List[str] = []
        roots: List[str] = []
        keys: List[Any] = []
        frames: List[str] = []
        for index in owners:
            if index == MORE:
                continue
            pid = tier.roots[index].path
            _, text = self.expr(pid)
            _kind, names, frame, entry = self.root_facts(pid)
            if frame:
                text = f"last traceback: {frame}() local {text!r}" if len(owners) > 1 else text
                frames.append(frame)
            if text not in exprs:
                exprs.append(text)
            roots.extend(n for n in names if n not in roots)
            keys.extend(k for k in entry if k not in keys)
        category_name = CATEGORIES[category]
        if len(exprs) == 1 and not more:
            return Holder("graph", category_name, dev, nbytes, roots=tuple(roots), expr=exprs[0],
                          frame=frames[0] if frames else "", keys=tuple(keys))
        return Holder("shared_graph", category_name, dev, nbytes, roots=tuple(roots), expr=" + ".join(exprs),
                      more=more, keys=tuple(keys))


class _NullContext:
    """``contextlib.nullcontext`` without the import."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
