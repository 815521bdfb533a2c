"""What an autograd node keeps alive, read without running anything: saved tensors, pack-hook payloads, checkpointed inputs, a leaf, a custom Function's ctx.

Four ways a graph keeps memory, each read raw (no saved-tensor unpack hook runs, so no
checkpointed region is recomputed and no CPU-offloaded tensor is copied back):

* **Saved tensors.** Each node's ``_raw_saved_*`` attributes are ``SavedTensor`` objects; their
  ``data`` is the tensor autograd saved, or, when a ``saved_tensors_hooks`` pack hook ran, what
  the pack hook returned (``save_on_cpu``'s ``(device, cpu tensor)``; a checkpoint placeholder,
  which holds nothing). The tensors inside a payload are counted.
* **Unpack hooks' closures.** A pack hook may keep memory elsewhere and hand back a placeholder:
  non-reentrant ``torch.utils.checkpoint`` keeps the region's inputs in a frame that only its
  unpack hook's closure reaches (``SavedTensor.unpack_hook.__closure__`` -> ``_CheckpointFrame``
  -> ``saved_args``). The closure's objects are read one attribute level deep, each frame once.
  (Reentrant checkpointing is a custom Function that saves its inputs as ordinary saved tensors.)
* **AccumulateGrad** keeps its leaf (and the leaf's ``.grad``) alive as long as the graph. That
  leaf is a parameter (or another tensor autograd accumulates into), never an activation, so it
  is read apart (:meth:`SavedReader.leaf`): a graph that outlives its model keeps the model's
  parameters and gradients, and they stay parameters and gradients.
* **Custom Functions** keep whatever their ``ctx`` was given as an attribute (``ctx.x = t``),
  even after backward.

After ``backward()`` the saved tensors are released and reading them raises: that is nothing saved.
"""
from __future__ import annotations

import types
import weakref
from typing import Any, Iterator, Tuple

__all__ = ["SavedReader", "MAX_ITEMS"]

#: Tensors read from one saved list, tuple, dict or payload.
MAX_ITEMS = 10_000
#: Objects examined in one unpack hook's closure.
_MAX_CLOSURE = 64
# Autograd node type -> (its _raw_saved_* names, AccumulateGrad?, a custom Function's?), for every
# count (``dir()`` of a node type is the costly part); weak keys: a custom Function's node class
# is never kept alive by it.
_NODE_INFO: "weakref.WeakKeyDictionary[type, Tuple[Tuple[str, ...], bool, bool]]" = weakref.WeakKeyDictionary()


class SavedReader:
    """Reads what autograd nodes keep alive, for one count. ``is_tensor(x)`` tells real tensors
    apart by type; ``instance_dict(x)`` reads ``x.__dict__`` through its C descriptor."""

    def __init__(self, api: Any, is_tensor, instance_dict):
        self.api = api
        self.is_tensor = is_tensor
        self.instance_dict = instance_dict
        self.saved_type = api.saved_tensor
        self.raw_data = api.saved_has_data
        self.hooks_readable = api.saved_has_unpack_hook
        self.cfunction = api.backward_cfunction
        self.grad_of = api.tensor_base.grad.__get__
        self.node_info = _NODE_INFO  # shared by every count: node types are few and live long
        self.closures_seen: set = set()  # ids of objects an unpack hook's closure led to (a frame once)

    def describe(self, tp: type) -> Tuple[Tuple[str, ...], bool, bool]:
        """``(_raw_saved_* names, is AccumulateGrad, is a custom Function)`` of a node type, cached."""
        info = self.node_info.get(tp)
        if info is None:
            is_custom = False
            if self.cfunction is not None:
                try:
                    is_custom = issubclass(tp, self.cfunction)
                except Exception:  # noqa: BLE001
                    pass
            info = self.node_info[tp] = (self.api.raw_saved_names(tp), getattr(tp, "__name__", "") == "AccumulateGrad",
                                         is_custom)
        return info

    def leaf(self, node: Any) -> Tuple[Any, Any]:
        """``(leaf, leaf.grad)`` that an ``AccumulateGrad`` node keeps alive as long as its graph
        (either may be None); ``(None, None)`` for any other node."""
        if not self.describe(type(node))[1]:
            return None, None
        leaf = getattr(node, "variable", None)
        if leaf is None or not self.is_tensor(leaf):
            return None, None
        return leaf, self.grad_of(leaf)

    def tensors(self, node: Any) -> Iterator[Any]:
        """Every tensor ``node`` keeps for backward: saved tensors, pack-hook payloads, a custom
        Function's ``ctx`` tensors (may repeat one; the caller counts storages once). An
        ``AccumulateGrad``'s leaf is not among them: see :meth:`leaf`."""
        raw_names, _is_accumulate, is_custom = self.describe(type(node))
        for attr in raw_names:
            try:
                value = getattr(node, attr)
            except Exception:  # noqa: BLE001 - released by backward: nothing saved
                continue
            if type(value) in (list, tuple):
                for item in value[:MAX_ITEMS]:
                    yield from self.saved(item, node, attr)
            else:
                yield from self.saved(value, node, attr)
        if is_custom:
            # ``ctx.x = tensor`` in a custom Function keeps ``tensor`` alive with the graph.
            attrs = self.instance_dict(node)
            if attrs is not None:
                for value in list(attrs.values())[:MAX_ITEMS]:
                    yield from self.within(value, 2)

    def saved(self, raw: Any, node: Any = None, attr: str = "") -> Iterator[Any]:
        """The tensors behind one ``SavedTensor``: its data or pack payload, and its unpack hook's closure."""
        if raw is None or type(raw) is not self.saved_type:
            return
        if not self.raw_data:  # pragma: no cover - torch without SavedTensor.data: unpacks (runs hooks)
            try:
                value = getattr(node, "_saved_" + attr[len("_raw_saved_"):])
            except Exception:  # noqa: BLE001
                return
            yield from self.within(value, 1)
            return
        try:
            data = raw.data  # the saved tensor, or what a pack hook returned
        except Exception:  # noqa: BLE001 - released
            return
        if self.is_tensor(data):
            yield data
            return
        yield from self.within(data, 2)
        if self.hooks_readable:
            yield from self.closure(raw)

    def closure(self, raw: Any) -> Iterator[Any]:
        """Tensors an unpack hook's closure reaches, one attribute level deep (a checkpoint frame's inputs)."""
        try:
            hook = raw.unpack_hook
        except Exception:  # noqa: BLE001
            return
        cells = getattr(hook, "__closure__", None) if isinstance(hook, types.FunctionType) else None
        if not cells:
            return
        for cell in cells[:_MAX_CLOSURE]:
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if value is None or id(value) in self.closures_seen or isinstance(value, types.FunctionType):
                continue
            self.closures_seen.add(id(value))
            attrs = self.instance_dict(value)
            if attrs is None:
                yield from self.within(value, 2)
                continue
            for item in list(attrs.values())[:_MAX_CLOSURE]:
                yield from self.within(item, 2)

    def within(self, value: Any, levels: int) -> Iterator[Any]:
        """``value`` if it is a tensor; tensors (and SavedTensors' data) inside lists, tuples and dicts ``levels`` deep."""
        if value is None:
            return
        if self.is_tensor(value):
            yield value
            return
        if type(value) is self.saved_type:
            yield from self.saved(value)
            return
        if levels <= 0:
            return
        if type(value) in (list, tuple):
            items = value[:MAX_ITEMS]
        elif type(value) is dict:
            items = list(dict.values(value))[:MAX_ITEMS]
        else:
            return
        for item in items:
            yield from self.within(item, levels - 1)
