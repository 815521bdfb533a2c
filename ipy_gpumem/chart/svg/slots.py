"""One cell's record as waterfall columns: the quantity charted, one column per executed line, their hovers.

A cell chart shows the device that moved most (allocated), else host RSS. When there are more lines
than the chart has room for, consecutive lines share a column; a column carries roles only when
every line in it has roles for the charted device, so that a stack never mixes in unmeasured lines.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

from ...core.devices import Device, cuda
from ...core.roles import ROLE_WORDS, ROLES, TENSOR_ROLES
from ...core.text import clip, first_line
from ...core.units import format_bytes, format_delta, format_seconds
from ..timeline import HOST_RSS, SeriesKey
from .legend import series_name


class _Subject(NamedTuple):
    """What a cell chart shows: the device that moved most (allocated), else host RSS."""

    key: SeriesKey
    before: Optional[int]
    after: Optional[int]
    peak: Optional[int]
    reserved: tuple  # (before, after), None where unknown
    total: Optional[int]


def _subject(record) -> _Subject:
    devices = [d for d in record.devices if d.allocated_before is not None or d.allocated_after is not None]
    if devices:
        dev = max(devices, key=lambda d: max(abs(d.allocated_delta or 0), d.peak_increase or 0))
        return _Subject(SeriesKey(cuda(dev.index), "allocated"), dev.allocated_before, dev.allocated_after,
                        dev.allocated_peak, (dev.reserved_before, dev.reserved_after), dev.total)
    host = record.host
    return _Subject(HOST_RSS, host.rss_before, host.rss_after, host.rss_peak, (None, None), None)


def _line_values(line, key: SeriesKey) -> tuple:
    """``(delta, peak increase)`` of one LineRecord for the subject's series."""
    if key.device.is_host:
        return line.host.rss_delta, line.host.rss_peak_increase
    dev = line.device(key.device.index)
    return (None, None) if dev is None else (dev.allocated_delta, dev.peak_increase)


def _record_title(record) -> str:
    return f"{record.label} {first_line(record.source, 60)}".rstrip()


class _Slot(NamedTuple):
    """One waterfall column: a level change with an optional peak whisker.

    ``first``/``last`` are the source lines it covers (None for the whole cell).
    """

    delta: Optional[int]
    peak_increase: Optional[int]
    hover: str
    first: Optional[int] = None
    last: Optional[int] = None
    #: ``((role, exact signed bytes), ...)`` of the roles that make up the charted quantity
    #: (ROLES order, zeros dropped); empty when the lines carry no roles for the device.
    roles: tuple = ()

    @property
    def tick(self) -> str:
        if self.first is None:
            return "cell"
        return str(self.first) if self.first == self.last else f"{self.first}–{self.last}"


def _role_order(item) -> tuple:
    return (ROLES.index(item[0]) if item[0] in ROLES else len(ROLES), str(item[0]))


def _line_roles(line, device: Device) -> Optional[tuple]:
    """``(in the bar, beside it)`` of a line's roles on ``device``, each ``((role, bytes), ...)``;
    None when the line carries no roles for it.

    Host RSS holds every role of the "cpu" row. A CUDA chart draws allocated memory: the tensor
    roles make it up exactly; the allocator's cache and memory outside PyTorch are beside it.
    """
    table = getattr(line, "roles", None)
    if not isinstance(table, dict) or not isinstance(table.get(device.label), dict):
        return None
    inside, beside = [], []
    for role, value in sorted(table[device.label].items(), key=_role_order):
        try:
            value = int(value)
        except (TypeError, ValueError):
            continue
        if value:
            (inside if device.is_host or role in TENSOR_ROLES else beside).append((role, value))
    return tuple(inside), tuple(beside)


def _role_list(items) -> str:
    return ", ".join(f"{ROLE_WORDS.get(role, role)} {format_delta(value)}" for role, value in items)


def _line_hover(line, key: SeriesKey, name: str, d, p, roles) -> str:
    """A line's part of its column's hover; with roles, what they are and why the line moved."""
    text = (f"line {line.lineno} ×{line.hits}: {clip(line.source.strip(), 80)}\n  {name} {format_delta(d)}"
            f"{'' if p is None else ', peak ' + format_delta(p)} · {format_seconds(line.duration_s)}")
    if roles is None:
        return text
    inside, beside = roles
    if inside:
        text += f"\n  roles (exact tensor bytes): {_role_list(inside)}"
    if beside:
        text += f"\n  beside allocated: {_role_list(beside)}"
    temporaries = getattr(line, "temporaries", None)
    temp = temporaries.get(key.device.label) if isinstance(temporaries, dict) else None
    if isinstance(temp, int) and temp > 0:
        text += f"\n  temporaries: {format_bytes(temp)} came and went"
    if line.reason:
        text += f"\n  {clip(line.reason, 400)}"
    return text


def _line_slots(record, subject: _Subject, max_slots: int) -> list:
    """One slot per executed line (source order), grouped into runs when there are too many.

    A slot carries roles when every line in it has roles for the charted device (their sum).
    """
    lines = sorted(record.lines or (), key=lambda ln: ln.lineno)
    if not lines:
        return []
    name = series_name(subject.key)
    group = max(1, math.ceil(len(lines) / max_slots))
    slots = []
    for i in range(0, len(lines), group):
        chunk = lines[i:i + group]
        delta, peak, level, texts, sums, measured = 0, None, 0, [], {}, True
        for line in chunk:
            d, p = _line_values(line, subject.key)
            if p is not None:
                peak = max(peak if peak is not None else p, level + p)
            level += d or 0
            delta += d or 0
            roles = _line_roles(line, subject.key.device)
            measured = measured and roles is not None
            for role, value in (roles or ((), ()))[0]:
                sums[role] = sums.get(role, 0) + value
            texts.append(_line_hover(line, subject.key, name, d, p, roles))
        drawn = tuple(sorted(((r, v) for r, v in sums.items() if v), key=_role_order)) if measured else ()
        slots.append(_Slot(delta, peak, "\n".join(texts[:12]), chunk[0].lineno, chunk[-1].lineno, drawn))
    return slots
