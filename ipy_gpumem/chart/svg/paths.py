"""Series as SVG path data: the hot loop of a redraw (2000 points x 4 series every second).

Coordinates come from tables of pre-formatted strings, cached across redraws, instead of being
formatted per point, and the common case (no gap, int bytes) maps bound methods over the values so
that it runs in C; a series merged into buckets also gets its min-max band.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

from ...display.escape import xml_text
from .axes import Frame
from .base import dash_attr, num

__all__ = ["series_paths"]


@lru_cache(maxsize=64)
def _coord_table(origin: float, step: float, count: int, suffix: str) -> tuple:
    """``count`` pre-formatted coordinates ``origin + i * step`` (cached across redraws)."""
    return tuple(num(origin + i * step) + suffix for i in range(count))


def _runs(values: Sequence) -> list:
    """``[(start, stop)]`` index ranges of consecutive non-None values."""
    if None not in values:
        return [(0, len(values))] if values else []
    runs, start = [], None
    for i, v in enumerate(values):
        if v is None:
            if start is not None:
                runs.append((start, i))
                start = None
        elif start is None:
            start = i
    if start is not None:
        runs.append((start, len(values)))
    return runs


def _y_table(frame: Frame) -> tuple:
    """``(quantum, table)``: ``table[v // quantum]`` is the pre-formatted y of ``v`` bytes plus a space.

    Integer floor division by a byte quantum (about half a pixel) is one C call per point, and
    the table lookup replaces per-point formatting; together they keep a 2000-point series
    under a quarter of a millisecond.
    """
    height = frame.py1 - frame.py0
    quantum = max(1, int(frame.ymax / (2 * height)))
    return quantum, _coord_table(frame.py1, -quantum * frame.sy, int(frame.ymax // quantum) + 3, " ")


def _interleave(xs: list, ys) -> str:
    """``"x0,y0 x1,y1 ..."`` from ``"x,"`` and ``"y "`` strings (slice assignment: C speed)."""
    out = [""] * (2 * len(xs))
    out[::2] = xs
    out[1::2] = ys
    return "".join(out)


def _path_data(xs: list, values: Sequence, frame: Frame) -> str:
    """SVG path data through the points (``M x,y x,y ...``); None values break the line.

    This is the hot loop of a redraw (2000 points x 4 series every second), so the common case
    (no None, int bytes) runs in C, mapping bound methods over the values; anything else takes
    the per-run path.
    """
    quantum, ytab = _y_table(frame)
    try:
        return "M" + _interleave(xs, map(ytab.__getitem__, map(quantum.__rfloordiv__, values)))
    except (TypeError, IndexError):  # a None (gap), a float, or an out-of-range value
        pass
    last = len(ytab) - 1
    parts = []
    for a, b in _runs(values):
        ys = [ytab[min(max(int(v) // quantum, 0), last)] for v in values[a:b]]
        parts.append("M" + _interleave(xs[a:b], ys))
    return "".join(parts)


def _x_coords(times: Sequence[float], frame: Frame) -> list:
    """``"x,"`` strings for each time (half-pixel precision), shared by every series."""
    xtab = _coord_table(frame.px0, 0.5, int(2 * (frame.px1 - frame.px0)) + 3, ",")
    k = 2 * frame.sx
    shifted = times if frame.x0 == 0 else map((-frame.x0).__add__, times)  # t[0] is usually 0
    return list(map(xtab.__getitem__, map(int, map(k.__mul__, shifted))))


def _envelope(xs: list, highs: Sequence, lows: Sequence, n: int, frame: Frame, color: str) -> str:
    """The min-max band of the first ``n`` (merged) points, when any bucket has a range."""
    hi, lo = tuple(highs[:n]), tuple(lows[:n])
    if n < 2 or hi == lo or None in hi or None in lo:
        return ""
    top = _path_data(xs[:n], hi, frame)
    bottom = _path_data(xs[:n][::-1], lo[::-1], frame)
    return (
        f'<path d="{top}L{bottom[1:]}Z" fill="{color}" fill-opacity="0.18" stroke="none" '
        f'pointer-events="none"/>'
    )


def series_paths(times, plans, merged: int, frame: Frame, titles: bool = True) -> str:
    """The layout's series (``chart.session.SeriesPlan``) as paths, each over its min-max band where
    merged points have one; ``titles`` names each path in a ``<title>``."""
    xs = _x_coords(times, frame)
    out = []
    for plan in plans:
        if plan.lows is not None:
            # Saw-tooth memory (training loops) merged into buckets keeps its range visible.
            out.append(_envelope(xs, plan.values, plan.lows, merged, frame, plan.color))
        data = _path_data(xs, plan.values, frame)
        if data:
            title = f"<title>{xml_text(plan.name)}</title>" if titles else ""
            out.append(
                f'<path d="{data}" fill="none" stroke="{plan.color}" stroke-width="1.6" '
                f'stroke-linejoin="round"{dash_attr(plan.kind)} pointer-events="none">{title}</path>'
            )
    return "".join(out)
