"""The tables the measured report (``%%gpumem``) and the estimated one (``%%gpumem --estimate``) share: byte figures, per-line changes, roles, phases and the heaviest modules.

Both reports say the same things about a cell, one measured and one predicted, so they draw them
with the same builders: a row of numbers reads the same in both, and a change to one table changes
both. Each builder takes plain data (records, dicts, numbers) and returns parts
(:mod:`.parts`); nothing here knows where the numbers came from.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ..core.roles import ROLE_SHORT, ROLE_WORDS, add_tables
from ..core.units import format_bytes, format_delta
from .parts import Para, Table
from .view import delta_class

__all__ = ["Column", "bytes_table", "line_table", "delta_cell", "peak_cell", "roles_cell", "roles_words",
           "summarize_phases", "phase_table", "heaviest", "as_modules", "PHASE_ORDER", "PHASE_WORDS"]

#: The phases a training step runs, in the order the tables list them.
PHASE_ORDER = ("forward", "backward", "optimizer_step", "zero_grad", "other")
PHASE_WORDS = {"forward": "forward", "backward": "backward", "optimizer_step": "optimizer step",
               "zero_grad": "zero grad", "other": "other"}

Cell = Tuple[str, str]  # (text, style class)


class Column(NamedTuple):
    """One column of a per-line table: its header, its cell for a line that ran, and whether its
    cells are words (left-aligned, wrapping where the table would not fit) rather than a number."""

    header: str
    cell: Callable[[object], Cell]
    words: bool = False


def delta_cell(value: Optional[int]) -> Cell:
    """A signed change, coloured by its sign."""
    return format_delta(value), delta_class(value)


def peak_cell(peak: Optional[int], delta: Optional[int]) -> Cell:
    """A peak above the start: highlighted when it rose above what the span kept."""
    return format_delta(peak), "up" if (peak or 0) > max(delta or 0, 0) else "dim"


def bytes_table(headers: Sequence[str], rows: Sequence[Tuple[str, Sequence[Optional[int]]]],
                signed: Sequence[bool]) -> Table:
    """Rows of byte figures under ``headers`` (the first column names each row): ``signed`` columns
    are changes (``+1.00 GiB``, coloured), the others sizes; an unknown figure is left blank."""
    out, classes = [], []
    for label, values in rows:
        row, cls = [label], [""]
        for value, is_delta in zip(values, signed):
            if value is None:
                row.append("")
                cls.append("")
            elif is_delta:
                text, style = delta_cell(value)
                row.append(text)
                cls.append(style)
            else:
                row.append(format_bytes(value))
                cls.append("")
        out.append(row)
        classes.append(cls)
    return Table(list(headers), out, classes=classes)


def line_table(source_lines: Sequence[str], lines: Sequence, columns: Sequence[Column], first: int = 1) -> Table:
    """``line | hits | columns... | source`` for every source line from ``first``, hit or not.

    ``lines`` are objects with ``lineno`` and ``hits`` (a measured ``LineRecord`` or a predicted
    ``LineEstimate``); a line that did not run shows its source only. The table starts at the code: the
    blank lines and the ``%%magic`` header line (``%%gpumem --lines``) before it ran nothing to show.
    """
    by_line = {line.lineno: line for line in lines}
    headers = ["line", "hits"] + [c.header for c in columns] + ["source"]
    count = max([len(source_lines)] + list(by_line))
    while first <= len(source_lines) and first not in by_line and (
            not source_lines[first - 1].strip() or source_lines[first - 1].lstrip().startswith("%%")):
        first += 1
    rows, classes = [], []
    for lineno in range(first, count + 1):
        text = source_lines[lineno - 1] if lineno <= len(source_lines) else ""
        line = by_line.get(lineno)
        if line is None:
            rows.append([str(lineno), ""] + [""] * len(columns) + [text])
            classes.append([])
            continue
        cells = [column.cell(line) for column in columns]
        rows.append([str(lineno), str(line.hits)] + [c[0] for c in cells] + [text])
        classes.append(["", ""] + [c[1] for c in cells] + [""])
    source = len(headers) - 1
    words = tuple(2 + i for i, column in enumerate(columns) if column.words)
    return Table(headers, rows, left=words + (source,), classes=classes, src_col=source)


def roles_cell(roles: Optional[Mapping], temporaries: Optional[Mapping] = None, count: int = 3) -> str:
    """Roles, compact: ``grad +32.02 MiB · act -4.00 MiB · temp 9.68 MiB`` (biggest first; the
    device is named when more than one moved)."""
    several = len(roles or {}) > 1
    items = [(dev, role, v) for dev, row in (roles or {}).items() for role, v in row.items() if v]
    items.sort(key=lambda item: -abs(item[2]))
    shown = [f"{dev + ' ' if several else ''}{ROLE_SHORT.get(role, role)} {format_delta(v)}"
             for dev, role, v in items[:count]]
    if len(items) > count:
        shown.append(f"+{len(items) - count} more")
    temp = max((temporaries or {}).values(), default=0)
    if temp >= 64 * 1024:
        shown.append(f"temp {format_bytes(temp)}")
    return " · ".join(shown)


def roles_words(roles: Optional[Mapping]) -> str:
    """Roles at a moment, in words: ``parameters 96.19 MiB · gradients 96.19 MiB · ...``."""
    items = [(role, v) for row in (roles or {}).values() for role, v in row.items() if v]
    return " · ".join(f"{ROLE_WORDS.get(role, role)} {format_bytes(v)}" for role, v in items)


def _peak(value) -> int:
    if isinstance(value, Mapping):
        return max((int(v) for v in value.values()), default=0)
    return int(value or 0)


def summarize_phases(phases: Sequence[Mapping]) -> Dict[str, dict]:
    """Per phase kind, in :data:`PHASE_ORDER`: ``count``, ``peak`` (the worst), ``first`` and
    ``steady`` (the roles of step 1 and of step 2, None when a step's roles were not counted), from
    phase dicts ``{phase, step, peak, roles}`` (measured: ``peak`` per device; predicted: bytes)."""
    out: Dict[str, dict] = {}
    for kind in PHASE_ORDER:
        mine = [p for p in phases if p.get("phase") == kind]
        if not mine:
            continue
        steps = {}
        for step in (1, 2):
            tables = [p.get("roles") for p in mine if p.get("step") == step]
            steps[step] = add_tables(*tables) if tables and all(t is not None for t in tables) else None
        out[kind] = {"count": len(mine), "peak": max(_peak(p.get("peak")) for p in mine), "first": steps[1],
                     "steady": steps[2]}
    return out


def phase_table(summary: Mapping[str, Mapping], first: str = "first step, by role",
                steady: str = "second step, by role") -> Optional[Table]:
    """``phase | count | peak above its start | first step | second step``, one row per phase kind
    (a ``summarize_phases``-shaped dict; a measured cell's is exact at any length); None when empty."""
    rows = []
    for kind in PHASE_ORDER:
        item = summary.get(kind)
        if not item or (kind == "other" and not _peak(item.get("peak"))):
            continue
        rows.append([PHASE_WORDS[kind], f"{item.get('count', 0):,}", format_bytes(_peak(item.get("peak"))),
                     roles_cell(item.get("first")) if item.get("first") is not None else "",
                     roles_cell(item.get("steady")) if item.get("steady") is not None else ""])
    if not rows:
        return None
    return Table(["phase", "count", "peak above its start", first, steady], rows, left=(0, 3, 4))


def heaviest(title: str, modules: Sequence[Mapping], limit: int = 5) -> list:
    """The modules whose activations weigh most: ``{module, activations}`` rows in one line after
    ``title``; rows that also say ``type``, ``peak`` and ``calls`` as a table under it."""
    rows = [m for m in modules if m.get("activations") or m.get("peak")][:limit]
    if not rows:
        return []
    if not any(key in m for m in rows for key in ("type", "peak", "calls")):
        return [Para(f"{title}: " + ", ".join(f"`{m['module']}` {format_bytes(m.get('activations', 0))}"
                                                for m in rows), "dim")]
    table = [[str(m["module"]), str(m.get("type", "")), format_bytes(m.get("activations", 0)),
              format_bytes(m.get("peak", 0)), str(m.get("calls", ""))] for m in rows]
    return [Para(f"{title}:", "dim"),
            Table(["module", "type", "activations", "peak in forward", "calls"], table, left=(0, 1))]


def as_modules(layers: Optional[Sequence[Tuple[str, int]]]) -> List[dict]:
    """A record's ``layers`` (``(name, bytes)``) as :func:`heaviest` rows."""
    return [{"module": name, "activations": size} for name, size in layers or ()]
