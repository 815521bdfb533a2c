"""``%gpumem free``: release what costs the user nothing (IPython's last error, cached outputs).

IPython keeps the last error's traceback (``sys.last_traceback``; its frames' locals pin the failed
call's tensors) and every displayed result (``Out``, ``_``, ``__``, ``___``, ``_N``). Dropping
those references loses nothing the user asked to keep: ``%tb`` and ``%debug`` will have nothing to
show, and ``Out[N]`` entries that held tensors are gone. A user variable is never touched. The
plan is computed from a ``who()`` report (its "ipython caches" holders are exactly the bytes only
those references keep alive), shown, then carried out; garbage collection and the allocator cache
are the extension's business, after this.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any, List, Optional

from ..core.units import format_bytes

__all__ = ["ReleasePlan", "plan_release", "release"]

_OUT_NAME = re.compile(r"^Out\[(-?\d+)\]$")
_UNDERSCORE_N = re.compile(r"^_(\d+)$")


@dataclass
class ReleasePlan:
    """What ``%gpumem free`` will drop, with the tensor bytes only those references keep alive."""

    error: Optional[str] = None  # class name of IPython's last error, if one is kept
    traceback_bytes: int = 0
    out_keys: List[Any] = field(default_factory=list)  # keys of Out whose values hold tensors
    out_bytes: int = 0
    names: List[str] = field(default_factory=list)  # "_", "__", "___", "_N" to clear

    @property
    def total(self) -> int:
        return self.traceback_bytes + self.out_bytes

    def lines(self) -> List[str]:
        out = []
        if self.error is not None:
            out.append(f"IPython's last error ({self.error}) and its traceback's frames: "
                       f"{format_bytes(self.traceback_bytes)} of tensors only they keep (%tb and %debug "
                       "will have nothing to show)")
        if self.out_keys or self.names:
            shown = ", ".join([f"Out[{k}]" for k in self.out_keys] + self.names)
            out.append(f"cached outputs holding tensors ({shown}): {format_bytes(self.out_bytes)}")
        return out


def plan_release(namespace: dict, who_report=None) -> ReleasePlan:
    """The plan for ``namespace`` (IPython's user namespace); ``who_report`` from ``who(namespace)``."""
    plan = ReleasePlan()
    value = getattr(sys, "last_value", None) or getattr(sys, "last_exc", None)
    if value is not None or getattr(sys, "last_traceback", None) is not None:
        plan.error = type(value).__name__ if value is not None else "an error"
    for holder in getattr(who_report, "holders", None) or ():
        if holder.get("category") != "ipython_caches":
            continue
        name, nbytes = holder.get("name", ""), int(holder.get("bytes") or 0)
        if name.startswith("last traceback"):
            plan.traceback_bytes += nbytes
            continue
        match = _OUT_NAME.match(name)
        if match:
            key = int(match.group(1))
            if key not in plan.out_keys:
                plan.out_keys.append(key)
            plan.out_bytes += nbytes
        elif name in ("_", "__", "___") or _UNDERSCORE_N.match(name):
            if name not in plan.names:
                plan.names.append(name)
            plan.out_bytes += nbytes
    # The Out entries and the underscore names are the same objects: clear every alias.
    out = namespace.get("Out")
    if isinstance(out, dict):
        targets = [out[k] for k in plan.out_keys if k in out]
        for name in ("_", "__", "___"):
            if name not in plan.names and any(namespace.get(name) is t for t in targets):
                plan.names.append(name)
        for k in plan.out_keys:
            if f"_{k}" in namespace and f"_{k}" not in plan.names:
                plan.names.append(f"_{k}")
        for name in list(plan.names):
            match = _UNDERSCORE_N.match(name)
            if match and int(match.group(1)) in out and int(match.group(1)) not in plan.out_keys:
                plan.out_keys.append(int(match.group(1)))
    return plan


def release(plan: ReleasePlan, namespace: dict, last_result=None, tb_formatters=(), displayhook=None,
            hidden: Optional[dict] = None) -> None:
    """Drop the references in ``plan`` (never a user variable).

    ``last_result`` is IPython's last ``ExecutionResult`` (it holds the last error and the last
    displayed value too); ``tb_formatters`` are IPython's traceback formatters
    (``shell.InteractiveTB``), which keep the last traceback they printed as ``.tb``;
    ``displayhook`` keeps its own ``_``, ``__`` and ``___``, and ``hidden`` (``user_ns_hidden``)
    a second copy of the ``_N`` names: IPython's own ``%reset out`` clears all of them too.
    """
    if plan.error is not None:
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                setattr(sys, name, None)
        for formatter in tb_formatters:
            if getattr(formatter, "tb", None) is not None:
                formatter.tb = None
        if last_result is not None:
            for name in ("error_in_exec", "error_before_exec"):
                if getattr(last_result, name, None) is not None:
                    setattr(last_result, name, None)
    out = namespace.get("Out")
    dropped = []
    if isinstance(out, dict):
        for key in plan.out_keys:
            if key in out:
                dropped.append(out.pop(key))
    for ns in (namespace, hidden):
        if ns is None:
            continue
        for name in plan.names:
            if name in ("_", "__", "___"):
                if name in ns:
                    dropped.append(ns[name])
                    ns[name] = ""  # what IPython's own %reset out leaves there
            elif name in ns:
                dropped.append(ns.pop(name))
    if displayhook is not None:
        for name in ("_", "__", "___"):
            if any(getattr(displayhook, name, None) is d for d in dropped if d is not None):
                setattr(displayhook, name, "")
    if last_result is not None and any(getattr(last_result, "result", None) is d for d in dropped):
        last_result.result = None
