"""The autograd half of a walk: what the graphs of the tensors it found keep alive (NOTES §7).

A depth-first walk from each root's ``grad_fn`` over ``next_functions`` marks which roots reach
each node (up to a few, then "many"), reads what every node keeps alive (:mod:`.saved`: saved
tensors without running unpack hooks, pack-hook payloads, checkpointed inputs, an
``AccumulateGrad``'s leaf, a custom Function's ``ctx`` tensors), and claims each storage for the
roots that reach it: only deleting all of them frees it.

What a storage *is* comes from the tensor, not from the graph that keeps it: an
``AccumulateGrad``'s leaf is a parameter (an ``nn.Parameter``; another leaf is the user's tensor)
and its ``.grad`` a gradient; a saved tensor that is a parameter or a view of one (``weight.t()``)
is a parameter; the rest of what nodes save are activations. So when a graph outlives its model
(``model`` rebound while ``loss`` still holds the last forward's graph), the old model's
parameters and gradients stay parameters and gradients, held by ``loss``. A graph's claim never
takes a storage from a holder of the same tier that is not a graph: a name that holds a tensor
holds it, whatever graph also reaches it.

With ``shared_owners`` off (the census) a node records the first root that reaches it; a later
root that meets it is noted as *joining* that root's graph (the tier's ``joined``), which is
how a census names every variable that keeps a graph alive (``output`` and ``loss``) at no more
cost than one set insertion per meeting.

:class:`GraphWalk` is a part of :class:`~ipy_gpumem.tensors.walk.Walk` and uses the walk's tiers
(``roots``, ``spread``, ``nodes``, ``owners_of``), claims, storages, saved-tensor reader, budget
and notes.
"""
from __future__ import annotations

from itertools import compress
from operator import or_
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from .claims import ACTIVATIONS, GRADIENTS, GRAPH, OTHER, PARAMETERS

__all__ = ["GraphNode", "GraphRoot", "GraphWalk", "MAX_NODES", "MORE", "sharing"]

MAX_NODES = 1_000_000  # autograd nodes per tier
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
    """The graph half of a walk: spread from roots, read what nodes save, claim it for its owners.

    ``shared_owners`` (the walk's): record every root that reaches a node (``who()`` names the
    variables that share a graph); False records the first only, which is all a census needs.
    """

    shared_owners = True
    #: storage key -> the role it plays when only a graph keeps it (absent: activations); set by the walk.
    graph_roles: Dict[Tuple[int, int], int]

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
                if not self.shared_owners:
                    # A census names one owner per storage (the first root that reaches it) and
                    # notes that this root keeps that root's graph alive too.
                    if owners[0] != index:
                        tier.joined.setdefault(index, set()).add(owners[0])
                    continue
                if owners[-1] == MORE or index in owners:
                    continue
                rec.owners = owners + ((index,) if len(owners) < _SHARED_NAMES else (MORE,))
            stack.extend(rec.children)
        return True

    def collect(self, tier: Any) -> None:
        """For each node that is new or gained owners: its saved storages belong to the union of their owners.

        A storage saved by several nodes belongs to the union of their roots: only deleting all
        of those variables frees it. The storages of the new nodes' tensors are read together
        (``Storages.bulk``: C descriptors over the whole list), and node types that keep nothing
        (``TBackward0``, ``ViewBackward0``...) are passed over without reading them.
        """
        owners_of, saved = tier.owners_of, self.saved
        pending = []  # (node record, its tensors) of the nodes read for the first time
        for count, rec in enumerate(list(tier.nodes.values())):
            if rec.collected is rec.owners:
                continue
            if not count & 1023 and self.out_of_budget():
                self.unexamined.append("part of the autograd graphs' saved tensors")
                break
            if rec.saved is None:
                raw_names, is_accumulate, is_custom = saved.describe(type(rec.node))
                if not raw_names and not is_accumulate and not is_custom:
                    rec.saved = []  # a node that keeps nothing alive
                else:
                    try:
                        tensors = list(saved.tensors(rec.node))
                        leaf, grad = saved.leaf(rec.node) if is_accumulate else (None, None)
                        pending.append((rec, tensors, leaf, grad))
                    except Exception as exc:  # noqa: BLE001
                        self.errors.append(f"autograd node {type(rec.node).__name__}: {type(exc).__name__}")
                        self.error_count += 1
                        rec.saved = []
        if pending:
            self._read_saved(pending)
        for rec in list(tier.nodes.values()):
            owners = rec.owners
            if rec.collected is owners or rec.saved is None:
                continue
            for key in rec.saved:
                owners_of[key] = _union(owners_of.get(key), owners)
            rec.collected = owners

    def _read_saved(self, pending: List[Tuple[Any, List[Any], Any, Any]]) -> None:
        """The storage keys of the tensors the pending nodes keep, read in bulk where they are
        plain, and the role of those that are no activation (:attr:`graph_roles`: what a tensor
        is, see the module's docstring)."""
        sizes, store, roles = self.sizes, self.store, self.graph_roles
        parameter = self.types.parameter_type
        flat: List[Any] = []
        special: Dict[int, int] = {}  # position in ``flat`` -> the role of a tensor that is no activation
        for _rec, tensors, leaf, grad in pending:
            flat.extend(tensors)
            if leaf is not None:
                is_param = parameter is not None and issubclass(type(leaf), parameter)
                special[len(flat)] = PARAMETERS if is_param else OTHER  # a user's tensor that requires grad
                flat.append(leaf)
            if grad is not None:
                special[len(flat)] = GRADIENTS
                flat.append(grad)
        for position in self._parameters_among(flat, parameter):
            special.setdefault(position, PARAMETERS)
        entries = store.bulk(flat)
        if entries is None:
            entries = [store.entries(t) for t in flat]
        else:
            entries = [[e] for e in entries]
        position = 0
        for rec, tensors, leaf, grad in pending:
            keys = []
            for _ in range(len(tensors) + (leaf is not None) + (grad is not None)):
                role = special.get(position)
                for key, nbytes, dev in entries[position]:
                    if key not in sizes:
                        sizes[key] = (nbytes, dev)
                    if role is not None and roles.get(key, ACTIVATIONS) > role:
                        roles[key] = role
                    keys.append(key)
                position += 1
            rec.saved = keys

    def _parameters_among(self, tensors: List[Any], parameter: Any) -> List[int]:
        """The positions of the tensors that are a parameter or a view of one (a frozen layer's
        ``weight.t()`` saved for backward), by type: types and ``_base`` read in C over the whole
        list, ``issubclass`` asked once per distinct type."""
        if parameter is None or not tensors:
            return []
        types_ = list(map(type, tensors))
        try:
            base_types = list(map(type, map(self.store.get_base, tensors)))
        except Exception:  # noqa: BLE001 - an odd tensor: its base is not looked at
            base_types = [type(None)] * len(tensors)
        found = {tp for tp in set(types_).union(base_types) if tp is not type(None) and issubclass(tp, parameter)}
        if not found:
            return []
        is_param = found.__contains__
        return list(compress(range(len(tensors)), map(or_, map(is_param, types_), map(is_param, base_types))))

    def claim_graphs(self) -> None:
        """Claim each storage a graph keeps for its owners, in the tier of those owners, in the role
        it plays (:attr:`graph_roles`; activations by default). A storage some other holder of the
        same tier (or a better one) already claimed stays that holder's."""
        claims, sizes, roles = self.claims, self.sizes, self.graph_roles
        for tier in self.tiers:
            roots, level = tier.roots, tier.level
            orders: Dict[tuple, int] = {}
            for key, owners in tier.owners_of.items():
                old = claims.get(key)
                if old is not None and old[0] <= level:
                    continue  # a name (or an earlier tier's graph) holds it: it stays theirs
                order = orders.get(owners)
                if order is None:
                    order = orders[owners] = min(roots[i].order for i in owners if i != MORE)
                claims[key] = (level, roles.get(key, ACTIVATIONS), 0, 0, 0, order, GRAPH, owners) + sizes[key]


def sharing(joined: Dict[int, set], first: int, limit: int = 8) -> List[int]:
    """Root ``first`` and the roots that met its graph (directly, or by meeting the graph of one
    that did), in root order, at most ``limit``: the variables that keep what only ``first``'s
    graph holds alive. ``joined`` is a tier's ``joined`` (root -> the earlier roots
    whose graph it met)."""
    if not joined:
        return [first]
    into: Dict[int, List[int]] = {}
    for later, earlier in joined.items():
        for root in earlier:
            into.setdefault(root, []).append(later)
    seen = {first}
    stack = [first]
    while stack and len(seen) < 4 * limit:
        for other in into.get(stack.pop(), ()):
            if other not in seen:
                seen.add(other)
                stack.append(other)
    return sorted(seen)[:limit]
