"""The autograd part of ``who()``: what the graphs of the tensors a walk found keep alive (NOTES §7).

A depth-first walk from each root's ``grad_fn`` over ``next_functions`` marks which roots reach
each node (up to a few, then "many"), reads every node's saved tensors without running
saved-tensor unpack hooks (``SavedTensor.data``), the leaf an ``AccumulateGrad`` keeps and a custom
Function's ``ctx`` tensors, and claims each saved storage for the roots that reach it: only
deleting all of them frees it. After ``backward()`` the saved tensors are gone and reading them
raises: that counts as nothing saved.

:class:`GraphWalk` is a part of :class:`~ipy_gpumem.attribution.walk.Walk` and uses the walk's tiers
(``roots``, ``spread``, ``nodes``, ``owners_of``, ``graph_category``), claims, storages, budget and
notes.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

from .claims import GRAPH

__all__ = ["GraphNode", "GraphRoot", "GraphWalk", "MAX_NODES", "MORE"]

MAX_NODES = 1_000_000  # autograd nodes per tier
MAX_ITEMS = 10_000  # tensors in one saved list/tuple/dict
_SHARED_NAMES = 4  # variables named in a shared-graph row before "+ more"
MORE = -1  # last item of an owner tuple: reached from more roots than we name


def _union(old: Optional[tuple], new: tuple) -> tuple:
    """Union of two owner tuples; past ``_SHARED_NAMES`` owners the tuple ends in ``MORE``."""
    if old is None or old == new:
        return new
    merged = sorted(set(old) | set(new))
    more = merged[0] == MORE
    if more:
        del merged[0]
    if more or len(merged) > _SHARED_NAMES:
        return tuple(merged[:_SHARED_NAMES]) + (MORE,)
    return tuple(merged)


class GraphRoot(NamedTuple):
    """A tensor with an autograd graph: its path, its top-level order, and its ``grad_fn``
    (dropped, set to None, when the walk ends)."""

    path: int
    order: int
    fn: Any


class GraphNode:
    """One autograd node reached by the walk: which roots reach it, and what it saves."""

    __slots__ = ("node", "owners", "children", "collected", "saved")

    def __init__(self, node: Any, owners: tuple, children: tuple):
        self.node = node  # held so that id(node) stays unique while the walk runs
        self.owners = owners  # indices into the tier's roots, ending in MORE past _SHARED_NAMES
        self.children = children
        self.collected: Optional[tuple] = None  # the owners when its saved storages were last counted
        self.saved: Optional[List[Tuple[int, int]]] = None  # keys of the storages it saves


class GraphWalk:
    """The graph half of a walk: spread from roots, read what nodes save, claim it for its owners."""

    def graphs(self) -> None:
        """Spread from the graph roots found since the last call, then read what new nodes save."""
        for tier in self.tiers:
            roots = tier.roots
            while tier.spread < len(roots):
                if self.out_of_budget():
                    left = len(roots) - tier.spread
                    self.unexamined.append(f"the autograd graphs of {left:,} tensors (e.g. "
                                           f"{self.label(roots[tier.spread].path)})")
                    tier.spread = len(roots)
                    break
                index = tier.spread
                tier.spread += 1
                if not self.spread(tier, roots[index].fn, index):
                    self.notes.append(f"autograd graphs larger than {MAX_NODES:,} nodes were only partly examined")
                    tier.spread = len(roots)
                    break
            self.collect(tier)

    def spread(self, tier: Any, fn: Any, index: int) -> bool:
        """Mark every node reachable from ``fn`` as reached by root ``index``; False if capped.

        Each node records which roots reach it (up to ``_SHARED_NAMES`` of them, then "many"),
        and is re-entered only when that set grows, so a node is visited at most a handful of
        times however many variables share it.
        """
        nodes = tier.nodes
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
                rec = nodes[id(node)] = GraphNode(node, (index,), children)
            else:
                owners = rec.owners
                if owners[-1] == MORE or index in owners:
                    continue
                rec.owners = owners + ((index,) if len(owners) < _SHARED_NAMES else (MORE,))
            stack.extend(rec.children)
        return True

    def collect(self, tier: Any) -> None:
        """For each node that is new or gained owners: its saved storages belong to the union of their owners.

        A storage saved by several nodes belongs to the union of their roots: only deleting all
        of those variables frees it.
        """
        owners_of, sizes = tier.owners_of, self.sizes
        for count, rec in enumerate(list(tier.nodes.values())):
            owners = rec.owners
            if rec.collected is owners:
                continue
            if not count & 1023 and self.out_of_budget():
                self.unexamined.append("part of the autograd graphs' saved tensors")
                return
            keys = rec.saved
            if keys is None:
                keys = []
                try:
                    for t in self.saved_tensors(rec.node):
                        for key, nbytes, dev in self.storages(t):
                            if key not in sizes:
                                sizes[key] = (nbytes, dev)
                            keys.append(key)
                except Exception as exc:
                    self.errors.append(f"autograd node {type(rec.node).__name__}: {type(exc).__name__}")
                    self.error_count += 1
                rec.saved = keys
            for key in keys:
                owners_of[key] = _union(owners_of.get(key), owners)
            rec.collected = owners

    def claim_graphs(self) -> None:
        """Claim each saved storage for its owners, in the tier's graph category."""
        claims, sizes = self.claims, self.sizes
        for tier in self.tiers:
            roots, category = tier.roots, tier.graph_category
            orders: Dict[tuple, int] = {}
            for key, owners in tier.owners_of.items():
                order = orders.get(owners)
                if order is None:
                    order = orders[owners] = min(roots[i].order for i in owners if i != MORE)
                claim = (category, 0, 0, 0, order, GRAPH, owners) + sizes[key]
                old = claims.get(key)
                if old is None or claim < old:
                    claims[key] = claim

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

