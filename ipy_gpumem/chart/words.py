"""What the charts say in words: series names, hover texts, titles and notes, written here once from the numbers.

Both renderers call these and escape the result for their target (``xml_text`` in the SVG,
``plotly_text`` in a figure), so a hover reads the same in the picture and in the figure. Nothing
here is stored in a layout or a timeline: a layout holds numbers and references, and its words
are made where they are shown. Hovers of spans are cached, since a live chart asks for the same
spans every second.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional, Sequence

from ..core.roles import ROLE_WORDS
from ..core.text import cell_name, clip
from ..core.units import format_bytes, format_delta, format_seconds
from ..display.words import line_reason
from .timeline import HOST_RSS, Change, SeriesKey, Span, TimelineSnapshot

__all__ = ["series_name", "quantity_name", "change_text", "span_hover", "record_title", "status_line",
           "capacity_text", "off_scale_note", "exact_peak_text", "missed_peak_hover", "role_word", "line_hover",
           "role_list", "segment_hover", "cell_summary", "level_text", "fit_text", "column_hover", "placement_text", "PEAK_LEGEND",
           "ROLES_SCALED"]

_QUANTITY_NAMES = {"used": "used (all processes)"}
#: The legend entry of a cell's exact peak on the session chart.
PEAK_LEGEND = "cell peak (exact)"


def quantity_name(quantity: str) -> str:
    """``allocated``, ``reserved``, ``used (all processes)``, ``rss``."""
    return _QUANTITY_NAMES.get(quantity, quantity)


def series_name(key: SeriesKey) -> str:
    """``"cuda:0 allocated"``, ``"cuda:0 used (all processes)"``, ``"host RSS"``."""
    if key.device.is_host:
        return "host RSS"
    return f"{key.device.label} {quantity_name(key.quantity)}"


def _peak_part(peak: Optional[int], increase: Optional[int]) -> str:
    if peak is None:
        return ""
    if increase is None:
        return f", peak {format_bytes(peak)}"
    return f", peak {format_bytes(peak)} ({format_delta(increase)})"


def change_text(change: Change) -> str:
    """One device's line of a hover: ``cuda:0 allocated +1.00 GiB, peak 3.50 GiB (+2.00 GiB) · reserved +2.00 GiB``."""
    if change.device.is_host:
        return f"host RSS {format_delta(change.delta)}{_peak_part(change.peak, change.peak_increase)}"
    return (f"{change.device.label} allocated {format_delta(change.delta)}"
            f"{_peak_part(change.peak, change.peak_increase)} · reserved {format_delta(change.reserved_delta)}")


@lru_cache(maxsize=2048)
def span_hover(span: Span) -> str:
    """The tooltip of a span: label and first line, per-device deltas and peaks, duration, error.

    Example::

        [7] y = model(x)
        cuda:0 allocated +1.00 GiB, peak 3.50 GiB (+2.00 GiB) · reserved +2.00 GiB
        1.2 s · OutOfMemoryError
    """
    if span.cells > 1:
        text = f"{span.cells} cells {span.label} (merged to keep the timeline bounded)"
        if span.largest is not None and span.largest.recorded:
            text += "\nlargest: " + span_hover(span.largest)
        return text
    lines = [f"{span.label} {span.first_line}".rstrip()]
    if span.end is None:
        lines.append("running…")
    elif not span.recorded:
        lines.append("(no record)")
    else:
        lines += [change_text(change) for change in span.changes]
        lines.append(format_seconds(span.duration) + (f" · {span.error}" if span.error else ""))
    return "\n".join(lines)


def record_title(record, width: int = 60) -> str:
    """``[5] loss.backward()``: a cell by its label and the line that names it (past a ``%%`` header)."""
    return f"{record.label} {cell_name(record.source, width)}".rstrip()


def _last(values) -> Optional[int]:
    for value in reversed(values):
        if value is not None:
            return value
    return None


def status_line(snapshot: Optional[TimelineSnapshot]) -> str:
    """The current numbers in one line: per device allocated / reserved / capacity, else RSS."""
    if snapshot is None or snapshot.empty:
        return "no samples yet"
    parts = []
    for device in snapshot.devices():
        alloc = _last(snapshot.series.get(SeriesKey(device, "allocated"), ()))
        reserved = _last(snapshot.series.get(SeriesKey(device, "reserved"), ()))
        used = _last(snapshot.series.get(SeriesKey(device, "used"), ()))
        total = snapshot.capacities.get(device)
        text = f"{device.label} {format_bytes(alloc)} allocated · {format_bytes(reserved)} reserved"
        if used is not None and total:
            text += f" · {format_bytes(used)} used of {format_bytes(total)}"
        elif total:
            text += f" of {format_bytes(total)}"
        parts.append(text)
    if not parts:
        rss = _last(snapshot.series.get(HOST_RSS, ()))
        parts.append(f"host {format_bytes(rss)} resident" if rss is not None else "no readings yet")
    if snapshot.running is not None:
        parts.append(f"running {snapshot.running.label} for {snapshot.end - snapshot.running.start:.0f} s")
    return " · ".join(parts)


def capacity_text(device, total: int, several: bool = True) -> str:
    """``cuda:0 15.78 GiB total`` (the device named where several are drawn)."""
    return f"{device.label} {format_bytes(total)} total" if several else f"{format_bytes(total)} total"


def off_scale_note(off: Sequence, several: bool = True) -> str:
    """The capacities too far above the data to draw, as a note: ``cuda:0 80.00 GiB total (off scale)``."""
    if not off:
        return ""
    return " · ".join(capacity_text(device, total, several) for device, total in off) + " (off scale)"


def exact_peak_text(peak: int) -> str:
    """The label of a cell chart's exact peak line."""
    return f"peak {format_bytes(peak)} (exact, from the record)"


def missed_peak_hover(label: str, peak: int, key: SeriesKey) -> str:
    """``[3] cuda:0 allocated peak 9.00 GiB (exact, from the cell's record)``."""
    return f"{label} {series_name(key)} peak {format_bytes(peak)} (exact, from the cell's record)".lstrip()


def role_word(role: str) -> str:
    """A role as a sentence names it (``optimizer state``)."""
    return ROLE_WORDS.get(role, role)


def role_list(items) -> str:
    """``gradients +96.19 MiB, activations -16.00 MiB``."""
    return ", ".join(f"{role_word(role)} {format_delta(value)}" for role, value in items)


#: The legend note of a waterfall whose role stacks were scaled to the charted change.
ROLES_SCALED = "roles: exact tensor bytes, scaled to the {quantity} change"


def line_hover(line, name: str, delta: Optional[int], peak: Optional[int], roles=None,
               temporaries: Optional[int] = None) -> str:
    """A source line's part of a column's hover: the line and its source, what it did to the charted
    quantity (``name``), its time; with roles, what they are (``roles``: ``(in the bar, beside it)``) and
    why the line moved."""
    text = (f"line {line.lineno} ×{line.hits}: {clip(line.source.strip(), 80)}\n  {name} {format_delta(delta)}"
            f"{'' if peak is None else ', peak ' + format_delta(peak)} · {format_seconds(line.duration_s)}")
    if roles is None:
        return text
    inside, beside = roles
    if inside:
        text += f"\n  roles (exact tensor bytes): {role_list(inside)}"
    if beside:
        text += f"\n  beside allocated: {role_list(beside)}"
    if isinstance(temporaries, int) and temporaries > 0:
        text += f"\n  temporaries: {format_bytes(temporaries)} came and went"
    reason = line_reason(line)  # why the line moved memory, made from its data now
    if reason:
        text += f"\n  {clip(reason, 400)}"
    return text


def segment_hover(role: str, exact: int, drawn: Optional[int], name: str, column_hover: str) -> str:
    """A role segment's tooltip: the role and its exact bytes (and what it was drawn as when scaled to
    the ``name`` change), then its column's hover."""
    text = f"{role_word(role)} {format_delta(exact)}"
    if drawn is not None:
        text += f" (exact tensor bytes; drawn as {format_delta(drawn)}, scaled to the {name} change)"
    return f"{text}\n{column_hover}"


def cell_summary(span: Span) -> str:
    """``[3] cuda:0 +1.00 GiB (peak +2.00 GiB)``: a cell in a few words, from its numbers."""
    if not span.changes:
        return span.label
    change = max(span.changes, key=lambda c: max(abs(c.delta or 0), c.peak_increase or 0))
    text = f"{span.label} {'host' if change.device.is_host else change.device.label} {format_delta(change.delta)}"
    if change.peak_increase is not None and change.peak_increase > max(change.delta or 0, 0):
        text += f" (peak {format_delta(change.peak_increase)})"
    return text


def level_text(label: str, value: int, reserved: Optional[int] = None) -> str:
    """``before: 1.00 GiB (reserved 2.00 GiB)``."""
    return f"{label}: {format_bytes(value)}" + ("" if reserved is None else f" (reserved {format_bytes(reserved)})")


def fit_text(fit) -> str:
    """An estimate's verdict against its GPU as a note: ``T4: 14.75 GiB usable · fits`` or ``... · needs 17.90 GiB``."""
    verdict = "fits" if fit.fits else f"needs {format_bytes(fit.needed)}"
    return f"{fit.gpu}: {format_bytes(fit.capacity)} usable · {verdict}"


def _cell_hover(rec, name: str, before, after, peak, reserved=None) -> str:
    text = (f"{rec.label} {cell_name(rec.source, 80)}\n{name} {format_delta(after - before)} "
            f"→ {format_bytes(after)}" + ("" if peak is None else f", peak {format_bytes(peak)}"))
    if reserved is not None:
        text += f"\nreserved {format_bytes(reserved)}"
    return text + f"\n{format_seconds(rec.duration_s)}" + (f" · {rec.error}" if rec.error else "")


def column_hover(layout, column) -> str:
    """A column's tooltip, from its numbers and what it stands for (``chart.columns.Column``): an end
    column's level, a cell's lines (their sources, changes, roles and why), a whole cell or a cell of the
    history, an estimate's line."""
    if column.kind == "end":
        return level_text(column.tick, int(column.start), column.reserved)
    if column.lines:
        return "\n".join(line_hover(bar.line, layout.name, bar.delta, bar.peak, bar.roles, bar.temporaries)
                         for bar in column.lines[:12])
    source = column.source
    if isinstance(source, tuple):  # an estimate's line: (LineEstimate, its source)
        line, text = source
        return (f"line {line.lineno} ×{line.hits}: {clip(text.strip(), 80)}\nallocated {format_delta(line.allocated_delta)}, "
                f"peak in line {format_delta(line.peak_increase)}, reserved {format_delta(line.reserved_delta)}")
    if source is not None:
        if layout.kind == "history":
            return _cell_hover(source, layout.name, int(column.start), int(column.end), column.peak, column.reserved)
        increase = None if column.peak is None else column.peak - column.start
        return (f"{record_title(source)}\n{layout.name} {format_delta(int(column.delta))}"
                f"{_peak_part(column.peak, None if increase is None else int(increase))}")
    return f"{column.tick}: {format_delta(int(column.delta))}"


def placement_text(placement: Optional[dict]) -> str:
    """Where the front end said it drew the live chart, for the line of numbers above it ("" before it said)."""
    if not placement:
        return ""
    if placement.get("sidebar"):
        return "chart in the right sidebar"
    if placement.get("picture"):
        return "no plotly in this front end: the chart below is a picture updated in place"
    if placement.get("inline"):
        return "no right sidebar in this front end: the chart is below"
    return ""
