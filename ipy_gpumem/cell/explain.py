"""The anatomy of a finished cell: its change by role and what it is made of, measured against the census taken when the previous cell ended.

A cell's explanation covers what that cell did, never what earlier cells did. So once torch is
imported (only then can a name hold a tensor) the end of every recorded cell refreshes the
*baseline*: a census of the user's names and IPython's own (``Out``, ``_``, the last error),
within a small time budget (:data:`BASELINE_BUDGET_S`). A cell that moved at least the threshold
(or a ``%%gpumem`` cell) is explained by the change from that baseline to a census at its end, and
that census becomes the next baseline. A silent cell that moved a tensor between names, freed a
graph or deleted a name leaves nothing for the next cell to inherit.

When a census stops on its budget (``complete`` False), the explanation says "at least" and names
what the count left out; the next baseline then gets more time (up to :data:`BASELINE_MAX_S`) so a
large structure that appeared once is proven tensor-free once and cheap afterwards.

Most cells change nothing a census counts (``x = 1``, a plot, a print): a cell's end first asks
the census's fingerprint (:class:`~ipy_gpumem.tensors.watch.CensusWatch`: the names' objects, the
holders' contents, a few sentinels, and the memory counters) whether anything it depended on
moved, and a quiet cell keeps the baseline it has without walking anything.

The same end of a cell notes how many modules ``sys.modules`` holds (one ``len``), so the next
cell that moved memory can say how many it imported and from which packages (creating the first
optimizer imports some 800 modules, +70 MiB of host RSS that no tensor explains): the new names
are the last ones in ``sys.modules``, read only for a cell that is explained.

The baseline of a cell is the state when it starts, which is the state when the previous one
ended: nothing of the user's runs in between. So the refresh is deferred: a cell that did change
something only marks the baseline stale and, where an event loop runs between cells (a Jupyter
kernel), schedules the census for the idle time after the cell's reply is sent; whatever has not
run by the next cell's start runs then, before any of its code (``ensure``). A cell's own latency
never pays for the next one's baseline in a kernel; in a terminal the next cell pays it when it starts.
"""
from __future__ import annotations

import sys
from collections import Counter
from itertools import islice
from typing import Any, Callable, Optional, Tuple


__all__ = ["CellAnatomy", "BASELINE_BUDGET_S", "BASELINE_MAX_S", "imported_since"]

#: Seconds the end-of-cell census may take: a few hundred microseconds with a small model in the
#: namespace (benchmarks/RESULTS.md); past it the census stops and says what it left out.
BASELINE_BUDGET_S = 0.01
#: The most a baseline census gets after incomplete ones (it grows fourfold each time).
BASELINE_MAX_S = 0.16

Names = Callable[[], Tuple[dict, Any]]  # () -> (namespace, IPython's refs: ``.names``)


class CellAnatomy:
    """The baseline census and the explanation of finished cells.

    Args:
        names: returns ``(namespace, refs)``: the user's namespace and IPython's own names in it
            (``attribution.holders.ipython_refs``); None: no census (no roles, no explanation).
    """

    def __init__(self, names: Optional[Names] = None, schedule: Optional[Callable[[Callable[[], None]], Any]] = None):
        self.names = names
        # The namespace alone (``CellNames.namespace``), what a quiet cell's check reads.
        self._namespace = getattr(names, "namespace", None)
        #: ``schedule(fn)`` runs ``fn`` when the process is next idle (None: no idle time to use).
        self.schedule = schedule
        self._baseline = None
        self._stale = False
        self._budget = BASELINE_BUDGET_S
        self._gave_up = False  # the largest budget was not enough: back to the small one, for good
        self._watch = None  # the census's fingerprint (tensors.watch.CensusWatch), made with the first census
        self._counters = None  # the reading (a Sample) when the baseline was marked stale
        #: Why the last cell's end took (or did not take) a new count: None for a quiet cell.
        self.recount_reason: Optional[str] = None
        self._modules: Optional[int] = None  # len(sys.modules) when the last recorded cell ended

    @property
    def baseline(self):
        """The census at the end of the last recorded cell (None until one was taken); taken now if
        it was only marked stale."""
        self.ensure()
        return self._baseline

    @baseline.setter
    def baseline(self, snapshot) -> None:
        self._stale = False
        self._baseline = snapshot

    # -- censuses --------------------------------------------------------------------------------

    def census(self, budget_s: Optional[float] = None, extra=()):
        """A census of the user's names now (an empty one without names or torch); never raises."""
        from ..tensors.census import BUDGET_S, EMPTY, take

        if self.names is None or "torch" not in sys.modules:
            return EMPTY
        try:
            namespace, refs = self.names()
            return take(namespace, extra=extra, ipython_names=getattr(refs, "names", ()) or (),
                        budget_s=BUDGET_S if budget_s is None else budget_s)
        except Exception:  # noqa: BLE001 - no namespace to read: no roles, never an error in a cell
            return EMPTY

    def refresh(self, sample=None, *, recount: bool = False) -> None:
        """The end of a recorded cell: the baseline of the next cell's explanation is the names as
        they are now; counted in the idle time after this cell, or when the next one starts, unless
        the cell changed nothing the baseline depends on (then it stays as it is).

        ``sample`` is the cell's closing reading (``core.probes.Sample``): its counters are part of
        the fingerprint. ``recount``: count again whatever the fingerprint says (our own magics ran:
        ``%gpumem free`` frees the user's tensors through IPython's caches). Without torch nothing holds a tensor: the empty census is exact and costs nothing.
        """
        self._modules = len(sys.modules)
        if "torch" not in sys.modules:
            from ..tensors.census import EMPTY

            self.baseline = EMPTY
            return
        if not recount and not self._stale and self._baseline is not None and self._quiet(sample):
            return
        self._counters = sample  # fingerprinted with the census it marks stale (read then)
        self._stale = True
        if self.schedule is not None:
            try:
                self.schedule(self.ensure)
            except Exception:  # noqa: BLE001 - no loop to schedule on: the next cell's start counts
                pass

    def ensure(self) -> None:
        """Take the baseline census now if it is stale (at the latest when the next cell starts)."""
        if not self._stale:
            return
        self._stale = False
        snap = self.census(self._budget)
        self._baseline = snap
        self._after(not snap.stopped)
        self._settle(snap, self._counters)
        self._counters = None

    def before_cell(self) -> None:
        """A recorded cell starts: its baseline is taken now if it is stale, or from the names as they
        are if there is none (after ``%gpumem on`` or an internal error)."""
        if self._stale:
            self.ensure()
        if self._baseline is None:
            self.refresh()
            self.ensure()
        # A cell's imports are counted from its own start: what was imported since the last recorded cell
        # ended is not this cell's (a cell of our magics alone is not recorded, and `%gpumem sidebar`
        # imports ipywidgets and anywidget; a front end's message or a thread may import between cells).
        self._modules = len(sys.modules)

    def adopt(self, snapshot, sample=None) -> None:
        """Use ``snapshot`` (a census taken at the end of a cell, whose closing reading is ``sample``)
        as the baseline."""
        self._modules = len(sys.modules)
        if snapshot is not None:
            self.baseline = snapshot
            self._after(not snapshot.stopped)
            self._settle(snapshot, sample)

    def forget(self) -> None:
        """Something ran that was not recorded (``%gpumem on``, an internal error): the next cell
        starts from a fresh census."""
        self._stale = False
        self._baseline = None
        self._modules = None
        if self._watch is not None:
            self._watch.forget()

    # -- the fingerprint ---------------------------------------------------------------------------

    def _quiet(self, sample) -> bool:
        """The cell (whose closing reading is ``sample``) changed nothing the baseline depends on
        (never raises: unsure means count again)."""
        watch = self._watch
        if watch is None or not watch.settled or self.names is None:
            self.recount_reason = "no fingerprint"
            return False
        try:
            read = self._namespace
            changed = watch.changed(read() if read is not None else self.names()[0], sample)
        except Exception:  # noqa: BLE001 - count again
            watch.forget()
            self.recount_reason = "the fingerprint failed"
            return False
        self.recount_reason = watch.reason
        return not changed

    def _settle(self, snapshot, sample) -> None:
        """Fingerprint what ``snapshot`` (taken when the reading was ``sample``) depended on; an
        incomplete count that still has budget to grow is not fingerprinted (the next cell counts
        again, with more time)."""
        try:
            if self.names is None or "torch" not in sys.modules or snapshot is None:
                return
            if self._watch is None:
                from ..tensors.torch_api import api
                from ..tensors.kinds import type_cache
                from ..tensors.watch import CensusWatch

                torch_api = api()
                if torch_api is None:
                    return
                self._watch = CensusWatch(type_cache(torch_api))
            if snapshot.stopped and not self._gave_up:
                self._watch.forget()  # the next cell counts again, with more time
                return
            from ..core.why import owner_module

            namespace, _refs = self.names()
            owners = {owner_module(owner) for (_dev, _role, owner) in snapshot.parts}
            self._watch.settle(namespace, owners, sample)
        except Exception:  # noqa: BLE001 - no fingerprint: every cell counts, as before
            if self._watch is not None:
                self._watch.forget()

    def _after(self, finished: bool) -> None:
        """Grow the budget after a count a budget stopped (an incomplete count for another reason,
        nesting or something unreadable, would not finish with more time)."""
        if finished:
            self._budget, self._gave_up = BASELINE_BUDGET_S, False
        elif self._gave_up or self._budget >= BASELINE_MAX_S:
            self._budget, self._gave_up = BASELINE_BUDGET_S, True
        else:
            self._budget = min(self._budget * 4, BASELINE_MAX_S)

    # -- the explanation ---------------------------------------------------------------------------

    def explain(self, frame, measurement, outermost: bool, budget_s: Optional[float] = None):
        """Fill the measurement's roles, ``why`` and phases; return the census at its end (None when
        none was taken), within ``budget_s`` (None: the census's own). Never raises: the anatomy is
        an explanation, not the record."""
        try:
            imported = imported_since(self._modules)  # first: before our own imports below
            from ..anatomy.account import gpu_extras, summed, with_extras
            from ..anatomy.reasons import why_of
            from ..core.records import DeviceRecord
            from ..core.roles import table_total
            from ..core.why import Imports

            tracer = frame.tracer
            if tracer is not None and tracer.census is not None and tracer.first_snapshot is not None:
                before, after = tracer.first_snapshot, tracer.last_snapshot
            else:
                # A whole-cell %%gpumem cell took its own census when it started; any other cell
                # the user ran is compared with the census at the end of the previous one.
                before = frame.snapshot if frame.snapshot is not None or not outermost else self.baseline
                after = self.census(budget_s)
            if frame.phases is not None:
                measurement.phases = tuple(frame.phases.phases) or None
                measurement.layers = tuple(frame.phases.layers) or None
                summary = getattr(frame.phases, "summary", None)
                measurement.phase_summary = (summary() or None) if summary is not None else None
            if before is None:
                return after
            change = after.diff(before)
            extras, temporaries = {}, 0
            base = {d.index: d for d in measurement.start.devices}
            for dev in measurement.end.devices:
                b = base.get(dev.index)
                rec = DeviceRecord(dev.index, type=dev.type, allocated_before=0 if b is None else b.allocated,
                                   allocated_after=dev.allocated, reserved_before=0 if b is None else b.reserved,
                                   reserved_after=dev.reserved, used_before=None if b is None else b.used,
                                   used_after=dev.used)
                extras[rec.label] = gpu_extras(rec, change.parts)
                peak = measurement.peak_allocated(dev, b)
                if peak is not None:
                    temporaries = max(temporaries, peak - max(rec.allocated_before, dev.allocated))
            untensored = None
            if not measurement.end.devices:
                rss0, rss1, peak = measurement.start.host.rss, measurement.end.host.rss, measurement.peak_rss()
                if None not in (rss0, rss1, peak):
                    temporaries = max(0, peak - max(rss0, rss1))
                if None not in (rss0, rss1):
                    untensored = rss1 - rss0 - table_total(change.table)
            imports = None
            if imported is not None:
                imports = Imports(imported[0], imported[1], untensored)
            measurement.roles = with_extras(change.table, extras)
            measurement.why = why_of(change.parts, before, after, temporaries=temporaries or None,
                                     extra=summed(extras), whole_cell=True,
                                     imports=imports)
            return after
        except Exception:  # noqa: BLE001
            return None


#: Packages named in a cell's imports (the rest are in the count).
MAX_PACKAGES = 3


def imported_since(count: Optional[int]) -> Optional[Tuple[int, Tuple[Tuple[str, int], ...]]]:
    """``(modules, ((top-level package, modules), ...))`` imported since ``sys.modules`` held
    ``count`` modules (None: not known, or none imported), our own package left out. The new ones
    are the last in ``sys.modules`` (a dict keeps insertion order), so only they are read."""
    if count is None:
        return None
    new = len(sys.modules) - count
    if new <= 0:
        return None
    try:
        names = list(islice(reversed(sys.modules), new))
    except RuntimeError:  # another thread imported meanwhile
        return None
    packages = Counter(name.partition(".")[0] for name in names if type(name) is str)
    packages.pop(__name__.partition(".")[0], None)
    total = sum(packages.values())
    if not total:
        return None
    return total, tuple(packages.most_common(MAX_PACKAGES))
