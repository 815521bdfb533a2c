"""A notebook cell as a step: its code, compiled with a marker before each line, run twice in a sealed copy of the process on fake tensors, estimated line by line.

``%%gpumem --estimate`` starts from a cell's source and the user's namespace. :func:`cell_program`
compiles the source once, in this process, with a marker before each of its statements (as
``--lines`` does, see ``cell/lines.py``), and refuses what the estimate cannot model before
anything runs: a syntax error, a magic or shell command, a top-level ``await`` (a ``get_ipython()``
line that only reads, such as ``get_ipython().user_ns``, runs; a magic or shell command reached
some other way is refused when it is called, in the child: ``child.no_magics``). :func:`estimate_cell`
then runs it in a sealed child (``preflight.run.sealed``): there the namespace, the child's own
copy, has its tensors faked in place (``preflight.world``) and the cell's code runs twice with it as
its globals (the second run is the steady state, as a cell run again is), with the marker
recording where each line's events start. The user's namespace, objects, files and random
state are never touched: all of that happens in the child.
"""
from __future__ import annotations

import ast
import linecache
import types
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .child import RUNNERS
from .result import Estimate, EstimateError, Fit

__all__ = ["CellProgram", "CellEstimate", "LineEstimate", "cell_program", "run_cell", "estimate_cell",
           "line_estimates", "MARK_NAME", "CELL_FILENAME"]

#: The marker's name in the fake globals (a name no cell uses).
MARK_NAME = "__ipy_gpumem_estimate_line__"
#: The filename the cell's code is compiled under: error messages say "line 3 of <cell>".
CELL_FILENAME = "<cell>"
class CellProgram:
    """A cell's code ready to run in the sealed child.

    Attributes:
        code: the compiled, marked code.
        lines: the cell's source lines as numbered in ``code``.
        marks: ``(event index, line number, call)`` recorded by the markers during the run.
    """

    __slots__ = ("code", "lines", "marks")

    def __init__(self, code, lines):
        self.code: types.CodeType = code
        self.lines: Tuple[str, ...] = lines
        self.marks: List[tuple] = []


class _Markers(ast.NodeTransformer):
    """A marker call before each statement of the cell's own code (not inside functions or classes it
    defines), and at the end of every ``for`` body, so the next item's fetch counts for the loop line."""

    def mark(self, statements: list) -> list:
        out, last = [], None
        for stmt in statements:
            if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
                out.append(stmt)
                continue
            self._children(stmt)
            if stmt.lineno != last:
                out.append(self._marker(stmt.lineno, stmt))
            last = stmt.lineno
            out.append(stmt)
        return out

    @staticmethod
    def _marker(lineno: int, where) -> ast.stmt:
        call = ast.Call(ast.Name(MARK_NAME, ast.Load()), [ast.Constant(lineno)], [])
        return ast.copy_location(ast.Expr(call), where)

    def _children(self, stmt) -> None:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return
        for name in ("body", "orelse", "finalbody"):
            body = getattr(stmt, name, None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                marked = self.mark(body)
                if name == "body" and isinstance(stmt, (ast.For, ast.AsyncFor)):
                    marked.append(self._marker(stmt.lineno, stmt))
                setattr(stmt, name, marked)
        for handler in getattr(stmt, "handlers", None) or ():
            handler.body = self.mark(handler.body)
        for case in getattr(stmt, "cases", None) or ():
            case.body = self.mark(case.body)


def cell_program(source: str, first_line: int = 1) -> CellProgram:
    """Compile a cell's (Python) source with its markers, refusing what the estimate cannot model.

    Args:
        source: the cell's code, already plain Python (IPython's ``transform_cell`` applied).
        first_line: the number the cell's first source line has for the user (2 when a
            ``%%gpumem`` line came before the body).

    Raises:
        EstimateError: the code does not parse, awaits at the top level, or runs IPython magics or
            shell commands (``get_ipython().run_line_magic(...)`` and the like; reading
            ``get_ipython().user_ns`` is allowed); the message names the line.
    """
    try:
        # Top-level await parses (as IPython allows it in a cell), so that it can be named below.
        tree = compile(source, CELL_FILENAME, "exec", ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError as exc:
        raise EstimateError(f"the cell does not parse: {exc.msg} (line {(exc.lineno or 1) + first_line - 1})") from None
    if first_line != 1:
        ast.increment_lineno(tree, first_line - 1)
    lines = tuple([""] * (first_line - 1) + source.splitlines())

    def text(node):
        return lines[node.lineno - 1].strip() if node.lineno <= len(lines) else ""

    for node in ast.walk(tree):
        if _runs_ipython(node):
            raise EstimateError(f"line {node.lineno} of the cell (`{text(node)}`) is an IPython magic or shell "
                                "command, which the estimate does not run; estimate a cell of plain Python")
    for node in _top_level_awaits(tree):
        raise EstimateError(f"line {node.lineno} of the cell (`{text(node)}`) awaits at the top level, which an "
                            "estimate cannot run (it runs the cell as a plain step); move the awaited work into a "
                            "function you call with asyncio.run(), or estimate the synchronous part")
    tree.body = _Markers().mark(tree.body)
    ast.fix_missing_locations(tree)
    code = compile(tree, CELL_FILENAME, "exec")
    # Error messages and tracebacks quote the cell's lines (mtime None: linecache keeps the entry).
    linecache.cache[CELL_FILENAME] = (len(source), None, [line + "\n" for line in lines], CELL_FILENAME)
    return CellProgram(code, lines)


def _runs_ipython(node) -> bool:
    """``get_ipython().run_line_magic(...)`` (what IPython makes of ``%time``, ``!ls``, ``x = !ls``) and the like."""
    return (isinstance(node, ast.Attribute) and node.attr in RUNNERS and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name) and node.value.func.id == "get_ipython")


def _top_level_awaits(tree) -> list:
    """``await``, ``async for`` and ``async with`` outside any function: what only an event loop could run."""
    found, stack = [], list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, (ast.Await, ast.AsyncFor, ast.AsyncWith)):
            found.append(node)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return sorted(found, key=lambda n: n.lineno)


def run_cell(namespace: Dict[str, Any], program: CellProgram) -> None:
    """The step, in the sealed child: run the cell's code with the (child's) namespace as its globals."""
    mark = namespace.get(MARK_NAME)
    if mark is None:
        program.marks = []
        mark = namespace[MARK_NAME] = _marker(program)
    mark(0)  # the call starts: its first line's events start here
    try:
        exec(program.code, namespace)  # noqa: S102 - the user's cell, in a sealed copy of the process
    finally:
        mark(-1)


def _marker(program: CellProgram):
    from ..tensors.tracker import StorageTracker

    def current_tracker():
        from ..tensors.torch_api import api

        for mode in api().dispatch_modes():
            tracker = getattr(mode, "tracker", None)
            if isinstance(tracker, StorageTracker):
                return tracker
        return None

    found: list = []

    def mark(lineno: int) -> None:
        if not found:
            found.append(current_tracker())
        tracker = found[0]
        if tracker is not None:
            program.marks.append((len(tracker.run.events), lineno, tracker.current_step))

    return mark


@dataclass(frozen=True)
class LineEstimate:
    """One line of the cell in the steady-state (second) call: hits and the predicted changes (bytes)."""

    lineno: int
    hits: int
    allocated_delta: int
    reserved_delta: int
    peak_increase: int


@dataclass
class CellEstimate:
    """What ``%%gpumem --estimate`` shows: the estimate, its lines, and the verdict against one GPU.

    Attributes:
        estimate: the :class:`Estimate` (what ``-o NAME`` stores).
        lines: per-line figures of the steady-state call (empty when they could not be taken).
        source_lines: the cell's lines as the user numbers them.
        fit: the verdict against ``gpu`` (None when no GPU was resolved).
        gpu_note: how the GPU was chosen when the user did not name one ("no GPU here: ...").
        faked: the names of the namespace whose values were copied around fake tensors.
    """

    estimate: Estimate
    lines: List[LineEstimate]
    source_lines: Tuple[str, ...]
    fit: Optional[Fit] = None
    gpu_note: Optional[str] = None
    faked: Tuple[str, ...] = ()

    def to_dict(self) -> dict:
        out = self.estimate.to_dict()
        out["lines"] = [dict(lineno=ln.lineno, hits=ln.hits, allocated_delta=ln.allocated_delta,
                             reserved_delta=ln.reserved_delta, peak_increase=ln.peak_increase) for ln in self.lines]
        if self.fit is not None:
            out["fit"] = {"gpu": self.fit.gpu, "capacity": self.fit.capacity, "needed": self.fit.needed,
                          "fits": self.fit.fits, "headroom": self.fit.headroom}
        return out


def line_estimates(est: Estimate, marks: Sequence[tuple], call: int = 2) -> List[LineEstimate]:
    """Per-line figures of one call from the markers' ``(event index, line, call)`` and the estimate's events.

    A line's span runs from its marker to the next one; its change is allocated (reserved) after
    the span less before it, its peak the highest allocated within the span above the start,
    summed (changes) and maximised (peaks) over its hits. On CUDA the events are replayed through
    the allocator model, so the figures are torch's counters; on the CPU they are live bytes.
    """
    from .allocator import replay

    events = est.events
    if est.device.startswith("cuda"):
        rep = replay(events)
        allocated, reserved = rep.allocated, rep.reserved
    else:
        allocated, total, sizes = [], 0, {}
        for key, size in events:
            if size >= 0:
                sizes[key] = size
                total += size
            else:
                total -= sizes.get(key, 0)
            allocated.append(total)
        reserved = allocated
    ours = [(i, line) for i, line, c in marks if c == call]

    def at(series, index):
        return series[index - 1] if index > 0 and series else 0

    rows: Dict[int, list] = {}
    for (begin, line), (end, _next) in zip(ours, ours[1:]):
        if line <= 0:
            continue
        base_a, base_r = at(allocated, begin), at(reserved, begin)
        top = max(allocated[begin:end], default=base_a)
        row = rows.setdefault(line, [0, 0, 0, 0])
        row[0] += 1
        row[1] += at(allocated, end) - base_a
        row[2] += at(reserved, end) - base_r
        row[3] = max(row[3], top - base_a)
    return [LineEstimate(line, *row) for line, row in sorted(rows.items())]


def estimate_cell(source: str, namespace: Dict[str, Any], gpu: Any = None, first_line: int = 1,
                  device: str = "cuda", budget_s: Optional[float] = None) -> CellEstimate:
    """Estimate a cell's code against the namespace's objects, in a sealed copy of this process.

    Args:
        source: the cell's plain-Python code.
        namespace: the user's namespace (never changed: the child works on its own copy).
        gpu: the card to judge against ("T4", "this GPU", bytes); None: "this GPU" if one is in use,
            else a T4 (and ``gpu_note`` says so).
        first_line: the user's number of the source's first line.
        device: "cuda" (torch's counters, through the allocator model) or "cpu".
        budget_s: stop the sealed run after this long (an ``EstimateError`` says so).

    Raises:
        EstimateError: the cell cannot be estimated; the message names the line.
        ValueError: ``gpu`` names no known card.
    """
    from .gpus import fixed_costs
    from .run import TIMEOUT_S, answer_of, check_timeout, device_label, sealed_estimate

    card, note = _card(gpu)
    program = cell_program(source, first_line)
    label = device_label(device)
    cuda = label.startswith("cuda")
    costs = fixed_costs(card) if cuda else {}
    value, notes = sealed_estimate(run_cell, (namespace, program), {}, label=label, costs=costs,
                                   gpu=card.name if cuda else None, namespace=namespace, program=program,
                                   timeout_s=TIMEOUT_S if budget_s is None else check_timeout(budget_s, "budget_s"))
    est, marks, names = answer_of(value, notes)
    lines = line_estimates(est, marks)
    fit = est.fits(card) if card is not None and cuda else None
    return CellEstimate(est, lines, program.lines, fit, note, tuple(names))


def _card(gpu):
    """The card to judge against, and a note when it was chosen for the user."""
    from .gpus import GPUS, resolve_gpu

    wanted = "this GPU" if gpu is None else gpu
    try:
        return resolve_gpu(wanted), None
    except ValueError:
        if not (isinstance(wanted, str) and wanted.strip().lower() in ("this gpu", "this", "current")):
            raise
    card = GPUS["T4"]
    return card, ("no GPU here: compared with a T4 (the free GPU of Colab and Kaggle); "
                  "name yours with %%gpumem --estimate A100-80")
