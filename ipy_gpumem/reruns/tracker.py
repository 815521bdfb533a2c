"""Re-runs of a cell: recognise them, compare what each run left behind, and name what keeps an earlier run's memory.

A notebook is re-run, not run: the commonest way to run out of memory is the same cell run again
while the last run's tensors are still held (an optimizer built in another cell still holding the
old model's parameters, ``losses.append(loss)`` keeping every iteration's graph, ``Out[n]``
keeping a displayed tensor, a hook registered on every run, the last error's traceback holding
its frames, another name still holding the first copy of a model).

How it works (:class:`RerunTracker`, called by the watcher once per finished outermost cell):

* **Recognising a re-run** costs one dict lookup per cell: the key is the cell id, else the
  source's hash (a front end without cell ids, such as terminal IPython or nbclient). The entry
  keeps the first run's execution count, the number of runs and the last run's closing reading
  (numbers only).
* **Growth.** On a GPU, memory a run left is torch's allocated bytes after it: the growth of a
  re-run is allocated-after minus the previous run's allocated-after. On the CPU the only cheap
  number is RSS, which is noisy and does not shrink when tensors are freed; it is only the
  trigger, and the growth is exact tensor accounting instead: the bytes of the tensor storages
  that :func:`~ipy_gpumem.attribution.who.who`'s walk finds alive after this run minus after the
  previous run.
* **Snapshots** (:mod:`.kept`: a walk within the cell end's budget, ``cell.budget.CellBudget``) are
  taken only after a run that kept memory (first run: kept at least the threshold; re-run: grew
  by it). A snapshot the budget stopped names no suspect, and that cell's next run may walk four
  times as long (up to the most a cell's end may spend, ``CellBudget.ceiling``). A snapshot keeps, per
  holder group (a variable and what hangs off it, IPython's output cache, the last traceback, the
  closures of a module's hooks), the bytes and the identities (address, size) of its storages:
  plain ints, never a tensor.
* **Suspects** are the groups that gained at least a quarter of the threshold since the previous
  run's snapshot *and* still hold storages alive at the end of the previous run: objects from
  the earlier run. A re-run that rebinds a name frees the old object, so its group gains nothing
  and nothing is reported; a cell that ran in between and made new tensors holds nothing old.
  Each suspect comes with its fix as data (a :class:`~ipy_gpumem.core.why.Suspect`: how it holds
  the memory, the fix, and the names the fix needs: the cell that built the optimizer, the item
  appended, the hook's module), and a cell names each suspect once. The sentences (``append
  `loss.item()```, ``%gpumem free``, ``handle.remove()``, ``del``) are made by the views
  (``ipy_gpumem.display.words``).

Nothing here imports torch (it is read through ``sys.modules``), collects garbage, calls user
code, or keeps a reference to a user's object.
"""
from __future__ import annotations

import re
import sys
import types
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from .kept import MAX_STORAGES, Snapshot, take_snapshot

if TYPE_CHECKING:  # the sentences' data load with the first re-run, not with the extension
    from ..core.why import Suspect

__all__ = ["RerunTracker", "Snapshot", "take_snapshot", "MAX_CELLS", "MAX_STORAGES", "MIN_WALK_S"]

#: The least a snapshot's walk gets, whatever the cell's end has left.
MIN_WALK_S = 0.1

#: Distinct cells remembered (the oldest are forgotten first).
MAX_CELLS = 10_000
#: Cells whose last snapshot is kept (a snapshot holds one int per storage).
MAX_SNAPSHOTS = 32


class _Cell:
    """What is remembered of one cell between its runs (numbers only)."""

    __slots__ = ("first", "runs", "last", "end", "snapshot", "warned", "walk_s")

    def __init__(self, first, end):
        self.first = first
        self.runs = 1
        self.last = first
        self.end = end
        self.snapshot: Optional[Snapshot] = None
        self.warned: set = set()
        self.walk_s = 0.0  # what its snapshots' walk needs at least (grown after one the budget stopped)


def _kept(start, end) -> Optional[int]:
    """What the run kept: allocated bytes on its CUDA devices, else host RSS."""
    if end.devices:
        before = {d.index: d.allocated for d in start.devices}
        values = [d.allocated - before.get(d.index, 0) for d in end.devices if d.allocated is not None]
        return sum(values) if values else None
    rss0, rss1 = start.host.rss, end.host.rss
    return None if rss0 is None or rss1 is None else rss1 - rss0


def _device_growth(previous, end) -> Optional[int]:
    """Allocated bytes after this run minus after the previous run, over the devices both read."""
    if not end.devices or previous is None or not previous.devices:
        return None
    before = {d.index: d.allocated for d in previous.devices}
    values = [d.allocated - before[d.index] for d in end.devices
              if d.index in before and d.allocated is not None and before[d.index] is not None]
    return sum(values) if values else None


class RerunTracker:
    """Recognises re-runs and says when one left memory behind from an earlier run.

    Attributes:
        context: a callable returning ``(namespace, refs)`` (the user namespace and IPython's
            own names in it, see ``ipython_refs``); None (no shell) measures no tensors.
        budget_s: seconds a snapshot's walk may take (None: ``who()``'s budget).
    """

    def __init__(self, context: Optional[Callable[[], Tuple[dict, Any]]] = None):
        self.context = context
        self.budget_s: Optional[float] = None
        self._budget = None  # this cell's end's CellBudget (the snapshot takes half of what it has left)
        self._cells: Dict[Any, _Cell] = {}
        self._snapshots: List[_Cell] = []  # cells holding a snapshot, oldest first

    def clear(self) -> None:
        self._cells.clear()
        self._snapshots.clear()

    def after_cell(self, measurement, threshold: int, ledger=None, budget=None) -> bool:
        """Note a finished outermost cell; set ``measurement.rerun``; True when it has a new warning.

        The common case (a cell that kept nothing) costs a hash, a dict lookup and a few stores; a
        snapshot's walk takes at most half of what ``budget`` (the cell end's ``CellBudget``) has
        left (None: :attr:`budget_s`, else ``who()``'s).
        """
        self._budget = budget
        key = measurement.cell_id or hash(measurement.source)
        cells = self._cells
        cell = cells.get(key)
        end = measurement.end
        if cell is None:
            cell = cells[key] = _Cell(measurement.execution_count, end)
            if len(cells) > MAX_CELLS:
                del cells[next(iter(cells))]
            if self.context is not None:
                kept = _kept(measurement.start, end)
                if kept is not None and kept >= threshold:
                    self._snap(cell)
            return False
        previous_end, previous_count = cell.end, cell.last
        cell.runs += 1
        cell.end = end
        cell.last = measurement.execution_count
        device_growth = _device_growth(previous_end, end) if end.devices else None
        growth = device_growth
        if device_growth is not None:
            from ..core.why import Rerun  # noqa: PLC0415 - loaded with the first re-run, not at load

            measurement.rerun = Rerun(cell.first, cell.runs, previous_count, device_growth)
            grew = device_growth >= threshold
        else:
            measurement.rerun_of(cell.first, cell.runs, previous_count)  # a Rerun, made when read
            kept = _kept(measurement.start, end)
            rss_growth = None
            if previous_end is not None and previous_end.host.rss is not None and end.host.rss is not None:
                rss_growth = end.host.rss - previous_end.host.rss
            # RSS only triggers: freed memory is reused without RSS moving, so a re-run of a cell
            # whose previous run was snapshotted (it kept memory) is always checked exactly.
            grew = (cell.snapshot is not None or (kept is not None and kept >= threshold)
                    or (rss_growth is not None and rss_growth >= threshold))
        old = cell.snapshot
        if not grew or self.context is None:
            if old is not None:
                self._drop(cell)  # nothing kept: the next comparison starts from a fresh snapshot
            return False
        now = self._snap(cell)
        if now is None or old is None:
            return False
        if not (now.complete and old.complete):
            return False  # a walk its budget stopped counts "at least": no growth, no suspect, to name
        from ..core.why import Rerun  # noqa: PLC0415

        if device_growth is None:
            growth = now.total - old.total  # exact: tensor bytes alive after each run
            measurement.rerun = Rerun(cell.first, cell.runs, previous_count, growth)
            if growth < max(threshold // 4, 1):
                self._drop(cell)  # it stopped growing: later runs are checked again only if RSS grows
        if growth < threshold:
            return False
        found = _suspects(old, now, max(threshold // 4, 1))
        if not found:
            return False
        context = _Classifier(measurement.source, ledger, self._namespace())
        suspects = []
        for gkey, group, gain in found:
            suspects.append(context.suspect(gkey, group, gain, now, new=gkey not in cell.warned))
            cell.warned.add(gkey)
        measurement.rerun = Rerun(cell.first, cell.runs, previous_count, growth, tuple(suspects))
        return measurement.rerun.warns

    # -- internals ---------------------------------------------------------------------------------

    def _namespace(self):
        try:
            return self.context()[0] if self.context is not None else None
        except Exception:  # noqa: BLE001
            return None

    def _snap(self, cell: _Cell) -> Optional[Snapshot]:
        try:
            namespace, refs = self.context()
        except Exception:  # noqa: BLE001 - no namespace, no snapshot
            return None
        budget = self.budget_s if self._budget is None else max(self._budget.left() / 2, MIN_WALK_S)
        if budget is not None and cell.walk_s > budget:
            budget = cell.walk_s  # this cell's earlier walk was stopped: this run may spend more
        snap = take_snapshot(namespace, refs, budget)
        self._drop(cell)
        if snap is None:
            return None
        if not snap.complete and budget is not None:
            # The next run of this cell gets four times as long, up to the most a cell's end may spend
            # (who()'s budget without one): a leak that grows run after run is then named on a later run
            # instead of never, and no cell's end spends more than the ceiling on it whatever the namespace
            # holds (the census after it gets what is left, at least a moment).
            from ..attribution.who import BUDGET_S

            cell.walk_s = min(4 * budget, self._budget.ceiling if self._budget is not None else BUDGET_S)
        cell.snapshot = snap
        self._snapshots.append(cell)
        if len(self._snapshots) > MAX_SNAPSHOTS:
            oldest = self._snapshots.pop(0)
            oldest.snapshot = None
        return snap

    def _drop(self, cell: _Cell) -> None:
        if cell.snapshot is not None:
            cell.snapshot = None
            try:
                self._snapshots.remove(cell)
            except ValueError:
                pass


def _suspects(old: Snapshot, now: Snapshot, min_gain: int):
    """Groups that gained at least ``min_gain`` and still hold storages from the earlier snapshot."""
    out = []
    for gkey, group in now.groups.items():
        before = old.groups.get(gkey)
        gain = group.bytes - (before.bytes if before is not None else 0)
        if gain < min_gain:
            continue
        if old.keys is None or not (group.keys & old.keys):
            continue  # nothing in it was alive after the earlier run: new tensors, not a leak
        out.append((gkey, group, gain))
    out.sort(key=lambda item: -item[2])
    return out[:4]


# ``Store.kept[0]``, ``remember.__defaults__[0][0]``, ``log.__closure__[0].cell_contents[0]``: a root
# name, one attribute, then the rest of the path (an index or more attributes)
_CODE_HELD = re.compile(r"^(?P<root>[A-Za-z_]\w*)\.(?P<attr>[A-Za-z_]\w*)(?P<rest>[\[.].*)?$")


def _first_index(rest: str) -> Optional[int]:
    match = re.match(r"\[(\d+)\]", rest)
    return int(match.group(1)) if match else None


_APPEND = r"\b{name}\s*\.\s*(?:append|extend|insert)\s*\((?:[^()]*,\s*)?([A-Za-z_][\w.]*)\s*\)"
_ASSIGNED = re.compile(r"^[ \t]*([A-Za-z_]\w*)[ \t]*(?::[^=\n]*)?=(?!=)", re.M)


class _Classifier:
    """Says how a suspect group holds an earlier run's tensors and what frees them, in the user's
    names (read from the cell's source, the ledger and the namespace), as a :class:`Suspect`."""

    def __init__(self, source: str, ledger, namespace):
        self.source = source or ""
        self.ledger = ledger
        self.namespace = namespace if isinstance(namespace, dict) else {}
        self.assigned = _ASSIGNED.findall(self.source)

    def built_in(self, name: str) -> Optional[int]:
        """The execution count of the latest other cell that assigned ``name`` at top level."""
        if self.ledger is None:
            return None
        pattern = re.compile(rf"^[ \t]*{re.escape(name)}[ \t]*=(?!=)", re.M)
        try:
            records = self.ledger.tail(500)
        except Exception:  # noqa: BLE001
            return None
        for rec in reversed(records):
            if rec.source == self.source or rec.source.strip() == self.source.strip():
                continue
            if pattern.search(rec.source or ""):
                return rec.execution_count
        return None

    def held_by_code(self, exprs) -> Optional[Tuple[str, str, Optional[str]]]:
        """``(kind, container, detail)`` when the tensors are kept by the user's code rather than by a
        variable: a class attribute (``Store.kept``), a global of their module (``helper.seen``), a
        function's default argument (``remember``, ``seen``) or its closure (``log``, ``kept``)."""
        for expr in exprs:
            match = _CODE_HELD.match(expr)
            if match is None:
                continue
            root, attr, rest = match.group("root"), match.group("attr"), match.group("rest") or ""
            obj = self.namespace.get(root, sys.modules.get(root))
            kind = type(obj)  # only types are asked: a user's __getattr__ or property never runs
            if kind is types.FunctionType and attr in ("__defaults__", "__closure__"):
                code, index = obj.__code__, _first_index(rest)
                if attr == "__defaults__":
                    count = len(obj.__defaults__ or ())
                    names = code.co_varnames[code.co_argcount - count:code.co_argcount]
                    return "default_argument", root, names[index] if index is not None and index < len(names) else None
                free = code.co_freevars
                return "closure", root, free[index] if index is not None and index < len(free) else None
            if attr.startswith("__") or not rest:
                continue  # a dunder, or a tensor held by the attribute itself (rebinding frees it)
            if issubclass(kind, type):
                return "class_attribute", f"{root}.{attr}", None
            if issubclass(kind, types.ModuleType):
                return "module_global", f"{root}.{attr}", None
        return None

    def one_element(self, container: str, item: Optional[str]) -> bool:
        """Whether what the cell appends is a one-element tensor (its ``.item()`` is a number): read
        from the variable ``item`` names, else the container's last entry; only an exact
        ``torch.Tensor`` or ``Parameter`` is asked its shape (a subclass's ``shape`` could run code),
        and unknown is False."""
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        exact = (torch.Tensor, torch.nn.Parameter)
        value = self.namespace.get(item) if item and "." not in item else None
        if type(value) not in exact:
            held = self.namespace.get(container)
            value = list.__getitem__(held, -1) if type(held) is list and held else None
        if type(value) not in exact:
            return False
        try:
            count = 1
            for size in value.shape:
                count *= int(size)
            return count == 1
        except Exception:  # noqa: BLE001 - a meta or broken tensor: unknown
            return False

    def module_name(self) -> Optional[str]:
        module_type = getattr(sys.modules.get("torch.nn.modules.module"), "Module", None)
        for name in self.assigned:
            if module_type is not None and isinstance(self.namespace.get(name), module_type):
                return name
        return None

    def suspect(self, gkey: tuple, group, gain: int, now: Snapshot, new: bool = True) -> Suspect:
        from ..core.why import Suspect  # noqa: PLC0415

        kind = gkey[0]
        if kind == "out":
            keys = [k for k in group.out_keys if isinstance(k, int)]
            exprs = [f"Out[{k}]" for k in sorted(keys)] or [e for e in group.exprs if e.startswith("Out")]
            underscores = [e for e in group.exprs if e.lstrip("_") == "" or e[1:].isdecimal()]
            return Suspect(exprs[0] if exprs else "Out", "output_cache", "free_or_semicolon", gain, new,
                           exprs=tuple(exprs[:3] + underscores[:2]))
        if kind == "traceback":
            return Suspect("traceback", "traceback", "free", gain, new, exprs=tuple(group.exprs[:2]),
                           frames=tuple(group.frames[:2]))
        if kind == "hook":
            dup = [h for h in now.hooks if h[0] == gkey[1]]
            return Suspect(f"{gkey[1]} hook", "hook", "remove_handle", gain, new,
                           hook=tuple(dup[0][:3]) if dup else None)
        roots = gkey[1]
        name = roots[0] if roots else (group.exprs[0] if group.exprs else "?")
        kinds = group.kinds
        if kinds & {"optimizer_params", "optimizer_grads", "optimizer"}:
            built = self.built_in(name)
            return Suspect(name, "optimizer", "rerun_cell" if built is not None else "recreate", gain, new,
                           cell=built, model=self.module_name())
        hooks = [h for h in now.hooks if name in h[3]]  # duplicated hooks that fill this name
        append = re.search(_APPEND.format(name=re.escape(name)), self.source)
        item = append.group(1) if append else None
        if kinds & {"graph", "shared_graph"} and append:
            # ``.item()`` raises on a tensor of more than one element: offered only for a scalar.
            fix = "append_item" if self.one_element(name, item) else "append_detached"
            return Suspect(name, "appended_graph", fix, gain, new, item=item)
        if hooks and name not in self.assigned and not append:
            return Suspect(name, "hook", "remove_handle", gain, new, hook=tuple(hooks[0][:3]))
        if append:
            return Suspect(name, "appended", "clear_or_del", gain, new, item=item)
        if kinds & {"graph", "shared_graph"}:
            return Suspect(name, "graph", "detach", gain, new)
        held = self.held_by_code(group.exprs)
        if held is not None and name not in self.assigned:
            kind, container, detail = held
            fix = {"default_argument": "default_none"}.get(kind, "clear")
            return Suspect(container.split(".")[0], kind, fix, gain, new, exprs=(detail,) if detail else (),
                           item=container)
        if name in self.assigned:
            return Suspect(name, "reassigned", "del_before_rerun", gain, new)
        model = self.module_name()
        return Suspect(name, "variable", "del", gain, new, model=model if model and "module" in kinds else None)
