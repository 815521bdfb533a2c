"""The charts' scales: one byte unit per axis, byte ticks at a round step written in that one unit, time ticks.

A byte axis is written in one unit chosen from its top (``0 GiB, 0.5 GiB, 1.0 GiB, 1.5 GiB``, never
``0 bytes, 500.00 MiB, 1.46 GiB``), and the plotly figures divide their values by the same unit, so
both renderers of a chart show the same numbers. Time is written in one unit for the whole axis
(ms, s, min:s, min, h).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

from ..core.units import GiB, KiB, MiB, TiB

__all__ = ["ByteUnit", "byte_unit", "byte_ticks", "byte_labels", "tick_label", "time_ticks", "format_time"]

#: Steps of a byte axis in its unit, roundest first (binary-friendly multiples and simple fractions).
_STEPS = (0.1, 0.2, 0.25, 0.5, 1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 40, 50, 64, 100, 128, 200, 250, 256, 500, 512)
_TIME_STEPS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300,
               600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)


class ByteUnit(NamedTuple):
    """A byte unit: what a value is divided by, and its name (``(2**30, "GiB")``)."""

    divisor: int
    name: str


_UNITS = (ByteUnit(TiB, "TiB"), ByteUnit(GiB, "GiB"), ByteUnit(MiB, "MiB"), ByteUnit(KiB, "KiB"))


def byte_unit(top: float) -> ByteUnit:
    """The unit for values up to ``top`` bytes: TiB from 1 TiB, GiB from 1 GiB, else MiB, else KiB.

    Examples:
        >>> byte_unit(3 * 2**30), byte_unit(0)
        (ByteUnit(divisor=1073741824, name='GiB'), ByteUnit(divisor=1024, name='KiB'))
    """
    for unit in _UNITS:
        if top >= unit.divisor:
            return unit
    return _UNITS[-1]


def _axis_unit(top: float) -> ByteUnit:
    return byte_unit(top) if top >= KiB else ByteUnit(1, "bytes")


def byte_ticks(top: float) -> tuple:
    """``(axis top, [tick values])``: 2 to 5 ticks from 0 at a round step of the axis's one unit.

    Examples:
        >>> byte_ticks(15.2 * 2**30)[1][-1] / 2**30, len(byte_ticks(15.2 * 2**30)[1])
        (16.0, 5)
        >>> [t / 2**30 for t in byte_ticks(1.46 * 2**30)[1]]
        [0.0, 0.5, 1.0, 1.5]
    """
    top = max(float(top or 0), 1.0)
    unit = _axis_unit(top)
    scaled = top / unit.divisor
    for step in _STEPS:
        if unit.divisor == 1 and step < 1:
            continue  # no fractions of a byte
        count = math.ceil(scaled / step - 1e-9)
        if count <= 4:
            break
    else:  # past 2048 of the largest unit
        step = 2 ** math.ceil(math.log2(scaled / 4))
        count = math.ceil(scaled / step - 1e-9)
    size = step * unit.divisor
    return count * size, [i * size for i in range(count + 1)]


def _decimals(step: float) -> int:
    for decimals in range(3):
        if abs(round(step, decimals) - step) < 1e-9:
            return decimals
    return 3


def byte_labels(ticks: Sequence[float]) -> list:
    """The tick values written in one unit, the largest tick's, with as many decimals as the step needs.

    Examples:
        >>> byte_labels([0, 2**29, 2**30, 3 * 2**29])
        ['0 GiB', '0.5 GiB', '1.0 GiB', '1.5 GiB']
        >>> byte_labels([0, 256, 512])
        ['0 bytes', '256 bytes', '512 bytes']
    """
    if not ticks:
        return []
    unit = _axis_unit(max(abs(t) for t in ticks))
    steps = [abs(b - a) for a, b in zip(ticks, ticks[1:])]
    decimals = _decimals(min(steps) / unit.divisor) if steps else 0
    return [tick_label(t, unit, decimals) for t in ticks]


def tick_label(value: float, unit: ByteUnit, decimals: int = 0) -> str:
    """``value`` bytes in ``unit`` with ``decimals`` (``"1.5 GiB"``)."""
    scaled = value / unit.divisor
    if abs(scaled) < 1e-12:
        return f"0 {unit.name}"
    return f"{scaled:.{decimals}f} {unit.name}"


def time_ticks(lo: float, hi: float, max_ticks: int = 6) -> list:
    """Tick positions (seconds) between ``lo`` and ``hi`` at a round step."""
    span = max(hi - lo, 1e-9)
    step = next((s for s in _TIME_STEPS if span / s <= max_ticks), None)
    if step is None:
        step = _TIME_STEPS[-1] * math.ceil(span / max_ticks / _TIME_STEPS[-1])
    first = math.ceil(lo / step - 1e-9) * step
    ticks, value = [], first
    while value <= hi + 1e-9 and len(ticks) < 100:
        ticks.append(value)
        value = first + len(ticks) * step
    return ticks


def format_time(value: float, step: float, hi: Optional[float] = None) -> str:
    """An axis label in one unit for the whole axis (chosen from the step and the axis end).

    Examples:
        >>> [format_time(v, 0.25, 0.75) for v in (0, 0.25)], format_time(1.5, 0.5, 2), format_time(30, 15, 60)
        (['0 ms', '250 ms'], '1.5 s', '30 s')
        >>> format_time(150, 30, 300), format_time(600, 300, 1800), format_time(5400, 1800, 14400)
        ('2:30', '10 min', '1.5 h')
    """
    hi = value if hi is None else hi
    if step >= 3600 or hi >= 3 * 3600:
        return f"{value / 3600:g} h"
    if step >= 60:
        return f"{value / 60:g} min"
    if step >= 1:
        if hi < 120:
            return f"{value:.0f} s"
        minutes, seconds = divmod(int(round(value)), 60)
        return f"{minutes}:{seconds:02d}"
    if hi < 1:
        return f"{value * 1000:.0f} ms"
    decimals = max(1, -math.floor(math.log10(step) + 1e-9))
    return f"{value:.{decimals}f} s"
