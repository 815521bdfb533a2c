"""The ledger's views: the line after a cell, the ``%%gpumem`` report and the ``%gpumem history`` table."""
from __future__ import annotations

from typing import Optional, Sequence

from ..core.records import CellRecord, DeviceRecord
from ..core.units import format_bytes, format_delta, format_seconds
from ..display.view import View, delta_class as _cls, esc, format_of, html_table, text_table, wrap_html as _wrap

__all__ = ["cell_moved", "cell_line", "cell_view", "cell_report_view", "history_view"]


# ---------------------------------------------------------------------------------------------
# The per-cell line
# ---------------------------------------------------------------------------------------------


def cell_moved(record: CellRecord, threshold: int) -> bool:
    """Whether a cell moved memory by at least ``threshold`` bytes (allocated, reserved or peak;
    host RSS when no CUDA device is in use)."""
    for dev in record.devices:
        for value in (dev.allocated_delta, dev.reserved_delta, dev.peak_increase):
            if value is not None and abs(value) >= threshold:
                return True
    if not record.devices:
        host = record.host
        for value in (host.rss_delta, host.rss_peak_increase):
            if value is not None and abs(value) >= threshold:
                return True
    return False


def _device_parts(dev: DeviceRecord):
    """``[(text, css class), ...]`` for one device in the compact line."""
    parts = [(f"{dev.label} ", ""), (f"{format_delta(dev.allocated_delta)} allocated", _cls(dev.allocated_delta))]
    peak = dev.peak_increase
    if peak is not None and peak > max(dev.allocated_delta or 0, 0):
        parts.append((f" (peak {format_delta(peak)})", "up"))
    parts.append((f" · reserved {format_of(dev.reserved_after, dev.total)}", ""))
    return parts


def _host_parts(record: CellRecord):
    host = record.host
    parts = [("host ", ""), (f"{format_delta(host.rss_delta)} RSS", _cls(host.rss_delta))]
    peak = host.rss_peak_increase
    if peak is not None and peak > max(host.rss_delta or 0, 0):
        parts.append((f" (peak {format_delta(peak)})", "up"))
    parts.append((f" · {format_bytes(host.rss_after)} resident", ""))
    return parts


def _line_parts(record: CellRecord, threshold: int = 0):
    parts = [(record.label + " ", "dim")]
    shown = False
    for dev in record.devices:
        moved = any(v is not None and abs(v) >= threshold for v in (dev.allocated_delta, dev.reserved_delta, dev.peak_increase))
        if moved or len(record.devices) == 1:
            if shown:
                parts.append((" │ ", "dim"))
            parts.extend(_device_parts(dev))
            shown = True
    if not shown:
        parts.extend(_host_parts(record))
    parts.append((f" · {format_seconds(record.duration_s)}", "dim"))
    if record.error:
        parts.append((f" · {record.error}", "err"))
    return parts


def cell_line(record: CellRecord, threshold: int = 0) -> str:
    """The compact line shown after a cell, e.g.
    ``[7] cuda:0 +2.81 GiB allocated (peak +5.62 GiB) · reserved 9.53 / 15.78 GiB · 1.2 s``."""
    return "".join(text for text, _ in _line_parts(record, threshold))


def cell_view(record: CellRecord, threshold: int = 0) -> View:
    parts = _line_parts(record, threshold)
    text = "".join(t for t, _ in parts)
    inner = "".join(f'<span class="{c}">{esc(t)}</span>' if c else esc(t) for t, c in parts)
    return View(text, _wrap(f'<div title="ipy_gpumem">{inner}</div>'))


# ---------------------------------------------------------------------------------------------
# The %%gpumem report
# ---------------------------------------------------------------------------------------------


def _span_rows(record: CellRecord):
    """Rows ``(what, before, after, delta, peak, peak increase)`` for the summary table."""
    rows = []
    for dev in record.devices:
        name = f"{dev.label}" + (f" ({dev.name})" if dev.name else "")
        rows.append((f"{name} allocated", dev.allocated_before, dev.allocated_after, dev.allocated_delta, dev.allocated_peak, dev.peak_increase))
        rows.append((f"{dev.label} reserved", dev.reserved_before, dev.reserved_after, dev.reserved_delta, dev.reserved_peak,
                     None if dev.reserved_peak is None or dev.reserved_before is None else dev.reserved_peak - dev.reserved_before))
        if dev.used_after is not None:
            rows.append((f"{dev.label} device used", dev.used_before, dev.used_after, dev.used_delta, None, None))
    host = record.host
    if host.rss_after is not None:
        rows.append(("host RSS", host.rss_before, host.rss_after, host.rss_delta, host.rss_peak, host.rss_peak_increase))
    return rows


def _lines_table(record: CellRecord, source_lines: Sequence[str]):
    """Headers and rows for the ``--lines`` table: every source line, hit or not."""
    by_line = {line.lineno: line for line in record.lines or ()}
    indices = [d.index for d in record.devices]
    if not indices and record.lines:
        seen = []
        for line in record.lines:
            for d in line.devices:
                if d.index not in seen:
                    seen.append(d.index)
        indices = seen
    headers = ["line", "hits"]
    for i in indices:
        prefix = f"cuda:{i} " if len(indices) > 1 else ""
        headers += [f"{prefix}Δallocated", f"{prefix}Δreserved", f"{prefix}peak in line"]
    headers += ["Δhost RSS", "host peak in line", "time", "source"]
    rows, classes = [], []
    count = max([len(source_lines)] + [ln.lineno for ln in record.lines or ()])
    for lineno in range(1, count + 1):
        text = source_lines[lineno - 1] if lineno <= len(source_lines) else ""
        line = by_line.get(lineno)
        if line is None:
            rows.append([str(lineno), ""] + [""] * (3 * len(indices)) + ["", "", "", text])
            classes.append([])
            continue
        row = [str(lineno), str(line.hits)]
        cls = ["", ""]
        for i in indices:
            dev = line.device(i)
            if dev is None:
                row += ["", "", ""]
                cls += ["", "", ""]
                continue
            row += [format_delta(dev.allocated_delta), format_delta(dev.reserved_delta), format_delta(dev.peak_increase)]
            cls += [_cls(dev.allocated_delta), _cls(dev.reserved_delta), "up" if (dev.peak_increase or 0) > max(dev.allocated_delta or 0, 0) else "dim"]
        h = line.host
        row += [format_delta(h.rss_delta), format_delta(h.rss_peak_increase), format_seconds(line.duration_s), text]
        cls += [_cls(h.rss_delta), "dim", "dim", ""]
        rows.append(row)
        classes.append(cls)
    return headers, rows, classes


def cell_report_view(record: CellRecord, source_lines: Optional[Sequence[str]] = None, note: Optional[str] = None,
                     chart_html: Optional[str] = None) -> View:
    """The ``%%gpumem`` report: before / after / peak per device and host, then the lines.

    ``chart_html`` (an inline SVG of the cell, from ``svgchart.cell_svg``) goes into the HTML
    between the summary and the line table.
    """
    title = f"%%gpumem {record.label} · {format_seconds(record.duration_s)}"
    if record.error:
        title += f" · {record.error}"
    headers = ["", "before", "after", "Δ", "peak", "peak Δ"]
    rows = [
        (what, format_bytes(b), format_bytes(a), format_delta(d), format_bytes(p) if p is not None else "", format_delta(pi) if pi is not None else "")
        for what, b, a, d, p, pi in _span_rows(record)
    ]
    classes = [["", "", "", _cls(d), "", _cls(pi)] for _, _, _, d, _, pi in _span_rows(record)]
    notes = []
    if record.reason and not record.devices:
        notes.append(f"No CUDA device measured: {record.reason}; showing host memory.")
    if record.peaks == "sampled":
        notes.append("Peaks are the highest values sampled (peak counters were not reset for this cell).")
    if note:
        notes.append(note)
    text_parts = [title, text_table(headers, rows)]
    html_parts = [f"<div><b>{esc(title)}</b></div>", html_table(headers, rows, classes=classes)]
    totals = [d for d in record.devices if d.total]
    for dev in totals:
        line = f"{dev.label}: {format_bytes(dev.reserved_after)} reserved of {format_bytes(dev.total)} total"
        text_parts.append(line)
        html_parts.append(f'<div class="dim">{esc(line)}</div>')
    if chart_html:
        html_parts.append(f'<div style="margin:4px 0">{chart_html}</div>')
    if record.lines is not None:
        lines_src = list(source_lines) if source_lines is not None else record.source.splitlines()
        lh, lrows, lcls = _lines_table(record, lines_src)
        left = [len(lh) - 1]
        text_parts.append("")
        text_parts.append(text_table(lh, lrows, left=left))
        html_parts.append(html_table(lh, lrows, left=left, classes=lcls, src_col=len(lh) - 1))
    for n in notes:
        text_parts.append(n)
        html_parts.append(f'<div class="dim">{esc(n)}</div>')
    return View("\n".join(text_parts), _wrap("".join(html_parts)))


# ---------------------------------------------------------------------------------------------
# %gpumem history and status
# ---------------------------------------------------------------------------------------------


def history_view(records: Sequence[CellRecord], limit: Optional[int] = None) -> View:
    """One row per recorded cell: deltas and peaks per device (host RSS when no device)."""
    if limit is not None and limit > 0:
        records = list(records)[-limit:]
    if not records:
        msg = "No cells recorded yet (ipy_gpumem records every cell after %load_ext ipy_gpumem)."
        return View(msg, _wrap(f"<div>{esc(msg)}</div>"))
    headers = ["cell", "device", "Δallocated", "peak Δ", "Δreserved", "reserved", "Δhost RSS", "time", "error", "source"]
    rows, classes = [], []
    for rec in records:
        devs = rec.devices or (None,)
        for dev in devs:
            if dev is None:
                row = [rec.label, "host", "", format_delta(rec.host.rss_peak_increase), "", "", format_delta(rec.host.rss_delta)]
                cls = ["", "", "", _cls(rec.host.rss_peak_increase), "", "", _cls(rec.host.rss_delta)]
            else:
                row = [rec.label, dev.label, format_delta(dev.allocated_delta), format_delta(dev.peak_increase),
                       format_delta(dev.reserved_delta), format_bytes(dev.reserved_after), format_delta(rec.host.rss_delta)]
                cls = ["", "", _cls(dev.allocated_delta), _cls(dev.peak_increase), _cls(dev.reserved_delta), "", _cls(rec.host.rss_delta)]
            first = rec.first_line
            row += [format_seconds(rec.duration_s), rec.error or "", first if len(first) <= 60 else first[:57] + "..."]
            cls += ["dim", "err", ""]
            rows.append(row)
            classes.append(cls)
    left = [0, 1, 8, 9]
    return View(text_table(headers, rows, left=left), _wrap(html_table(headers, rows, left=left, classes=classes, src_col=9)))
