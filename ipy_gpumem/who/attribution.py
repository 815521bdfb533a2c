"""Who holds the memory: attribute each live tensor byte in a namespace to a category and variable.

``who(namespace)`` walks the user's variables (and IPython's output caches and last traceback)
without importing torch, allocating tensors, collecting garbage or calling user code, and answers
"these bytes are parameters of ``model``, these are Adam's moments in ``optimizer``, these are
activations kept alive by the graph of ``loss``". Every storage counts once, in the first of
these categories that reaches it:

    parameters > gradients > optimizer_state > other_tensors > retained_graphs > ipython_caches

The report holds only str/int/float/None, so keeping it never keeps a tensor alive.
"""
from __future__ import annotations

import gc
import re
import sys
import time
import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..core.units import format_bytes

__all__ = ["CATEGORIES", "CATEGORY_LABELS", "WhoReport", "who"]

#: The attributed categories, highest precedence first.
CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_state",
    "other_tensors",
    "retained_graphs",
    "ipython_caches",
)
_PARAMETERS, _GRADIENTS, _OPTIMIZER, _OTHER, _GRAPHS, _CACHES = range(6)

#: How each category reads in a table (the panel and %gpumem who use the same words).
CATEGORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "other_tensors": "other tensors",
    "retained_graphs": "retained graphs",
    "ipython_caches": "IPython caches",
    "unattributed": "unattributed",
}

# Limits that keep the walk bounded on any namespace; hitting one is reported in ``notes``.
MAX_DEPTH = 4  # containers/attributes below a variable, e.g. ckpt['a']['b']['c']['d']
MAX_ITEMS = 10_000  # items examined per container
MAX_VISITS = 2_000_000  # items examined in all containers together
MAX_NODES = 1_000_000  # autograd nodes per tier
MAX_HOLDER_ROWS = 500  # holder rows kept; the rest are summed into one row per category
_SHARED_NAMES = 4  # variables named in a shared-graph row before "+ more"
_SMALL = 64  # containers up to this size are first checked for scalars-only in one C call

# The CUDA caching allocator hands out blocks whose size is the request rounded up to a
# multiple of kMinBlockSize (512 bytes); ``torch.cuda.memory_allocated`` sums block sizes, so
# we round CUDA storages the same way for the numbers to add up. (Large blocks are carved out
# of 2 MiB/20 MiB segments; the rest of a segment is "reserved", not "allocated".)
CUDA_BLOCK_BYTES = 512

# IPython's output-cache names; ``_<digits>`` is matched separately.
_CACHE_SCALARS = ("_", "__", "___")
_CACHE_DIGITS = re.compile(r"^_\d+$")
# Names IPython puts into every user namespace that never hold user tensors.
_IPYTHON_NAMES = frozenset(("In", "Out", "exit", "quit", "get_ipython"))
# Packages whose objects are the session's machinery, not the user's data. Walking them would
# find the user namespace again (e.g. ``exit._ip.user_ns``) under misleading names.
_SKIP_PACKAGES = frozenset((
    "IPython", "ipykernel", "traitlets", "jupyter_client", "jupyter_core", "zmq", "tornado",
    "ipywidgets", "plotly", "matplotlib", "asyncio", "logging", "threading", "concurrent",
    "multiprocessing", "socket", "ssl", "subprocess", "ipy_gpumem", "comm", "debugpy",
))

_SKIP, _TENSOR, _PARAM, _MODULE, _OPTIM, _DICT, _SEQ, _OBJECT = range(8)
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
_EXC_TRACEBACK = BaseException.__dict__["__traceback__"]
_EXC_CAUSE = BaseException.__dict__["__cause__"]
_EXC_CONTEXT = BaseException.__dict__["__context__"]
_NOTHING = ((), 0, "")  # storage_entry: a storage that owns no memory we count
_C_DESCRIPTORS = (types.GetSetDescriptorType, types.MemberDescriptorType)
_MORE = -1  # last item of an owner tuple: reached from more roots than we name


@dataclass(frozen=True)
class WhoReport:
    """Which variables hold which tensor bytes, by category.

    Attributes:
        categories: Bytes per category, keys ``CATEGORIES`` plus ``"unattributed"``
            (``allocator_total`` minus the attributed total, or None without a total).
            Module buffers (BatchNorm running stats and the like) count as ``parameters``:
            they are model state that lives exactly as long as the model, so deleting the model
            is what frees them, just like its weights.
        holders: One dict per (holder, category, device) -- ``name``, ``category``,
            ``bytes``, ``device`` -- largest first. Holders' bytes sum to the categories'
            total. Names read as Python where they can: ``x``, ``batch[0]``, ``cfg['w']``,
            ``trainer.model`` (attributes of plain objects), ``model`` (its parameters and
            buffers), ``model (grads)``, ``model.block.mask`` (a module's plain tensor
            attribute), ``optimizer`` (its state), ``optimizer (params)``/``(grads)`` (only
            for parameters no module holds), ``x (grad)``, ``loss (graph)`` (what ``del loss``
            frees beyond ``loss``'s own data), ``output + loss (shared graph)`` (freed only
            once all of them are deleted), ``Out[3]``, ``_``, ``_5``,
            ``last traceback: f() local 'x'`` and ``(N smaller holders)``.
        by_device: ``{device: {category: bytes}}`` when no device filter was given, else None.
        device: The device filter as given (normalised), or None for all devices.
        allocator_total: The ``allocator_total`` passed to :func:`who`, if any.
        tensor_count: Distinct storages counted (views of one storage count once).
        elapsed_s: Wall time of the walk in seconds.
        reason: Why the report is empty or partial, else None.
        notes: Limits hit and objects skipped, in words.
    """

    categories: Dict[str, Optional[int]]
    holders: Tuple[Dict[str, Any], ...] = ()
    by_device: Optional[Dict[str, Dict[str, int]]] = None
    device: Optional[str] = None
    allocator_total: Optional[int] = None
    tensor_count: int = 0
    elapsed_s: float = 0.0
    reason: Optional[str] = None
    notes: Tuple[str, ...] = field(default_factory=tuple)

    @property
    def total(self) -> int:
        """Bytes attributed to any category (``unattributed`` excluded)."""
        return sum(int(self.categories.get(name) or 0) for name in CATEGORIES)

    @property
    def unattributed(self) -> Optional[int]:
        """``allocator_total`` minus :attr:`total`, or None when no total was given."""
        return self.categories.get("unattributed")

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-serialisable copy of the report."""
        return {
            "categories": dict(self.categories),
            "total": self.total,
            "holders": [dict(row) for row in self.holders],
            "by_device": None if self.by_device is None
            else {dev: dict(cats) for dev, cats in self.by_device.items()},
            "device": self.device,
            "allocator_total": self.allocator_total,
            "tensor_count": self.tensor_count,
            "elapsed_s": self.elapsed_s,
            "reason": self.reason,
            "notes": list(self.notes),
        }

    def summary(self, top: int = 10) -> str:
        """A small plain-text table: categories, then the ``top`` largest holders.

        Args:
            top: How many holder rows to show.
        """
        where = "all devices" if self.device is None else self.device
        lines = [f"Who holds the memory ({where}): {format_bytes(self.total)} "
                 f"in {self.tensor_count} tensor storages"]
        if self.reason:
            lines.append(f"  ({self.reason})")
        for name in CATEGORIES + ("unattributed",):
            value = self.categories.get(name)
            if name == "unattributed" and value is None:
                continue
            lines.append(f"  {CATEGORY_LABELS[name]:<17}{format_bytes(value):>12}")
        rows = [row for row in self.holders if row["bytes"]][:top]
        if rows:
            width = min(48, max(len(row["name"]) for row in rows))
            lines.append("Largest holders:")
            for row in rows:
                lines.append(f"  {_clip(row['name'], width):<{width}}  "
                             f"{CATEGORY_LABELS.get(row['category'], row['category']):<16}"
                             f"{format_bytes(row['bytes']):>12}  {row['device']}")
            hidden = len([row for row in self.holders if row["bytes"]]) - len(rows)
            if hidden > 0:
                lines.append(f"  ... and {hidden} more")
        lines.extend(f"Note: {note}" for note in self.notes)
        return "\n".join(lines)

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}={format_bytes(self.categories.get(name))!r}"
                          for name in CATEGORIES + ("unattributed",))
        return (f"WhoReport(total={format_bytes(self.total)!r}, {parts}, "
                f"holders={len(self.holders)}, tensor_count={self.tensor_count}"
                + (f", reason={self.reason!r}" if self.reason else "") + ")")


def who(namespace: Any, device: Any = None, allocator_total: Optional[int] = None) -> WhoReport:
    """Attribute every tensor byte reachable from ``namespace`` to a category and a variable.

    Safe to run at the moment of an OOM: never imports torch or initialises CUDA, never
    allocates tensors, collects garbage, calls user methods or keeps a reference to what it
    walked, and never raises because of what the namespace contains.

    Args:
        namespace: The user's variables, e.g. IPython's ``user_ns`` or ``globals()``.
        device: Count only storages on this device: ``"cpu"``, ``"cuda"`` (every CUDA
            device), ``"cuda:1"``, an int N (``cuda:N``) or a ``torch.device``; None counts
            every device and fills ``by_device``.
        allocator_total: Bytes the allocator reports in use (e.g.
            ``torch.cuda.memory_allocated(0)`` with ``device=0``); what no category explains
            becomes ``unattributed``. It is compared with the counted storages, so give the
            matching ``device`` (without one, CPU tensors would be subtracted too).

    Returns:
        A :class:`WhoReport`.

    Raises:
        ValueError: ``device`` is not a device.
    """
    start = time.perf_counter()
    wanted, device_name = _parse_device(device)
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "_C"):
        return _empty_report("torch is not imported", device_name, allocator_total, start)
    if not isinstance(namespace, dict):
        return _empty_report("namespace is not a dict", device_name, allocator_total, start)
    # Pause the automatic collector (never collect): on a torch-sized heap the walk's own small
    # allocations could otherwise trigger a full collection mid-walk, costing 100+ ms and
    # running arbitrary finalizers. The previous state is restored exactly.
    gc_was_enabled = gc.isenabled()
    if gc_was_enabled:
        gc.disable()
    try:
        walk = _Walk(torch, namespace, wanted)
        with walk.no_torch_function():
            walk.run()
        return walk.report(device_name, allocator_total, start)
    except Exception as exc:  # the walk guards each object; this is the last line of defence
        return _empty_report(f"who() failed: {type(exc).__name__}: {exc}", device_name,
                             allocator_total, start)
    finally:
        if gc_was_enabled:
            gc.enable()


def _empty_report(reason: str, device_name: Optional[str], allocator_total: Optional[int],
                  start: float) -> WhoReport:
    """A report with every category at 0 that says why."""
    categories: Dict[str, Optional[int]] = dict.fromkeys(CATEGORIES, 0)
    categories["unattributed"] = None if allocator_total is None else int(allocator_total)
    return WhoReport(categories=categories, device=device_name,
                     by_device=None if device_name else {},
                     allocator_total=None if allocator_total is None else int(allocator_total),
                     elapsed_s=time.perf_counter() - start, reason=reason)


def _parse_device(device: Any) -> Tuple[Optional[Tuple[str, Optional[int]]], Optional[str]]:
    """Turn the ``device`` argument into ``((type, index or None), name)``, or ``(None, None)``.

    Raises:
        ValueError: ``device`` is not a device.
    """
    if device is None:
        return None, None
    if isinstance(device, bool):
        raise ValueError(f"not a device: {device!r}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"not a device: {device!r}")
        return ("cuda", device), f"cuda:{device}"
    text = str(device).strip().lower()  # torch.device prints as "cuda:0" / "cuda" / "cpu"
    match = re.match(r"^([a-z_][a-z0-9_]*)(?::(\d+))?$", text)
    if not match:
        raise ValueError(f"not a device: {device!r} (try 'cpu', 'cuda', 'cuda:1' or 0)")
    kind, index = match.group(1), match.group(2)
    if kind == "cpu":  # CPU storages carry no index: "cpu:0" is all of the CPU
        return ("cpu", None), "cpu"
    return (kind, None if index is None else int(index)), text


def _clip(text: str, width: int) -> str:
    """Shorten ``text`` to ``width`` characters with an ellipsis."""
    return text if len(text) <= width else text[: width - 1] + "…"


def _key_repr(key: Any) -> str:
    """How a dict key appears in a holder name: ``['w']``, ``[3]``, or ``[<Foo>]``.

    Only builtin scalars are repr'd, so no user ``__repr__`` ever runs.
    """
    if type(key) in (str, int, float, bool) or key is None:
        text = repr(key)
        return text if len(text) <= 60 else text[:57] + "..."
    return f"<{type(key).__name__}>"


class _Walk:
    """One walk over a namespace; holds references only while :meth:`run` is going."""

    def __init__(self, torch: Any, namespace: dict, wanted: Optional[Tuple[str, Optional[int]]]):
        self.torch = torch
        self.namespace = namespace
        self.wanted = wanted
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
        self.tensor_type = torch.Tensor
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

        self.kinds: Dict[type, int] = {tp: _SKIP for tp in _SCALAR_TYPES}
        self.skip_types = set(_SCALAR_TYPES)  # the types whose kind is _SKIP, for C-speed tests
        self.seq_base: Dict[type, type] = {}
        self.seq_iter: Dict[type, Any] = {}
        self.dict_desc: Dict[type, Any] = {}
        self.node_info: Dict[type, Tuple[Tuple[str, ...], bool, bool]] = {}
        self.dev_names: Dict[Tuple[str, Optional[int]], str] = {}

        # storage key (device, data_ptr) -> (nbytes, device name) and best claim.
        # A claim is (category, priority, depth, weight, order, holder); the smallest wins.
        self.sizes: Dict[Tuple[str, int], Tuple[int, str]] = {}
        self.claims: Dict[Tuple[str, int], Tuple[int, int, int, int, int, str]] = {}
        self.tier = _OTHER
        self.roots: List[Tuple[str, int, Any]] = []
        self.seen: Dict[int, int] = {}
        self.visits = 0
        self.order = 0
        self.notes: List[str] = []
        self.truncated: List[str] = []
        self.too_deep = 0
        self.depth_notes = True  # off for traceback locals, which go one level deep by design
        self.too_deep_name = ""
        self.errors: List[str] = []
        self.error_count = 0

    # ----------------------------------------------------------------- driver
    def no_torch_function(self) -> Any:
        """A context that keeps tensor subclasses' ``__torch_function__`` from running."""
        ctx = getattr(self.torch._C, "DisableTorchFunctionSubclass", None)
        if ctx is None:  # pragma: no cover - torch < 2.0
            ctx = getattr(self.torch._C, "DisableTorchFunction", None)
        return ctx() if ctx is not None else _NullContext()

    def run(self) -> None:
        """Walk the user's variables, their graphs, then IPython's caches and their graphs."""
        ns, kinds = self.namespace, self.kinds
        self.tier, self.roots, self.seen = _OTHER, [], {id(ns): -1}
        numbered: List[str] = []  # IPython's _<n> output variables, for the cache tier
        # Copy only the keys: a list of existing strings feeds the garbage collector nothing,
        # while 100k (name, value) tuples could trigger a full collection mid-walk.
        for name in list(dict.keys(ns)):
            if type(name) is not str:
                continue
            if name[:1] == "_":
                if _CACHE_DIGITS.match(name):
                    numbered.append(name)
                continue
            if name in _IPYTHON_NAMES:
                continue
            value = dict.get(ns, name)
            if kinds.get(type(value)) != _SKIP:  # the common case costs one lookup
                self.visit_top(value, name, 0)
        self.walk_graphs(_GRAPHS)

        self.tier, self.roots, self.seen = _CACHES, [], {id(ns): -1}
        self.walk_output_caches(numbered)
        self.walk_tracebacks()
        self.walk_graphs(_CACHES)
        self.roots, self.seen = [], {}

    def visit_top(self, value: Any, name: str, depth: int) -> None:
        """Visit one named value under its own order number, never letting it raise."""
        self.order += 1
        try:
            kind = self.kind_of(value)
            if kind != _SKIP:
                self.visit(value, kind, name, depth, self.order)
        except Exception as exc:
            self.error(name, exc)

    def error(self, name: str, exc: BaseException) -> None:
        """Remember that ``name`` could not be examined (as text only)."""
        self.error_count += 1
        if len(self.errors) < 3:
            try:
                text = _clip(str(exc), 80)
            except Exception:  # an exception whose __str__ raises
                text = "?"
            self.errors.append(f"{name}: {type(exc).__name__}: {text}")

    # ------------------------------------------------------------- classify
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

    # ------------------------------------------------------------- visiting
    def visit(self, obj: Any, kind: int, name: str, depth: int, order: int) -> None:
        """Attribute what ``obj`` holds to holder ``name``."""
        if kind == _TENSOR or kind == _PARAM:
            self.held_tensor(obj, kind == _PARAM, name, depth, order)
        elif kind == _MODULE:
            self.module(obj, name, depth, order)
        elif kind == _OPTIM:
            self.optimizer(obj, name, depth, order)
        elif self.only_scalars(obj, kind):
            return
        elif self.seen.get(id(obj), MAX_DEPTH + 1) <= depth:
            return  # already walked at this depth or shallower (also breaks cycles)
        elif depth >= MAX_DEPTH:
            if self.depth_notes:
                self.too_deep += 1
                self.too_deep_name = self.too_deep_name or name
        else:
            self.seen[id(obj)] = depth
            if kind == _DICT:
                self.container(dict.items(obj), True, name, depth, order)
            elif kind == _SEQ:
                self.container(self.seq_iter[type(obj)](obj), False, name, depth, order)
            elif kind == _OBJECT:
                attrs = self.instance_dict(obj)
                if attrs is not None:
                    self.attributes(attrs, name, depth, order)

    def only_scalars(self, obj: Any, kind: int) -> bool:
        """True for a small dict or sequence holding only values of skipped types.

        Most containers in a namespace are like that; testing it in C (``map(type, ...)``
        into ``set.issuperset``) is several times faster than the item loop.
        """
        if kind == _DICT:
            return dict.__len__(obj) <= _SMALL and self.skip_types.issuperset(
                map(type, dict.values(obj)))
        if kind == _SEQ:
            base = self.seq_base[type(obj)]
            return base.__len__(obj) <= _SMALL and self.skip_types.issuperset(
                map(type, base.__iter__(obj)))
        return False

    def container(self, items: Iterator[Any], keyed: bool, name: str, depth: int,
                  order: int) -> None:
        """Visit up to ``MAX_ITEMS`` items of a dict (``keyed``) or sequence one level down."""
        limit = min(MAX_ITEMS, max(0, MAX_VISITS - self.visits))
        kinds = self.kinds
        count = 0
        for item in items:
            if count >= limit:
                self.truncated.append(f"{name} ({count:,} items)")
                break
            count += 1
            value = item[1] if keyed else item
            kind = kinds.get(type(value))
            if kind == _SKIP:
                continue
            if kind is None:
                kind = self.classify(type(value))
                if kind == _SKIP:
                    continue
            label = f"{name}[{_key_repr(item[0]) if keyed else count - 1}]"
            try:
                self.visit(value, kind, label, depth + 1, order)
            except Exception as exc:
                self.error(label, exc)
        self.visits += count

    def attributes(self, attrs: dict, name: str, depth: int, order: int) -> None:
        """Visit the instance attributes of a plain Python object one level down."""
        kinds, classify = self.kinds, self.classify
        count = 0
        for key, value in list(dict.items(attrs)):
            count += 1
            if count > MAX_ITEMS:
                self.truncated.append(f"{name} ({MAX_ITEMS:,} attributes)")
                break
            kind = kinds.get(type(value))
            if kind is None:
                kind = classify(type(value))
            if kind == _SKIP:
                continue
            label = f"{name}.{key}" if type(key) is str else f"{name}.<{type(key).__name__}>"
            try:
                self.visit(value, kind, label, depth + 1, order)
            except Exception as exc:
                self.error(label, exc)
        self.visits += count

    def held_tensor(self, t: Any, is_param: bool, name: str, depth: int, order: int) -> None:
        """A tensor the user holds: its data, its ``.grad``, and its graph as a root."""
        if is_param:
            self.claim(t, _PARAMETERS, 2, depth, order, name)
        else:
            self.claim(t, _OTHER, 0, depth, order, name)
        self.tensor_extras(t, _GRADIENTS, 2, depth, order, name, f"{name} (grad)")

    def tensor_extras(self, t: Any, grad_category: int, priority: int, depth: int, order: int,
                      root_name: str, grad_name: str, weight: int = 0) -> None:
        """Claim ``t.grad`` (leaves and retain_grad only) and queue ``t``'s graph."""
        fn = self.get_grad_fn(t)
        if fn is not None:
            self.roots.append((root_name, order, fn))
            if not self.get_retains_grad(t):
                return
        grad = self.get_grad(t)
        if grad is not None:
            self.claim(grad, grad_category, priority, depth, order, grad_name, weight)

    def module(self, module: Any, name: str, depth: int, order: int) -> None:
        """An ``nn.Module``: parameters and buffers, their grads, and tensor attributes.

        Reads ``_parameters``/``_buffers``/``_modules`` straight from each instance dict, so
        an overridden ``parameters()`` or ``__getattr__`` never runs. When two variables hold
        modules sharing parameters (``model`` and ``head = model.fc``), the larger module gets
        them: deleting ``head`` frees nothing.
        """
        key = id(module)
        if self.seen.get(key, MAX_DEPTH + 1) <= depth:
            return
        self.seen[key] = depth
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
                    tensors.extend(t for t in list(dict.values(slot_dict))
                                   if t is not None and self.is_tensor(t))
            self.module_attributes(attrs, prefix, name, depth, order)
            children = dict.get(attrs, "_modules")
            if not isinstance(children, dict):
                continue
            for child_name, child in list(dict.items(children)):
                if child is None or id(child) in walked or self.kind_of(child) != _MODULE:
                    continue
                if len(walked) >= MAX_ITEMS:
                    self.truncated.append(f"{name} ({MAX_ITEMS:,} submodules)")
                    stack.clear()
                    break
                walked.add(id(child))
                stack.append((f"{prefix}{child_name}.", child))
        weight = -len(tensors)
        grads_name = f"{name} (grads)"
        for t in tensors:
            self.claim(t, _PARAMETERS, 0, depth, order, name, weight)
            self.tensor_extras(t, _GRADIENTS, 0, depth, order, name, grads_name, weight)

    def module_attributes(self, attrs: dict, prefix: str, name: str, depth: int,
                          order: int) -> None:
        """Plain tensor attributes of a module (``self.mask = ...``): other tensors."""
        for key, value in list(dict.items(attrs)):
            kind = self.kind_of(value)
            if kind == _TENSOR or kind == _PARAM:
                self.held_tensor(value, False, f"{name}.{prefix}{key}", depth, order)

    def optimizer(self, opt: Any, name: str, depth: int, order: int) -> None:
        """An optimizer: its ``state`` tensors, and the parameters of its ``param_groups``."""
        attrs = self.instance_dict(opt)
        if attrs is None:
            return
        state = dict.get(attrs, "state")
        if isinstance(state, dict):
            count = 0
            for per_param in list(dict.values(state)):
                count += 1
                if count > MAX_ITEMS * 10:
                    self.truncated.append(f"{name}.state ({MAX_ITEMS * 10:,} parameters)")
                    break
                values = (list(dict.values(per_param)) if isinstance(per_param, dict)
                          else [per_param])
                for value in values:
                    if self.is_tensor(value):
                        self.claim(value, _OPTIMIZER, 0, depth, order, name)
        groups = dict.get(attrs, "param_groups")
        if isinstance(groups, list):
            for group in list(groups):
                params = dict.get(group, "params") if isinstance(group, dict) else None
                if not isinstance(params, list):
                    continue
                for p in list(params):
                    if self.is_tensor(p):
                        self.claim(p, _PARAMETERS, 1, depth, order, f"{name} (params)")
                        self.tensor_extras(p, _GRADIENTS, 1, depth, order, name,
                                           f"{name} (grads)")

    # ------------------------------------------------------------- storages
    def storages(self, t: Any) -> List[Tuple[Tuple[str, int], int, str]]:
        """``[(key, bytes, device name)]`` of the storages behind ``t`` (none if meta/empty)."""
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
        if self.wanted is not None and (dtype != self.wanted[0] or (
                self.wanted[1] is not None and index != self.wanted[1])):
            return _NOTHING
        dev_name = self.dev_names.get((dtype, index))
        if dev_name is None:
            dev_name = dtype if index is None else f"{dtype}:{index}"
            self.dev_names[(dtype, index)] = dev_name
        if dtype == "cuda":
            nbytes = -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
        return (dev_name, ptr), nbytes, dev_name

    def component_storages(self, t: Any) -> List[Tuple[Tuple[str, int], int, str]]:
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
            if entry is not None and entry is not _NOTHING:
                out.append(entry)
        return out

    def wrapper_storages(self, t: Any) -> List[Tuple[Tuple[str, int], int, str]]:
        """Storages of the tensors a wrapper subclass keeps as attributes (``_values``...)."""
        attrs = self.instance_dict(t)
        out: List[Tuple[Tuple[str, int], int, str]] = []
        if attrs is None:
            return out
        for value in list(dict.values(attrs))[:64]:
            if value is not t and self.is_tensor(value):
                try:
                    entry = self.storage_entry(self.untyped_storage(value))
                except Exception:
                    continue  # a wrapper inside a wrapper: rare enough to leave out
                if entry is not None and entry is not _NOTHING:
                    out.append(entry)
        return out

    def claim(self, t: Any, category: int, priority: int, depth: int, order: int,
              name: str, weight: int = 0) -> None:
        """Offer ``t``'s storages to holder ``name``; the best claim per storage wins.

        Claims compare as tuples: category (the precedence), then priority (a module over an
        optimizer's param list over a bare Parameter), then depth (``x`` over ``batch[0]``),
        then weight (the larger module), then namespace order.
        """
        if self.tier == _CACHES:
            category = _CACHES
        claims, sizes = self.claims, self.sizes
        for key, nbytes, dev_name in self.storages(t):
            claim = (category, priority, depth, weight, order, name)
            old = claims.get(key)
            if old is None:
                claims[key] = claim
                sizes[key] = (nbytes, dev_name)
            elif claim < old:
                claims[key] = claim

    # --------------------------------------------------------------- graphs
    def walk_graphs(self, category: int) -> None:
        """Claim what the autograd graphs of ``self.roots`` keep alive.

        Each node records which roots reach it (up to ``_SHARED_NAMES`` of them, then "many"),
        and is re-entered only when that set grows, so a node is visited at most a handful of
        times however many variables share it. A storage saved by several nodes belongs to
        the union of their roots: only deleting all of those variables frees it.
        """
        roots = self.roots
        if not roots:
            return
        # id(node) -> [node, owners, children]; holding the node keeps its id unique.
        nodes: Dict[int, list] = {}
        for index, (_name, _order, fn) in enumerate(roots):
            if not self.spread(fn, index, nodes):
                self.notes.append(f"autograd graphs larger than {MAX_NODES:,} nodes were "
                                  "only partly examined")
                break
        owners_of: Dict[Tuple[str, int], tuple] = {}
        for node, owners, _children in nodes.values():
            try:
                for t in self.saved_tensors(node):
                    for key, nbytes, dev_name in self.storages(t):
                        if key not in self.sizes:
                            self.sizes[key] = (nbytes, dev_name)
                        owners_of[key] = _union(owners_of.get(key), owners)
            except Exception as exc:
                self.error(f"autograd node {type(node).__name__}", exc)
        labels: Dict[tuple, Tuple[int, str]] = {}
        claims = self.claims
        for key, owners in owners_of.items():
            label = labels.get(owners)
            if label is None:
                label = labels[owners] = self.graph_label(owners)
            claim = (category, 0, 0, 0, label[0], label[1])
            old = claims.get(key)
            if old is None or claim < old:
                claims[key] = claim
        nodes.clear()

    def spread(self, fn: Any, index: int, nodes: Dict[int, list]) -> bool:
        """Mark every node reachable from ``fn`` as reached by root ``index``; False if capped."""
        stack = [fn]
        while stack:
            node = stack.pop()
            rec = nodes.get(id(node))
            if rec is None:
                if len(nodes) >= MAX_NODES:
                    return False
                try:
                    children = tuple(nxt for nxt, _ in node.next_functions if nxt is not None)
                except Exception:
                    children = ()
                rec = nodes[id(node)] = [node, (index,), children]
            else:
                owners = rec[1]
                if owners[-1] == _MORE or index in owners:
                    continue
                rec[1] = owners + ((index,) if len(owners) < _SHARED_NAMES else (_MORE,))
            stack.extend(rec[2])
        return True

    def graph_label(self, owners: tuple) -> Tuple[int, str]:
        """(order, name) of the holder row for storages kept alive by the roots ``owners``."""
        names: List[str] = []
        for index in owners:
            if index != _MORE and self.roots[index][0] not in names:
                names.append(self.roots[index][0])
        order = min(self.roots[index][1] for index in owners if index != _MORE)
        if owners[-1] == _MORE:
            names.append("more")
        if len(names) == 1:
            return order, f"{names[0]} (graph)"
        return order, " + ".join(names) + " (shared graph)"

    def saved_tensors(self, node: Any) -> Iterator[Any]:
        """Tensors a graph node keeps alive: saved tensors, a leaf and its grad, ctx tensors."""
        tp = type(node)
        info = self.node_info.get(tp)
        if info is None:
            info = self.node_info[tp] = self.describe_node(tp)
        raw_names, is_accumulate, is_custom = info
        for attr in raw_names:
            try:
                value = getattr(node, attr)
            except Exception:  # after backward the saved tensors are gone: nothing to count
                continue
            if type(value) in (list, tuple):
                for item in value:
                    yield from self.unpack_saved(item, node, attr)
            else:
                yield from self.unpack_saved(value, node, attr)
        if is_accumulate:
            # The leaf an AccumulateGrad node accumulates into lives as long as the graph;
            # parameters are claimed earlier with higher precedence, so only orphans count.
            leaf = getattr(node, "variable", None)
            if leaf is not None and self.is_tensor(leaf):
                yield leaf
                grad = self.get_grad(leaf) if self.get_is_leaf(leaf) else None
                if grad is not None:
                    yield grad
        if is_custom:
            # ``ctx.x = tensor`` in a custom Function keeps ``tensor`` alive with the graph,
            # even after backward.
            attrs = self.instance_dict(node)
            if attrs is not None:
                for value in list(dict.values(attrs)):
                    yield from self.tensors_in(value)

    def describe_node(self, tp: type) -> Tuple[Tuple[str, ...], bool, bool]:
        """``(_raw_saved_* names, is AccumulateGrad, is a custom Function)`` of a node type."""
        try:
            raw = tuple(a for a in dir(tp) if a.startswith("_raw_saved_"))
        except Exception:
            raw = ()
        is_custom = False
        if self.cfunction_type is not None:
            try:
                is_custom = issubclass(tp, self.cfunction_type)
            except Exception:
                pass
        return raw, getattr(tp, "__name__", "") == "AccumulateGrad", is_custom

    def unpack_saved(self, raw: Any, node: Any, attr: str) -> Iterator[Any]:
        """Tensors behind one ``SavedTensor`` without running saved-tensor unpack hooks."""
        if raw is None or type(raw) is not self.saved_tensor_type:
            return
        if self.raw_data:
            try:
                data = raw.data  # the saved tensor, or what a pack hook returned
            except Exception:
                return
            yield from self.tensors_in(data)
            return
        try:  # pragma: no cover - torch without SavedTensor.data
            value = getattr(node, "_saved_" + attr[len("_raw_saved_"):])
        except Exception:
            return
        yield from self.tensors_in(value)  # pragma: no cover

    def tensors_in(self, value: Any) -> Iterator[Any]:
        """``value`` if it is a tensor, or the tensors directly inside a list/tuple/dict."""
        if value is None:
            return
        if self.is_tensor(value):
            yield value
            return
        if type(value) in (list, tuple):
            items = value
        elif type(value) is dict:
            items = list(dict.values(value))
        else:
            return
        for item in items[:MAX_ITEMS]:
            if self.is_tensor(item):
                yield item

    def kind_of(self, value: Any) -> int:
        """How ``value`` is walked, decided by its type (never by ``__class__``)."""
        kind = self.kinds.get(type(value))
        return self.classify(type(value)) if kind is None else kind

    def is_tensor(self, value: Any) -> bool:
        """True for real tensors (by type, never by ``__class__``)."""
        kind = self.kind_of(value)
        return kind == _TENSOR or kind == _PARAM

    # --------------------------------------------------------- IPython caches
    def walk_output_caches(self, numbered: List[str]) -> None:
        """``Out``/``_oh`` entries, then ``_``, ``__``, ``___`` and the ``numbered`` ``_<n>``."""
        ns = self.namespace
        seen_caches = set()
        for cache_name in ("Out", "_oh"):
            cache = dict.get(ns, cache_name)
            if not isinstance(cache, dict) or id(cache) in seen_caches:
                continue
            seen_caches.add(id(cache))
            for key, value in list(dict.items(cache))[-MAX_ITEMS:]:
                self.visit_top(value, f"Out[{_key_repr(key)}]", 0)
        for name in _CACHE_SCALARS:
            if dict.__contains__(ns, name):
                self.visit_top(dict.get(ns, name), name, 0)
        for name in numbered:
            self.visit_top(dict.get(ns, name), name, 0)

    def walk_tracebacks(self) -> None:
        """Locals of the frames of the last exception's traceback (and chained exceptions)."""
        tracebacks = []
        exceptions = [getattr(sys, "last_exc", None), getattr(sys, "last_value", None)]
        last_tb = getattr(sys, "last_traceback", None)
        if isinstance(last_tb, types.TracebackType):
            tracebacks.append(last_tb)
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
        self.depth_notes = False
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
                    self.frame_locals(frame)
                except Exception as exc:
                    self.error(f"traceback frame {frame.f_code.co_name}", exc)

    def frame_locals(self, frame: types.FrameType) -> None:
        """Visit one frame's locals: tensors, modules, optimizers, one level into containers."""
        f_locals = frame.f_locals
        if f_locals is frame.f_globals or f_locals is self.namespace:
            return  # a cell's module-level frame: its "locals" are the user namespace itself
        items = list(dict.items(f_locals)) if isinstance(f_locals, dict) else list(f_locals.items())
        where = f"last traceback: {frame.f_code.co_name}()"
        for name, value in items[:MAX_ITEMS]:
            self.visit_top(value, f"{where} local {name!r}", MAX_DEPTH - 1)

    # --------------------------------------------------------------- report
    def report(self, device_name: Optional[str], allocator_total: Optional[int],
               start: float) -> WhoReport:
        """Resolve the claims into a :class:`WhoReport` of plain values."""
        totals = [0] * len(CATEGORIES)
        by_device: Dict[str, List[int]] = {}
        rows: Dict[Tuple[str, int, str], int] = {}
        sizes = self.sizes
        for key, claim in self.claims.items():
            nbytes, dev_name = sizes[key]
            category = claim[0]
            totals[category] += nbytes
            per_dev = by_device.get(dev_name)
            if per_dev is None:
                per_dev = by_device[dev_name] = [0] * len(CATEGORIES)
            per_dev[category] += nbytes
            row = (claim[5], category, dev_name)
            rows[row] = rows.get(row, 0) + nbytes
        categories: Dict[str, Optional[int]] = dict(zip(CATEGORIES, totals))
        total = sum(totals)
        categories["unattributed"] = (None if allocator_total is None
                                      else int(allocator_total) - total)
        return WhoReport(
            categories=categories,
            holders=tuple(_holder_rows(rows)),
            by_device=None if device_name is not None else {
                dev: dict(zip(CATEGORIES, cats)) for dev, cats in sorted(by_device.items())},
            device=device_name,
            allocator_total=None if allocator_total is None else int(allocator_total),
            tensor_count=len(self.claims),
            elapsed_s=time.perf_counter() - start,
            reason=None,
            notes=tuple(self.finish_notes(allocator_total, total, len(by_device))),
        )

    def finish_notes(self, allocator_total: Optional[int], total: int,
                     devices: int) -> List[str]:
        """The notes of this walk in words."""
        notes = list(self.notes)
        if self.truncated:
            more = f" and {len(self.truncated) - 3} more" if len(self.truncated) > 3 else ""
            notes.append("only the first items of these were examined: "
                         + ", ".join(self.truncated[:3]) + more)
        if self.visits >= MAX_VISITS:
            notes.append(f"stopped looking into containers after {MAX_VISITS:,} items in all")
        if self.too_deep:
            notes.append(f"containers nested deeper than {MAX_DEPTH} levels were not examined "
                         f"({self.too_deep} in all, e.g. {self.too_deep_name})")
        if self.error_count:
            notes.append(f"{self.error_count} object(s) could not be examined: "
                         + "; ".join(self.errors))
        if allocator_total is not None and self.wanted is None and devices > 1:
            notes.append("allocator_total was compared with tensors on every device; pass "
                         "device= to compare it with that device's tensors only")
        if allocator_total is not None and int(allocator_total) < total:
            notes.append("allocator_total is smaller than the attributed bytes (another "
                         "device's total, or taken at another moment?)")
        return notes


def _union(old: Optional[tuple], new: tuple) -> tuple:
    """Union of two owner tuples; past ``_SHARED_NAMES`` owners the tuple ends in ``_MORE``."""
    if old is None or old == new:
        return new
    merged = sorted(set(old) | set(new))
    more = merged[0] == _MORE
    if more:
        del merged[0]
    if more or len(merged) > _SHARED_NAMES:
        return tuple(merged[:_SHARED_NAMES]) + (_MORE,)
    return tuple(merged)


def _holder_rows(rows: Dict[Tuple[str, int, str], int]) -> List[Dict[str, Any]]:
    """Holder dicts, largest first; past ``MAX_HOLDER_ROWS`` the rest are summed per category."""
    ordered = sorted(rows.items(), key=lambda item: (-item[1], item[0][1], item[0][0]))
    out = [{"name": name, "category": CATEGORIES[cat], "bytes": nbytes, "device": dev}
           for (name, cat, dev), nbytes in ordered[:MAX_HOLDER_ROWS]]
    rest: Dict[Tuple[int, str], List[int]] = {}
    for (_name, cat, dev), nbytes in ordered[MAX_HOLDER_ROWS:]:
        acc = rest.setdefault((cat, dev), [0, 0])
        acc[0] += nbytes
        acc[1] += 1
    for (cat, dev), (nbytes, count) in sorted(rest.items(), key=lambda item: -item[1][0]):
        out.append({"name": f"({count} smaller holders)", "category": CATEGORIES[cat],
                    "bytes": nbytes, "device": dev})
    return out


class _NullContext:
    """``contextlib.nullcontext`` without the import."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
