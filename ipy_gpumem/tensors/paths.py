"""How a walk names what it reached: paths from a root (a name, IPython's caches, a traceback local, a module) to a holder, as Python.

A path is one entry in four parallel lists kept by the walk: its parent (-1 for a root), the step
from the parent (an item, an attribute, a closure cell, the class of an object, a dict's key, or a
way in that has no Python spelling) or the kind of root, the key (a dict key, an index, an
attribute, a name) and the order of its root (namespace order, the last tie-break between claims).
A path becomes text (``batch[0]``, ``trainer.model``, ``make_step.__closure__[0].cell_contents``,
``list(cache)[0]``, ``load.<lru_cache>[1]``) only when a report shows it.
"""
from __future__ import annotations

from typing import Any, Dict, NamedTuple, Tuple

__all__ = ["ITEM", "ATTR", "CELL", "CLASSOF", "KEY", "VIA", "NAME", "OUT", "UNDER", "LOCAL", "MODROOT", "EXTRA",
           "THREAD", "ROOT_KINDS", "Local", "PathsMixin", "key_text", "clip", "thread_local_text"]

# How a path continues from its parent (steps below a root): an item, an attribute, a closure
# cell, the class of an object, the key at a position of a dict (``list(d)[i]``), or a way in
# that Python cannot spell, whose key is the text appended as it is (``.<lru_cache>[0]``)...
ITEM, ATTR, CELL, CLASSOF, KEY, VIA = range(6)
# ... or what kind of root it is (a namespace name, IPython's output cache, ``_``/``_N``, a local
# of the last traceback, a module of the user's that no name holds, a root the caller added, a
# local of another running thread).
NAME, OUT, UNDER, LOCAL, MODROOT, EXTRA, THREAD = range(6, 13)
#: The holder kind of each root kind.
ROOT_KINDS = {NAME: "variable", OUT: "out_cache", UNDER: "underscore", LOCAL: "traceback_local",
              MODROOT: "module_global", EXTRA: "variable", THREAD: "thread_local"}


def clip(text: str, width: int) -> str:
    """``text`` on one line, cut to ``width`` characters with an ellipsis."""
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def key_text(key: Any) -> str:
    """How a dict key reads in a path: ``['w']``, ``[3]``, or ``[<Foo>]``; no user ``__repr__`` runs."""
    if type(key) in (str, int, float, bool) or key is None:
        return clip(repr(key), 60)
    return f"<{type(key).__name__}>"


class Local(NamedTuple):
    """The key of a traceback local's root path: the frame's function and the local's name (and,
    for another thread's local, that thread's name)."""

    frame: str
    name: str
    thread: str = ""


def thread_local_text(key: Local, text: str) -> str:
    """How a running thread's local reads: ``thread 'loader': load() local 'batch[0]'``."""
    return f"thread {key.thread!r}: {key.frame}() local {text!r}"


class PathsMixin:
    """The path lists of a walk and their text. Uses ``p_parent``, ``p_step``, ``p_key``, ``p_order``."""

    _exprs: Dict[int, Tuple[int, str]]

    def path(self, parent: int, step: int, key: Any, order: int) -> int:
        """A new path: ``key`` reached from ``parent`` by ``step``."""
        self.p_parent.append(parent)
        self.p_step.append(step)
        self.p_key.append(key)
        self.p_order.append(order)
        return len(self.p_parent) - 1

    def root_of(self, pid: int) -> int:
        """The root path of path ``pid``."""
        parent = self.p_parent
        while parent[pid] >= 0:
            pid = parent[pid]
        return pid

    def expr(self, pid: int) -> Tuple[int, str]:
        """``(root path, Python expression)`` of path ``pid``: ``batch[0]``, ``trainer.model``, ``Out[3]``."""
        cached = self._exprs.get(pid)
        if cached is not None:
            return cached
        steps = []
        node = pid
        while self.p_step[node] < NAME:  # a step below a root
            steps.append((self.p_step[node], self.p_key[node]))
            node = self.p_parent[node]
        key = self.p_key[node]
        text = key.name if self.p_step[node] in (LOCAL, THREAD) else str(key)
        for step, key in reversed(steps):
            if step == ITEM:
                text += f"[{key_text(key)}]"
            elif step == ATTR:
                text += f".{key}" if type(key) is str else f".<{type(key).__name__}>"
            elif step == CELL:
                text += f".__closure__[{key}].cell_contents"
            elif step == KEY:
                text = f"list({text})[{key}]"
            elif step == VIA:
                text += str(key)
            else:  # CLASSOF: the class of the object at the parent
                text = f"type({text})"
        result = self._exprs[pid] = (node, text)
        return result

    def label(self, pid: int) -> str:
        """How path ``pid`` reads in a note."""
        root, text = self.expr(pid)
        if self.p_step[root] == LOCAL:
            return f"last traceback: {self.p_key[root].frame}() local {text!r}"
        if self.p_step[root] == THREAD:
            return thread_local_text(self.p_key[root], text)
        return text

    def owner(self, pid: int) -> str:
        """The top-level owner of path ``pid``, as the census names it: the name (``model``), ``Out``,
        ``_5``, the module (``helpers``), or ``last error: f() local x``."""
        root = self.root_of(pid)
        step, key = self.p_step[root], self.p_key[root]
        if step == LOCAL:
            return f"last error: {key.frame}() local {key.name}"
        if step == THREAD:
            return f"thread {key.thread}: {key.frame}() local {key.name}"
        return str(key)

    def root_facts(self, pid: int) -> Tuple[str, Tuple[str, ...], str, Tuple[Any, ...]]:
        """``(kind of root, roots, frame, output-cache keys)`` of the holder at path ``pid``."""
        root, _ = self.expr(pid)
        step, key = self.p_step[root], self.p_key[root]
        if step == LOCAL:
            return "traceback_local", (), key.frame, ()
        if step == OUT:
            entry = pid
            while self.p_parent[entry] != root:
                entry = self.p_parent[entry]
            return "out_cache", (key,), "", (self.p_key[entry],)
        if step == MODROOT:
            return "module_global", (), "", ()
        if step == THREAD:
            return "thread_local", (), "", ()
        return ROOT_KINDS[step], (key,), "", ()
