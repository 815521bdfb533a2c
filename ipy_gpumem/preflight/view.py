"""What ``%%gpumem --estimate`` shows: the predicted peaks, the verdict against a GPU, the roles at the peak, the lines, phases and modules, as one list of parts rendered to text and HTML.

``estimate_view`` draws a :class:`~ipy_gpumem.preflight.cell.CellEstimate` and keeps it as
``View.data``; :func:`verdict` is the one sentence the view, the notebook and the OOM panel share.
Its tables (the figures, the per-line changes, the roles, the phases, the heaviest modules) are
the measured report's too (``display.tables``): a prediction reads like the measurement it predicts.
"""
from __future__ import annotations

from typing import List, Optional

from ..core.units import format_bytes, format_seconds
from ..display.parts import Blank, Line, Para, Span, render
from ..display.tables import (PHASE_WORDS, Column, bytes_table, delta_cell, heaviest, line_table, peak_cell,
                              phase_table, roles_words, summarize_phases)
from ..display.view import View
from .cell import CellEstimate
from .result import COST_WORDS, Fit

__all__ = ["estimate_view", "verdict"]



def verdict(fit: Fit) -> str:
    """``fits with 3.10 GiB to spare on T4 (14.75 GiB usable)`` or ``does not fit on T4: needs 17.90 GiB of 14.75 GiB``."""
    if not fit.fits:
        return f"does not fit on {fit.gpu}: needs {format_bytes(fit.needed)} of {format_bytes(fit.capacity)}"
    if fit.headroom < 0:  # the allocator model served every request once torch released its cache
        return (f"fits on {fit.gpu} only because torch frees its cache when it runs short: it would reserve "
                f"{format_bytes(fit.needed)} of {format_bytes(fit.capacity)} with room to cache")
    return f"fits with {format_bytes(fit.headroom)} to spare on {fit.gpu} ({format_bytes(fit.capacity)} usable)"


def estimate_view(cell: CellEstimate, title: Optional[str] = None) -> View:
    """The ``%%gpumem --estimate`` report of ``cell``; ``data`` is the ``CellEstimate``."""
    est = cell.estimate
    cuda = est.device.startswith("cuda")
    head = title or "%%gpumem --estimate"
    parts: List = [Line(Span(f"{head} · predicted on fake tensors in {format_seconds(est.seconds)}", "bold"))]
    names = ", ".join(cell.faked) if cell.faked else "no objects of yours"
    parts.append(Para(f"Nothing ran for real: the cell's code ran twice (the second run is the steady state) "
                      f"on fake copies of {names}.", "dim"))
    rows = [("peak allocated", (est.peak_allocated,))]
    if cuda:
        rows.append(("peak reserved", (est.peak_reserved,)))
        for key, value in est.fixed_costs.items():
            rows.append((f"+ {COST_WORDS.get(key, key)} (assumed)", (value,)))
        rows.append(("total needed", (est.total_needed,)))
    parts.append(bytes_table(["", "predicted"], rows, signed=(False,)))
    if cuda:  # the card the fixed costs are for; cuBLAS's workspaces are allocator memory, in the peaks
        workspaces = (f"; cuBLAS workspaces {format_bytes(est.cublas_workspaces)} in the peaks"
                      if est.cublas_workspaces else "")
        parts.append(Para(est.assumed + workspaces, "dim"))
    if cell.fit is not None:
        fit = cell.fit
        parts.append(Line(Span("Verdict: ", "bold"), Span(verdict(fit), "down" if fit.fits else "err")))
    if cell.gpu_note:
        parts.append(Para(cell.gpu_note, "dim"))
    if est.roles:
        phase = PHASE_WORDS.get(est.peak_phase, est.peak_phase)
        parts.append(Para(f"At the peak ({phase}, {'second' if est.peak_step == 2 else 'first'} run): "
                          + roles_words(est.roles)))
    if cell.lines:
        hit = {ln.lineno for ln in cell.lines}
        first = next((i for i, text in enumerate(cell.source_lines, 1) if text.strip() or i in hit), 1)
        columns = [Column("Δallocated", lambda ln: delta_cell(ln.allocated_delta)),
                   Column("Δreserved" if cuda else "", lambda ln: delta_cell(ln.reserved_delta) if cuda else ("", "")),
                   Column("peak in line", lambda ln: peak_cell(ln.peak_increase, ln.allocated_delta))]
        parts.append(Blank())
        parts.append(Line(Span("Per line, predicted for the second run (the steady state):", "dim")))
        parts.append(line_table(cell.source_lines, cell.lines, columns, first=first))
    table = phase_table(summarize_phases(est.phases), first="first run, by role", steady="second run, by role")
    if table is not None:
        parts.append(Blank())
        parts.append(Line(Span("Training phases, in the first and the second run:", "dim")))
        parts.append(table)
    modules = heaviest("Heaviest modules (activations autograd keeps for backward)", est.modules)
    if modules:
        parts.append(Blank())
        parts.extend(modules)
    for note in est.notes:
        parts.append(Para(f"note: {note}", "dim"))
    return render(parts, data=cell)
