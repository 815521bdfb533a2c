"""The plot's frame and what is drawn against it: byte and time ticks, both axes, the device capacity.

Byte ticks are in torch's spelling at a binary-friendly step, and time is written in one unit for
the whole axis (ms, s, min:s, min, h). A capacity far above the data would squash it into the bottom
pixels, so it is written in the legend row instead (:data:`CAPACITY_ON_SCALE`).
"""
from __future__ import annotations

import math
from typing import Optional

from ...core.units import GiB, KiB, MiB, format_bytes
from ...display.escape import xml_text
from .base import _num, device_color

#: A capacity line is drawn (and included in the y range) when the data reach this fraction
#: of it; below that, a 80 GiB line would squash a 2 GiB session into the bottom pixels, so
#: the capacity is only written in the corner.
CAPACITY_ON_SCALE = 0.3
_TICK_MULTIPLIERS = (1, 2, 4, 5, 8, 10, 16, 20, 25, 32, 40, 50, 64, 100, 128, 200, 250, 256, 500, 512)
_TIME_STEPS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300,
               600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)


def byte_ticks(top: float) -> tuple:
    """``(axis top, [tick values])``: 4-5 ticks from 0 at a binary-friendly step.

    Examples:
        >>> byte_ticks(15.2 * 2**30)[1][-1] / 2**30, len(byte_ticks(15.2 * 2**30)[1])
        (16.0, 5)
    """
    top = max(float(top or 0), 1.0)
    for unit in (1, KiB, MiB, GiB, GiB * 1024):
        for m in _TICK_MULTIPLIERS:
            step = m * unit
            count = math.ceil(top / step - 1e-9)
            if count <= 4:
                return count * step, [i * step for i in range(count + 1)]
    step = 2 ** math.ceil(math.log2(top / 4))
    count = math.ceil(top / step)
    return count * step, [i * step for i in range(count + 1)]


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


class _Frame:
    """Plot geometry: the data ranges and the pixel rectangle they map to."""

    def __init__(self, width, height, left, top, bottom, x0, x1, ymax, ymin=0):
        self.width, self.height = width, height
        self.px0, self.px1 = float(left), float(width - 10)
        self.py0, self.py1 = float(top), float(height - bottom)
        self.x0, self.x1 = x0, max(x1, x0 + 1e-6)
        self.ymin, self.ymax = ymin, max(ymax, ymin + 1)
        self.sx = (self.px1 - self.px0) / (self.x1 - self.x0)
        self.sy = (self.py1 - self.py0) / (self.ymax - ymin)

    def x(self, t: float) -> float:
        return self.px0 + (t - self.x0) * self.sx

    def y(self, v: float) -> float:
        return self.py1 - (v - self.ymin) * self.sy


def _y_axis(frame: _Frame, ticks: list) -> str:
    out = []
    for value in ticks:
        y = frame.y(value)
        out.append(
            f'<line x1="{_num(frame.px0)}" y1="{_num(y)}" x2="{_num(frame.px1)}" y2="{_num(y)}" '
            f'stroke="currentColor" stroke-opacity="{0.35 if value == 0 else 0.12}"/>'
            f'<text x="{_num(frame.px0 - 4)}" y="{_num(y + 3.5)}" text-anchor="end" fill="currentColor" '
            f'fill-opacity="0.75">{xml_text(format_bytes(int(value)))}</text>'
        )
    return "".join(out)


def _x_axis(frame: _Frame) -> str:
    ticks = time_ticks(frame.x0, frame.x1, max_ticks=max(2, int((frame.px1 - frame.px0) / 90)))
    step = ticks[1] - ticks[0] if len(ticks) > 1 else max(frame.x1 - frame.x0, 1e-3)
    y = frame.py1
    out = []
    for value in ticks:
        x = frame.x(value)
        out.append(
            f'<line x1="{_num(x)}" y1="{_num(y)}" x2="{_num(x)}" y2="{_num(y + 3)}" stroke="currentColor" '
            f'stroke-opacity="0.5"/><text x="{_num(x)}" y="{_num(y + 13)}" text-anchor="middle" '
            f'fill="currentColor" fill-opacity="0.75">{xml_text(format_time(value, step, ticks[-1]))}</text>'
        )
    return "".join(out)


def _capacity_layout(capacities, devices: list, data_max: float) -> tuple:
    """``(on-scale capacities, off-scale capacities)`` as ``[(device, bytes)]`` lists."""
    on, off = [], []
    for device in devices:
        total = capacities.get(device)
        if not total:
            continue
        (on if data_max >= CAPACITY_ON_SCALE * total else off).append((device, total))
    return on, off


def _label_y(y: float, frame: _Frame) -> float:
    """Baseline of a label for a horizontal line at ``y``: above it, or below when near the top."""
    return y - 3 if y - 12 >= frame.py0 else y + 11


def _capacities(on: list, frame: _Frame, several: bool) -> str:
    out = []
    for device, total in on:
        y = frame.y(total)
        text = f"{device.label} {format_bytes(total)} total" if several else f"{format_bytes(total)} total"
        out.append(
            f'<line x1="{_num(frame.px0)}" y1="{_num(y)}" x2="{_num(frame.px1)}" y2="{_num(y)}" '
            f'stroke="{device_color(device)}" stroke-width="1.2" stroke-dasharray="8 3 2 3" stroke-opacity="0.8"/>'
            f'<text x="{_num(frame.px1 - 3)}" y="{_num(_label_y(y, frame))}" text-anchor="end" fill="currentColor" '
            f'fill-opacity="0.8">{xml_text(text)}</text>'
        )
    return "".join(out)


def _off_scale(off: list, several: bool) -> str:
    """The capacities too far above the data to draw, as a note for the legend row."""
    if not off:
        return ""
    return " · ".join(f"{device.label} {format_bytes(total)} total" if several else f"{format_bytes(total)} total"
                      for device, total in off) + " (off scale)"
