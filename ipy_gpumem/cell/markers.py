"""The ``--lines`` markers: an AST transformer that puts a call before each of a cell's own statements, and the hook those calls reach.

The markers never change what the user's code does or which errors it raises: they wrap nothing (a
``for`` loop's iterable is iterated by the loop itself, so ``for x in 5`` and ``async for x in
[1, 2]`` fail exactly as without them), and they call a hook that lives in ``builtins`` for the
duration of the cell, so a cell that runs ``%reset -f`` or reloads the extension keeps working and
the user's namespace is never touched. IPython's debugger steps over the hook
(``__debuggerskip__``) and tracebacks hide it (``__tracebackhide__``). What a marker measures is
:class:`~ipy_gpumem.cell.lines.LineTracer`'s business.
"""
from __future__ import annotations

import ast
import builtins
from typing import Any, List, Optional

from ..core.records import LoopSpan

__all__ = ["LineMarkers", "HOOK_NAME", "install_hook", "detach_hook", "remove_hook"]

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


def install_hook(mark) -> None:
    _HOOK.target = mark
    if getattr(builtins, HOOK_NAME, None) is not _HOOK:
        setattr(builtins, HOOK_NAME, _HOOK)


def detach_hook(mark) -> None:
    """The markers stop calling ``mark`` (they call nothing until the next :func:`install_hook`)."""
    if _HOOK.target == mark:
        _HOOK.target = None


def remove_hook() -> None:
    """Take the hook out of ``builtins`` (when no marked cell can still be running)."""
    _HOOK.target = None
    if getattr(builtins, HOOK_NAME, None) is _HOOK:
        delattr(builtins, HOOK_NAME)



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
        self.tracer: Optional[Any] = None

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
