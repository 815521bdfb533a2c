"""What ``%gpumem free`` would release and what it released: one list of parts, rendered to text and HTML.

``free_view`` shows a whole :class:`~ipy_gpumem.free.release.FreeOutcome` (the plan, then what was
released and the memory before and after); ``plan_view`` a
:class:`~ipy_gpumem.free.release.ReleasePlan` alone and ``freed_view`` a
:class:`~ipy_gpumem.free.release.ReleaseResult` alone. Each keeps what it shows as ``View.data``.
"""
from __future__ import annotations

from typing import Any, List, Optional

from ..core.backends import for_device_type
from ..core.memory import DeviceMemory
from ..core.units import format_bytes, format_delta
from ..display.parts import Heading, Para, Table, render
from ..display.view import View, delta_class
from .release import FreeOutcome, ReleasePlan, ReleaseResult

__all__ = ["free_view", "plan_view", "freed_view"]

_ITEM = dict(indent="  - ", hanging="    ")


def free_view(outcome: FreeOutcome) -> View:
    """``%gpumem free``: the plan, then (unless a dry run) what was released and the memory before
    and after; ``data`` is the outcome."""
    parts = _plan_parts(outcome.plan, outcome.before, outcome.dry_run)
    if outcome.result is not None:
        parts.extend(_freed_parts(outcome.result, outcome.before, outcome.after))
    return render(parts, data=outcome)


def plan_view(plan: ReleasePlan, before: Any = None, dry_run: bool = True) -> View:
    """What ``%gpumem free`` would release (``dry_run``) or is about to release; ``data`` is the plan.

    Args:
        plan: from :func:`~ipy_gpumem.free.release.plan_release`.
        before: a probe ``Sample`` taken now, for what the allocator's cache holds (None: unknown).
        dry_run: say "would release" and that nothing was released.
    """
    return render(_plan_parts(plan, before, dry_run), data=plan)


def freed_view(result: ReleaseResult, before: Any = None, after: Any = None) -> View:
    """What ``%gpumem free`` released, and the memory before and after (probe ``Sample``s); ``data`` is the result."""
    return render(_freed_parts(result, before, after), data=result)


def _plan_parts(plan: ReleasePlan, before: Any, dry_run: bool) -> List[Any]:
    parts: List[Any] = [Heading("ipy_gpumem free " + ("would release" if dry_run else "releases")
                                + " (never a variable of yours):")]
    if plan.error is not None:
        parts.append(Para(f"IPython's last error ({plan.error}) and its traceback's frames: "
                          f"{format_bytes(plan.traceback_bytes)} of tensors only they keep "
                          "(%tb and %debug will have nothing to show)", **_ITEM))
    if plan.out_keys or plan.names:
        parts.append(Para(f"cached outputs holding tensors ({_references(plan.out_keys, plan.names)}): "
                          f"{format_bytes(plan.cache_bytes)}", **_ITEM))
    if not plan.tensors:
        parts.append(Para("torch is not imported, so no tensors exist: nothing IPython keeps holds any", **_ITEM))
    elif plan.empty:
        parts.append(Para("no IPython error or cached output is keeping tensors alive", **_ITEM))
    if plan.kept:
        parts.append(Para(f"left alone: {', '.join(plan.kept)} (yours: you assigned them, so IPython "
                          "does not own them)", **_ITEM))
    if not plan.complete:
        parts.append(Para(f"who() did not count everything ({plan.incomplete}): IPython's references may keep "
                          "more than this", style="dim", **_ITEM))
    parts.append(Para("then: " + "; ".join(_then(before)), indent="  ", hanging="    "))
    if dry_run:
        parts.append(Para("(dry run: nothing was released)", style="dim"))
    return parts


def _freed_parts(result: ReleaseResult, before: Any, after: Any) -> List[Any]:
    parts: List[Any] = [Heading("ipy_gpumem free: done.")]
    released = []
    if result.error is not None:
        released.append(f"IPython's last error ({result.error})")
    if result.out_keys or result.names:
        released.append("cached outputs " + _references(result.out_keys, result.names))
    parts.append(Para("released: " + ("; ".join(released) if released
                                      else "no reference of IPython's (none was holding tensors)"), **_ITEM))
    if result.skipped:
        parts.append(Para(f"left alone: {', '.join(result.skipped)} (you rebound them before they were released)",
                          **_ITEM))
    table = _changes(before, after)
    if table is not None:
        parts.append(table)
    return parts


def _references(keys, names) -> str:
    """``Out[3], Out[5], _3, _``: IPython's references as the user would type them."""
    return ", ".join([f"Out[{key}]" for key in keys] + list(names))


def _then(before: Any) -> List[str]:
    steps = ["garbage collection (gc.collect())"]
    devices = getattr(before, "devices", None) or ()
    if devices:
        cached = sum(DeviceMemory.from_sample(d).reserved_unallocated or 0 for d in devices)
        backend = for_device_type(getattr(devices[0], "type", "cuda"))
        if backend.key == "mps":
            # torch.mps.driver_allocated_memory() counts MPSGraph's own buffers as well as the pool.
            held = "held by the Metal driver beyond tensors now, the allocator's cache among it"
        else:
            held = "reserved but unallocated now"
        steps.append(f"the {backend.title} allocator's cache ({backend.module}.empty_cache(): "
                     f"{format_bytes(cached)} {held})")
    return steps


def _changes(before: Any, after: Any) -> Optional[Table]:
    """Allocated and reserved per device and host RSS, before and after, as one table."""
    if before is None or after is None:
        return None
    rows, classes = [], []
    prior = {d.index: d for d in getattr(before, "devices", ()) or ()}
    for dev in getattr(after, "devices", ()) or ():
        old = prior.get(dev.index)
        if old is None:
            continue
        for what, a, b in (("allocated", old.allocated, dev.allocated), ("reserved", old.reserved, dev.reserved)):
            delta = None if a is None or b is None else b - a
            rows.append([f"{dev.device.label} {what}", format_bytes(a), format_bytes(b), format_delta(delta)])
            classes.append(["", "", "", delta_class(delta)])
    rss_a = getattr(getattr(before, "host", None), "rss", None)
    rss_b = getattr(getattr(after, "host", None), "rss", None)
    if rss_a is not None and rss_b is not None:
        rows.append(["host RSS", format_bytes(rss_a), format_bytes(rss_b), format_delta(rss_b - rss_a)])
        classes.append(["", "", "", delta_class(rss_b - rss_a)])
    if not rows:
        return None
    return Table(["", "before", "after", "change"], rows, left=(0,), classes=classes, indent="  ")
