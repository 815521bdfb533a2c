"""What a line or a cell's change is made of, as data: the census's change with what its owners are and what held memory before.

:func:`why_of` turns a census change (``{(device, role, owner): bytes}``) and the snapshots around
it into a :class:`~ipy_gpumem.core.why.Why`: the parts, the owners' info (a module's class and
parameter bytes, an optimizer's class and state names), the ``(role, owner)`` pairs that held
memory before, the temporaries and the GPU-only roles, and whether both counts were complete.
Only what explains the parts is kept (a record must stay small). The sentence is made from it by
the views (``ipy_gpumem.core.words``), never here.
"""
from __future__ import annotations

from typing import Mapping, Optional, Tuple

from ..core.why import OwnerInfo, Why, owner_module

__all__ = ["why_of"]


def _owner_info(data: Mapping) -> Optional[OwnerInfo]:
    kind = data.get("kind")
    if kind not in ("module", "optimizer"):
        return None
    return OwnerInfo(kind, data.get("class"), int(data.get("parameters") or 0), tuple(data.get("state") or ()))


def why_of(parts: Mapping[Tuple[str, str, str], int], before=None, after=None, *, seen=None,
           temporaries: Optional[int] = None, extra: Optional[Mapping[str, int]] = None) -> Why:
    """The data of one change.

    Args:
        parts: the change, ``{(device, role, owner): signed bytes}``.
        before, after: the census snapshots around it (their ``info`` names an optimizer's class and
            state, a module's parameter bytes; ``complete``/``left_out`` say what they counted);
            either may be None.
        seen: ``(role, owner)`` pairs that held memory before the change; None: what ``before``
            held.
        temporaries: bytes that came and went within the span (its peak above its start and end).
        extra: GPU-only roles (``allocator_cache``, ``outside_pytorch``) and unnamed tensors
            (``other_tensors``), signed bytes summed over devices.
    """
    items = tuple(sorted(((dev, role, owner, int(v)) for (dev, role, owner), v in parts.items() if v),
                         key=lambda p: (-abs(p[3]), p[:3])))
    owners = {owner for _d, _r, owner, _v in items}
    names = {owner_module(o) for o in owners}
    info = {}
    for snap in (after, before):  # the later snapshot knows the optimizer's state names
        for name, data in (getattr(snap, "info", None) or {}).items():
            if name in names and name not in info:
                owner = _owner_info(data)
                if owner is not None:
                    info[name] = owner
    if seen is None:
        seen = {(role, owner) for (_d, role, owner), v in (getattr(before, "parts", None) or {}).items() if v > 0}
    kept_seen = frozenset((role, owner) for role, owner in seen if owner in owners)
    complete = all(getattr(snap, "complete", True) for snap in (before, after))
    left_out = []
    for snap in (before, after):
        for note in getattr(snap, "left_out", ()) or ():
            if note not in left_out:
                left_out.append(note)
    return Why(items, info, kept_seen, temporaries or None,
               {role: int(v) for role, v in (extra or {}).items() if v}, complete, tuple(left_out))
