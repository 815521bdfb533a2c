"""Waterfall columns stacked by role: how much of what a line did each role (parameters, activations...) was.

A line whose record carries roles (``LineRecord.roles``) for the charted device has its bar stacked
by role (see :func:`_role_plan`): one Okabe–Ito colour per role, released roles outlined, a legend
of the roles drawn and a hover per segment with the role, its exact bytes and the line's reason.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from ...core.roles import ROLE_WORDS
from ...core.units import format_delta
from ...display.escape import xml_text
from ..timeline import SeriesKey
from .axes import _Frame
from .base import _num, role_color
from .slots import _role_order, _Slot

#: Roles are scaled to a column's change by at most this factor: tensors that make up less than
#: 1/16 of what a line did to host RSS did not make that change, and are not painted over it.
MAX_ROLE_SCALE = 16.0


class _Segment(NamedTuple):
    """One role's part of a column: ``v0`` to ``v1`` in chart bytes, ``exact`` the role's bytes."""

    role: str
    exact: int
    v0: float
    v1: float
    left: bool  # released (drawn in the left half when the column also has added roles)


class _RolePlan(NamedTuple):
    segments: tuple
    low: float  # the lowest level the column reaches (released roles hang from its start)
    scale: float  # chart bytes per role byte (1.0: drawn exactly)
    split: bool  # released and added roles side by side, each in half the column


def _role_plan(slot: _Slot, start: int, end: int) -> Optional[_RolePlan]:
    """How a column with roles is stacked; None when it is drawn plainly.

    Released roles (negative) hang down from the line's start level, then added roles (positive)
    rise from there to its end level: the column ends where the line did and never rises above
    the larger of start and end, so it cannot contradict the measured peak (the whisker). We do
    not know in which order the line released and allocated, so when it did both the two stacks
    stand side by side (released left, added right) instead of one on top of the other.

    The roles are exact tensor bytes. When they do not add up to the charted change (always on a
    host RSS chart, where the allocator's pages and non-tensor objects count too) they are scaled
    to add up to it, and the legend says so; when they cannot be (no change, roles netting to the
    other direction, or roles far too small to be what moved it: :data:`MAX_ROLE_SCALE`) the
    column is drawn plainly and the roles are in its hover only.
    """
    if not slot.roles:
        return None
    delta = end - start
    net = sum(value for _role, value in slot.roles)
    if not delta or not net or (delta > 0) != (net > 0):
        return None
    scale = delta / net
    if scale > MAX_ROLE_SCALE:
        return None
    downs = [(role, value) for role, value in slot.roles if value < 0]
    ups = [(role, value) for role, value in slot.roles if value > 0]
    segments, level = [], float(start)
    for role, value in downs + ups:
        top = level + value * scale
        segments.append(_Segment(role, value, level, top, value < 0))
        level = top
    low = start + sum(value for _role, value in downs) * scale
    return _RolePlan(tuple(segments), min(low, start, end), scale, bool(downs and ups))


def _scaled(scale: float) -> bool:
    return abs(scale - 1.0) > 1e-3


def _role_legend(plans: list, key: SeriesKey) -> list:
    """The roles drawn (ROLES order), ``released`` when a role was drawn going down, and a note
    when the roles were scaled to the charted change."""
    segments = [seg for plan in plans if plan is not None for seg in plan.segments]
    if not segments:
        return []
    roles = sorted({seg.role for seg in segments}, key=lambda role: _role_order((role, 0)))
    items = [(ROLE_WORDS.get(role, role), role_color(role), "box") for role in roles]
    if any(seg.exact < 0 for seg in segments):
        items.append(("released", "currentColor", "box-out"))
    if any(_scaled(plan.scale) for plan in plans if plan is not None):
        quantity = "RSS" if key.device.is_host else key.quantity
        items.append((f"roles: exact tensor bytes, scaled to the {quantity} change", None, ""))
    return items


def _segment_hover(slot: _Slot, seg: _Segment, plan: _RolePlan, name: str) -> str:
    """A role segment's tooltip: the role and its exact bytes (what it was drawn as when
    scaled), then the column's own hover (the line, its change, its roles and its reason)."""
    text = f"{ROLE_WORDS.get(seg.role, seg.role)} {format_delta(seg.exact)}"
    if _scaled(plan.scale):
        text += f" (exact tensor bytes; drawn as {format_delta(round(seg.v1 - seg.v0))}, scaled to the {name} change)"
    return f"{text}\n{slot.hover}"


def _role_column(slot: _Slot, plan: _RolePlan, x: float, w: float, frame: _Frame, name: str) -> str:
    """The column's role segments, each a ``<g class="role" data-role=...>`` with its own title."""
    out = []
    for seg in plan.segments:
        sx, sw = (x, w / 2) if plan.split and seg.left else (x + w / 2, w / 2) if plan.split else (x, w)
        color = role_color(seg.role)
        style = (f'fill="{color}" fill-opacity="0.3" stroke="{color}" stroke-width="1" stroke-dasharray="3 2"'
                 if seg.exact < 0 else f'fill="{color}" fill-opacity="0.85"')
        y0, y1 = frame.y(max(seg.v0, seg.v1)), frame.y(min(seg.v0, seg.v1))
        hover = xml_text(_segment_hover(slot, seg, plan, name))
        out.append(f'<g class="role" data-role="{xml_text(seg.role)}"><title>{hover}</title>'
                   f'<rect x="{_num(sx)}" y="{_num(y0)}" width="{_num(sw)}" height="{_num(max(y1 - y0, 1.0))}" '
                   f'{style}/></g>')
    return "".join(out)
