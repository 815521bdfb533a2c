"""What every chart shares: its colours and sizes, escaped text, coordinates, the ``<svg>`` element, the empty chart.

Text and axes use ``currentColor`` and fills are semi-transparent, so the charts read in light and
dark themes; a chart meant for an ``<img>`` (where nothing is inherited) sets that colour to a mid
grey that reads on both (``ink=IMG_INK``). Every piece of text goes through ``display.escape.xml_text``,
which escapes it and drops what XML 1.0 forbids.
"""
from __future__ import annotations

from typing import Optional

from ...core.devices import Device
from ...display.escape import xml_text

FONT = "-apple-system,BlinkMacSystemFont,'Segoe UI',Helvetica,Arial,sans-serif"
#: Line colours per CUDA device (mid tones: readable on white and on a dark theme).
DEVICE_COLORS = ("#3b82f6", "#a855f7", "#14b8a6", "#f97316", "#ec4899", "#84cc16", "#06b6d4", "#eab308")
HOST_COLOR = "#10b981"
RUNNING_COLOR = "#f59e0b"
FAILED_COLOR = "#ef4444"
UP_COLOR = "#ef4444"
DOWN_COLOR = "#22c55e"
#: One colour per role (``core.roles.ROLES``): the Okabe–Ito palette, told apart with any colour
#: vision and readable on light and dark pages. A role this version does not know is grey.
ROLE_COLORS = {
    "parameters": "#0072B2",       # blue
    "gradients": "#E69F00",        # orange
    "optimizer_state": "#CC79A7",  # reddish purple
    "activations": "#009E73",      # bluish green
    "other_tensors": "#56B4E9",    # sky blue
    "allocator_cache": "#F0E442",  # yellow
    "outside_pytorch": "#D55E00",  # vermillion
}
OTHER_ROLE_COLOR = "#999999"
#: Dash pattern per series kind: allocated solid, reserved dashed, used dotted.
DASHES = {"allocated": "", "reserved": "6 3", "used": "1.5 2.5", "rss": ""}
#: ``currentColor`` of a chart drawn for an ``<img>``: a grey that reads on light and dark pages.
IMG_INK = "#8c8c8c"
CHAR_W = 5.6  # average glyph width at font-size 10, for layout estimates
#: Smaller charts are drawn at this size: axis labels alone need about 70 x 60 pixels.
MIN_WIDTH, MIN_HEIGHT = 240, 120


def _num(value: float) -> str:
    return f"{value:.1f}"


def _text_width(text: str, size: float = 10) -> float:
    return len(text) * CHAR_W * size / 10


def _svg_open(width: int, height: int, label: str, ink: Optional[str] = None) -> str:
    color = "inherit" if ink is None else ink
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{int(width)}" height="{int(height)}" '
        f'viewBox="0 0 {int(width)} {int(height)}" font-family="{FONT}" font-size="10" '
        f'role="img" aria-label="{xml_text(label)}" style="color:{color};overflow:visible">'
    )


def empty_svg(message: str = "no samples yet", width: int = 720, height: int = 40, ink: Optional[str] = None) -> str:
    """A small placeholder chart with a centred message."""
    height = max(int(height), 20)
    return (
        _svg_open(width, height, message, ink)
        + f'<rect x="0.5" y="0.5" width="{int(width) - 1}" height="{height - 1}" rx="4" fill="none" '
        f'stroke="currentColor" stroke-opacity="0.25"/>'
        + f'<text x="{int(width) / 2:.1f}" y="{height / 2 + 3.5:.1f}" text-anchor="middle" '
        f'fill="currentColor" fill-opacity="0.6">{xml_text(message)}</text></svg>'
    )


def device_color(device: Device) -> str:
    if not device.is_cuda or device.index is None:
        return HOST_COLOR
    return DEVICE_COLORS[device.index % len(DEVICE_COLORS)]


def role_color(role: str) -> str:
    return ROLE_COLORS.get(role, OTHER_ROLE_COLOR)
