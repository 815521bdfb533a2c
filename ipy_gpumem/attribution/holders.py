"""Typed facts about who holds memory: a ``Holder`` per row of ``who()``, and which names IPython itself bound.

A holder says *how* it keeps tensors alive as fields (``kind``, ``roots``, ``expr``, ``frame``), so
the diagnosis, ``%gpumem free`` and the leak finder read facts instead of parsing display names;
``Holder.name`` is only for people. Whether a name of the user's namespace is one of IPython's
caches is decided by identity with the object IPython put there (``user_ns_hidden``, the
displayhook's own ``_``/``__``/``___``), never by its spelling: ``x, _ = torch.max(t, 0)`` makes
``_`` the user's variable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Mapping, Optional, Tuple

from ..core.devices import Device

__all__ = ["HOLDER_KINDS", "Holder", "IPythonRefs", "ipython_refs"]

#: How a holder keeps its bytes alive.
HOLDER_KINDS = (
    "variable",          # a tensor the user's code reaches: ``expr`` is ``x``, ``batch[0]``, ``cfg['w']``, ``model.block.mask``
    "grad",              # ``expr``'s ``.grad``
    "module",            # parameters and buffers of the nn.Module at ``expr``
    "module_grads",      # the gradients of those parameters
    "optimizer",         # the state (exp_avg, momentum_buffer...) of the optimizer at ``expr``
    "optimizer_params",  # parameters that only the optimizer's param_groups hold
    "optimizer_grads",   # the gradients of those
    "graph",             # what the autograd graph of ``expr`` keeps alive (``del expr`` frees it)
    "shared_graph",      # kept by the graphs of all of ``roots`` together (freed once all are gone)
    "out_cache",         # IPython's output cache entry ``expr`` (``Out[3]``)
    "underscore",        # IPython's ``_``, ``__``, ``___`` or ``_N`` (``expr``)
    "traceback_local",   # local ``expr`` of function ``frame`` in IPython's last traceback
    "module_global",     # a global of a module the user wrote that no name holds (``helpers.CACHE``), or what
                         # ``weakref.finalize`` keeps for a finalizer (``weakref.finalize._registry[0][2]``)
    "thread_local",      # a local of the user's code another thread is running (``expr`` names the thread)
    "rest",              # ``count`` smaller holders summed into one row
)


# What a holder's name adds to its expression, by kind.
_SUFFIXES = {"grad": " (grad)", "module_grads": " (grads)", "optimizer_grads": " (grads)",
             "optimizer_params": " (params)", "graph": " (graph)"}


@dataclass(frozen=True)
class Holder:
    """The bytes one holder keeps alive in one category on one device.

    Attributes:
        kind: one of :data:`HOLDER_KINDS`.
        category: the ``who()`` category (``parameters``, ``gradients``, ``optimizer_state``,
            ``other_tensors``, ``retained_graphs``, ``ipython_caches``).
        device: where the bytes are.
        bytes: how many (CUDA storages rounded to the allocator's 512-byte blocks).
        roots: the names in the user's namespace whose deletion frees these bytes: ``("batch",)``
            for ``batch[0]``, ``("output", "loss")`` for a shared graph, ``("Out",)`` for
            ``Out[3]``, ``("_5",)``; empty for traceback locals and ``rest``.
        expr: how to reach the holder, as Python (``batch[0]``, ``model``, ``Out[3]``); for a
            traceback local, the local's name (``batch[0]`` for an item of the local ``batch``);
            for a shared graph, the expressions of the variables that share it joined by
            ``" + "`` (for people: ``roots`` is what code reads); empty for ``rest``.
        frame: the function of the frame whose local holds it, for everything a traceback
            local keeps (its data, its module's parameters, its graph); else empty.
        more: a shared graph also kept by more variables than ``roots`` names.
        count: how many holders a ``rest`` row sums.
        keys: the keys of IPython's output cache (the ``N`` of ``Out[N]``) whose entries keep
            these bytes alive: set on ``out_cache`` rows and on the graph rows they keep, so
            ``%gpumem free`` knows which entries to drop without reading ``expr``.
    """

    kind: str
    category: str
    device: Device
    bytes: int
    roots: Tuple[str, ...] = ()
    expr: str = ""
    frame: str = ""
    more: bool = False
    count: int = 0
    keys: Tuple[Any, ...] = ()

    @property
    def name(self) -> str:
        """How the holder reads in a table (for people; code reads the fields)."""
        kind = self.kind
        if kind == "rest":
            return f"({self.count} smaller holders)"
        if kind == "shared_graph":
            shared = self.expr or " + ".join(self.roots)
            return shared + (" + more" if self.more else "") + " (shared graph)"
        base = f"last traceback: {self.frame}() local {self.expr!r}" if self.frame else self.expr
        return base + _SUFFIXES.get(kind, "")

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready: ``name``, ``category``, ``bytes``, ``device`` (a label) and the typed fields."""
        out: Dict[str, Any] = {"name": self.name, "category": self.category, "bytes": self.bytes,
                               "device": self.device.label, "kind": self.kind, "roots": list(self.roots),
                               "expr": self.expr}
        if self.frame:
            out["frame"] = self.frame
        if self.more:
            out["more"] = True
        if self.count:
            out["count"] = self.count
        if self.keys:
            out["keys"] = [k if type(k) in (int, str) else f"<{type(k).__name__}>" for k in self.keys]  # no user __repr__
        return out


@dataclass(frozen=True)
class IPythonRefs:
    """The names of a namespace that IPython itself bound, with the value it bound (by identity).

    ``who()`` counts what these names hold as IPython's caches and ``%gpumem free`` may clear
    them; every other name, whatever its spelling, is the user's and is never touched.
    """

    names: FrozenSet[str] = frozenset()

    def owns(self, name: str) -> bool:
        return name in self.names


_UNDERSCORES = ("_", "__", "___")
_MISSING = object()


def ipython_refs(namespace: Mapping[str, Any], hidden: Optional[Mapping[str, Any]] = None,
                 displayhook: Any = None) -> IPythonRefs:
    """Which names of ``namespace`` still hold what IPython put there.

    Args:
        namespace: the user's namespace (``shell.user_ns``).
        hidden: ``shell.user_ns_hidden``: every name IPython pushed itself (``In``, ``Out``,
            ``_oh``, ``_ih``, ``_i3``, ``_5``, ``exit``, ...) with the value it pushed.
        displayhook: ``shell.displayhook``, whose own ``_``, ``__`` and ``___`` are what IPython
            compares before overwriting them (IPython only overwrites ``_`` when it set it).
    """
    names = set()
    for name, value in list((hidden or {}).items()):
        if type(name) is str and namespace.get(name, _MISSING) is value:
            names.add(name)
    if displayhook is not None:
        for name in _UNDERSCORES:
            value = getattr(displayhook, name, _MISSING)
            if value is not _MISSING and namespace.get(name, _MISSING) is value:
                names.add(name)
            elif name in names and namespace.get(name, _MISSING) is not value:
                names.discard(name)  # the user rebound it since IPython last set it
    return IPythonRefs(frozenset(names))
