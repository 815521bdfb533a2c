"""What a run left alive, by holder group: the snapshot a re-run of a cell is compared with.

A snapshot is one walk of the namespace (``tensors.walk.Walk``, within ``who()``'s budget) that
keeps, per holder group (a variable and what hangs off it, IPython's output cache, the last
traceback, the closures of a module's hooks), the bytes and the identities (address, size) of its
storages: plain ints, never a tensor. It also lists the functions registered more than once as a
module's hook (one added again on every run). Used by :mod:`.tracker`; nothing here imports torch
(it is read through ``sys.modules``), collects garbage or calls user code.
"""
from __future__ import annotations

import gc
import sys
import time
from typing import Any, Dict, List, Optional

from ..tensors.module_tables import HOOK_ATTRS, hook_tables, submodules

__all__ = ["Snapshot", "take_snapshot", "MAX_STORAGES", "MAX_MODULES", "MAX_EXPRS"]

#: Storages whose identities a snapshot keeps; past this it keeps only byte counts (no suspects).
MAX_STORAGES = 200_000
#: Modules (submodules included) whose hooks are examined.
MAX_MODULES = 10_000
#: Expressions (and traceback frames) a group keeps, the heaviest first: a suspect names a few.
MAX_EXPRS = 64


class _Group:
    """One holder group of a snapshot: its bytes, its storages and how it reads."""

    __slots__ = ("bytes", "keys", "kinds", "exprs", "frames", "out_keys")

    def __init__(self):
        self.bytes = 0
        self.keys: set = set()
        self.kinds: set = set()
        self.exprs: List[str] = []
        self.frames: List[str] = []
        self.out_keys: List[Any] = []


class Snapshot:
    """The tensor storages alive after one run, by holder group (numbers and strings only).

    Attributes:
        total: bytes of every storage counted.
        groups: ``{group key: _Group}``; a key is ``("var", roots)``, ``("out",)``,
            ``("traceback",)`` or ``("hook", module expression)``.
        keys: the identities (address and size) of every storage, or None past
            :data:`MAX_STORAGES`.
        complete: the walk examined everything and every holder it reached was named (no budget ran
            out); an incomplete snapshot has no groups past the point its budget ran out.
        hooks: ``[(module expression, hook kind, how many hooks share one function, the global
            and free names that function reads)]`` for functions registered more than once on one
            module.
    """

    __slots__ = ("total", "groups", "keys", "complete", "hooks", "elapsed_s")

    def __init__(self, total=0, groups=None, keys=None, complete=True, hooks=(), elapsed_s=0.0):
        self.total = total
        self.groups: Dict[tuple, _Group] = groups if groups is not None else {}
        self.keys = keys
        self.complete = complete
        self.hooks = list(hooks)
        self.elapsed_s = elapsed_s


def _group_key(holder) -> Optional[tuple]:
    kind = holder.kind
    if kind == "rest":
        return None
    if holder.frame or kind == "traceback_local":
        return ("traceback",)
    if kind in ("out_cache", "underscore") or holder.category == "ipython_caches":
        return ("out",)
    return ("var", tuple(holder.roots))


def take_snapshot(namespace: dict, refs=None, budget_s: Optional[float] = None) -> Optional[Snapshot]:
    """Walk ``namespace`` within ``who()``'s budget (or ``budget_s``, which the naming of the holders shares);
    the storages alive now, by holder group.

    None when torch is not imported. Pauses the automatic garbage collector during the walk
    (as ``who()`` does) and never collects.
    """
    from ..attribution.who import BUDGET_S, category_of, holder
    from ..tensors.torch_api import api as torch_api
    from ..tensors.walk import Walk

    api = torch_api()
    if api is None or not isinstance(namespace, dict):
        return None
    start = time.perf_counter()
    budget = BUDGET_S if budget_s is None else budget_s
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        walk = Walk(api, namespace, ipython_names=refs.names if refs is not None else (), budget_s=budget,
                    start=start)
        walk.run()
        if walk.stopped is not None:
            # The budget stopped the walk: a snapshot that counts "at least" is never compared (re-runs name no
            # growth from it), so grouping its holders would be work for nothing, and outside the budget (3 s
            # for the 82k holders a half-second walk reached in a list of 1M tensors).
            snap = Snapshot(complete=False)
            snap.elapsed_s = time.perf_counter() - start
            return snap
        deadline = start + budget if budget is not None else None
        rows: Dict[tuple, list] = {}
        for (_dev_id, ptr), (level, role, _p, _d, _w, order, relation, ref, nbytes, dev) in walk.claims.items():
            key = (category_of(level, role), order, relation, ref, id(dev))
            row = rows.get(key)
            if row is None:
                row = rows[key] = [0, [], dev]
            row[0] += nbytes
            row[1].append((ptr, nbytes))
        snap = Snapshot(complete=walk.stopped is None)
        keep_keys = len(walk.claims) <= MAX_STORAGES
        snap.keys = set() if keep_keys else None
        groups = snap.groups
        # Per group, dicts (insertion-ordered, one lookup each): a list's ``in`` per holder made this
        # quadratic in the holders (24 s at 50k tensors held by objects in one list).
        exprs: Dict[tuple, Dict[str, int]] = {}  # group key -> {expression: bytes}
        frames: Dict[tuple, Dict[str, None]] = {}
        out_keys: Dict[tuple, Dict[Any, None]] = {}
        for n, ((category, _order, relation, ref, _dev), (nbytes, storages, dev)) in enumerate(rows.items()):
            if deadline is not None and not n % 256 and time.perf_counter() > deadline:
                # The naming of each holder shares the walk's budget: past it, the snapshot is incomplete
                # (never compared) rather than the cell slow.
                snap.complete = False
                break
            row_holder = holder(walk, category, relation, ref, dev, nbytes)
            snap.total += nbytes
            hook = _hook_module(walk, ref) if type(ref) is int else None
            key = ("hook", hook) if hook is not None else _group_key(row_holder)
            if key is None:
                continue
            group = groups.get(key)
            if group is None:
                group = groups[key] = _Group()
                exprs[key], frames[key], out_keys[key] = {}, {}, {}
            group.bytes += nbytes
            group.kinds.add("hook" if hook is not None else row_holder.kind)
            expr = hook if hook is not None else row_holder.expr
            if expr:
                seen = exprs[key]
                seen[expr] = seen.get(expr, 0) + nbytes
            if row_holder.frame:
                frames[key][row_holder.frame] = None
            for k in row_holder.keys:
                try:
                    out_keys[key][k] = None
                except TypeError:  # an unhashable key: kept as it is
                    group.out_keys.append(k)
            if keep_keys:
                ids = [_identity(ptr, size) for ptr, size in storages]
                group.keys.update(ids)
                snap.keys.update(ids)
        for key, group in groups.items():
            # The largest first; a group keeps its MAX_EXPRS heaviest expressions (what the words name).
            ordered = sorted(exprs[key].items(), key=lambda item: -item[1])
            group.exprs = [expr for expr, _ in ordered[:MAX_EXPRS]]
            group.frames = list(frames[key])[:MAX_EXPRS]
            group.out_keys = list(out_keys[key]) + group.out_keys
        _scan_hooks(namespace, snap)
    except Exception:  # noqa: BLE001 - a snapshot is a nicety; the cell's record stands without it
        return None
    finally:
        if enabled:
            gc.enable()
    snap.elapsed_s = time.perf_counter() - start
    return snap


def _identity(ptr: int, size: int) -> int:
    return (ptr << 20) ^ size


def _hook_module(walk, pid: int) -> Optional[str]:
    """The module whose hook (through its closure) holds the storage at path ``pid``, as Python, or None."""
    from ..tensors.paths import ATTR

    node = pid
    while node >= 0:
        key = walk.p_key[node]
        if walk.p_step[node] == ATTR and type(key) is str:
            prefix, _, attr = key.rpartition(".")
            if attr in HOOK_ATTRS:
                _, text = walk.expr(walk.p_parent[node])
                return f"{text}.{prefix}" if prefix else text
        node = walk.p_parent[node]
    return None


def _scan_hooks(namespace: dict, snap: Snapshot) -> None:
    """Modules' hooks registered more than once (one function added again on every run). The
    tensors their closures hold are the walk's (under ``("hook", module)``)."""
    module_type = getattr(sys.modules.get("torch.nn.modules.module"), "Module", None)
    if module_type is None:
        return
    stack = [(name, value) for name, value in list(namespace.items())
             if type(name) is str and not name.startswith("_") and isinstance(value, module_type)]
    walked = set()
    while stack and len(walked) < MAX_MODULES:
        expr, mod = stack.pop()
        if id(mod) in walked:
            continue
        walked.add(id(mod))
        attrs = getattr(mod, "__dict__", None)
        if not isinstance(attrs, dict):
            continue
        for label, hooks in hook_tables(attrs):
            same: Dict[tuple, int] = {}
            names: Dict[tuple, frozenset] = {}
            for fn in list(hooks.values()):
                code = getattr(fn, "__code__", None)
                if code is not None:
                    sig = (getattr(fn, "__qualname__", ""), code.co_code, code.co_firstlineno)
                    same[sig] = same.get(sig, 0) + 1
                    names[sig] = frozenset(code.co_names) | frozenset(code.co_freevars)
            for sig, count in same.items():
                if count >= 2:  # one function registered again on every run
                    snap.hooks.append((expr, label, count, names[sig]))
        children = submodules(attrs)
        if children is not None:
            stack.extend((f"{expr}.{name}", child) for name, child in list(children.items())
                         if isinstance(child, module_type))


# ---------------------------------------------------------------------------------------------
# Per cell
# ---------------------------------------------------------------------------------------------
