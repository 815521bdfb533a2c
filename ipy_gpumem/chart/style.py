"""How the charts look, whichever renderer draws them: the colours, line kinds and band fills of every series, cell and role.

Both renderers (``svg/`` and ``figures/``) read these, so a series has one colour and one line kind
everywhere. Colours are mid tones that read on light and dark pages. ``INK`` stands for the page's
own text colour: the SVG writes ``currentColor`` for it, and where nothing is inherited (an
``<img>``, a plotly figure) it is :data:`IMG_INK`, a grey that reads on both.
"""
from __future__ import annotations

from typing import Optional

from ..core.devices import Device

__all__ = ["DEVICE_COLORS", "HOST_COLOR", "RUNNING_COLOR", "FAILED_COLOR", "UP_COLOR", "DOWN_COLOR", "FLAT_COLOR",
           "PEAK_COLOR", "ROLE_COLORS", "OTHER_ROLE_COLOR", "RANK_COLORS", "IMG_INK", "INK", "LINE_KINDS",
           "BANDS", "device_color", "role_color", "line_kind", "band", "rgba"]

#: Line colours per CUDA device.
DEVICE_COLORS = ("#3b82f6", "#a855f7", "#14b8a6", "#f97316", "#ec4899", "#84cc16", "#06b6d4", "#eab308")
HOST_COLOR = "#10b981"
RUNNING_COLOR = "#f59e0b"
FAILED_COLOR = "#ef4444"
#: A column that grew, shrank, or stayed.
UP_COLOR = "#ef4444"
DOWN_COLOR = "#22c55e"
FLAT_COLOR = "#8c8c8c"
#: A cell's exact peak: a colour of its own, apart from every series (host RSS's green included), so
#: a peak mark never reads as a piece of the line it stands over.
PEAK_COLOR = "#db2777"
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
#: One colour per rank a cell launched, apart from the devices' (Okabe–Ito's darker half).
RANK_COLORS = ("#CC79A7", "#0072B2", "#D55E00", "#009E73", "#E69F00", "#56B4E9", "#999933", "#882255")
#: The page's text colour where nothing is inherited: a grey that reads on light and dark pages.
IMG_INK = "#8c8c8c"
#: Stands for the page's text colour in this module's tables (``currentColor`` in an inline SVG).
INK = "ink"
#: Line kind per quantity: allocated solid, reserved dashed, device-wide used dotted, RSS solid.
LINE_KINDS = {"allocated": "solid", "reserved": "dash", "used": "dot", "rss": "solid"}
#: A cell's band on the session chart, by kind: ``(colour, opacity)``. Back-to-back cells alternate.
BANDS = {"running": (RUNNING_COLOR, 0.25), "failed": (FAILED_COLOR, 0.18), "even": (INK, 0.12), "odd": (INK, 0.06)}


def device_color(device: Device) -> str:
    """A device's series colour: its index's, or the host's green."""
    if not device.is_cuda or device.index is None:
        return HOST_COLOR
    return DEVICE_COLORS[device.index % len(DEVICE_COLORS)]


def role_color(role: str) -> str:
    """A role's colour (grey for a role this version does not know)."""
    return ROLE_COLORS.get(role, OTHER_ROLE_COLOR)


def line_kind(quantity: str) -> str:
    """``solid``, ``dash`` or ``dot`` for a quantity (:data:`LINE_KINDS`)."""
    return LINE_KINDS.get(quantity, "solid")


def band(kind: str) -> tuple:
    """``(colour, opacity)`` of a cell band of ``kind`` (:data:`BANDS`); the colour may be :data:`INK`."""
    return BANDS.get(kind, BANDS["even"])


def rgba(colour: str, opacity: float, ink: Optional[str] = IMG_INK) -> str:
    """``#rrggbb`` (or :data:`INK`, drawn as ``ink``) at ``opacity`` as CSS ``rgba(...)``."""
    colour = (ink if colour == INK else colour).lstrip("#")
    red, green, blue = (int(colour[i:i + 2], 16) for i in (0, 2, 4))
    return f"rgba({red},{green},{blue},{opacity})"
