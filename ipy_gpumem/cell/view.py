"""The ledger's views: the line after a cell, the ``%%gpumem`` report and the ``%gpumem history`` table.

Each view is built once as parts (display/parts.py) and rendered to text and HTML from them, and
keeps the record(s) it shows as ``View.data``. The records keep numbers and typed explanations;
the sentences are made here, when the view is drawn (``display.words``), and the report's tables
are the ones the estimated report draws too (``display.tables``).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..core.devices import cuda
from ..core.records import CellRecord, DeviceRecord, LineRecord
from ..core.text import cell_name
from ..core.units import format_bytes, format_delta, format_seconds
from ..display.parts import Blank, Line, Para, Raw, Span, Table, render
from ..display.tables import (Column, as_modules, bytes_table, delta_cell, heaviest, line_table, peak_cell, phase_table,
                              roles_cell, summarize_phases)
from ..display import words
from ..display.view import View, delta_class, format_of
from ..ranks.view import rank_line_parts, rank_report_parts

__all__ = ["cell_view", "cell_report_view", "history_view", "loop_summaries"]


# ---------------------------------------------------------------------------------------------
# The per-cell line
# ---------------------------------------------------------------------------------------------


def _device_spans(dev: DeviceRecord) -> List[Span]:
    spans = [Span(f"{dev.label} "), Span(f"{format_delta(dev.allocated_delta)} allocated", delta_class(dev.allocated_delta))]
    peak = dev.peak_increase
    if peak is not None and peak > max(dev.allocated_delta or 0, 0):
        spans.append(Span(f" (peak {format_delta(peak)})", "up"))
    spans.append(Span(f" · reserved {format_of(dev.reserved_after, dev.total)}"))
    return spans


def _host_spans(record: CellRecord) -> List[Span]:
    host = record.host
    spans = [Span("host "), Span(f"{format_delta(host.rss_delta)} RSS", delta_class(host.rss_delta))]
    peak = host.rss_peak_increase
    if peak is not None and peak > max(host.rss_delta or 0, 0):
        spans.append(Span(f" (peak {format_delta(peak)})", "up"))
    spans.append(Span(f" · {format_bytes(host.rss_after)} resident"))
    return spans


def _line_spans(record: CellRecord, threshold: int = 0) -> List[Span]:
    spans = [Span(record.label + " ", "dim")]
    shown = False
    for dev in record.devices:
        moved = any(v is not None and abs(v) >= threshold for v in (dev.allocated_delta, dev.reserved_delta, dev.peak_increase))
        if moved or len(record.devices) == 1:
            if shown:
                spans.append(Span(" │ ", "dim"))
            spans.extend(_device_spans(dev))
            shown = True
    if not shown:
        spans.extend(_host_spans(record))
    spans.append(Span(f" · {format_seconds(record.duration_s)}", "dim"))
    if record.error:
        spans.append(Span(f" · {record.error}", "err"))
    return spans


def cell_view(record: CellRecord, threshold: int = 0) -> View:
    """The compact line shown after a cell, e.g.
    ``[7] cuda:0 +2.81 GiB allocated (peak +5.62 GiB) · reserved 9.53 / 15.78 GiB · 1.2 s``,
    and, when the anatomy found what the change is made of, a second line naming its dominant roles
    (``  +2.60 GiB activations saved for backward, kept by `output`, `loss```)."""
    parts = [Line(*_line_spans(record, threshold))]
    phrase = words.headline(record.why)
    if phrase:
        parts.append(Line(Span("  " + phrase, "dim")))
    parts.extend(rank_line_parts(record))  # the processes it launched (issue 20)
    parts.extend(rerun_parts(record))  # re-runs (issue 12)
    return render(parts, data=record)


# -- re-runs (the data comes from ipy_gpumem.reruns.tracker) -----------------------------------------


def rerun_parts(record: CellRecord) -> list:
    """The re-run warning under the per-cell line, once per suspect: what the earlier run left
    alive, who holds it, and the fix (the suspects this run names for the first time)."""
    warning = words.rerun_warning(record.rerun)
    if not warning:
        return []
    parts = [Line(Span("  " + warning, "err"))]
    parts.extend(Para("· " + cause, indent="    ", hanging="      ")
                 for cause in words.causes(record.rerun, new_only=True))
    return parts


def _history_label(rec: CellRecord) -> str:
    """``[7]``, or ``[7] ↻[3] +64.00 MiB`` for a re-run of [3] that kept 64 MiB more than its previous run."""
    rerun = rec.rerun
    if rerun is None:
        return rec.label
    text = f"{rec.label} ↻[{rerun.of if rerun.of is not None else ' '}]"
    if rerun.growth and rerun.suspects:
        text += f" {format_delta(rerun.growth)}"
    return text


_RERUN_NOTE = "↻[n]: a re-run of cell [n], and the memory it kept beyond its previous run when an earlier run's tensors were still held."


# ---------------------------------------------------------------------------------------------
# The %%gpumem report
# ---------------------------------------------------------------------------------------------


def _span_rows(record: CellRecord) -> List[Tuple[str, tuple]]:
    """Rows ``(what, (before, after, delta, peak, peak increase))`` for the summary table."""
    rows = []
    for dev in record.devices:
        name = dev.label + (f" ({dev.name})" if dev.name else "")
        reserved_rise = (None if dev.peak_reserved is None or dev.reserved_before is None
                         else dev.peak_reserved - dev.reserved_before)
        rows.append((f"{name} allocated", (dev.allocated_before, dev.allocated_after, dev.allocated_delta,
                                           dev.peak_allocated, dev.peak_increase)))
        rows.append((f"{dev.label} reserved", (dev.reserved_before, dev.reserved_after, dev.reserved_delta,
                                               dev.peak_reserved, reserved_rise)))
        if dev.used_after is not None:
            rows.append((f"{dev.label} device used", (dev.used_before, dev.used_after, dev.used_delta, None, None)))
    host = record.host
    if host.rss_after is not None:
        rows.append(("host RSS", (host.rss_before, host.rss_after, host.rss_delta, host.peak_rss,
                                  host.rss_peak_increase)))
    return rows


def _device_indices(record: CellRecord) -> List[int]:
    indices = [d.index for d in record.devices]
    for line in record.lines or ():
        for dev in line.devices:
            if dev.index not in indices:
                indices.append(dev.index)
    return indices


def _device_columns(index: int, prefix: str) -> List[Column]:
    """Δallocated, Δreserved and the peak within the line on one device (blank where it was not read)."""
    def change(name):
        def cell(line):
            dev = line.device(index)
            return ("", "") if dev is None else delta_cell(getattr(dev, name))
        return cell

    def peak(line):
        dev = line.device(index)
        return ("", "") if dev is None else peak_cell(dev.peak_increase, dev.allocated_delta)

    return [Column(f"{prefix}Δallocated", change("allocated_delta")), Column(f"{prefix}Δreserved", change("reserved_delta")),
            Column(f"{prefix}peak in line", peak)]


def _lines_table(record: CellRecord, source_lines: Sequence[str]) -> Table:
    """The ``--lines`` table: every source line, hit or not; per device the columns the estimated
    report has too, then host RSS, time and the roles."""
    indices = _device_indices(record)
    columns: List[Column] = []
    for i in indices:
        columns += _device_columns(i, f"{cuda(i)} " if len(indices) > 1 else "")
    columns += [Column("Δhost RSS", lambda line: delta_cell(line.host.rss_delta)),
                Column("host peak in line", lambda line: (format_delta(line.host.rss_peak_increase), "dim")),
                Column("time", lambda line: (format_seconds(line.duration_s), "dim"))]
    if any(line.roles is not None for line in record.lines or ()):
        columns.append(Column("by role", lambda line: (roles_cell(line.roles, line.temporaries), ""), words=True))
    return line_table(source_lines, record.lines or (), columns)


def _reasons(record: CellRecord) -> List[str]:
    """``line N: why`` for each line that moved memory, and for lines counted together."""
    out = []
    for line in record.lines or ():
        text = words.line_reason(line)
        if text:
            out.append(f"line {line.lineno}: {text}")
    for span in record.joined or ():
        text = words.line_reason(span)
        if text:
            times = f", {span.hits} times" if span.hits > 1 else ""
            out.append(f"lines {_line_list(span.lines)} (counted together{times}): {text}")
    return out


def _line_list(lines) -> str:
    """``4–5`` for consecutive lines, ``2, 4, 7`` otherwise."""
    lines = sorted(lines)
    if lines == list(range(lines[0], lines[-1] + 1)):
        return f"{lines[0]}–{lines[-1]}"
    return ", ".join(map(str, lines))


def _line_change(line: LineRecord, index: Optional[int]) -> Optional[int]:
    if index is None:
        return line.host.rss_delta
    dev = line.device(index)
    return None if dev is None else dev.allocated_delta


def loop_summaries(record: CellRecord) -> List[str]:
    """For each loop of a ``--lines`` cell: what it kept, apart from what its lines allocated and
    released again within it (the churn that a loop line's summed change would otherwise show as
    a leak). Allocated memory on each CUDA device in use, else host RSS."""
    if not record.lines or not record.loops:
        return []
    indices = _device_indices(record) or [None]
    out = []
    for loop in record.loops:
        inside = [ln for ln in record.lines if loop.first <= ln.lineno <= loop.last]
        body = [ln for ln in inside if ln.lineno != loop.first]
        iterations = max((ln.hits for ln in body), default=0)
        if iterations < 2:
            continue
        for index in indices:
            changes = [c for c in (_line_change(ln, index) for ln in inside) if c is not None]
            if not changes:
                continue
            kept = sum(changes)
            churn = sum(c for c in changes if c > 0) - max(kept, 0)
            what = "host RSS" if index is None else (f"{cuda(index)} allocated" if len(indices) > 1 else "allocated")
            text = (f"Loop at line {loop.first} (lines {loop.first}–{loop.last}, {iterations} iterations): "
                    f"kept {format_delta(kept)} {what}")
            if churn > 0:
                text += (f"; its lines also allocated and released {format_bytes(churn)} within the loop "
                         "(churn: the per-line sums above include it, the cell did not keep it)")
            out.append(text + ".")
    return out


def _notes(record: CellRecord, stopped: Optional[str], counted: Optional[Tuple[int, int]]) -> List[str]:
    """The report's closing notes: what was not measured, and how."""
    notes = []
    if record.devices_note and not record.devices:
        notes.append(f"No GPU measured: {record.devices_note}; showing host memory.")
    if record.peaks == "sampled":
        notes.append("Peaks are the highest values sampled (peak counters were not reset for this cell).")
    if stopped:
        notes.append(stopped)
    if counted is not None:
        taken, total = counted
        from .lines import CENSUS_SHARE

        notes.append(f"Roles were counted at {taken:,} of {total:,} line boundaries (after each line's first run, "
                     f"then as often as keeps the count under {CENSUS_SHARE:.0%} of the cell's time); lines run "
                     "between two counts are counted together.")
    return notes


def cell_report_view(record: CellRecord, source_lines: Optional[Sequence[str]] = None, stopped: Optional[str] = None,
                     counted: Optional[Tuple[int, int]] = None, chart_html: Optional[str] = None) -> View:
    """The ``%%gpumem`` report: before / after / peak per device and host, then the lines.

    ``stopped`` says why line measurement stopped early, ``counted`` is ``(taken, boundaries)``
    when roles were counted at only some line boundaries. ``chart_html`` (an inline SVG of the
    cell, from ``chart.svg.cell_svg``) goes into the HTML between the summary and the line table.
    """
    head, tail = _report_parts(record, source_lines, stopped, counted)
    chart = [Raw("", f'<div style="margin:4px 0">{chart_html}</div>')] if chart_html else []
    return render(head + chart + tail, data=record)


def _report_parts(record: CellRecord, source_lines, stopped, counted) -> Tuple[list, list]:
    """The report's parts before the chart (title, summary table, capacity) and after it."""
    title = f"%%gpumem {record.label} · {format_seconds(record.duration_s)}"
    if record.error:
        title += f" · {record.error}"
    head = [Line(Span(title, "bold")),
            bytes_table(["", "before", "after", "Δ", "peak", "peak Δ"], _span_rows(record),
                        signed=(False, False, True, False, True))]
    for dev in record.devices:
        if dev.total:
            head.append(Line(Span(f"{dev.label}: {format_bytes(dev.reserved_after)} reserved of "
                                  f"{format_bytes(dev.total)} total", "dim")))
    head.extend(rank_report_parts(record))  # the processes it launched (issue 20)
    parts: list = []
    if record.lines is not None:
        lines_src = list(source_lines) if source_lines is not None else record.source.splitlines()
        parts.append(Blank())
        parts.append(_lines_table(record, lines_src))
        reasons = _reasons(record)
        if reasons:
            parts.append(Para("Why (by role: param, grad, optim state, act = activations autograd saved for backward, "
                              "other tensors; temp = what came and went within the line):", "dim"))
            parts.extend(Para(text, indent="  ") for text in reasons)
        summaries = loop_summaries(record)
        if summaries:
            parts.append(Para("A loop's lines sum their changes over every iteration; what each loop kept:", "dim"))
            parts.extend(Para(text, "dim", indent="  ") for text in summaries)
    reason = words.cell_reason(record)
    if reason:
        parts.append(Para(f"The cell: {reason}."))
    parts.extend(_phase_parts(record))
    parts.extend(Line(Span(n, "dim")) for n in _notes(record, stopped, counted))
    return head, parts


def _phase_parts(record: CellRecord) -> list:
    """The training phases the cell ran (forward, backward, optimizer step, zero_grad): per phase,
    how often (exact at any length), the worst peak, and what its first and steady steps changed by
    role; then the layers whose activations weigh most."""
    if not record.phases and not record.phase_summary:
        return []
    table = phase_table(record.phase_summary or summarize_phases(record.phases or ()))
    if table is None:
        return []
    return ([Blank(), Line(Span("Training phases (recognised from the modules, autograd and optimizers the cell used)",
                                "dim")), table]
            + heaviest("Heaviest activations (first forward)", as_modules(record.layers)))


# ---------------------------------------------------------------------------------------------
# %gpumem history
# ---------------------------------------------------------------------------------------------


def _history_rank_rows(records, cuda: bool) -> dict:
    """``{row index: [(row, classes)]}``: under a cell that launched processes, one row per rank
    (its host RSS change and peak rise, and on a GPU its device's), inserted after the cell's rows."""
    out, at = {}, 0
    for rec in records:
        at += 1 if not cuda else len(rec.devices or (None,))
        if not rec.ranks:
            continue
        rows = []
        for rank in rec.ranks:
            name = f"  rank {rank.rank}" if rank.rank is not None else f"  pid {rank.pid}"
            host = rank.host
            note = f"pid {rank.pid}" + ("" if rank.end == "exited" else f", {rank.end}")
            if not cuda:
                rows.append(([name, format_delta(host.rss_delta), format_delta(host.rss_peak_increase),
                              format_bytes(host.rss_after), "", "", note],
                             ["dim", delta_class(host.rss_delta), delta_class(host.rss_peak_increase), "", "", "", "dim"]))
                continue
            for dev in rank.devices or (None,):
                if dev is None:
                    row = [name, "host", "", "", "", "", format_delta(host.rss_delta)]
                    cls = ["dim", "", "", "", "", "", delta_class(host.rss_delta)]
                else:
                    row = [name, dev.label, format_delta(dev.allocated_delta), format_delta(dev.peak_increase),
                           format_delta(dev.reserved_delta), format_bytes(dev.reserved_after), format_delta(host.rss_delta)]
                    cls = ["dim", "", delta_class(dev.allocated_delta), delta_class(dev.peak_increase),
                           delta_class(dev.reserved_delta), "", delta_class(host.rss_delta)]
                rows.append((row + ["", "", note], cls + ["", "", "dim"]))
        out[at] = rows
    return out


def history_view(records: Sequence[CellRecord], limit: Optional[int] = None) -> View:
    """One row per recorded cell: per device deltas and peaks, or host RSS when no cell used CUDA."""
    if limit is not None and limit > 0:
        records = list(records)[-limit:]
    if not records:
        msg = "No cells recorded yet (ipy_gpumem records every cell after %load_ext ipy_gpumem)."
        return render([Line(msg)], data=[])
    cuda = any(rec.devices for rec in records)
    rows, classes = [], []
    for rec in records:
        source, error = cell_name(rec.source, 60), rec.error or ""
        host = rec.host
        if not cuda:
            rows.append([_history_label(rec), format_delta(host.rss_delta), format_delta(host.rss_peak_increase),
                         format_bytes(host.rss_after), format_seconds(rec.duration_s), error, source])
            classes.append(["", delta_class(host.rss_delta), delta_class(host.rss_peak_increase), "", "dim", "err", ""])
            continue
        for dev in rec.devices or (None,):
            if dev is None:
                row = [_history_label(rec), "host", "", "", "", "", format_delta(host.rss_delta)]
                cls = ["", "", "", "", "", "", delta_class(host.rss_delta)]
            else:
                row = [_history_label(rec), dev.label, format_delta(dev.allocated_delta), format_delta(dev.peak_increase),
                       format_delta(dev.reserved_delta), format_bytes(dev.reserved_after), format_delta(host.rss_delta)]
                cls = ["", "", delta_class(dev.allocated_delta), delta_class(dev.peak_increase),
                       delta_class(dev.reserved_delta), "", delta_class(host.rss_delta)]
            rows.append(row + [format_seconds(rec.duration_s), error, source])
            classes.append(cls + ["dim", "err", ""])
    for at, rank_rows in sorted(_history_rank_rows(records, cuda).items(), reverse=True):
        rows[at:at] = [row for row, _cls in rank_rows]
        classes[at:at] = [cls for _row, cls in rank_rows]
    if cuda:
        headers = ["cell", "device", "Δallocated", "peak Δ", "Δreserved", "reserved", "Δhost RSS", "time", "error", "source"]
        left = (0, 1, 8, 9)
    else:
        headers = ["cell", "Δhost RSS", "host peak Δ", "resident", "time", "error", "source"]
        left = (0, 5, 6)
    parts = [Table(headers, rows, left=left, classes=classes, src_col=len(headers) - 1)]
    if any(rec.rerun for rec in records):  # re-runs (issue 12)
        parts.append(Line(Span(_RERUN_NOTE, "dim")))
    return render(parts, data=list(records))
