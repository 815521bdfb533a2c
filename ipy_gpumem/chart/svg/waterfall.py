"""One cell drawn from its record alone: a waterfall of before, one floating bar per line, after.

A ``before`` bar, one floating bar per executed source line (or one for the whole cell) going up or
down by the line's delta with a whisker up to its peak, and an ``after`` bar. We know before, peak
and after but not *when* the peak happened, so we draw no invented time axis; the waterfall shows
exactly what was measured and points at the line that moved memory.
"""
from __future__ import annotations

import math
from typing import Optional

from ...core.units import format_bytes, format_delta
from ...display.escape import xml_text
from .axes import _capacities, _Frame, _off_scale, _y_axis, byte_ticks
from .base import DOWN_COLOR, UP_COLOR, _num, _svg_open, _text_width, empty_svg
from .legend import _legend, _legend_rows, series_name
from .roles import _role_column, _role_legend, _role_plan
from .slots import _line_slots, _record_title, _Slot, _subject


def _waterfall_levels(before: int, slots: list) -> list:
    """``[(level at start, level at end, whisker top or None)]`` per slot."""
    out, level = [], before
    for slot in slots:
        start, end = level, level + (slot.delta or 0)
        whisker = None
        if slot.peak_increase is not None and start + slot.peak_increase > max(start, end):
            whisker = start + slot.peak_increase
        out.append((start, end, whisker))
        level = end
    return out


def _waterfall_range(low: float, high: float) -> tuple:
    """``(floor, top, ticks)``: from 0 normally; zoomed when the changes are small next to the base.

    A waterfall is about the changes: +256 MiB on top of 5 GiB would be a hairline on an axis
    from 0. When everything sits above 40% of the top, the axis starts at a round value below
    the lowest level instead (the before/after bars then carry a break mark).
    """
    if 0 <= low <= 0.4 * high:
        top, ticks = byte_ticks(high * 1.08)
        return 0, top, ticks
    # Zoomed, or below zero when the line deltas of an incomplete record undershoot.
    _, span_ticks = byte_ticks((high - low) * 1.15)
    step = span_ticks[1]
    floor = math.floor((low - 0.05 * (high - low)) / step) * step
    floor = max(0, floor) if low >= 0 else floor
    count = max(1, math.ceil((high + 0.08 * (high - low) - floor) / step))
    return floor, floor + count * step, [floor + i * step for i in range(count + 1)]


def _bar(x, w, v0, v1, frame, fill, opacity, hover, extra="") -> str:
    y0, y1 = frame.y(max(v0, v1)), frame.y(min(v0, v1))
    return (
        f'<g><title>{xml_text(hover)}</title><rect x="{_num(x)}" y="{_num(y0)}" width="{_num(w)}" '
        f'height="{_num(max(y1 - y0, 1.0))}" fill="{fill}" fill-opacity="{opacity}"/>{extra}</g>'
    )


def _waterfall(record, width: int, height: int, title: Optional[str], ink: Optional[str] = None) -> str:
    subject = _subject(record)
    name = series_name(subject.key)
    if subject.before is None and subject.after is None:
        return empty_svg(f"{record.label}: no memory readings for this cell", width, ink=ink)
    before = subject.before if subject.before is not None else 0
    after = subject.after if subject.after is not None else before
    peak = subject.peak
    max_slots = max(1, int((width - 80) / 6) - 2)
    slots = _line_slots(record, subject, max_slots) if record.lines else []
    if not slots:
        delta = after - before
        increase = None if peak is None else peak - before
        hover = (f"{_record_title(record)}\n{name} {format_delta(delta)}"
                 f"{'' if peak is None else f', peak {format_bytes(peak)} ({format_delta(increase)})'}")
        slots = [_Slot(delta, increase, hover)]
    levels = _waterfall_levels(before, slots)
    plans = [_role_plan(slot, start, end) for slot, (start, end, _w) in zip(slots, levels)]
    marks = [before, after] + [v for level in levels for v in level if v is not None]
    marks += [v for v in (peak,) + tuple(subject.reserved) if v is not None]
    marks += [plan.low for plan in plans if plan is not None]
    floor, top, ticks = _waterfall_range(min(marks), max(marks))
    left = 8 + max(_text_width(format_bytes(int(t))) for t in ticks)
    title = title if title is not None else f"{_record_title(record)} · {name}"
    role_rows = _legend_rows(_role_legend(plans, subject.key), left, width - 4)
    frame = _Frame(width, height, left, 20, 34 + 13 * len(role_rows), 0.0, float(len(slots) + 2), top, floor)
    parts = [_svg_open(width, height, title, ink), _y_axis(frame, ticks)]
    capacity = [(subject.key.device, subject.total)] if subject.total else []
    on_scale = subject.total is not None and subject.total <= top
    if capacity and on_scale:
        parts.append(_capacities(capacity, frame, False))
    parts.append(_end_bar(0, before, subject.reserved[0], "before", frame))
    parts += _slot_marks(slots, levels, frame, plans, name)
    parts.append(_end_bar(len(slots) + 1, after, subject.reserved[1], "after", frame))
    plain = any(plan is None and start != end for plan, (start, end, _w) in zip(plans, levels))
    legend = _waterfall_legend(subject.reserved, grew=plain or all(plan is None for plan in plans))
    if slots[0].first is not None and not _tick_words(slots, frame.sx):
        legend.append(("ticks: source lines", None, ""))
    y = height - 5 - 13 * len(role_rows)
    parts.append(_legend(legend, frame.px0, y, width - 4, "" if on_scale else _off_scale(capacity, False)))
    for row in role_rows:
        y += 13
        parts.append(_legend(row, frame.px0, y, width - 4))
    parts.append(f'<text x="{_num(frame.px0)}" y="13" font-size="11" font-weight="600" fill="currentColor">'
                 f'{xml_text(title)}</text></svg>')
    return "".join(parts)


def _waterfall_legend(reserved, grew: bool = True) -> list:
    """The waterfall's own legend row; ``grew``/``shrank`` only when a column is drawn plainly."""
    items = [("before / after", "currentColor", "")]
    if grew:
        items += [("grew", UP_COLOR, ""), ("shrank", DOWN_COLOR, "")]
    items.append(("peak", "currentColor", "2 2"))
    if any(r is not None for r in reserved):
        items.append(("reserved", "currentColor", "4 2"))
    return items


def _end_bar(slot: int, value: int, reserved, label: str, frame: _Frame) -> str:
    """The before/after column: a neutral bar with its value, and reserved as a dashed tick."""
    w = frame.sx * 0.7
    x = frame.x(slot) + frame.sx * 0.15
    extra = (f'<text x="{_num(x + w / 2)}" y="{_num(frame.y(value) - 3)}" text-anchor="middle" font-size="9" '
             f'fill="currentColor">{xml_text(format_bytes(value))}</text>')
    if reserved is not None:
        y = frame.y(reserved)
        extra += (f'<line x1="{_num(x - 2)}" y1="{_num(y)}" x2="{_num(x + w + 2)}" y2="{_num(y)}" '
                  f'stroke="currentColor" stroke-width="1.2" stroke-dasharray="4 2"/>')
    if frame.ymin > 0:  # the bar is cut: say so with a break mark at its foot
        y = frame.py1 - 5
        extra += (f'<path d="M{_num(x - 2)},{_num(y + 2)} l{_num(w + 4)},-4 m0,4 l{_num(-w - 4)},4" '
                  f'stroke="currentColor" stroke-opacity="0.6" fill="none"/>')
    hover = f"{label}: {format_bytes(value)}" + ("" if reserved is None else f" (reserved {format_bytes(reserved)})")
    tick = (f'<text x="{_num(x + w / 2)}" y="{_num(frame.py1 + 13)}" text-anchor="middle" fill="currentColor" '
            f'fill-opacity="0.75">{xml_text(label)}</text>')
    base = max(frame.ymin, 0) if value >= 0 else frame.ymin
    return _bar(x, w, base, value, frame, "currentColor", 0.3, hover, extra) + tick


def _fits(text: str, width: float, size: float = 9) -> bool:
    return _text_width(text, size) <= width


def _whisker(cx: float, w: float, y_from: float, y_top: float) -> str:
    return (f'<line x1="{_num(cx)}" y1="{_num(y_from)}" x2="{_num(cx)}" y2="{_num(y_top)}" stroke="currentColor" '
            f'stroke-width="1.2" stroke-dasharray="2 2"/><line x1="{_num(cx - w / 4)}" y1="{_num(y_top)}" '
            f'x2="{_num(cx + w / 4)}" y2="{_num(y_top)}" stroke="currentColor" stroke-width="1.2"/>')


def _label(x: float, y: float, text: str, extra: str = "") -> str:
    return (f'<text x="{_num(x)}" y="{_num(y)}" text-anchor="middle" font-size="9" fill="currentColor"{extra}>'
            f'{xml_text(text)}</text>')


def _slot_texts(slot: _Slot, start: int, end: int, whisker, cx: float, w: float, room: float, frame: _Frame,
                low: Optional[float] = None) -> str:
    """The delta at its bar and the peak at its whisker, each only where it fits.

    The delta is written at the bar it belongs to, never at the whisker's top, where it would
    read as the peak: above a growing bar without a whisker, inside a growing bar tall enough to
    hold it (under the whisker otherwise), below a shrinking one. The whisker gets its own
    ``peak +X`` above it. A column stacked by role (``low``: its lowest level) keeps its label
    outside the coloured segments.
    """
    out = ""
    delta = end - start
    text = format_delta(delta)
    if delta != 0 and _fits(text, room):
        top, bottom = frame.y(max(start, end)), frame.y(min(start, end) if low is None else low)
        if delta < 0:
            out += _label(cx, bottom + 10, text)
        elif whisker is None:
            out += _label(cx, top - 3, text)
        elif low is None and bottom - top >= 13 and _fits(text, w):
            out += _label(cx, top + 10, text, ' fill-opacity="0.95" style="fill:#fff"')
        else:
            out += _label(cx, bottom + 10, text)
    if whisker is not None and slot.peak_increase is not None:
        peak_text = f"peak {format_delta(slot.peak_increase)}"
        if _fits(peak_text, room):
            out += _label(cx, frame.y(whisker) - 3, peak_text, ' fill-opacity="0.8"')
    return out


def _tick_words(slots: list, slot_w: float) -> bool:
    """True when every column is wide enough for ``line 3`` / ``lines 3–5`` (else bare numbers,
    explained once in the legend)."""
    return all(_fits(f"lines {s.tick}", slot_w - 4) for s in slots if s.first is not None)


def _slot_marks(slots: list, levels: list, frame: _Frame, plans: Optional[list] = None, name: str = "") -> list:
    """The floating bars (stacked by role where ``plans`` says so), peak whiskers, connectors and
    the line ticks (``line 3``, or bare numbers when the columns are narrow)."""
    out = []
    slot_w = frame.sx
    every = max(1, math.ceil(_text_width("00–00", 9) / max(slot_w, 1e-6)))
    words = _tick_words(slots, slot_w)
    plans = plans or [None] * len(slots)
    for i, (slot, (start, end, whisker), plan) in enumerate(zip(slots, levels, plans)):
        x = frame.x(i + 1) + slot_w * 0.15
        w = max(slot_w * 0.7, 1.0)
        color = UP_COLOR if end > start else DOWN_COLOR if end < start else "currentColor"
        extra = ""
        if whisker is not None:
            extra += _whisker(x + w / 2, w, frame.y(max(start, end)), frame.y(whisker))
        extra += _slot_texts(slot, start, end, whisker, x + w / 2, w, slot_w - 2, frame,
                             None if plan is None else plan.low)
        if plan is None:
            out.append(_bar(x, w, start, end, frame, color, 0.75 if end != start else 0.3, slot.hover, extra))
        else:
            out.append(f'<g><title>{xml_text(slot.hover)}</title>{extra}</g>')
            out.append(_role_column(slot, plan, x, w, frame, name))
        # A connector from the previous column's level shows where this one starts.
        out.append(f'<line x1="{_num(frame.x(i + 0.85))}" y1="{_num(frame.y(start))}" x2="{_num(x)}" '
                   f'y2="{_num(frame.y(start))}" stroke="currentColor" stroke-opacity="0.35"/>')
        if i % every == 0:
            tick = slot.tick
            if words and slot.first is not None:
                tick = f"line {tick}" if slot.first == slot.last else f"lines {tick}"
            out.append(f'<text x="{_num(x + w / 2)}" y="{_num(frame.py1 + 13)}" text-anchor="middle" font-size="9" '
                       f'fill="currentColor" fill-opacity="0.75">{xml_text(tick)}</text>')
    if levels:
        last, n = levels[-1][1], len(slots)
        out.append(f'<line x1="{_num(frame.x(n + 0.85))}" y1="{_num(frame.y(last))}" '
                   f'x2="{_num(frame.x(n + 1.15))}" y2="{_num(frame.y(last))}" stroke="currentColor" '
                   f'stroke-opacity="0.35"/>')
    return out
