"""What a line or a cell's change is made of, as data: the census's change with what its owners are and what held memory before.

:func:`why_of` turns a census change (``{(device, role, owner): bytes}``) and the snapshots around
it into a :class:`~ipy_gpumem.core.why.Why`: the parts, the owners' info (a module's class and
parameter bytes, an optimizer's class and state names, and what a rebound name held before), the
``(role, owner)`` pairs that held memory before, the storages that only changed owner (the old
model's parameters now kept by the graph ``loss`` holds), what only a graph keeps, the
temporaries and the GPU-only roles, and whether both counts were complete. Only what explains
the parts is kept (a record must stay small). The sentence is made from it by the views
(``ipy_gpumem.display.words``), never here.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

from ..core.why import Imports, Moved, OwnerInfo, Why, owner_module

__all__ = ["why_of"]

#: Roles whose storages are followed from a name to a graph (what a model or an optimizer is made of).
_FOLLOWED = ("parameters", "gradients", "optimizer_state")


def _owner_info(data: Mapping) -> Optional[OwnerInfo]:
    kind = data.get("kind")
    if kind not in ("module", "optimizer"):
        return None
    return OwnerInfo(kind, data.get("class"), int(data.get("parameters") or 0), tuple(data.get("state") or ()))


def _infos(snap, names) -> Dict[str, OwnerInfo]:
    out = {}
    for name, data in (getattr(snap, "info", None) or {}).items():
        if name in names:
            owner = _owner_info(data)
            if owner is not None:
                out[name] = owner
    return out


def _moved(parts: Mapping[Tuple[str, str, str], int], before, after) -> Tuple[Moved, ...]:
    """Storages alive in both censuses that kept their role (one of :data:`_FOLLOWED`) and size and
    went from a name to an autograd graph: a model rebound (or deleted) whose parameters and
    gradients the graph of its last forward keeps. Only moves into a graph are followed: a storage
    is known by its address, which a caching allocator hands out again at once, so a name-to-name
    "move" could as well be a free and an allocation of the same size.

    Costs one pass over ``before``'s storages, and only when some owner lost bytes of a role that
    a graph's owner gained."""
    old_keys, new_keys = getattr(before, "keys", None), getattr(after, "keys", None)
    held = getattr(after, "graph_held", None)
    if not old_keys or not new_keys or not held:
        return ()
    losing = {(role, owner) for (_d, role, owner), v in parts.items() if v < 0 and role in _FOLLOWED}
    gaining = {(role, owner) for (_d, role, owner), v in parts.items() if v > 0 and (role, owner) in held}
    if not any(r == r2 and o != o2 for r, o in losing for r2, o2 in gaining):
        return ()
    moves: Dict[Tuple[str, str, str], int] = {}
    for key, old in old_keys.items():
        if (old[0], old[1]) not in losing:
            continue
        new = new_keys.get(key)
        if new is None or new[1] == old[1] or new[0] != old[0] or new[2] != old[2] or (new[0], new[1]) not in gaining \
                or not (len(new) > 3 and new[3]):
            continue
        move = (old[0], old[1], new[1])
        moves[move] = moves.get(move, 0) + new[2]
    if not moves:
        return ()
    still = {owner for (_d, _r, owner), v in (getattr(after, "parts", None) or {}).items() if v > 0}
    out = [Moved(role, source, holder, nbytes, source in still) for (role, source, holder), nbytes in moves.items()]
    out.sort(key=lambda m: (-m.bytes, m.role, m.source, m.holder))
    return tuple(out)


def why_of(parts: Mapping[Tuple[str, str, str], int], before=None, after=None, *, seen=None,
           temporaries: Optional[int] = None, extra: Optional[Mapping[str, int]] = None,
           whole_cell: bool = False, imports: Optional[Imports] = None) -> Why:
    """The data of one change.

    Args:
        parts: the change, ``{(device, role, owner): signed bytes}``.
        before, after: the census snapshots around it (their ``info`` names an optimizer's class and
            state, a module's parameter bytes; ``keys`` follow each storage from owner to owner;
            ``graph_held``/``graphs`` say what only a graph keeps and through which names;
            ``complete``/``left_out`` say what they counted); either may be None.
        seen: ``(role, owner)`` pairs that held memory before the change; None: what ``before``
            held.
        temporaries: bytes that came and went within the span (its peak above its start and end).
        extra: GPU-only roles (``allocator_cache``, ``outside_pytorch``) and unnamed tensors
            (``other_tensors``), signed bytes summed over devices.
        whole_cell: the change is a whole cell's (see :class:`~ipy_gpumem.core.why.Why`).
        imports: the modules the cell imported, if any.
    """
    items = tuple(sorted(((dev, role, owner, int(v)) for (dev, role, owner), v in parts.items() if v),
                         key=lambda p: (-abs(p[3]), p[:3])))
    owners = {owner for _d, _r, owner, _v in items}
    names = {owner_module(o) for o in owners}
    info = _infos(before, names)
    info.update(_infos(after, names))  # the later snapshot knows the optimizer's state names
    earlier = {name: data for name, data in _infos(before, names).items()
               if info.get(name) is not None and (data.kind, data.cls) != (info[name].kind, info[name].cls)}
    if seen is None:
        seen = {(role, owner) for (_d, role, owner), v in (getattr(before, "parts", None) or {}).items() if v > 0}
    kept_seen = frozenset((role, owner) for role, owner in seen if owner in owners)
    complete = all(getattr(snap, "complete", True) for snap in (before, after))
    left_out = []
    for snap in (before, after):
        for note in getattr(snap, "left_out", ()) or ():
            if note not in left_out:
                left_out.append(note)
    graph_held = frozenset(pair for snap in (before, after) for pair in (getattr(snap, "graph_held", None) or ())
                           if pair[1] in owners)
    graphs: Dict[str, Tuple[str, ...]] = {}
    for snap in (after, before):  # the names that keep a graph now, else those that kept it
        for owner, held_by in (getattr(snap, "graphs", None) or {}).items():
            if owner in owners and owner not in graphs:
                graphs[owner] = tuple(held_by)
    return Why(items, info, kept_seen, temporaries or None,
               {role: int(v) for role, v in (extra or {}).items() if v}, complete, tuple(left_out),
               moved=_moved(parts, before, after), graph_held=graph_held, graphs=graphs, owners_before=earlier,
               whole_cell=whole_cell, imports=imports)
