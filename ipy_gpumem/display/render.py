"""Pure text and HTML renderers for records and samples, and the ``View`` that carries both.

Every function here takes plain data and returns strings; nothing is displayed or imported
from IPython. Everything that comes from the user (source lines, error messages, names) is
HTML-escaped.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from ..core.records import CellRecord, DeviceRecord
from ..core.units import format_bytes, format_delta

__all__ = [
    "View",
    "cell_moved",
    "cell_line",
    "cell_view",
    "cell_report_view",
    "history_view",
    "status_view",
    "text_table",
    "html_table",
    "format_seconds",
    "freed_report",
]

_CSS = (
    "<style>"
    ".ipy-gpumem{font-family:var(--jp-code-font-family,monospace);font-size:12px;line-height:1.4}"
    ".ipy-gpumem table{border-collapse:collapse;margin:2px 0}"
    ".ipy-gpumem th,.ipy-gpumem td{padding:1px 8px;text-align:right;white-space:nowrap}"
    ".ipy-gpumem th{border-bottom:1px solid #999;font-weight:600}"
    ".ipy-gpumem td.l,.ipy-gpumem th.l{text-align:left}"
    ".ipy-gpumem td.src{text-align:left;white-space:pre}"
    ".ipy-gpumem .up{color:#c0392b}.ipy-gpumem .down{color:#27864a}.ipy-gpumem .dim{color:#888}"
    ".ipy-gpumem .err{color:#c0392b;font-weight:600}"
    "</style>"
)


@dataclass(frozen=True)
class View:
    """One rendering in two MIME types: what magics return and hooks display."""

    text: str
    html: str

    def __repr__(self) -> str:
        return self.text

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(self.text)  # terminal IPython and every front end without HTML

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        bundle = {"text/plain": self.text, "text/html": self.html}
        wanted = set(include or bundle) - set(exclude or ())
        return {mime: body for mime, body in bundle.items() if mime in wanted}


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def format_seconds(seconds: Optional[float]) -> str:
    """``0.4 ms``, ``12 ms``, ``1.2 s``, ``3 min 5 s``."""
    if seconds is None:
        return "n/a"
    if seconds < 0.001:
        return f"{seconds * 1e3:.2f} ms"
    if seconds < 1:
        return f"{seconds * 1e3:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes} min {rest} s"


def format_of(part: Optional[int], whole: Optional[int]) -> str:
    """``9.53 / 15.78 GiB`` (one unit when both share it), or just the part without a whole."""
    if not whole:
        return format_bytes(part)
    a, b = format_bytes(part), format_bytes(whole)
    unit_a, unit_b = a.rsplit(" ", 1)[-1], b.rsplit(" ", 1)[-1]
    if unit_a == unit_b and unit_a != "bytes":
        return f"{a.rsplit(' ', 1)[0]} / {b}"
    return f"{a} / {b}"


def _cls(delta: Optional[int]) -> str:
    if not delta:
        return "dim"
    return "up" if delta > 0 else "down"


def text_table(headers: Sequence[str], rows: Iterable[Sequence[str]], left: Sequence[int] = (0,)) -> str:
    """Aligned plain-text table; columns listed in ``left`` are left-aligned, others right."""
    rows = [list(map(str, r)) for r in rows]
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row[: len(widths)]):
            widths[i] = max(widths[i], len(cell))

    def fmt(cells):
        out = []
        for i, cell in enumerate(cells):
            if i == len(cells) - 1 and i in left:
                out.append(cell)  # no trailing padding on a left-aligned last column
            else:
                out.append(cell.ljust(widths[i]) if i in left else cell.rjust(widths[i]))
        return "  ".join(out).rstrip()

    lines = [fmt(list(headers)), "  ".join("-" * w for w in widths)]
    lines.extend(fmt(r) for r in rows)
    return "\n".join(lines)


def html_table(headers: Sequence[str], rows: Iterable[Sequence[object]], left: Sequence[int] = (0,),
               classes: Optional[Sequence[Sequence[str]]] = None, src_col: Optional[int] = None) -> str:
    """An HTML table; every cell is escaped. ``classes[r][c]`` adds a CSS class to a cell."""
    head = "".join(f'<th class="{"l" if i in left else ""}">{esc(h)}</th>' for i, h in enumerate(headers))
    body = []
    for r, row in enumerate(rows):
        cells = []
        for c, cell in enumerate(row):
            names = []
            if c in left:
                names.append("l")
            if c == src_col:
                names.append("src")
            if classes is not None and r < len(classes) and c < len(classes[r]) and classes[r][c]:
                names.append(classes[r][c])
            cells.append(f'<td class="{" ".join(names)}">{esc(cell)}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _wrap(inner: str) -> str:
    return f'{_CSS}<div class="ipy-gpumem">{inner}</div>'


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


def status_view(sample, names: Optional[dict] = None, host_backend: Optional[str] = None) -> View:
    """``%gpumem status``: per device, who has the memory now; and the process's host RSS.

    "used outside PyTorch" is the device's used memory minus what torch reserved: the CUDA
    context, other libraries (cuBLAS workspaces, NCCL) and other processes.
    """
    names = names or {}
    headers = ["device", "allocated by PyTorch", "reserved but unallocated", "used outside PyTorch", "free", "total"]
    rows = []
    for dev in sample.devices:
        unalloc = None if dev.reserved is None or dev.allocated is None else dev.reserved - dev.allocated
        outside = None if dev.used is None or dev.reserved is None else max(dev.used - dev.reserved, 0)
        free = None if dev.used is None or dev.total is None else dev.total - dev.used
        label = f"cuda:{dev.index}" + (f" ({names[dev.index]})" if names.get(dev.index) else "")
        rows.append([label, format_bytes(dev.allocated), format_bytes(unalloc), format_bytes(outside), format_bytes(free), format_bytes(dev.total)])
    text_parts, html_parts = [], []
    if rows:
        text_parts.append(text_table(headers, rows))
        html_parts.append(html_table(headers, rows))
    else:
        msg = f"No CUDA device in use: {sample.reason or 'none found'}."
        text_parts.append(msg)
        html_parts.append(f"<div>{esc(msg)}</div>")
    rss = sample.host.rss
    host = f"host: {format_bytes(rss)} resident (process RSS)" if rss is not None else "host: RSS unavailable"
    text_parts.append(host)
    html_parts.append(f"<div>{esc(host)}</div>")
    return View("\n".join(text_parts), _wrap("".join(html_parts)))


def freed_report(before, after) -> str:
    """What ``%gpumem free`` released, from samples before and after: per device and host RSS."""
    lines = ["ipy_gpumem free: done."]
    prior = {d.index: d for d in before.devices}
    for dev in after.devices:
        b = prior.get(dev.index)
        if b is None:
            continue
        lines.append(f"  cuda:{dev.index}: allocated {format_bytes(b.allocated)} -> {format_bytes(dev.allocated)} "
                     f"({format_delta((dev.allocated or 0) - (b.allocated or 0))}), reserved "
                     f"{format_bytes(b.reserved)} -> {format_bytes(dev.reserved)} "
                     f"({format_delta((dev.reserved or 0) - (b.reserved or 0))})")
    if before.host.rss is not None and after.host.rss is not None:
        lines.append(f"  host RSS: {format_bytes(before.host.rss)} -> {format_bytes(after.host.rss)} "
                     f"({format_delta(after.host.rss - before.host.rss)})")
    return "\n".join(lines)
