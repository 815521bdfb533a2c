"""What ``%%gpumem --estimate`` shows: the predicted peaks, the verdict against a GPU, the roles at the peak, the lines, phases and modules, as one list of parts rendered to text and HTML.

``estimate_view`` draws a :class:`~ipy_gpumem.preflight.cell.CellEstimate` and keeps it as
``View.data``; :func:`verdict` is the one sentence the view, the notebook and the OOM panel share.
"""
from __future__ import annotations

from typing import List, Optional

from ..core.roles import ROLE_SHORT, ROLE_WORDS
from ..core.units import format_bytes, format_delta, format_seconds
from ..display.parts import Blank, Line, Para, Span, Table, render
from ..display.view import View, delta_class
from .cell import CellEstimate
from .result import Fit

__all__ = ["estimate_view", "verdict"]

_COSTS = {"cuda_context": "CUDA context", "cublas_workspace": "cuBLAS workspace"}
_PHASES = {"forward": "forward", "backward": "backward", "optimizer_step": "optimizer step", "zero_grad": "zero_grad",
           "other": "other"}


def verdict(fit: Fit) -> str:
    """``fits with 3.10 GiB to spare on T4 (14.75 GiB usable)`` or ``does not fit on T4: needs 17.90 GiB of 14.75 GiB``."""
    if not fit.fits:
        return f"does not fit on {fit.gpu}: needs {format_bytes(fit.needed)} of {format_bytes(fit.capacity)}"
    if fit.headroom < 0:  # the allocator model served every request once torch released its cache
        return (f"fits on {fit.gpu} only because torch frees its cache when it runs short: it would reserve "
                f"{format_bytes(fit.needed)} of {format_bytes(fit.capacity)} with room to cache")
    return f"fits with {format_bytes(fit.headroom)} to spare on {fit.gpu} ({format_bytes(fit.capacity)} usable)"


def _roles_text(roles: dict) -> str:
    items = [(role, v) for row in roles.values() for role, v in row.items() if v]
    return " · ".join(f"{ROLE_WORDS.get(role, role)} {format_bytes(v)}" for role, v in items)


def _roles_short(roles: dict) -> str:
    items = [(role, v) for row in roles.values() for role, v in row.items() if v]
    items.sort(key=lambda item: -abs(item[1]))
    return " · ".join(f"{ROLE_SHORT.get(role, role)} {format_delta(v)}" for role, v in items[:3])


def estimate_view(cell: CellEstimate, title: Optional[str] = None) -> View:
    """The ``%%gpumem --estimate`` report of ``cell``; ``data`` is the ``CellEstimate``."""
    est = cell.estimate
    cuda = est.device.startswith("cuda")
    head = title or "%%gpumem --estimate"
    parts: List = [Line(Span(f"{head} · predicted on fake tensors in {format_seconds(est.seconds)}", "bold"))]
    names = ", ".join(cell.faked) if cell.faked else "no objects of yours"
    parts.append(Para(f"Nothing ran for real: the cell's code ran twice (the second run is the steady state) "
                      f"on fake copies of {names}.", "dim"))
    rows = [["peak allocated", format_bytes(est.peak_allocated)]]
    if cuda:
        rows.append(["peak reserved", format_bytes(est.peak_reserved)])
        for key, value in est.fixed_costs.items():
            rows.append([f"+ {_COSTS.get(key, key)} (assumed)", format_bytes(value)])
        rows.append(["total needed", format_bytes(est.total_needed)])
    parts.append(Table(["", "predicted"], rows))
    if cell.fit is not None:
        fit = cell.fit
        parts.append(Line(Span("Verdict: ", "bold"), Span(verdict(fit), "down" if fit.fits else "err")))
    if cell.gpu_note:
        parts.append(Para(cell.gpu_note, "dim"))
    if est.roles:
        phase = _PHASES.get(est.peak_phase, est.peak_phase)
        parts.append(Para(f"At the peak ({phase}, {'second' if est.peak_step == 2 else 'first'} run): "
                          + _roles_text(est.roles)))
    if cell.lines:
        by_line = {ln.lineno: ln for ln in cell.lines}
        table_rows, classes = [], []
        first = next((i for i, text in enumerate(cell.source_lines, 1) if text.strip() or i in by_line), 1)
        for lineno in range(first, len(cell.source_lines) + 1):
            text = cell.source_lines[lineno - 1]
            ln = by_line.get(lineno)
            if ln is None:
                table_rows.append([str(lineno), "", "", "", "", text])
                classes.append([])
                continue
            table_rows.append([str(lineno), str(ln.hits), format_delta(ln.allocated_delta),
                               format_delta(ln.reserved_delta) if cuda else "", format_delta(ln.peak_increase), text])
            classes.append(["", "", delta_class(ln.allocated_delta), delta_class(ln.reserved_delta) if cuda else "",
                            "up" if ln.peak_increase > max(ln.allocated_delta, 0) else "dim", ""])
        parts.append(Blank())
        parts.append(Line(Span("Per line, predicted for the second run (the steady state):", "dim")))
        parts.append(Table(["line", "hits", "Δallocated", "Δreserved" if cuda else "", "peak in line", "source"],
                           table_rows, left=(5,), classes=classes, src_col=5))
    phases = [p for p in est.phases if p["phase"] != "other" or p["peak"]]
    if phases:
        rows = [[_PHASES.get(p["phase"], p["phase"]), str(p["step"]), format_bytes(p["peak"]), _roles_short(p["roles"])]
                for p in phases]
        parts.append(Blank())
        parts.append(Line(Span("Training phases, per run:", "dim")))
        parts.append(Table(["phase", "run", "peak above its start", "change by role"], rows, left=(0, 3)))
    modules = [m for m in est.modules if m.get("activations") or m.get("peak")][:5]
    if modules:
        rows = [[m["module"], m.get("type", ""), format_bytes(m.get("activations", 0)), format_bytes(m.get("peak", 0)),
                 str(m.get("calls", ""))] for m in modules]
        parts.append(Blank())
        parts.append(Line(Span("Heaviest modules (activations autograd keeps for backward):", "dim")))
        parts.append(Table(["module", "type", "activations", "peak in forward", "calls"], rows, left=(0, 1)))
    for note in est.notes:
        parts.append(Para(f"note: {note}", "dim"))
    return render(parts, data=cell)
