"""Who holds the memory: attribute each live tensor byte in a namespace to a category and a typed holder.

``who(namespace, refs=...)`` walks the user's variables, IPython's own references (its output
cache, ``_``/``__``/``___``/``_N``) and the last error's traceback without importing torch,
allocating tensors, collecting garbage or calling user code, and answers "these bytes are
parameters of ``model``, these are Adam's moments in ``optimizer``, these are activations kept
alive by the graph of ``loss``". Every storage counts once, in the first of these categories
that reaches it:

    parameters > gradients > optimizer_state > other_tensors > retained_graphs > ipython_caches

A category says what a tensor is, its holder who keeps it: the parameters and gradients of a model
whose name was rebound, kept alive by the graph ``loss`` still holds, are parameters and gradients
held by that graph; retained graphs are what the graphs' nodes saved for backward.

A name is IPython's only when ``refs`` says IPython bound it (by identity, see
:func:`~ipy_gpumem.attribution.holders.ipython_refs`); without ``refs`` every name is the user's. The walk
has a time and a visit budget: when one runs out the report says so (``complete`` is False) and
names what it did not examine, instead of stalling the kernel.

The report holds only numbers, strings, devices and :class:`~ipy_gpumem.attribution.holders.Holder`
rows, so keeping it never keeps a tensor alive.
"""
from __future__ import annotations

import gc
import heapq
import time
from collections import Counter
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Tuple

from ..core.devices import Device, parse_device
from ..core.units import format_bytes
from ..tensors.claims import GRAPH, IPYTHON, RELATION_KINDS, VAR
from ..tensors.graphs import MORE
from ..tensors.torch_api import api as torch_api
from ..tensors.walk import MAX_DEPTH, MAX_VISITS, Walk
from .holders import Holder, IPythonRefs

__all__ = ["BUDGET_S", "CATEGORIES", "CATEGORY_LABELS", "MAX_VISITS", "WhoReport", "who", "holder", "category_of",
           "left_out"]

#: The attributed categories, highest precedence first: the walk's roles (activations, what the
#: graphs the user's tensors keep saved for backward, are "retained graphs"), then everything only
#: IPython keeps.
CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_state",
    "other_tensors",
    "retained_graphs",
    "ipython_caches",
)
_CACHES = len(CATEGORIES) - 1
MAX_HOLDER_ROWS = 500  # holder rows kept; the rest are summed into one row per category and device

#: How each category reads in a table (the panel and %gpumem who use the same words).
CATEGORY_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "other_tensors": "other tensors",
    "retained_graphs": "retained graphs",
    "ipython_caches": "IPython caches",
    "unattributed": "unattributed",
}

#: Seconds ``who()`` may spend before it stops looking and says what it left out. A namespace of
#: 1.5 million small objects takes well under this on a slow 2-core machine (benchmarks/RESULTS.md).
BUDGET_S = 0.75
# Seconds per claim the last large report took (the walk stops early enough to leave the report its
# time within the same budget; a loaded machine's pace is learnt from the previous call).
_REPORT_COST = [1e-6]


@dataclass(frozen=True)
class WhoReport:
    """Which holders keep which tensor bytes alive, by category.

    Attributes:
        categories: Bytes per category, keys ``CATEGORIES`` plus ``"unattributed"``
            (``allocator_total`` minus the attributed total, or None without a total).
            Module buffers (BatchNorm running stats and the like) count as ``parameters``:
            they are model state that lives exactly as long as the model, so deleting the model
            is what frees them, just like its weights.
        holders: One :class:`Holder` per (holder, category, device), largest first; their bytes
            sum to the categories' total. Past 500 rows the rest are summed into one ``rest``
            row per category and device.
        by_device: ``{Device: {category: bytes}}`` when no device filter was given, else None.
        device: The device filter (a :class:`~ipy_gpumem.core.devices.Device`), or None for all.
        allocator_total: The ``allocator_total`` passed to :func:`who`, if any.
        tensor_count: Distinct storages counted (views of one storage count once).
        elapsed_s: Wall time of the walk in seconds.
        reason: Why the report is empty, else None.
        stopped: Why a budget stopped the walk early, else None (then ``notes[0]`` names
            what was not examined).
        notes: Limits hit and objects skipped, in words.
        left_out: What the walk reached but did not examine, in words, budget or not: containers
            nested too deep, holders it cannot read safely (another thread's running locals before
            Python 3.13), objects that failed. Empty when the walk is complete.
    """

    categories: Dict[str, Optional[int]]
    holders: Tuple[Holder, ...] = ()
    by_device: Optional[Dict[Device, Dict[str, int]]] = None
    device: Optional[Device] = None
    allocator_total: Optional[int] = None
    tensor_count: int = 0
    elapsed_s: float = 0.0
    reason: Optional[str] = None
    stopped: Optional[str] = None
    notes: Tuple[str, ...] = ()
    left_out: Tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        """True when the walk examined everything it reaches (no budget ran out, nothing was left
        unread or failed: :attr:`left_out` is empty)."""
        return self.stopped is None and self.reason is None and not self.left_out

    @property
    def total(self) -> int:
        """Bytes attributed to any category (``unattributed`` excluded)."""
        return sum(int(self.categories.get(name) or 0) for name in CATEGORIES)

    @property
    def unattributed(self) -> Optional[int]:
        """``allocator_total`` minus :attr:`total`, or None when no total was given."""
        return self.categories.get("unattributed")

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-serialisable copy: devices as labels (``"cuda:0"``), holders as dicts."""
        return {
            "categories": dict(self.categories),
            "total": self.total,
            "holders": [holder.to_dict() for holder in self.holders],
            "by_device": None if self.by_device is None
            else {dev.label: dict(cats) for dev, cats in self.by_device.items()},
            "device": None if self.device is None else self.device.label,
            "allocator_total": self.allocator_total,
            "tensor_count": self.tensor_count,
            "elapsed_s": self.elapsed_s,
            "reason": self.reason,
            "complete": self.complete,
            "stopped": self.stopped,
            "left_out": list(self.left_out),
            "notes": list(self.notes),
        }

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}={format_bytes(self.categories.get(name))!r}"
                          for name in CATEGORIES + ("unattributed",))
        return (f"WhoReport(total={format_bytes(self.total)!r}, {parts}, "
                f"holders={len(self.holders)}, tensor_count={self.tensor_count}"
                + (f", reason={self.reason!r}" if self.reason else "")
                + (f", stopped={self.stopped!r}" if self.stopped else "") + ")")


def who(namespace: Any, device: Any = None, allocator_total: Optional[int] = None,
        refs: Optional[IPythonRefs] = None, *, errors: Iterable[Any] = (), budget_s: float = BUDGET_S,
        max_visits: int = MAX_VISITS) -> WhoReport:
    """Attribute every tensor byte reachable from ``namespace`` to a category and a holder.

    Safe to run at the moment of an OOM: never imports torch or initialises CUDA, never
    allocates tensors, collects garbage, calls user methods or keeps a reference to what it
    walked, and never raises because of what the namespace contains.

    Args:
        namespace: The user's variables, e.g. IPython's ``user_ns`` or ``globals()``.
        device: Count only storages on this device: ``"cpu"``, ``"cuda"`` (every CUDA
            device), ``"cuda:1"``, an int N (``cuda:N``), a ``torch.device`` or a ``Device``;
            None counts every device and fills ``by_device``.
        allocator_total: Bytes the allocator reports in use (e.g.
            ``torch.cuda.memory_allocated(0)`` with ``device=0``); what no category explains
            becomes ``unattributed``. It is compared with the counted storages, so give the
            matching ``device`` (without one, CPU tensors would be subtracted too).
        refs: The names IPython itself bound (``ipython_refs(shell.user_ns,
            shell.user_ns_hidden, shell.displayhook)``): what they hold counts as
            ``ipython_caches``. Without it every name is the user's variable, ``_`` and ``Out``
            included.
        errors: Exceptions or tracebacks IPython keeps besides ``sys.last_*`` (the last
            ``ExecutionResult``'s ``error_in_exec``, a traceback formatter's ``.tb``): their
            frames' locals count as IPython's last error too. They differ from ``sys.last_value``
            only when IPython failed to format an error.
        budget_s: Seconds the walk may take; past them it stops, ``stopped`` says so and a note
            names what was not examined.
        max_visits: Items the walk may examine in all (the same, counted instead of timed).

    Returns:
        A :class:`WhoReport`.

    Raises:
        ValueError: ``device`` is not a device.
    """
    start = time.perf_counter()
    wanted = None if device is None else parse_device(device)
    total = None if allocator_total is None else int(allocator_total)
    api = torch_api()
    if api is None or api.tensor_base is None:
        return _empty_report("torch is not imported", wanted, total, start)
    if not isinstance(namespace, dict):
        return _empty_report("namespace is not a dict", wanted, total, start)
    # Pause the automatic collector (never collect): on a torch-sized heap the walk's own small
    # allocations could otherwise trigger a full collection mid-walk, costing 100+ ms and
    # running arbitrary finalizers. The previous state is restored exactly.
    gc_was_enabled = gc.isenabled()
    if gc_was_enabled:
        gc.disable()
    try:
        walk = Walk(api, namespace, wanted=wanted, ipython_names=refs.names if refs is not None else (),
                    budget_s=budget_s, max_visits=max_visits, start=start, errors=tuple(errors))
        walk.report_s_per_claim = _REPORT_COST[0]
        walk.run()
        begun = time.perf_counter()
        report = _report(walk, wanted, total, start)
        if len(walk.claims) >= 1000:  # what the next walk leaves its report: this machine's pace, now
            per_claim = (time.perf_counter() - begun) / len(walk.claims)
            _REPORT_COST[0] = min(2e-5, max(1e-6, per_claim))
        return report
    except Exception as exc:  # the walk guards each object; this is the last line of defence
        return _empty_report(f"who() failed: {type(exc).__name__}: {exc}", wanted, total, start)
    finally:
        if gc_was_enabled:
            gc.enable()


def _empty_report(reason: str, device: Optional[Device], allocator_total: Optional[int],
                  start: float) -> WhoReport:
    """A report with every category at 0 that says why."""
    categories: Dict[str, Optional[int]] = dict.fromkeys(CATEGORIES, 0)
    categories["unattributed"] = allocator_total
    return WhoReport(categories=categories, device=device, by_device=None if device else {},
                     allocator_total=allocator_total, elapsed_s=time.perf_counter() - start, reason=reason)


class _Rest(NamedTuple):
    """What the holder rows past the first 500 of one category and device add up to."""

    bytes: int
    count: int


def _report(walk: Walk, device: Optional[Device], allocator_total: Optional[int], start: float) -> WhoReport:
    """Resolve the walk's claims into a :class:`WhoReport` of plain values."""
    totals = [0] * len(CATEGORIES)
    by_device: Dict[Device, List[int]] = {}
    # ((category, order, role, ref), storage key's device id) -> minus the bytes, so that sorting
    # the (value, key) pairs puts the largest first and breaks ties by precedence, then walk order.
    rows: Dict[tuple, int] = {}
    for (dev_id, _ptr), (level, role, _priority, _depth, _weight, order, relation, ref, nbytes, dev) in walk.claims.items():
        category = _CACHES if level == IPYTHON else role  # category_of, inline: once per storage
        totals[category] += nbytes
        per_dev = by_device.get(dev)
        if per_dev is None:
            per_dev = by_device[dev] = [0] * len(CATEGORIES)
        per_dev[category] += nbytes
        row = ((category, order, relation, ref), dev_id)
        rows[row] = rows.get(row, 0) - nbytes
    device_of = {id(dev): dev for dev in by_device}
    categories: Dict[str, Optional[int]] = dict(zip(CATEGORIES, totals))
    attributed = sum(totals)
    categories["unattributed"] = None if allocator_total is None else allocator_total - attributed
    top = heapq.nsmallest(MAX_HOLDER_ROWS, zip(rows.values(), rows.keys()))
    holders = [holder(walk, category, relation, ref, device_of[dev_id], -negative)
               for negative, ((category, _order, relation, ref), dev_id) in top]
    if len(rows) > len(top):  # the rest: one row per category and device
        # Rows per (category, device) counted in C; minus the rows shown, in bytes and in number.
        counts = Counter(zip(map(itemgetter(0), map(itemgetter(0), rows)), map(itemgetter(1), rows)))
        rest = {(category, dev_id): _Rest(by_device[device_of[dev_id]][category], count)
                for (category, dev_id), count in counts.items()}
        for negative, ((category, _order, _role, _ref), dev_id) in top:
            size, count = rest[(category, dev_id)]
            rest[(category, dev_id)] = _Rest(size + negative, count - 1)
        for (category, dev_id), (size, count) in sorted(rest.items(), key=lambda item: (-item[1].bytes, item[0][0])):
            if count:
                holders.append(Holder("rest", CATEGORIES[category], device_of[dev_id], size, count=count))
    return WhoReport(
        categories=categories,
        holders=tuple(holders),
        by_device=None if device is not None else {
            dev: dict(zip(CATEGORIES, cats)) for dev, cats in sorted(by_device.items(), key=lambda d: d[0].label)},
        device=device,
        allocator_total=allocator_total,
        tensor_count=len(walk.claims),
        elapsed_s=time.perf_counter() - start,
        stopped=walk.stopped,
        notes=tuple(_notes(walk, device, allocator_total, attributed, len(by_device))),
        left_out=tuple(left_out(walk)),
    )


def left_out(walk: Walk) -> List[str]:
    """What a finished walk did not examine, in words (empty when it is complete)."""
    out = list(walk.unexamined)
    if walk.too_deep:
        out.append(f"{walk.too_deep:,} container(s) nested deeper than {MAX_DEPTH} levels (e.g. "
                   f"{walk.label(walk.too_deep_path)})")
    if walk.error_count:
        out.append(f"{walk.error_count} object(s) that could not be examined")
    if not out and not walk.complete:
        out.append(walk.stopped or "part of what the names reach")
    return out


def _notes(walk: Walk, device: Optional[Device], allocator_total: Optional[int], attributed: int,
           devices: int) -> List[str]:
    """What the reader should know about this walk, in words; a budget's stop comes first."""
    notes = []
    if walk.stopped:
        left = "; ".join(walk.unexamined) or "nothing"
        notes.append(f"incomplete: {walk.stopped}; not examined: {left}")
    elif walk.unexamined:
        notes.append(f"incomplete: not examined: {'; '.join(walk.unexamined)}")
    notes.extend(walk.notes)
    if walk.too_deep:
        notes.append(f"containers nested deeper than {MAX_DEPTH} levels were not examined "
                     f"({walk.too_deep:,} in all, e.g. {walk.label(walk.too_deep_path)})")
    if walk.error_count:
        notes.append(f"{walk.error_count} object(s) could not be examined: " + "; ".join(walk.errors))
    if allocator_total is not None and device is None and devices > 1:
        notes.append("allocator_total was compared with tensors on every device; pass "
                     "device= to compare it with that device's tensors only")
    if allocator_total is not None and allocator_total < attributed:
        notes.append("allocator_total is smaller than the attributed bytes (another "
                      "device's total, or taken at another moment?)")
    return notes


def category_of(level: int, role: int) -> int:
    """The ``who()`` category (an index into :data:`CATEGORIES`) of a claim's tier and role."""
    return _CACHES if level == IPYTHON else role


def holder(walk: Walk, category: int, relation: int, ref: Any, dev: Device, nbytes: int) -> Holder:
    """The typed row for the ``nbytes`` on ``dev`` that claims of ``(category, relation, ref)`` won."""
    if relation == GRAPH:
        return _graph_holder(walk, category, ref, dev, nbytes)
    root_kind, roots, frame, keys = walk.root_facts(ref)
    text = walk.label(ref) if root_kind == "thread_local" else walk.expr(ref)[1]
    kind = root_kind if relation == VAR else RELATION_KINDS[relation]
    return Holder(kind, CATEGORIES[category], dev, nbytes, roots=roots, expr=text, frame=frame, keys=keys)


def _graph_holder(walk: Walk, category: int, owners: tuple, dev: Device, nbytes: int) -> Holder:
    """The row of the bytes that only the graphs of the roots ``owners`` keep alive."""
    tier = walk.tiers[1] if category == _CACHES else walk.tiers[0]
    more = owners[-1] == MORE
    exprs: List[str] = []
    roots: List[str] = []
    keys: List[Any] = []
    frames: List[str] = []
    for index in owners:
        if index == MORE:
            continue
        pid = tier.roots[index].path
        _, text = walk.expr(pid)
        root_kind, names, frame, entry = walk.root_facts(pid)
        if root_kind == "thread_local":
            text = walk.label(pid)
        if frame:
            text = f"last traceback: {frame}() local {text!r}" if len(owners) > 1 else text
            frames.append(frame)
        if text not in exprs:
            exprs.append(text)
        roots.extend(n for n in names if n not in roots)
        keys.extend(k for k in entry if k not in keys)
    category_name = CATEGORIES[category]
    if len(exprs) == 1 and not more:
        return Holder("graph", category_name, dev, nbytes, roots=tuple(roots), expr=exprs[0],
                      frame=frames[0] if frames else "", keys=tuple(keys))
    return Holder("shared_graph", category_name, dev, nbytes, roots=tuple(roots), expr=" + ".join(exprs),
                  more=more, keys=tuple(keys))
