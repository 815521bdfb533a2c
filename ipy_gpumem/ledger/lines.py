"""Measure memory line by line inside one cell: the engine of ``%%gpumem --lines``.

The cell's syntax tree gets a marker call before each of its own statements (inside loops, ``if``,
``with`` and ``try`` blocks too, never inside functions or classes it defines). A marker reads the
counters, folds the change since the previous marker into the line that just finished and resets
the peak counters, so each line gets its own delta and peak; lines of a loop aggregate over their
hits, as in line_profiler. Unlike ``sys.settrace``, markers cost nothing outside the cell's own
lines (library code runs at full speed: tracing would slow every Python call in a training step)
and they leave debuggers and coverage tools alone.
"""
from __future__ import annotations

import ast
import time
from typing import Optional, Sequence

from ..core.probes import PEAK_SLACK, MemoryProbe
from ..core.records import DeviceRecord, HostRecord, LineRecord

__all__ = ["LineTracer", "LineMarkers", "HOOK_NAME"]

#: The name the marker calls use; present in the user's namespace only while a cell is measured.
HOOK_NAME = "__ipy_gpumem_line__"


class _LineStats:
    """Running totals for one line (mutable while tracing; frozen into a LineRecord at the end)."""

    __slots__ = ("hits", "seconds", "host", "devices")

    def __init__(self, device_count: int):
        self.hits = 0
        self.seconds = 0.0
        # [before(first hit), after(last hit), peak(max), delta sum, max rise within one hit]
        self.host = [None, None, None, 0, None]
        # per device: [alloc before, after, peak, sum, reserved before, after, peak, sum, max rise]
        self.devices = [[None, None, None, 0, None, None, None, 0, None] for _ in range(device_count)]


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
        user_globals: the namespace the cell's code runs in; identifies the cell's frames.
        devices: CUDA device indices to read; None means every initialized device.
        track_peaks: reset peak counters at each line so each line's peak is its own.
    """

    def __init__(self, probe: MemoryProbe, user_globals: dict, devices: Optional[Sequence[int]] = None,
                 track_peaks: bool = True, include_host: bool = True):
        self.probe = probe
        self._globals = user_globals
        self._device_filter = None if devices is None else tuple(devices)
        self._devices: Optional[tuple] = None  # fixed once CUDA is up
        self._track_peaks = track_peaks
        self._include_host = include_host
        self._stats: dict = {}
        self._current = None  # (lineno, reading) of the line now running
        self._active = False
        self.reason: Optional[str] = None
        self.host_peak = None
        self.device_peaks: dict = {}

    # -- reading -----------------------------------------------------------------------------

    def _resolve_devices(self) -> tuple:
        if self._devices is not None:
            return self._devices
        cuda, _ = self.probe.cuda.status()
        if cuda is None:
            return ()
        found = self.probe.cuda.device_indices(cuda)
        if self._device_filter is not None:
            found = [i for i in found if i in self._device_filter]
        self._devices = tuple(found)
        return self._devices

    def _read(self):
        host = self.probe.host
        rss = host.rss() if self._include_host else None
        host_peak = host.peak_rss() if (self._include_host and self._track_peaks and host.can_reset_peak) else None
        devs = []
        cuda = self.probe.cuda
        for index in self._resolve_devices():
            allocated, reserved, peak_a, peak_r = cuda.counters(index)
            devs.append((allocated, reserved, peak_a, peak_r))
        return time.perf_counter(), rss, host_peak, devs

    def _reset(self, reading) -> None:
        """Reset the peak counters that are above their current value (a peak already at the
        current value measures the next line correctly as it is: one syscall saved per line)."""
        if not self._track_peaks:
            return
        _, rss, host_peak, devs = reading
        if self._include_host and (host_peak is None or rss is None or host_peak - rss > PEAK_SLACK):
            self.probe.host.reset_peak()
        cuda = self.probe.cuda
        for index, (allocated, reserved, peak_a, peak_r) in zip(self._resolve_devices(), devs):
            if peak_a != allocated or peak_r != reserved:
                cuda.reset_peak(index)

    def _fold(self, lineno: int, start, end) -> None:
        stats = self._stats.get(lineno)
        t0, rss0, _, devs0 = start
        t1, rss1, hpeak1, devs1 = end
        if stats is None:
            stats = self._stats[lineno] = _LineStats(len(devs1))
        stats.hits += 1
        stats.seconds += t1 - t0
        h = stats.host
        if h[0] is None:
            h[0] = rss0
        h[1] = rss1
        hit_peak = _mx(hpeak1, _mx(rss0, rss1))
        h[2] = _mx(h[2], hit_peak)
        self.host_peak = _mx(self.host_peak, h[2])
        if rss0 is not None and rss1 is not None:
            h[3] += rss1 - rss0
            h[4] = _mx(h[4], hit_peak - rss0)
        while len(stats.devices) < len(devs1):  # CUDA came up during this line
            stats.devices.append([None, None, None, 0, None, None, None, 0, None])
        for k, (a1, r1, pa1, pr1) in enumerate(devs1):
            a0, r0 = (devs0[k][0], devs0[k][1]) if k < len(devs0) else (0, 0)
            d = stats.devices[k]
            if d[0] is None:
                d[0], d[4] = a0, r0
            d[1], d[5] = a1, r1
            peak_a = _mx(_mx(a0, a1), pa1 if self._track_peaks else None)
            peak_r = _mx(_mx(r0, r1), pr1 if self._track_peaks else None)
            d[2] = _mx(d[2], peak_a)
            d[6] = _mx(d[6], peak_r)
            if a0 is not None and a1 is not None:
                d[3] += a1 - a0
                d[8] = _mx(d[8], peak_a - a0)
            if r0 is not None and r1 is not None:
                d[7] += r1 - r0
            index = self._devices[k]
            old = self.device_peaks.get(index, (None, None))
            self.device_peaks[index] = (_mx(old[0], d[2]), _mx(old[1], d[6]))

    def _boundary(self, next_lineno: Optional[int]) -> None:
        reading = self._read()
        if self._current is not None:
            self._fold(self._current[0], self._current[1], reading)
        if next_lineno is None:
            self._current = None
        else:
            self._reset(reading)
            # Nothing ran between the read and the reset, so the same reading is where the
            # next line starts, and its peaks are its own.
            self._current = (next_lineno, reading)

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
        """Put the marker hook in the user's namespace (the markers call it by name)."""
        self._active = True
        self._hook = _Hook(self.mark)
        self._globals[HOOK_NAME] = self._hook
        return True

    def stop(self) -> None:
        """Close the line still open (the cell ended, raised or awaits) and remove the marker hook."""
        if self._globals.get(HOOK_NAME) is getattr(self, "_hook", None):
            del self._globals[HOOK_NAME]
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
        devices = self._devices or ()
        for lineno in sorted(self._stats):
            stats = self._stats[lineno]
            shown = lineno + offset
            text = source_lines[shown - 1] if 0 < shown <= len(source_lines) else ""
            h = stats.host
            host = HostRecord(h[0], h[1], h[2], h[3], h[4]) if self._include_host else HostRecord()
            devs = []
            for k, d in enumerate(stats.devices):
                if k >= len(devices):
                    break
                index = devices[k]
                devs.append(DeviceRecord(
                    index=index,
                    name=(names or {}).get(index),
                    allocated_before=d[0], allocated_after=d[1], allocated_peak=d[2],
                    reserved_before=d[4], reserved_after=d[5], reserved_peak=d[6],
                    allocated_delta_sum=d[3], reserved_delta_sum=d[7], peak_increase_max=d[8],
                ))
            out.append(LineRecord(shown, text, stats.hits, host, tuple(devs), stats.seconds))
        return tuple(out)


class _Hook:
    """What the markers call: ``hook(lineno)`` before a statement, and ``hook.each(lineno, iterable)``
    around a ``for`` loop's iterable so that fetching each item (a DataLoader batch, say) counts
    for the loop's own line, as it does in line_profiler, not for the body's last line."""

    __slots__ = ("mark",)

    def __init__(self, mark):
        self.mark = mark

    def __call__(self, lineno: int) -> None:
        self.mark(lineno)

    def each(self, lineno: int, iterable):
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame if the iterable raises
        mark = self.mark
        iterator = iter(iterable)
        while True:
            try:
                item = next(iterator)
            except StopIteration:
                return
            yield item
            # The statement's own marker opened the first fetch; each later fetch is a new hit.
            mark(lineno)

    async def each_async(self, lineno: int, iterable):
        __tracebackhide__ = True  # noqa: F841
        mark = self.mark
        iterator = iterable.__aiter__()
        while True:
            try:
                item = await iterator.__anext__()
            except StopAsyncIteration:
                return
            yield item
            mark(lineno)


class LineMarkers(ast.NodeTransformer):
    """Insert ``__ipy_gpumem_line__(lineno)`` before every statement of a cell's own code.

    An IPython AST transformer (``shell.ast_transformers``), installed only while a ``--lines``
    cell runs. Compound statements at the cell's level (``for``, ``while``, ``if``, ``with``,
    ``try``, ``match``) get markers in their bodies too, and loops mark their own line at each
    iteration (``for`` when it fetches an item, ``while`` when it tests); ``def`` and ``class``
    bodies do not (their lines run later, inside the calling line). The one-line trampoline IPython makes of a leading
    cell magic (``get_ipython().run_cell_magic(...)``) is left alone: the body it runs is a cell of
    its own and gets its markers when it is compiled. It never raises: IPython unregisters a
    transformer that does.
    """

    _BODIES = ("body", "orelse", "finalbody")

    def __init__(self):
        super().__init__()
        #: Set before the measured cell compiles; cleared once its tree is marked, so code the
        #: cell itself compiles through IPython (a nested run_cell) is not mixed into its lines.
        self.armed = False

    def visit_Module(self, node):  # noqa: N802 - ast.NodeTransformer's naming
        try:
            if not self.armed or _is_trampoline(node):
                return node
            self.armed = False
            node.body = self._marked(node.body)
            return ast.fix_missing_locations(node)
        except Exception:  # noqa: BLE001
            return node

    def _marked(self, statements: list) -> list:
        out = []
        for stmt in statements:
            if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
                out.append(stmt)  # must stay first
                continue
            self._mark_children(stmt)
            if not isinstance(stmt, ast.While):  # a while loop marks itself at every test
                marker = ast.Expr(ast.Call(ast.Name(HOOK_NAME, ast.Load()), [ast.Constant(stmt.lineno)], []))
                out.append(ast.copy_location(marker, stmt))
            out.append(stmt)
        return out

    def _mark_children(self, stmt) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return
        line = ast.Constant(stmt.lineno)
        if isinstance(stmt, (ast.For, ast.AsyncFor)):
            # each item is fetched in the loop's own line: for x in hook.each(N, ITER)
            method = "each_async" if isinstance(stmt, ast.AsyncFor) else "each"
            func = ast.Attribute(ast.Name(HOOK_NAME, ast.Load()), method, ast.Load())
            stmt.iter = ast.copy_location(ast.Call(func, [line, stmt.iter], []), stmt.iter)
        elif isinstance(stmt, ast.While):
            # and each test of a while loop: while hook(N) or (TEST)  (the hook returns None)
            stmt.test = ast.copy_location(
                ast.BoolOp(ast.Or(), [ast.Call(ast.Name(HOOK_NAME, ast.Load()), [line], []), stmt.test]), stmt.test)
        for name in self._BODIES:
            body = getattr(stmt, name, None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                setattr(stmt, name, self._marked(body))
        for handler in getattr(stmt, "handlers", None) or ():  # try/except
            handler.body = self._marked(handler.body)
        for case in getattr(stmt, "cases", None) or ():  # match (3.10+)
            case.body = self._marked(case.body)


def _is_trampoline(module) -> bool:
    """``get_ipython().run_cell_magic(...)`` alone: how IPython compiles a cell starting with ``%%``."""
    if len(module.body) != 1 or not isinstance(module.body[0], ast.Expr):
        return False
    call = module.body[0].value
    return isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "run_cell_magic"
