"""Which layers' activations weigh most: the tensors autograd saved inside each submodule call of one forward.

During one outermost forward with autograd on, the autograd nodes each submodule call creates
are walked from its outputs back to its inputs (``next_functions``), and what they keep alive is
read raw through the tensors room (``tensors.saved``: no unpack hook runs). ``saved_tensors_hooks``
is not used: its docstring says a pack hook returning the tensor itself makes a reference cycle
(a saved output holds its own ``grad_fn``), a detached copy would change how autograd checks
versions, and only the innermost pair of hooks applies, so ours would silently replace a user's.

A saved tensor belongs to the submodule whose call created it: one that is an input of the call
that saved it goes to the call that output it. The root's children are depth 2, theirs depth 3;
a single wrapper (``model.backbone``) is looked inside. ``keep`` holds the nodes seen until the
root's forward ends, so ``id()`` stays unique while they are compared; they are reachable from the
forward's live outputs anyway, and the whole record is dropped at its end.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

from ..tensors.holding import module_parts

__all__ = ["LayerTracker", "TOP_LAYERS", "MAX_LAYER_NODES"]

#: How many layers :meth:`LayerTracker.finish` names.
TOP_LAYERS = 5
#: Autograd nodes walked (a model with more is cut there).
MAX_LAYER_NODES = 100_000


class LayerTracker:
    """The heaviest layers of one forward. ``start(root, inputs)``, ``enter``/``exit`` per submodule
    call, ``finish(outputs)`` -> ``[(qualified name, activation bytes)]``, heaviest first."""

    def __init__(self, walk: Any, root: Any, inputs: list):
        self.walk = walk  # a tensors.walk.Walk: its saved-tensor reader and storage reader
        self.names: Dict[int, str] = {}
        self.root_name = type(root).__name__
        self.exclude = set()
        try:
            # Read from the instance dicts: an overridden named_modules() or parameters() never runs.
            named, params, buffers = module_parts(root)
            self.names = {id(m): name for name, m in named if name}
            self.exclude.update(self._keys(params + buffers))
        except Exception:  # noqa: BLE001
            pass
        self.visited: set = set()
        self.keep: List[Any] = []
        self.stack: List[dict] = []
        self.owner: Dict[Any, str] = {}
        self.sizes: Dict[str, int] = {}
        self.pending: Dict[Any, int] = {}
        self.outs: Dict[Any, str] = {}
        self.parent: Dict[str, str] = {}
        self.budget = MAX_LAYER_NODES
        self.root_stop = self._stop_set(inputs)
        self.root_inputs = self._keys(inputs)

    def _keys(self, tensors) -> set:
        store = self.walk.store
        return {key for t in tensors for key, _n, _d in store.entries(t)}

    def _stop_set(self, tensors) -> set:
        stop = set()
        for t in tensors:
            fn = t.grad_fn
            if fn is not None:
                self.keep.append(fn)
                stop.add(id(fn))
        return stop

    def enter(self, module: Any, inputs: list, depth: int) -> None:
        name = self.names.get(id(module)) or type(module).__name__
        if depth == 3 and self.stack:
            self.parent.setdefault(name, self.stack[-1]["name"])
        self.stack.append({"module": id(module), "name": name, "stop": self._stop_set(inputs),
                           "inputs": self._keys(inputs)})

    def exit(self, module: Any, outputs: list) -> None:
        if not self.stack or self.stack[-1]["module"] != id(module):
            return
        frame = self.stack.pop()
        for key in self._keys(outputs):
            self.outs.setdefault(key, frame["name"])
        for key, nbytes in self._saved(outputs, frame["stop"] | self.root_stop):
            if key in frame["inputs"]:
                self.pending[key] = nbytes  # created before this call: goes to the call that output it
            else:
                self._attribute(key, nbytes, frame["name"])

    def _attribute(self, key, nbytes: int, name: str) -> None:
        if key in self.exclude or key in self.owner:
            return
        self.owner[key] = name
        self.sizes[name] = self.sizes.get(name, 0) + nbytes

    def finish(self, outputs: list) -> List[Tuple[str, int]]:
        own = f"({self.root_name}.forward)"  # ops the root's own forward ran outside any submodule
        for key, nbytes in self._saved(outputs, self.root_stop):
            if key not in self.root_inputs:
                self.pending.setdefault(key, nbytes)
        for key, nbytes in self.pending.items():
            if key in self.root_inputs:
                continue  # the caller's input, saved by the first layer: no layer made it
            self._attribute(key, nbytes, self.outs.get(key, own))
        sizes, parent = self.sizes, self.parent
        self.keep.clear()
        self.walk.store.memo = {}  # it holds the tensors it read
        top: Dict[str, int] = {}
        for name, nbytes in sizes.items():
            top[parent.get(name, name)] = top.get(parent.get(name, name), 0) + nbytes
        total = sum(top.values())
        if len(top) == 1 and total:
            # One submodule holds it all (a wrapper such as ``model.backbone``): name what is inside it.
            only = next(iter(top))
            inner = {name: n for name, n in sizes.items() if parent.get(name) == only}
            if inner:
                inner_total = sum(inner.values())
                if sizes.get(only, 0) or inner_total < total:
                    inner[only] = total - inner_total
                top = inner
        ranked = sorted(((name, n) for name, n in top.items() if n > 0), key=lambda kv: -kv[1])
        return ranked[:TOP_LAYERS]

    def _saved(self, outputs, stop) -> List[Tuple[Any, int]]:
        """``(storage key, bytes)`` of what the nodes new since the last walk keep, from ``outputs``
        back to ``stop`` (the grad_fns of the call's inputs)."""
        visited, keep = self.visited, self.keep
        store, saved = self.walk.store, self.walk.saved
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        found = []
        while stack:
            node = stack.pop()
            if id(node) in visited or id(node) in stop:
                continue
            self.budget -= 1
            if self.budget < 0:
                break
            visited.add(id(node))
            keep.append(node)
            for nxt, _ in node.next_functions:
                if nxt is not None and id(nxt) not in visited and id(nxt) not in stop:
                    stack.append(nxt)
            try:
                for t in saved.tensors(node):
                    found.extend((key, nbytes) for key, nbytes, _dev in store.entries(t))
            except Exception:  # noqa: BLE001 - a node whose saved tensors cannot be read
                continue
        return found
