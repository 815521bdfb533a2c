"""A notebook cell as a step: its code, run on fake copies of the namespace objects it reads, estimated line by line without running it for real.

``%%gpumem --estimate`` and the OOM panel's batch-size finding both start from a cell's source and
the user's namespace. :func:`cell_program` compiles the source once, with a marker before each of
its statements (as ``--lines`` does, see ``ledger/lines.py``; here the marker lives in the fake
globals, never in ``builtins``), and picks the namespace values it reads: the names in its code and
in the code of the notebook's own functions it calls. :func:`run_cell` is the step handed to the
engine: its one argument is a dict of those values, which the engine deep-copies around fake
tensors (:mod:`.fake`), and the cell's code runs with that copy as its globals. So the cell's
assignments, ``counter += 1`` or ``losses.append(...)``, land in the copy; the user's namespace,
objects and random number generator are left as they were. The same dict serves both calls of the
estimate, as the namespace serves a cell run twice: what the first call left (``loss``) is alive
during the second.
"""
from __future__ import annotations

import ast
import builtins
import linecache
import time
import types
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .result import Estimate, EstimateError, Fit

__all__ = ["CellProgram", "CellEstimate", "LineEstimate", "cell_program", "run_cell", "estimate_cell",
           "line_estimates", "BudgetExceeded", "MARK_NAME", "CELL_FILENAME"]

#: The marker's name in the fake globals (a name no cell uses).
MARK_NAME = "__ipy_gpumem_estimate_line__"
#: The filename the cell's code is compiled under: error messages say "line 3 of <cell>".
CELL_FILENAME = "<cell>"
#: Values passed to the fake run as they are: nothing in them can be changed by the cell, or they
#: are code (a module, a class, a library function), which runs on the fakes it is given.
_ATOMS = (type(None), bool, int, float, complex, str, bytes, range, type(Ellipsis), types.ModuleType, type,
          types.BuiltinFunctionType, types.BuiltinMethodType, types.FunctionType)


class BudgetExceeded(Exception):
    """The estimate ran past its time budget (raised from inside the fake run, which cleans up)."""


class CellProgram:
    """A cell's code ready to run on fakes.

    Attributes:
        code: the compiled, marked code.
        world: the namespace values it reads that must be copied (tensors, modules, optimizers,
            lists and other objects the cell could change), in the order the cell first names them.
        passed: the values passed as they are (numbers, strings, modules, classes, functions).
        functions: the notebook's own functions it reaches (their globals are the namespace: the
            fake run gives them the fake globals instead).
        lines: the cell's source lines as numbered in ``code``.
        marks: ``(event index, line number, call)`` recorded by the markers during the last run.
        deadline: ``time.perf_counter()`` past which a marker raises :class:`BudgetExceeded`.
    """

    # The program rides along as the step's second argument. Slots and no ``__dict__``: the engine
    # walks arguments' attributes for tensors, modules and optimizers (and patches what it finds),
    # so it must never reach the real objects in ``world`` through here; and copying the arguments
    # returns the program itself.
    __slots__ = ("code", "world", "passed", "functions", "lines", "marks", "deadline")

    def __init__(self, code, world, passed, functions, lines):
        self.code: types.CodeType = code
        self.world: Dict[str, Any] = world
        self.passed: Dict[str, Any] = passed
        self.functions: Dict[str, types.FunctionType] = functions
        self.lines: Tuple[str, ...] = lines
        self.marks: List[tuple] = []
        self.deadline: Optional[float] = None

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self


def _names(code: types.CodeType) -> List[str]:
    out = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out.extend(_names(const))
    return out


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


def cell_program(source: str, namespace: Dict[str, Any], first_line: int = 1) -> CellProgram:
    """Compile a cell's (Python) source and pick the namespace values it reads.

    Args:
        source: the cell's code, already plain Python (IPython's ``transform_cell`` applied).
        namespace: the user's namespace.
        first_line: the number the cell's first source line has for the user (2 when a
            ``%%gpumem`` line came before the body).

    Raises:
        EstimateError: the code does not parse, or it runs IPython magics or shell commands
            (they would run for real); the message names the line.
    """
    try:
        tree = ast.parse(source, CELL_FILENAME)
    except SyntaxError as exc:
        raise EstimateError(f"the cell does not parse: {exc.msg} (line {(exc.lineno or 1) + first_line - 1})") from None
    if first_line != 1:
        ast.increment_lineno(tree, first_line - 1)
    lines = tuple([""] * (first_line - 1) + source.splitlines())
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "get_ipython":
            text = lines[node.lineno - 1].strip() if node.lineno <= len(lines) else ""
            raise EstimateError(f"line {node.lineno} of the cell (`{text}`) is an IPython magic or shell command, "
                                "which would run for real; estimate a cell of plain Python")
    tree.body = _Markers().mark(tree.body)
    ast.fix_missing_locations(tree)
    code = compile(tree, CELL_FILENAME, "exec")
    # Error messages and tracebacks quote the cell's lines (mtime None: linecache keeps the entry).
    linecache.cache[CELL_FILENAME] = (len(source), None, [line + "\n" for line in lines], CELL_FILENAME)

    world: Dict[str, Any] = {}
    passed: Dict[str, Any] = {}
    functions: Dict[str, types.FunctionType] = {}
    todo = list(dict.fromkeys(_names(code)))
    seen = set()
    while todo:
        name = todo.pop(0)
        if name in seen or name == MARK_NAME or name not in namespace:
            continue
        seen.add(name)
        value = namespace[name]
        if isinstance(value, types.FunctionType) and value.__globals__ is namespace:
            functions[name] = value  # the notebook's own function: what it reads is read too
            todo.extend(n for n in dict.fromkeys(_names(value.__code__)) if n not in seen)
        elif isinstance(value, _ATOMS) or _is_torch_atom(value):
            passed[name] = value
        else:
            world[name] = value
    return CellProgram(code, world, passed, functions, lines)


def _is_torch_atom(value) -> bool:
    torch = __import__("sys").modules.get("torch")
    return torch is not None and isinstance(value, (torch.dtype, torch.device))


def run_cell(world: Dict[str, Any], program: CellProgram) -> None:
    """The step: run the cell's code with ``world`` (the engine's fake copy) as its globals.

    The first call fills the copy with the values passed as they are and the notebook's functions,
    re-bound to it; the second call finds the copy as the first left it.
    """
    if MARK_NAME not in world:  # a new copy: a new estimate
        program.marks = []
        world.update({k: v for k, v in program.passed.items() if k not in world})
        world.setdefault("__builtins__", builtins)
        world.setdefault("__name__", "__main__")
        for name, func in program.functions.items():
            copy = types.FunctionType(func.__code__, world, func.__name__, func.__defaults__, func.__closure__)
            copy.__kwdefaults__ = func.__kwdefaults__
            copy.__dict__.update(func.__dict__)
            world[name] = copy
        world[MARK_NAME] = _marker(program)
    mark = world[MARK_NAME]
    mark(0)  # the call starts: its first line's events start here
    try:
        exec(program.code, world)  # noqa: S102 - the user's cell, on fake copies of its objects
    finally:
        mark(-1)


def _marker(program: CellProgram):
    from .tracker import StorageTracker

    def current_tracker():
        try:
            from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
        except ImportError:  # pragma: no cover - older torch: no per-line figures
            return None
        for mode in _get_current_dispatch_mode_stack():
            tracker = getattr(mode, "tracker", None)
            if isinstance(tracker, StorageTracker):
                return tracker
        return None

    found: list = []

    def mark(lineno: int) -> None:
        if program.deadline is not None and time.perf_counter() > program.deadline:
            raise BudgetExceeded("the estimate ran past its time budget")
        if not found:
            found.append(current_tracker())
        tracker = found[0]
        if tracker is not None:
            program.marks.append((len(tracker.run.events), lineno, tracker._step))

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
    """Estimate a cell's code against the namespace's objects (faked), without running it.

    Args:
        source: the cell's plain-Python code.
        namespace: the user's namespace (read, never changed).
        gpu: the card to judge against ("T4", "this GPU", bytes); None: "this GPU" if there is one,
            else a T4 (and ``gpu_note`` says so).
        first_line: the user's number of the source's first line.
        device: "cuda" (torch's counters, through the allocator model) or "cpu".
        budget_s: give up (``EstimateError`` whose ``original`` is a :class:`BudgetExceeded`) after this long.

    Raises:
        EstimateError: the cell cannot be estimated; the message names the line.
        ValueError: ``gpu`` names no known card.
    """
    from .run import estimate

    card, note = _card(gpu)
    program = cell_program(source, namespace, first_line)
    if budget_s is not None:
        program.deadline = time.perf_counter() + budget_s
    est = estimate(run_cell, program.world, program, device=device, gpu=card)
    program.deadline = None
    lines = line_estimates(est, program.marks)
    fit = est.fits(card) if card is not None and est.device.startswith("cuda") else None
    return CellEstimate(est, lines, program.lines, fit, note, tuple(program.world))


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
