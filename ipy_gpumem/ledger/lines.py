"""Measure memory line by line inside one cell: the engine of ``%%gpumem --lines``.

The cell's syntax tree gets a marker call before each of its own statements (inside loops, ``if``,
``with`` and ``try`` blocks too, never inside functions or classes it defines). A marker reads the
counters, folds the change since the previous marker into the line that just finished and resets
the peak counters, so each line gets its own delta and peak; lines of a loop aggregate over their
hits, as in line_profiler. Unlike ``sys.settrace``, markers cost nothing outside the cell's own
lines (library code runs at full speed: tracing would slow every Python call in a training step)
and they leave debuggers and coverage tools alone.

Markers never change what the user's code does or which errors it raises: they wrap nothing (a
``for`` loop's iterable is iterated by the loop itself, so ``for x in 5`` and ``async for x in
[1, 2]`` fail exactly as without them), and they call a hook that lives in ``builtins`` for the
duration of the cell, so a cell that runs ``%reset -f`` or reloads the extension keeps working and
the user's namespace is never touched. IPython's debugger steps over the hook
(``__debuggerskip__``) and tracebacks hide it (``__tracebackhide__``).
"""
from __future__ import annotations

import ast
import builtins
import time
from typing import List, NamedTuple, Optional, Sequence

from ..core.probes import PEAK_SLACK, MemoryProbe
from ..core.records import DeviceRecord, HostRecord, LineRecord, LoopSpan

__all__ = ["LineTracer", "LineMarkers", "HOOK_NAME", "remove_hook"]

#: The most of a cell's time the roles' census may take (see ``LineTracer._roles``).
CENSUS_SHARE = 0.10

#: The name the marker calls use; bound in ``builtins`` while a ``--lines`` cell may run.
HOOK_NAME = "__ipy_gpumem_line__"


class _Hook:
    """What the markers call: ``__ipy_gpumem_line__(lineno)`` before a statement. A no-op when no
    tracer is active (a cell that unloaded the extension half-way still runs to its end)."""

    __slots__ = ("target",)

    def __init__(self):
        self.target = None

    def __call__(self, lineno: int) -> None:
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame in tracebacks
        __debuggerskip__ = True  # noqa: F841 - IPython's debugger steps over it and what it calls
        target = self.target
        if target is not None:
            target(lineno)


_HOOK = _Hook()


def _install_hook(mark) -> None:
    _HOOK.target = mark
    if getattr(builtins, HOOK_NAME, None) is not _HOOK:
        setattr(builtins, HOOK_NAME, _HOOK)


def remove_hook() -> None:
    """Take the hook out of ``builtins`` (when no marked cell can still be running)."""
    _HOOK.target = None
    if getattr(builtins, HOOK_NAME, None) is _HOOK:
        delattr(builtins, HOOK_NAME)


class _Quantity:
    """Running totals of one quantity (host RSS, or one device's allocated/reserved) over a line's hits."""

    __slots__ = ("before", "after", "peak", "net", "rise")

    def __init__(self):
        self.before = None  # value when the line first started
        self.after = None  # value when it last finished
        self.peak = None  # highest value while it ran
        self.net = 0  # changes summed over its hits
        self.rise = None  # the largest rise above the starting value within one hit

    def fold(self, start, end, hit_peak) -> None:
        # Runs at every marker: plain comparisons, no helper calls.
        if self.before is None:
            self.before = start
        self.after = end
        if hit_peak is not None and (self.peak is None or hit_peak > self.peak):
            self.peak = hit_peak
        if start is not None and end is not None:
            self.net += end - start
            if hit_peak is not None:
                rise = hit_peak - start
                if self.rise is None or rise > self.rise:
                    self.rise = rise


class _DeviceStats:
    __slots__ = ("allocated", "reserved")

    def __init__(self):
        self.allocated = _Quantity()
        self.reserved = _Quantity()


class _LineStats:
    """Running totals for one line (mutable while tracing; frozen into a LineRecord at the end)."""

    __slots__ = ("hits", "seconds", "host", "devices", "temporaries", "change", "first", "last")

    def __init__(self):
        self.hits = 0
        self.seconds = 0.0
        self.host = _Quantity()
        self.devices: dict = {}  # device index -> _DeviceStats
        self.temporaries: dict = {}  # device label -> the most that came and went within one hit
        # Roles (a census at each boundary): the change summed over hits, and the first and the
        # latest hit's own change with what held memory before it (for the line's sentence).
        self.change = None
        self.first = None  # (Change, seen, before Snapshot, after Snapshot)
        self.last = None


class _Reading(NamedTuple):
    """Counters at one line boundary."""

    t: float
    rss: Optional[int]
    peak_rss: Optional[int]
    #: device index -> (allocated, reserved, peak allocated, peak reserved)
    devices: dict


def _mx(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a if a >= b else b


class LineTracer:
    """Per-line memory for one cell. ``start()`` before the cell runs, ``stop()`` after.

    Args:
        probe: the memory probe (host RSS and torch's counters).
        devices: CUDA device indices to read; None means every initialized device.
        track_peaks: reset peak counters at each line so each line's peak is its own (this also
            resets the peaks the user's own code reads, as the per-cell reset does).
        include_host: measure host RSS too.
    """

    def __init__(self, probe: MemoryProbe, devices: Optional[Sequence[int]] = None, track_peaks: bool = True,
                 include_host: bool = True, census=None):
        self.probe = probe
        #: A callable returning a census ``Snapshot`` (``ipy_gpumem.anatomy.census``): the roles of
        #: each line come from the census at its boundaries. None measures no roles.
        self.census = census
        self.first_snapshot = None
        self._snapshot = None
        self._seen: set = set()  # (role, owner) pairs that held memory at some boundary so far
        # The census's cost is kept under CENSUS_SHARE of the cell's time: a boundary that comes
        # sooner is skipped (a tight loop of trivial lines), and the next census's change goes to
        # the line that ends there. The report says how many boundaries were skipped.
        self._census_s = 0.0
        self._t0 = None
        self.census_skipped = 0
        self.census_taken = 0
        self._device_filter = None if devices is None else tuple(devices)
        self._devices: Optional[tuple] = None  # fixed once a device with a context is found
        self._track_peaks = track_peaks
        self._include_host = include_host
        self._stats: dict = {}
        self._current = None  # (lineno, reading) of the line now running
        host = probe.host
        # With a resettable high-water mark, a boundary reads the finishing line's peak, resets the
        # mark, and reads the RSS back from it (it equals the RSS right after a reset): one /proc
        # access per line instead of two, which is most of a marker's cost on some kernels.
        self._resets = include_host and track_peaks and host.can_reset_peak
        self._rss = host.rss if include_host else None
        self._peak_rss = host.peak_rss if self._resets else None
        self._reset_peak = host.reset_peak
        self._rss_after_reset = host.rss_after_reset
        # A CPU-only build never brings CUDA up: no need to ask at every marker.
        self._no_cuda = probe.cuda.device_count() == 0
        self._active = False
        self.reason: Optional[str] = None
        self.host_peak = None
        self.device_peaks: dict = {}
        self.loops: tuple = ()  # LoopSpans of the marked code (its own line numbers)

    # -- reading -----------------------------------------------------------------------------

    def _resolve_devices(self) -> tuple:
        if self._devices is not None:
            return self._devices
        if self._no_cuda:
            return ()
        cuda, _ = self.probe.cuda.status()
        if cuda is None:
            return ()
        found = self.probe.cuda.device_indices(cuda)
        if self._device_filter is not None:
            found = [i for i in found if i in self._device_filter]
        # CUDA can be up before any device has a context: keep looking until one has, rather
        # than caching "no device" for the rest of the cell.
        if found:
            self._devices = tuple(found)
        return tuple(found)

    def _read(self, next_line: bool = True) -> _Reading:
        if self._resets and next_line:
            peak = self._peak_rss()
            rss = self._rss_after_reset() if self._reset_peak() else self._rss()
        else:
            rss = self._rss() if self._rss is not None else None
            peak = self._peak_rss() if self._peak_rss is not None else None
        indices = self._devices if self._devices is not None else self._resolve_devices()
        devices = {}
        if indices:
            counters = self.probe.cuda.counters
            for index in indices:
                devices[index] = counters(index)
        return _Reading(time.perf_counter(), rss, peak, devices)

    def _reset(self, reading: _Reading) -> None:
        """Reset the peak counters that are above their current value (a peak already at the
        current value measures the next line correctly as it is: one syscall saved per line)."""
        if not self._track_peaks:
            return
        if self._include_host and not self._resets:
            rss, peak = reading.rss, reading.peak_rss
            if peak is None or rss is None or peak - rss > PEAK_SLACK:
                self.probe.host.reset_peak()
        cuda = self.probe.cuda
        for index, (allocated, reserved, peak_a, peak_r) in reading.devices.items():
            if peak_a != allocated or peak_r != reserved:
                cuda.reset_peak(index)

    def _fold(self, lineno: int, start: _Reading, end: _Reading) -> None:
        stats = self._stats.get(lineno)
        if stats is None:
            stats = self._stats[lineno] = _LineStats()
        stats.hits += 1
        stats.seconds += end.t - start.t
        hit_peak = _mx(end.peak_rss, _mx(start.rss, end.rss))
        if hit_peak is not None:
            temporary = hit_peak - _mx(start.rss, end.rss)
            if temporary > stats.temporaries.get("cpu", 0):
                stats.temporaries["cpu"] = temporary
        host = stats.host
        host.fold(start.rss, end.rss, hit_peak)
        if host.peak is not None and (self.host_peak is None or host.peak > self.host_peak):
            self.host_peak = host.peak
        if not end.devices:
            return
        for index, (a1, r1, pa1, pr1) in end.devices.items():
            # A device that CUDA brought up during this line started at zero.
            a0, r0 = start.devices.get(index, (0, 0, 0, 0))[:2]
            dev = stats.devices.get(index)
            if dev is None:
                dev = stats.devices[index] = _DeviceStats()
            alloc_peak = _mx(_mx(a0, a1), pa1 if self._track_peaks else None)
            dev.allocated.fold(a0, a1, alloc_peak)
            dev.reserved.fold(r0, r1, _mx(_mx(r0, r1), pr1 if self._track_peaks else None))
            temporary = alloc_peak - max(a0, a1)
            label = f"cuda:{index}"
            if temporary > stats.temporaries.get(label, 0):
                stats.temporaries[label] = temporary
            old = self.device_peaks.get(index, (None, None))
            self.device_peaks[index] = (_mx(old[0], dev.allocated.peak), _mx(old[1], dev.reserved.peak))

    def _boundary(self, next_lineno: Optional[int]) -> None:
        reading = self._read(next_lineno is not None)
        if self._current is not None:
            self._fold(self._current[0], self._current[1], reading)
        if self.census is not None:
            self._roles(self._current[0] if self._current is not None else None, next_lineno is None)
        if next_lineno is None:
            self._current = None
        else:
            self._reset(reading)
            # Nothing ran between the read and the reset, so the same reading is where the
            # next line starts, and its peaks are its own.
            self._current = (next_lineno, reading)

    def _roles(self, lineno: Optional[int], final: bool = False) -> None:
        """Census now; the change since the previous boundary belongs to the line that just ran."""
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now
        elif not final and self._census_s > CENSUS_SHARE * (now - self._t0):
            self.census_skipped += 1
            return
        snap = self.census()
        self._census_s += time.perf_counter() - now
        self.census_taken += 1
        before = self._snapshot
        self._snapshot = snap
        if before is None:
            self.first_snapshot = snap
        elif lineno is not None:
            stats = self._stats.get(lineno)
            if stats is not None:
                change = snap.diff(before)
                stats.change = change if stats.change is None else stats.change.add(change)
                hit = (change, frozenset(self._seen), before, snap)
                if stats.first is None:
                    stats.first = hit
                stats.last = hit
        for (_dev, role, owner), value in snap.parts.items():
            if value > 0:
                self._seen.add((role, owner))

    @property
    def last_snapshot(self):
        """The census at the latest boundary (the cell's end once stopped)."""
        return self._snapshot

    # -- markers -----------------------------------------------------------------------------

    def mark(self, lineno: int) -> None:
        """Called by the marker before each statement of the cell: a line boundary."""
        if not self._active:
            return
        try:
            self._boundary(lineno)
        except Exception as exc:  # noqa: BLE001 - a raising marker would raise into the cell
            self._active = False
            self.reason = f"line measurement stopped: {type(exc).__name__}: {exc}"

    def start(self) -> bool:
        """Make the markers call this tracer (the hook goes into ``builtins`` for the cell)."""
        self._active = True
        _install_hook(self.mark)
        return True

    def stop(self) -> None:
        """Close the line still open (the cell ended, raised or awaits); markers become no-ops.

        The hook stays in ``builtins`` until :func:`remove_hook`: code of this cell may still run
        its markers after an unload, and a missing name would raise NameError into it.
        """
        if _HOOK.target == self.mark:
            _HOOK.target = None
        if self._active and self._current is not None:
            try:
                self._boundary(None)
            except Exception as exc:  # noqa: BLE001
                self.reason = f"line measurement stopped: {type(exc).__name__}: {exc}"
        self._active = False

    # -- result ------------------------------------------------------------------------------

    def records(self, source_lines: Sequence[str], offset: int = 0, names=None) -> tuple:
        """Freeze the totals into LineRecords, numbered like ``source_lines`` (1-based).

        ``offset`` maps the traced code's line numbers onto ``source_lines`` (leading magic
        lines that the traced code does not contain).
        """
        out = []
        for lineno in sorted(self._stats):
            stats = self._stats[lineno]
            shown = lineno + offset
            text = source_lines[shown - 1] if 0 < shown <= len(source_lines) else ""
            h = stats.host
            host = HostRecord(h.before, h.after, h.peak, h.net, h.rise) if self._include_host else HostRecord()
            devs = []
            for index in sorted(stats.devices):
                d = stats.devices[index]
                a, r = d.allocated, d.reserved
                devs.append(DeviceRecord(
                    index=index,
                    name=(names or {}).get(index),
                    allocated_before=a.before, allocated_after=a.after, allocated_peak=a.peak,
                    reserved_before=r.before, reserved_after=r.after, reserved_peak=r.peak,
                    allocated_delta_sum=a.net, reserved_delta_sum=r.net, peak_increase_max=a.rise,
                ))
            roles = reason = None
            if self.census is not None:
                roles, reason = _line_roles(stats, devs)
            out.append(LineRecord(shown, text, stats.hits, host, tuple(devs), stats.seconds, roles=roles,
                                  temporaries=dict(stats.temporaries) or None, reason=reason))
        return tuple(out)

    def loop_spans(self, offset: int = 0) -> tuple:
        """The cell's loops in the numbering of :meth:`records`."""
        return tuple(LoopSpan(s.first + offset, s.last + offset, s.kind) for s in self.loops)


def _line_roles(stats: _LineStats, devices) -> tuple:
    """A line's role table (its census change summed over hits, with the GPU-only roles from its
    counters) and its sentence (from its first hit, and its latest when that differs)."""
    from ..anatomy.account import gpu_extras, with_extras
    from ..anatomy.reasons import describe

    change = stats.change
    parts = change.parts if change is not None else {}
    extras = {dev.label: gpu_extras(dev, parts) for dev in devices}
    roles = with_extras(change.table if change is not None else {}, extras)
    reason = None
    if stats.first is not None:
        first_change, seen, before, after = stats.first
        first_extras = extras if stats.hits == 1 else None
        temporaries = max(stats.temporaries.values(), default=None) if stats.hits == 1 else None
        reason = describe(first_change.parts, before, after, seen=seen, temporaries=temporaries,
                          extra=_merged(first_extras))
        if stats.hits > 1 and stats.last is not stats.first:
            last_change, seen, before, after = stats.last
            later = describe(last_change.parts, before, after, seen=seen)
            first_text = reason or "nothing"
            if later != reason:
                reason = f"first hit: {first_text}; last hit: {later or 'nothing'}"
            elif reason is not None:
                reason = f"each hit: {reason}"
    return roles, reason


def _merged(extras):
    if not extras:
        return None
    out: dict = {}
    for row in extras.values():
        for role, value in row.items():
            out[role] = out.get(role, 0) + value
    return out


class LineMarkers(ast.NodeTransformer):
    """Insert ``__ipy_gpumem_line__(lineno)`` before every statement of a cell's own code.

    An IPython AST transformer (``shell.ast_transformers``), installed only while a ``--lines``
    cell runs. Compound statements at the cell's level (``for``, ``while``, ``if``, ``with``,
    ``try``, ``match``) get markers in their bodies too, and loops mark their own line at each
    iteration: a ``for`` line at the end of its body and before each ``continue`` (so fetching
    the next item, a DataLoader batch say, counts for the loop's line, as in line_profiler), a
    ``while`` line in its test. ``def`` and ``class`` bodies get none (their lines run later,
    inside the calling line). Statements sharing a line (``a = 1; b = 2``) get one marker: one
    hit of that line. The one-line trampoline IPython makes of a leading cell magic
    (``get_ipython().run_cell_magic(...)``) is left alone: the body it runs is a cell of its own
    and gets its markers when it is compiled. It never raises: IPython unregisters a
    transformer that does.
    """

    _BODIES = ("body", "orelse", "finalbody")

    def __init__(self):
        super().__init__()
        #: Set before the measured cell compiles; cleared once its tree is marked, so code the
        #: cell itself compiles through IPython (a nested run_cell) is not mixed into its lines.
        self.armed = False
        #: The tracer that receives the marked cell's loop spans.
        self.tracer: Optional[LineTracer] = None

    def visit_Module(self, node):  # noqa: N802 - ast.NodeTransformer's naming
        try:
            if not self.armed or _is_trampoline(node):
                return node
            self.armed = False
            loops: List[LoopSpan] = []
            node.body = self._marked(node.body, None, loops)
            if self.tracer is not None:
                self.tracer.loops = tuple(loops)
            return ast.fix_missing_locations(node)
        except Exception:  # noqa: BLE001
            return node

    @staticmethod
    def _marker(lineno: int, where) -> ast.stmt:
        call = ast.Call(ast.Name(HOOK_NAME, ast.Load()), [ast.Constant(lineno)], [])
        return ast.copy_location(ast.Expr(call), where)

    def _marked(self, statements: list, parent_line: Optional[int], loops: list) -> list:
        out = []
        last = parent_line  # a statement on the line already marked gets no marker of its own
        for stmt in statements:
            if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
                out.append(stmt)  # must stay first
                continue
            self._mark_children(stmt, loops)
            # a while loop marks itself at every test
            if not isinstance(stmt, ast.While) and stmt.lineno != last:
                out.append(self._marker(stmt.lineno, stmt))
            last = stmt.lineno
            out.append(stmt)
        return out

    def _mark_children(self, stmt, loops: list) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return
        line = stmt.lineno
        is_for = isinstance(stmt, (ast.For, ast.AsyncFor))
        if is_for or isinstance(stmt, ast.While):
            loops.append(LoopSpan(line, getattr(stmt, "end_lineno", None) or line,
                                  "while" if isinstance(stmt, ast.While) else "for"))
        if isinstance(stmt, ast.While):
            # while hook(N) or (TEST): the hook returns None, so the test's value is unchanged
            call = ast.Call(ast.Name(HOOK_NAME, ast.Load()), [ast.Constant(line)], [])
            stmt.test = ast.copy_location(ast.BoolOp(ast.Or(), [call, stmt.test]), stmt.test)
        for name in self._BODIES:
            body = getattr(stmt, name, None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                marked = self._marked(body, line if name == "body" else None, loops)
                if is_for and name == "body":
                    # The next item is fetched after the body: that fetch is the loop line's.
                    _mark_continues(marked, line, self._marker)
                    marked.append(self._marker(line, stmt))
                setattr(stmt, name, marked)
        for handler in getattr(stmt, "handlers", None) or ():  # try/except
            handler.body = self._marked(handler.body, None, loops)
        for case in getattr(stmt, "cases", None) or ():  # match (3.10+)
            case.body = self._marked(case.body, None, loops)


def _mark_continues(statements: list, line: int, marker) -> None:
    """Put the loop line's marker before each ``continue`` of this loop (not of nested loops)."""
    k = 0
    while k < len(statements):
        stmt = statements[k]
        if isinstance(stmt, ast.Continue):
            statements.insert(k, marker(line, stmt))
            k += 2
            continue
        if not isinstance(stmt, (ast.For, ast.AsyncFor, ast.While, ast.FunctionDef, ast.AsyncFunctionDef,
                                 ast.ClassDef)):
            for name in ("body", "orelse", "finalbody"):
                body = getattr(stmt, name, None)
                if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                    _mark_continues(body, line, marker)
            for handler in getattr(stmt, "handlers", None) or ():
                _mark_continues(handler.body, line, marker)
            for case in getattr(stmt, "cases", None) or ():
                _mark_continues(case.body, line, marker)
        k += 1


def _is_trampoline(module) -> bool:
    """``get_ipython().run_cell_magic(...)`` alone: how IPython compiles a cell starting with ``%%``."""
    if len(module.body) != 1 or not isinstance(module.body[0], ast.Expr):
        return False
    call = module.body[0].value
    return isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "run_cell_magic"
