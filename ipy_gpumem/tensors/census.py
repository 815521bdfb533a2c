"""A census: every tensor byte the user's objects reach, by role and by owner, from one walk (:mod:`.walk`).

A census is a snapshot of plain numbers: each storage (counted once) has one role, in the one order
of :mod:`.claims` (parameters, gradients, optimizer state, other tensors, activations: MemTracker's
categories, found by reachability at a moment instead of by intercepting every allocation), and
one owner, the top-level name whose holder won the claim (``model``, ``optimizer``, ``losses``,
``Out``, a module of the user's, ``last error: f() local x``). The role is what the storage is and
the owner who keeps it alive, two facts: the parameters and gradients of a model whose name was
rebound, kept by the autograd graph ``loss`` still holds, are parameters and gradients owned by
``loss`` (:attr:`Snapshot.graph_held` says that a graph keeps them, :attr:`Snapshot.graphs` which
names keep that graph). It holds no tensor after :func:`take` returns. When the walk's budget
stops it, ``complete`` is False and ``left_out`` says what it did not examine: its roles are then
"at least" these.
"""
from __future__ import annotations

import time
from typing import Any, Dict, FrozenSet, Iterable, Mapping, NamedTuple, Optional, Set, Tuple

from ..core.roles import clean_table
from .claims import ACTIVATIONS, GRAPH, OPT_PARAMS, ROLE_ORDER
from .graphs import MORE, sharing
from .torch_api import api as torch_api
from .walk import MAX_DEPTH

__all__ = ["Snapshot", "Change", "take", "EMPTY", "BUDGET_S"]

#: Seconds a census may take before it stops and says what it left out. The first census after a
#: very large structure appears (a list of a million ints) proves it holds no tensor, in full;
#: later ones re-check a slice of it (see :mod:`.kinds`), so they cost a few milliseconds.
BUDGET_S = 0.5

Part = Tuple[str, str, str]  # (device, role, owner)


class Snapshot:
    """What a census found: ``parts`` ``{(device, role, owner): bytes}``, per-storage ``keys``
    ``{(device, data pointer): (role, owner, bytes, kept by a graph)}``, ``info`` about owners (a
    module's class and parameter bytes, an optimizer's class and state names), and whether it is
    complete.

    ``graph_held`` is the ``(role, owner)`` pairs, other than activations, that only an autograd
    graph keeps (an old model's parameters and gradients held by ``loss``); ``graphs`` names, for
    each owner of such a pair, every variable that keeps its graph (``{"output": ("output",
    "loss")}``, the owner first).

    ``stopped`` says that a budget stopped it (more time would count more); a census can also be
    incomplete for good (nesting deeper than the walk goes, something it cannot read).
    """

    __slots__ = ("parts", "keys", "info", "complete", "left_out", "elapsed_s", "stopped", "graph_held", "graphs")

    def __init__(self, parts=None, keys=None, info=None, complete=True, left_out=(), elapsed_s=0.0,
                 stopped=False, graph_held=frozenset(), graphs=None):
        self.parts: Dict[Part, int] = parts if parts is not None else {}
        self.keys: Dict[Tuple[str, int], Tuple[str, str, int, bool]] = keys if keys is not None else {}
        self.info: Dict[str, dict] = info if info is not None else {}
        self.complete = complete
        self.left_out: Tuple[str, ...] = tuple(left_out)
        self.elapsed_s = elapsed_s
        self.stopped = stopped
        self.graph_held: FrozenSet[Tuple[str, str]] = frozenset(graph_held)
        self.graphs: Dict[str, Tuple[str, ...]] = graphs if graphs is not None else {}

    @property
    def truncated(self) -> bool:
        return not self.complete

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
        return Change({k: v for k, v in parts.items() if v}, self.complete and before.complete)


EMPTY = Snapshot()


class Change(NamedTuple):
    """A signed change, part by part: ``{(device, role, owner): bytes}``; ``complete`` is False when
    either census stopped early (the change is then what the two counted)."""

    parts: Dict[Part, int]
    complete: bool = True

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
        return Change({k: v for k, v in parts.items() if v}, self.complete and other.complete)

    def owners(self, role: str, device: Optional[str] = None) -> Dict[str, int]:
        """The owners of ``role``'s change (on ``device``), biggest |bytes| first."""
        out: Dict[str, int] = {}
        for (dev, r, owner), value in self.parts.items():
            if r == role and device in (None, dev):
                out[owner] = out.get(owner, 0) + value
        return dict(sorted(out.items(), key=lambda kv: -abs(kv[1])))


def take(names: Optional[Mapping[str, Any]] = None, *, extra: Iterable[Tuple[str, Any]] = (),
         ipython_names: Iterable[str] = (), budget_s: float = BUDGET_S, caches: bool = True,
         user_modules: bool = True) -> Snapshot:
    """Census of what ``names`` (a namespace) and the ``extra`` ``(name, object)`` roots reach.

    Returns an empty snapshot when torch is not imported (nothing can hold a tensor). Never raises:
    a census that fails half-way returns what it counted, marked incomplete.
    """
    api = torch_api()
    if api is None:
        return Snapshot()
    start = time.perf_counter()
    from .walk import Walk  # noqa: PLC0415 - imported on first use: importing the room stays cheap

    try:
        walk = Walk(api, dict(names) if names is not None and not isinstance(names, dict) else names,
                    ipython_names=ipython_names, extra=extra, budget_s=budget_s, start=start, caches=caches,
                    user_modules=user_modules, shared_owners=False)
        walk.run()
    except Exception as exc:  # noqa: BLE001 - an incomplete census is still a census
        return Snapshot(complete=False, left_out=(f"the census failed: {type(exc).__name__}",),
                        elapsed_s=time.perf_counter() - start)
    return snapshot_of(walk, start)


def snapshot_of(walk: Any, start: float) -> Snapshot:
    """The census view of a finished walk."""
    parts: Dict[Part, int] = {}
    keys: Dict[Tuple[str, int], Tuple[str, str, int, bool]] = {}
    owner_of_path: Dict[int, str] = {}
    graph_owner: Dict[tuple, str] = {}
    graph_first: Dict[str, Tuple[int, int]] = {}  # owner of what a graph keeps -> (tier, its first root)
    graph_held: Set[Tuple[str, str]] = set()
    for (_dev_id, ptr), (level, role, _p, _d, _w, _o, relation, ref, nbytes, dev) in walk.claims.items():
        via_graph = relation == GRAPH
        if via_graph:
            owner = graph_owner.get((level, ref))
            if owner is None:
                roots = walk.tiers[level].roots
                first = next((i for i in ref if i != MORE), None)
                owner = graph_owner[(level, ref)] = walk.owner(roots[first].path) if first is not None else "?"
                if first is not None:
                    graph_first.setdefault(owner, (level, first))
        else:
            owner = owner_of_path.get(ref)
            if owner is None:
                owner = owner_of_path[ref] = walk.owner(ref)
            if relation == OPT_PARAMS:  # parameters only an optimizer still reaches (its model's name was rebound)
                owner += "'s parameters"
        label = dev.label
        role_name = ROLE_ORDER[role]
        part = (label, role_name, owner)
        parts[part] = parts.get(part, 0) + nbytes
        keys[(label, ptr)] = (role_name, owner, nbytes, via_graph)
        if via_graph and role != ACTIVATIONS:
            graph_held.add((role_name, owner))
    graphs: Dict[str, Tuple[str, ...]] = {}
    for owner in sorted({o for _r, o in graph_held}):
        found = graph_first.get(owner)
        if found is None:
            continue
        level, first = found
        tier = walk.tiers[level]
        names = [owner]
        for index in sharing(tier.joined, first):
            name = walk.owner(tier.roots[index].path)
            if name not in names:
                names.append(name)
        graphs[owner] = tuple(names)
    left_out = list(walk.unexamined)
    if walk.stopped:
        left_out.insert(0, walk.stopped)
    if walk.too_deep:
        left_out.append(f"{walk.too_deep:,} container(s) nested deeper than {MAX_DEPTH} levels (e.g. "
                        f"{walk.label(walk.too_deep_path)})")
    return Snapshot(parts, keys, walk.info, walk.complete, left_out, time.perf_counter() - start,
                    stopped=walk.stopped is not None, graph_held=frozenset(graph_held), graphs=graphs)
