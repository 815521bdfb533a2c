"""The cells in flight: one frame per ``run_cell``, nested cells inside cells, and frames of cells that ended without telling us dropped.

``%%capture``, ``%rerun`` and ``run_cell`` calls run cells inside cells: only the outermost is "the
cell" the user ran. A frame never outlives its cell: a cell whose exception cannot be formatted,
or a ``BaseException`` escaping ``run_cell_async``, never gets a matching ``post_run_cell``, and
its frame would make every later cell look nested (no records, no OOM panel). So the stack is
checked against the ``run_cell_async`` frames that are really live whenever it is not empty, and
frames of cells that ended are dropped (their line tracer and phase hooks stopped by ``on_drop``).
"""
from __future__ import annotations

import sys
from typing import Callable, Iterator, List, Optional, Tuple

__all__ = ["Frame", "CellStack", "live_runners", "exception_marker", "cell_error"]


class Frame:
    """One ``run_cell`` in flight: what it runs and what measures it."""

    # No __slots__: what only a %%gpumem cell has is a class default, so an ordinary cell's frame
    # (one before every cell) stores five values.
    header = None
    tracer = None  # the LineTracer of a --lines cell
    reported_inside = False  # a nested %%gpumem cell showed its report: no line for this one
    snapshot = None  # the census when a %%gpumem cell started (its roles' "before")
    trace = None  # the CellTrace of a --trace cell
    phases = None  # the PhaseWatcher of a %%gpumem cell

    def __init__(self, info, raw, measurement=None, header=None, tracer=None, marker=None, cell_id=None):
        self.info = info
        self.raw = raw
        self.cell_id = cell_id
        self.measurement = measurement
        self.marker = marker  # sys.last_value's marker when it started (see exception_marker)
        if header is not None:
            self.header = header
        if tracer is not None:
            self.tracer = tracer


_SYS = sys.__dict__  # the module's attributes, read without raising for a missing one


def live_runners(code, skip: int = 1) -> int:
    """How many frames running ``code`` (IPython's ``run_cell_async``) are on the stack now."""
    count, frame = 0, sys._getframe(skip)
    while frame is not None:
        if frame.f_code is code:
            count += 1
        frame = frame.f_back
    return count


def exception_marker():
    """Something that changes whenever IPython records a new error in ``sys.last_value``.

    Exceptions cannot be weakly referenced and we must not keep one alive, so the marker is the
    object's id and type: a new error replaces the old one while both are alive, so its id differs.
    """
    value = _SYS.get("last_value")  # not getattr: a missing attribute costs an exception, before and after every cell
    return None if value is None else (id(value), type(value))


def cell_error(result, marker) -> Tuple[Optional[str], Optional[str]]:
    """The class name and message of the cell's error, also when ``%%time`` swallowed it."""
    exc = getattr(result, "error_in_exec", None) or getattr(result, "error_before_exec", None)
    if exc is None:
        last = _SYS.get("last_value")  # exception_marker(), inlined: this runs after every cell
        if last is not None and (id(last), type(last)) != marker:
            exc = last
    if exc is None:
        return None, None
    try:
        message = str(exc)
    except BaseException:  # noqa: BLE001 - a user __str__ may raise anything
        message = None
    return type(exc).__name__, message


class CellStack:
    """The frames of the cells in flight, outermost first.

    Args:
        runner_code: the code object of IPython's ``InteractiveShell.run_cell_async`` (the frame
            that triggers ``pre_run_cell``); None (tests without IPython) trusts the hooks to pair up.
        on_drop: called with each frame dropped without its ``post_run_cell`` (stop what it runs).
    """

    def __init__(self, runner_code=None, on_drop: Optional[Callable[[Frame], None]] = None):
        #: The frames, outermost first (read directly on the hot path: empty between cells).
        self.frames: List[Frame] = []
        self._runner_code = runner_code
        self._on_drop = on_drop or (lambda frame: None)

    def __len__(self) -> int:
        return len(self.frames)

    def __bool__(self) -> bool:
        return bool(self.frames)

    def __iter__(self) -> Iterator[Frame]:
        return iter(list(self.frames))

    @property
    def top(self) -> Optional[Frame]:
        """The innermost frame (read from the sampler thread too: never raises)."""
        try:
            return self.frames[-1] if self.frames else None
        except IndexError:  # the main thread popped it meanwhile
            return None

    def push(self, frame: Frame) -> None:
        self.frames.append(frame)

    def prune(self) -> bool:
        """Drop frames of cells that ended without ``post_run_cell`` (before a cell starts); True
        when that left the stack empty."""
        if not self.frames:
            return False
        live = self._live_runners()
        if live is not None and live - 1 < len(self.frames):
            self.truncate(max(0, live - 1))
            return not self.frames
        return False

    def truncate(self, keep: int) -> None:
        frames = self.frames
        if len(frames) <= keep:
            return
        stale = frames[keep:]
        del frames[keep:]
        for frame in stale:
            self._on_drop(frame)

    def pop(self, result) -> Optional[Frame]:
        """The frame ``post_run_cell(result)`` closes, or None (an empty cell, the cell that loaded
        the extension, a cell we never saw start)."""
        stack = self.frames
        if not stack:
            return None
        info = getattr(result, "info", None)
        if info is not None and stack[-1].info is info:
            return stack.pop()
        live = self._live_runners()
        if live is None:  # no IPython frames to go by: the innermost frame with this info, if any
            for k in range(len(stack) - 1, -1, -1):
                if stack[k].info is info or info is None:
                    self.truncate(k + 1)
                    return stack.pop()
            return None
        # post_run_cell fires after the cell's run_cell_async returned: the live ones are its parents.
        if live >= len(stack):
            return None  # a post_run_cell without pre_run_cell (an empty cell)
        frame = stack[live]
        self.truncate(live + 1)
        stack.pop()
        if result is not None and info is not None and not (
                frame.raw == getattr(info, "raw_cell", None) and frame.cell_id == getattr(info, "cell_id", None)):
            # A frame left by a cell that ended without post_run_cell, and this post belongs to
            # a cell we never saw start: drop the stale frame, report nothing.
            self._on_drop(frame)
            return None
        return frame

    def _live_runners(self) -> Optional[int]:
        """How many of IPython's ``run_cell_async`` frames are running now, or None (unknown)."""
        code = self._runner_code
        return None if code is None else live_runners(code, 3)
