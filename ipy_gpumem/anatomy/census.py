"""Count every tensor byte the user's objects reach, by role and by owner, exactly and fast enough to run at each line.

A census is a snapshot: each tensor storage reached (counted once, by its data pointer and device,
however many views share it) gets one role and one owner, the first that claims it in this order:

1. ``parameters``: parameters and buffers of the modules found (and the parameters an optimizer
   holds when its model has no name any more);
2. ``gradients``: their ``.grad`` (and the ``.grad`` of other leaf tensors found);
3. ``optimizer_state``: the tensors in an optimizer's ``state`` (Adam's ``exp_avg``, ...);
4. ``other_tensors``: tensors a name (or a list, tuple, dict or set under a name) holds directly:
   inputs, outputs, the loss, a list of losses;
5. ``activations``: tensors autograd saved for backward in the graphs of the tensors found, not
   already counted above (so an op's output that the user holds is ``other_tensors``, and an input
   saved by the first layer but still named is not an activation: backward would not free it).

These are MemTracker's categories (``torch.distributed._tools.mem_tracker``: PARAM, BUFFER, GRAD,
ACT, OPT, ...), found by reachability at a moment instead of by intercepting every allocation:
a ``TorchDispatchMode`` around the cell would tax every operator of a training step, while a census
costs tens of microseconds for a model of a few layers. Saved tensors are read the way ``who()``
reads them (``_raw_saved_*`` and ``SavedTensor.data``), so no saved-tensor unpack hook runs, and
gradient checkpointing's placeholders count as what they are (nothing). No tensor outlives
:func:`take`: a snapshot keeps only integers and names.
"""
from __future__ import annotations

import sys
from typing import Any, Dict, Iterable, Mapping, NamedTuple, Optional, Tuple

from ..core.roles import clean_table

__all__ = ["Snapshot", "Change", "take", "EMPTY"]

#: Tensors looked at inside one container (a list of a million floats is not scanned).
MAX_ITEMS = 4096
#: Autograd nodes visited per census (a graph kept across thousands of iterations is cut there).
MAX_NODES = 200_000

Part = Tuple[str, str, str]  # (device, role, owner)

# IPython's own names in a user namespace (counted after the user's names).
_IPYTHON_NAMES = frozenset({"In", "Out", "exit", "quit", "get_ipython"})


class Snapshot:
    """What a census found: ``parts`` ``{(device, role, owner): bytes}``, per-storage ``keys``, and
    ``info`` about owners (an optimizer's class and state names, a module's parameter bytes)."""

    __slots__ = ("parts", "keys", "info", "truncated")

    def __init__(self, parts=None, keys=None, info=None, truncated=False):
        self.parts: Dict[Part, int] = parts if parts is not None else {}
        self.keys: Dict[Tuple[int, str], Tuple[str, str, int]] = keys if keys is not None else {}
        self.info: Dict[str, dict] = info if info is not None else {}
        self.truncated = truncated

    @property
    def totals(self) -> Dict[str, Dict[str, int]]:
        """The role table: ``{device: {role: bytes}}``."""
        out: Dict[str, Dict[str, int]] = {}
        for (device, role, _owner), nbytes in self.parts.items():
            row = out.setdefault(device, {})
            row[role] = row.get(role, 0) + nbytes
        return clean_table(out)

    def role_bytes(self, role: str, owner: Optional[str] = None, device: Optional[str] = None) -> int:
        return sum(v for (dev, r, o), v in self.parts.items()
                   if r == role and owner in (None, o) and device in (None, dev))

    def diff(self, before: "Snapshot") -> "Change":
        """What changed from ``before`` to this snapshot, part by part."""
        parts = dict(self.parts)
        for key, value in before.parts.items():
            parts[key] = parts.get(key, 0) - value
        return Change({k: v for k, v in parts.items() if v})


EMPTY = Snapshot()


class Change(NamedTuple):
    """A signed change, part by part: ``{(device, role, owner): bytes}``."""

    parts: Dict[Part, int]

    @property
    def table(self) -> Dict[str, Dict[str, int]]:
        out: Dict[str, Dict[str, int]] = {}
        for (device, role, _owner), nbytes in self.parts.items():
            row = out.setdefault(device, {})
            row[role] = row.get(role, 0) + nbytes
        return clean_table(out)

    def add(self, other: "Change") -> "Change":
        parts = dict(self.parts)
        for key, value in other.parts.items():
            parts[key] = parts.get(key, 0) + value
        return Change({k: v for k, v in parts.items() if v})

    def owners(self, role: str, device: Optional[str] = None) -> Dict[str, int]:
        """The owners of ``role``'s change (on ``device``), biggest |bytes| first."""
        out: Dict[str, int] = {}
        for (dev, r, owner), value in self.parts.items():
            if r == role and device in (None, dev):
                out[owner] = out.get(owner, 0) + value
        return dict(sorted(out.items(), key=lambda kv: -abs(kv[1])))


_LABELS: Dict[Any, str] = {}  # torch.device -> "cpu", "cuda:0"
_KINDS: Dict[type, Optional[str]] = {}  # type -> "tensor" | "module" | "optim" | "seq" | "map" | None


def _kind(tp: type, torch) -> Optional[str]:
    kind = _KINDS.get(tp, 0)
    if kind != 0:
        return kind
    kind = None
    if issubclass(tp, torch.Tensor):
        kind = "tensor"
    elif issubclass(tp, torch.nn.Module):
        kind = "module"
    elif issubclass(tp, torch.optim.Optimizer):
        kind = "optim"
    elif issubclass(tp, (list, tuple, set, frozenset)):
        kind = "seq"
    elif issubclass(tp, dict):
        kind = "map"
    _KINDS[tp] = kind
    return kind


_RAW_NAMES: Dict[type, tuple] = {}


def raw_saved_names(tp: type) -> tuple:
    """The ``_raw_saved_*`` attributes of an autograd node type (read without unpack hooks), cached."""
    names = _RAW_NAMES.get(tp)
    if names is None:
        try:
            names = tuple(a for a in dir(tp) if a.startswith("_raw_saved_"))
        except Exception:  # noqa: BLE001
            names = ()
        _RAW_NAMES[tp] = names
    return names


def saved_tensor_type(torch):
    """The class of what ``_raw_saved_*`` returns (``torch._C._autograd.SavedTensor``), or None."""
    return getattr(torch._C, "_SavedTensor", None) or getattr(getattr(torch._C, "_autograd", None), "SavedTensor", None)


class _Census:
    __slots__ = ("torch", "snap", "parts", "keys", "graph_roots", "visited", "params", "param_ids")

    def __init__(self, torch):
        self.torch = torch
        self.snap = Snapshot()
        self.parts = self.snap.parts
        self.keys = self.snap.keys
        self.graph_roots = []  # (owner, grad_fn)
        self.visited = set()
        self.params = []  # (owner, parameter)
        self.param_ids = set()

    def count(self, t, role: str, owner: str) -> bool:
        """Count ``t``'s storage for ``role``/``owner`` unless already counted; True if new."""
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            nbytes = st.nbytes()
            device = t.device
        except Exception:  # noqa: BLE001 - sparse, meta or fake tensors have no storage to count
            return False
        dev = _LABELS.get(device)
        if dev is None:
            dev = _LABELS[device] = "cpu" if device.type == "cpu" else str(device)
        key = (ptr, dev)
        if key in self.keys or (ptr == 0 and nbytes == 0):
            return False
        self.keys[key] = (role, owner, nbytes)
        part = (dev, role, owner)
        self.parts[part] = self.parts.get(part, 0) + nbytes
        return True

    def module(self, owner: str, module) -> None:
        info = self.snap.info.setdefault(owner, {"kind": "module", "class": type(module).__name__, "parameters": 0})
        try:
            for p in module.parameters():
                if self.count(p, "parameters", owner):
                    info["parameters"] += _nbytes(p)
                self.params.append((owner, p))
                self.param_ids.add(id(p))
            for b in module.buffers():
                self.count(b, "parameters", owner)
        except Exception:  # noqa: BLE001 - a module with a broken parameters() is skipped
            pass

    def optimizer_params(self, owner: str, opt) -> None:
        info = self.snap.info.setdefault(owner, {"kind": "optimizer", "class": type(opt).__name__, "state": [],
                                                 "parameters": 0})
        try:
            groups = opt.param_groups
        except Exception:  # noqa: BLE001
            return
        counted = self.param_ids
        for group in groups:
            for p in group.get("params", ()):
                info["parameters"] += p.nelement() * p.element_size()
                if id(p) not in counted:
                    # Parameters only an optimizer still reaches (its model's name was rebound).
                    self.count(p, "parameters", f"{owner}'s parameters")
                    self.params.append((owner, p))

    def gradients(self) -> None:
        seen = set()
        for owner, p in self.params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            g = p.grad
            if g is not None:
                self.count(g, "gradients", owner)

    def optimizer_state(self, owner: str, opt) -> None:
        info = self.snap.info.setdefault(owner, {"kind": "optimizer", "class": type(opt).__name__, "state": [],
                                                 "parameters": 0})
        names = set()
        try:
            states = list(opt.state.values())
        except Exception:  # noqa: BLE001
            return
        tensor = self.torch.Tensor
        for state in states:
            if not isinstance(state, dict):
                continue
            for key, value in state.items():
                if isinstance(value, tensor):
                    self.count(value, "optimizer_state", owner)
                    names.add(key)
        info["state"] = sorted(names, key=str)

    def tensor(self, owner: str, t) -> None:
        self.count(t, "other_tensors", owner)
        try:
            fn = t.grad_fn
            if fn is not None:
                self.graph_roots.append((owner, fn))
            elif t.requires_grad:
                g = t.grad
                if g is not None:
                    self.count(g, "gradients", owner)
        except Exception:  # noqa: BLE001
            pass

    def graphs(self) -> None:
        visited = self.visited
        saved_type = saved_tensor_type(self.torch)
        tensor = self.torch.Tensor
        budget = MAX_NODES
        for owner, fn in self.graph_roots:
            stack = [fn]
            while stack:
                node = stack.pop()
                if id(node) in visited:
                    continue
                visited.add(id(node))
                budget -= 1
                if budget <= 0:
                    self.snap.truncated = True
                    return
                try:
                    nexts = node.next_functions
                except Exception:  # noqa: BLE001
                    nexts = ()
                for nxt, _ in nexts:
                    if nxt is not None and id(nxt) not in visited:
                        stack.append(nxt)
                for attr in raw_saved_names(type(node)):
                    try:
                        raw = getattr(node, attr)
                    except Exception:  # noqa: BLE001 - released by backward: nothing saved
                        continue
                    items = raw if type(raw) in (list, tuple) else (raw,)
                    for item in items:
                        if item is None or (saved_type is not None and type(item) is not saved_type):
                            continue
                        try:
                            data = item.data
                        except Exception:  # noqa: BLE001 - released
                            continue
                        if isinstance(data, tensor):
                            self.count(data, "activations", owner)
        self.graph_roots = []


def _nbytes(t) -> int:
    try:
        return t.untyped_storage().nbytes()
    except Exception:  # noqa: BLE001
        return 0


def take(names: Optional[Mapping[str, Any]] = None, *, modules: Iterable = (), optimizers: Iterable = (),
         tensors: Iterable = (), skip: Optional[Iterable[str]] = None) -> Snapshot:
    """Census of what ``names`` (a namespace) and the extra ``(name, object)`` pairs reach.

    Returns an empty snapshot when torch is not imported (nothing can hold a tensor). Never raises:
    a census that fails half-way returns what it counted, marked ``truncated``.
    """
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "Tensor"):
        return Snapshot()
    census = _Census(torch)
    try:
        _run(census, torch, names, modules, optimizers, tensors, set(skip or ()))
    except Exception:  # noqa: BLE001 - an incomplete census is still a census
        census.snap.truncated = True
    return census.snap


def _run(census: _Census, torch, names, modules, optimizers, tensors, skip) -> None:
    found_modules, found_optims, found_tensors, containers = [], [], [], []
    for owner, value in modules:
        found_modules.append((owner, value))
    for owner, value in optimizers:
        found_optims.append((owner, value))
    for owner, value in tensors:
        found_tensors.append((owner, value))
    if names:
        kinds = _KINDS
        user, late = [], []
        # One dict lookup per value: most of a namespace is ints, strings and functions.
        for owner, value in list(names.items()):
            kind = kinds.get(type(value), 0)
            if kind is None:
                continue
            if kind == 0:
                kind = _kind(type(value), torch)
                if kind is None:
                    continue
            # The user's own names first, IPython's caches (Out, _, _5) last: a tensor both
            # ``output`` and ``Out[7]`` hold belongs to ``output``.
            (late if owner[:1] == "_" or owner in _IPYTHON_NAMES else user).append((owner, value, kind))
        for owner, value, kind in user + late:
            if owner in skip:
                continue
            if kind == "tensor":
                found_tensors.append((owner, value))
            elif kind == "module":
                found_modules.append((owner, value))
            elif kind == "optim":
                found_optims.append((owner, value))
            elif value:
                containers.append((owner, value))
    for owner, value in containers:
        _container(owner, value, torch, found_modules, found_optims, found_tensors, 2)
    for owner, module in found_modules:
        census.module(owner, module)
    for owner, opt in found_optims:
        census.optimizer_params(owner, opt)
    census.gradients()
    for owner, opt in found_optims:
        census.optimizer_state(owner, opt)
    for owner, t in found_tensors:
        census.tensor(owner, t)
    census.graphs()


def _container(owner, value, torch, modules, optims, tensors, depth) -> None:
    """Tensors, modules and optimizers directly inside a list/tuple/set/dict (``depth`` levels)."""
    try:
        items = value.values() if isinstance(value, dict) else value
        for count, item in enumerate(items):
            if count >= MAX_ITEMS:
                return
            kind = _kind(type(item), torch)
            if kind is None:
                continue
            if kind == "tensor":
                tensors.append((owner, item))
            elif kind == "module":
                modules.append((owner, item))
            elif kind == "optim":
                optims.append((owner, item))
            elif depth > 1 and item:
                _container(owner, item, torch, modules, optims, tensors, depth - 1)
    except Exception:  # noqa: BLE001 - a container that changes size while read, a custom mapping
        return

