"""The plot's frame and what is drawn against it: byte and time ticks, both axes, capacity lines.

The ticks are the layout's (``chart.scale``): a byte axis is written in one unit, time in one unit
for the whole axis.
"""
from __future__ import annotations

from typing import Sequence

from ...display.escape import xml_text
from ..scale import byte_labels, format_time, time_ticks
from ..style import device_color
from ..words import capacity_text
from .base import DASH_ARRAYS, num

__all__ = ["Frame", "y_axis", "x_axis", "capacity_lines", "label_y", "hline"]


class Frame:
    """Plot geometry: the data ranges and the pixel rectangle they map to.

    Args:
        width, height: the picture's size; ``left``, ``top``, ``bottom``: its margins (the right one is 10).
        x0, x1: the data's x range; ``ymin``, ``ymax``: its y range.
    """

    def __init__(self, width, height, left, top, bottom, x0, x1, ymax, ymin=0):
        self.width, self.height = width, height
        self.px0, self.px1 = float(left), float(width - 10)
        self.py0, self.py1 = float(top), float(height - bottom)
        self.x0, self.x1 = x0, max(x1, x0 + 1e-6)
        self.ymin, self.ymax = ymin, max(ymax, ymin + 1)
        self.sx = (self.px1 - self.px0) / (self.x1 - self.x0)
        self.sy = (self.py1 - self.py0) / (self.ymax - ymin)

    def x(self, t: float) -> float:
        """The pixel column of data x ``t``."""
        return self.px0 + (t - self.x0) * self.sx

    def y(self, v: float) -> float:
        """The pixel row of data y ``v``."""
        return self.py1 - (v - self.ymin) * self.sy


def y_axis(frame: Frame, ticks: Sequence[float]) -> str:
    """Grid lines and labels at the byte ``ticks``, written in one unit."""
    out = []
    for value, label in zip(ticks, byte_labels(list(ticks))):
        y = frame.y(value)
        out.append(
            f'<line x1="{num(frame.px0)}" y1="{num(y)}" x2="{num(frame.px1)}" y2="{num(y)}" '
            f'stroke="currentColor" stroke-opacity="{0.35 if value == 0 else 0.12}"/>'
            f'<text x="{num(frame.px0 - 4)}" y="{num(y + 3.5)}" text-anchor="end" fill="currentColor" '
            f'fill-opacity="0.75">{xml_text(label)}</text>'
        )
    return "".join(out)


def x_axis(frame: Frame) -> str:
    """Time ticks along the bottom, in one unit for the whole axis."""
    ticks = time_ticks(frame.x0, frame.x1, max_ticks=max(2, int((frame.px1 - frame.px0) / 90)))
    step = ticks[1] - ticks[0] if len(ticks) > 1 else max(frame.x1 - frame.x0, 1e-3)
    y = frame.py1
    out = []
    for value in ticks:
        x = frame.x(value)
        out.append(
            f'<line x1="{num(x)}" y1="{num(y)}" x2="{num(x)}" y2="{num(y + 3)}" stroke="currentColor" '
            f'stroke-opacity="0.5"/><text x="{num(x)}" y="{num(y + 13)}" text-anchor="middle" '
            f'fill="currentColor" fill-opacity="0.75">{xml_text(format_time(value, step, ticks[-1]))}</text>'
        )
    return "".join(out)


def label_y(y: float, frame: Frame) -> float:
    """Baseline of a label for a horizontal line at ``y``: above it, or below when near the top."""
    return y - 3 if y - 12 >= frame.py0 else y + 11


def hline(frame: Frame, value: float, colour: str, kind: str, label: str, anchor: str = "end",
          width: float = 1.2) -> str:
    """A horizontal line across the plot at ``value`` with its label (right- or left-aligned)."""
    y = frame.y(value)
    dash = DASH_ARRAYS.get(kind, "")
    dash = f' stroke-dasharray="{dash}"' if dash else ""
    x = frame.px1 - 3 if anchor == "end" else frame.px0 + 3
    return (f'<line x1="{num(frame.px0)}" y1="{num(y)}" x2="{num(frame.px1)}" y2="{num(y)}" stroke="{colour}" '
            f'stroke-width="{width}"{dash} stroke-opacity="0.85"/>'
            f'<text x="{num(x)}" y="{num(label_y(y, frame))}" text-anchor="{anchor}" fill="currentColor" '
            f'fill-opacity="0.8">{xml_text(label)}</text>')


def capacity_lines(capacities: Sequence, frame: Frame, several: bool) -> str:
    """Each ``(device, bytes)`` capacity as a dash-dot line in the device's colour, with its total."""
    return "".join(hline(frame, total, device_color(device), "dashdot", capacity_text(device, total, several))
                   for device, total in capacities)
