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
* **Snapshots** (a walk within ``who()``'s budget) are taken only after a run that kept memory
  (first run: kept at least the threshold; re-run: grew by it). A snapshot keeps, per holder
  group (a variable and what hangs off it, IPython's output cache, the last traceback, the
  closures of a module's hooks), the bytes and the identities (address, size) of its storages:
  plain ints, never a tensor.
* **Suspects** are the groups that gained at least a quarter of the threshold since the previous
  run's snapshot *and* still hold storages alive at the end of the previous run: objects from
  the earlier run. A re-run that rebinds a name frees the old object, so its group gains nothing
  and nothing is reported; a cell that ran in between and made new tensors holds nothing old.
  Each suspect comes with its fix in the user's names (re-run the cell that built the optimizer,
  ``append(loss.item())``, ``%gpumem free``, ``handle.remove()``, ``del``), and a cell says so
  once per suspect.

Nothing here imports torch (it is read through ``sys.modules``), collects garbage, calls user
code, or keeps a reference to a user's object.
"""
from __future__ import annotations

import gc
import re
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..core.units import format_bytes

__all__ = ["RerunTracker", "Snapshot", "take_snapshot", "MAX_CELLS", "MAX_STORAGES"]

#: Distinct cells remembered (the oldest are forgotten first).
MAX_CELLS = 10_000
#: Cells whose last snapshot is kept (a snapshot holds one int per storage).
MAX_SNAPSHOTS = 32
#: Storages whose identities a snapshot keeps; past this it keeps only byte counts (no suspects).
MAX_STORAGES = 200_000
#: Modules (submodules included) whose hooks are examined.
MAX_MODULES = 10_000

_HOOK_DICTS = (("_forward_hooks", "forward hook"), ("_forward_pre_hooks", "forward pre-hook"),
               ("_backward_hooks", "backward hook"), ("_backward_pre_hooks", "backward pre-hook"))


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
        complete: the walk examined everything (no budget ran out).
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
    """Walk ``namespace`` within ``who()``'s budget; the storages alive now, by holder group.

    None when torch is not imported. Pauses the automatic garbage collector during the walk
    (as ``who()`` does) and never collects.
    """
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "_C") or not isinstance(namespace, dict):
        return None
    from ..attribution.walk import Walk
    from ..attribution.who import BUDGET_S

    start = time.perf_counter()
    budget = BUDGET_S if budget_s is None else budget_s
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        walk = Walk(torch, namespace, None, refs, budget, 10_000_000, start)
        with walk.no_torch_function():
            walk.run()
        rows: Dict[tuple, list] = {}
        for (_dev_id, ptr), (category, _p, _d, _w, order, role, ref, nbytes, dev) in walk.claims.items():
            row = rows.get((category, order, role, ref, id(dev)))
            if row is None:
                row = rows[(category, order, role, ref, id(dev))] = [0, [], dev]
            row[0] += nbytes
            row[1].append((ptr, nbytes))
        snap = Snapshot(complete=walk.stopped is None)
        keep_keys = len(walk.claims) <= MAX_STORAGES
        snap.keys = set() if keep_keys else None
        groups = snap.groups
        sizes: Dict[tuple, int] = {}  # (group key, expression) -> bytes: the largest reads first
        for (category, _order, role, ref, _dev), (nbytes, storages, dev) in rows.items():
            holder = walk.holder(category, role, ref, dev, nbytes)
            snap.total += nbytes
            key = _group_key(holder)
            if key is None:
                continue
            group = groups.get(key)
            if group is None:
                group = groups[key] = _Group()
            group.bytes += nbytes
            group.kinds.add(holder.kind)
            if holder.expr:
                sizes[(key, holder.expr)] = sizes.get((key, holder.expr), 0) + nbytes
                if holder.expr not in group.exprs:
                    group.exprs.append(holder.expr)
            if holder.frame and holder.frame not in group.frames:
                group.frames.append(holder.frame)
            for k in holder.keys:
                if k not in group.out_keys:
                    group.out_keys.append(k)
            if keep_keys:
                ids = [_identity(ptr, size) for ptr, size in storages]
                group.keys.update(ids)
                snap.keys.update(ids)
        for key, group in groups.items():
            group.exprs.sort(key=lambda expr: -sizes.get((key, expr), 0))
        seen = {ptr for (_dev_id, ptr) in walk.claims}
        _scan_hooks(torch, namespace, snap, seen, keep_keys)
    except Exception:  # noqa: BLE001 - a snapshot is a nicety; the cell's record stands without it
        return None
    finally:
        if enabled:
            gc.enable()
    snap.elapsed_s = time.perf_counter() - start
    return snap


def _identity(ptr: int, size: int) -> int:
    return (ptr << 20) ^ size


def _scan_hooks(torch, namespace: dict, snap: Snapshot, seen: set, keep_keys: bool) -> None:
    """Modules' hooks: functions registered more than once, and tensors only their closures hold."""
    module_type = getattr(sys.modules.get("torch.nn.modules.module"), "Module", None)
    tensor_base = getattr(torch._C, "TensorBase", None)
    if module_type is None or tensor_base is None:
        return
    storage_of = tensor_base.untyped_storage
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
        for attr, label in _HOOK_DICTS:
            hooks = attrs.get(attr)
            if not isinstance(hooks, dict) or not hooks:
                continue
            same: Dict[tuple, int] = {}
            names: Dict[tuple, frozenset] = {}
            for fn in list(hooks.values()):
                code = getattr(fn, "__code__", None)
                if code is not None:
                    sig = (getattr(fn, "__qualname__", ""), code.co_code, code.co_firstlineno)
                    same[sig] = same.get(sig, 0) + 1
                    names[sig] = frozenset(code.co_names) | frozenset(code.co_freevars)
                _closure_tensors(fn, tensor_base, storage_of, snap, ("hook", expr), seen, keep_keys)
            for sig, count in same.items():
                if count >= 2:  # one function registered again on every run
                    snap.hooks.append((expr, label, count, names[sig]))
        children = attrs.get("_modules")
        if isinstance(children, dict):
            stack.extend((f"{expr}.{name}", child) for name, child in list(children.items())
                         if isinstance(child, module_type))


def _closure_tensors(fn, tensor_base, storage_of, snap: Snapshot, key: tuple, seen: set, keep_keys: bool) -> None:
    """Tensors a hook's closure holds (directly or one container deep) that the walk did not count."""
    cells = getattr(fn, "__closure__", None) or ()
    values = []
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, (list, tuple, set)):
            values.extend(list(value)[:10_000])
        elif isinstance(value, dict):
            values.extend(list(value.values())[:10_000])
        else:
            values.append(value)
    for value in values:
        if not isinstance(value, tensor_base):
            continue
        try:
            storage = storage_of(value)
            ptr, size = storage.data_ptr(), storage.nbytes()
        except Exception:  # noqa: BLE001 - sparse layouts and wrappers: left out
            continue
        if not ptr or size <= 0 or ptr in seen:
            continue
        seen.add(ptr)
        group = snap.groups.get(key)
        if group is None:
            group = snap.groups[key] = _Group()
            group.kinds.add("hook")
            group.exprs.append(key[1])
        group.bytes += size
        snap.total += size
        if keep_keys:
            group.keys.add(_identity(ptr, size))
            snap.keys.add(_identity(ptr, size))


# ---------------------------------------------------------------------------------------------
# Per cell
# ---------------------------------------------------------------------------------------------


class _Cell:
    """What is remembered of one cell between its runs (numbers only)."""

    __slots__ = ("first", "runs", "last", "end", "snapshot", "warned")

    def __init__(self, first, end):
        self.first = first
        self.runs = 1
        self.last = first
        self.end = end
        self.snapshot: Optional[Snapshot] = None
        self.warned: set = set()


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
        self._cells: Dict[Any, _Cell] = {}
        self._snapshots: List[_Cell] = []  # cells holding a snapshot, oldest first

    def clear(self) -> None:
        self._cells.clear()
        self._snapshots.clear()

    def after_cell(self, measurement, threshold: int, ledger=None) -> bool:
        """Note a finished outermost cell; set ``measurement.rerun``; True when it has a new warning.

        The common case (a cell that kept nothing) costs a hash, a dict lookup and a few stores.
        """
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
        rerun = {"of": cell.first, "runs": cell.runs, "previous": previous_count, "growth": None, "suspects": [],
                 "causes": [], "warning": None}
        measurement.rerun = rerun
        device_growth = _device_growth(previous_end, end)
        if device_growth is not None:
            rerun["growth"] = device_growth
            grew = device_growth >= threshold
        else:
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
            self._drop(cell)  # nothing kept: the next comparison starts from a fresh snapshot
            return False
        now = self._snap(cell)
        if now is None or old is None:
            return False
        if device_growth is None:
            rerun["growth"] = now.total - old.total  # exact: tensor bytes alive after each run
            if rerun["growth"] < max(threshold // 4, 1):
                self._drop(cell)  # it stopped growing: later runs are checked again only if RSS grows
        if rerun["growth"] < threshold:
            return False
        suspects = _suspects(old, now, max(threshold // 4, 1))
        if not suspects:
            return False
        context = _Wording(measurement.source, ledger, cell.first, self._namespace())
        names, causes, new = [], [], []
        for gkey, group, gain in suspects:
            name, cause = context.explain(gkey, group, gain, now)
            names.append(name)
            causes.append(cause)
            if gkey not in cell.warned:
                new.append(cause)
                cell.warned.add(gkey)
        rerun["suspects"] = names
        rerun["causes"] = causes
        if new:
            rerun["warning"] = (f"Re-run of {_label(cell.first)} (run {cell.runs}) kept "
                                f"{format_bytes(rerun['growth'])} more than the previous run:")
            rerun["causes_new"] = new
        return bool(new)

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
        snap = take_snapshot(namespace, refs, self.budget_s)
        self._drop(cell)
        if snap is None:
            return None
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


def _label(count) -> str:
    return f"[{count}]" if count is not None else "[ ]"


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


_APPEND = r"\b{name}\s*\.\s*(?:append|extend|insert)\s*\((?:[^()]*,\s*)?([A-Za-z_][\w.]*)\s*\)"
_ASSIGNED = re.compile(r"^[ \t]*([A-Za-z_]\w*)[ \t]*(?::[^=\n]*)?=(?!=)", re.M)


class _Wording:
    """Turns a suspect group into a name and a sentence with its fix, in the user's names."""

    def __init__(self, source: str, ledger, first, namespace):
        self.source = source or ""
        self.ledger = ledger
        self.first = first
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

    def module_name(self) -> Optional[str]:
        module_type = getattr(sys.modules.get("torch.nn.modules.module"), "Module", None)
        for name in self.assigned:
            if module_type is not None and isinstance(self.namespace.get(name), module_type):
                return name
        return None

    def explain(self, gkey: tuple, group: _Group, gain: int, now: Snapshot) -> Tuple[str, str]:
        size = format_bytes(gain)
        kind = gkey[0]
        if kind == "out":
            keys = [k for k in group.out_keys if isinstance(k, int)]
            exprs = [f"Out[{k}]" for k in sorted(keys)] or [e for e in group.exprs if e.startswith("Out")]
            underscores = [e for e in group.exprs if e.lstrip("_") == "" or e[1:].isdecimal()]
            held = " and ".join(_ticks(exprs[:3] + underscores[:2])) or "IPython's output cache"
            return (exprs[0] if exprs else "Out", f"{held} keep the displayed tensor ({size}): `%gpumem free` or end "
                    "the line with `;`")
        if kind == "traceback":
            where = ", ".join(f"{f}()" for f in group.frames[:2])
            local = f" ({where} local {', '.join(_ticks(group.exprs[:2]))})" if where else ""
            return ("traceback", f"the last error's traceback holds its frames{local}, {size} from an earlier run: "
                    "`%gpumem free`")
        if kind == "hook":
            dup = [h for h in now.hooks if h[0] == gkey[1]]
            return (f"{gkey[1]} hook", self._hook_sentence(gkey[1], dup, size, "its closure keeps"))
        roots = gkey[1]
        name = roots[0] if roots else (group.exprs[0] if group.exprs else "?")
        kinds = group.kinds
        if kinds & {"optimizer_params", "optimizer_grads", "optimizer"}:
            built = self.built_in(name)
            model = self.module_name()
            what = f"the old `{model}`'s parameters" if model else "the parameters of an earlier model"
            where = f" (built in [{built}])" if built is not None else ""
            fix = f"re-run [{built}] after this cell" if built is not None else f"re-create `{name}` after this cell"
            return name, f"`{name}`{where} still holds {what} ({size}): {fix}"
        hooks = [h for h in now.hooks if name in h[3]]  # duplicated hooks that fill this name
        append = re.search(_APPEND.format(name=re.escape(name)), self.source)
        if kinds & {"graph", "shared_graph"} and append:
            item = append.group(1)
            return name, (f"`{name}.append({item})` keeps each run's graph ({size}): append `{item}.item()` "
                          f"(or `{item}.detach()`)")
        if hooks and name not in self.assigned and not append:
            return name, self._hook_sentence(hooks[0][0], hooks, size, f"`{name}` gains")
        if append:
            item = append.group(1)
            return name, (f"`{name}` gains {size} on every run (`{name}.append({item})`): clear it at the top of "
                          f"the cell (`{name}.clear()`) or `del` what you no longer need")
        if kinds & {"graph", "shared_graph"}:
            return name, (f"`{name}` keeps an earlier run's graph ({size}): keep `.item()` or `.detach()` "
                          "instead of the tensor")
        if name in self.assigned:
            return name, (f"`{name}` still holds tensors from the earlier run ({size}): `del` them before "
                          "re-running, or clear it at the top of the cell")
        model = self.module_name()
        what = f"the earlier run's `{model}`" if model and "module" in kinds else "tensors from the earlier run"
        return name, f"`{name}` still holds {what} ({size}): `del {name}` (or rebind it)"

    def _hook_sentence(self, module: str, dup, size: str, lead: str) -> str:
        if dup:
            mod, label, count = dup[0][:3]
            return (f"a {label} is registered on every run (`{mod}` has {count} copies of it; {lead} {size}): keep "
                    "its handle and call `handle.remove()` before registering it again")
        return f"a hook on `{module}`: {lead} {size}: keep its handle and call `handle.remove()`"


def _ticks(items) -> List[str]:
    return [f"`{item}`" for item in items]
