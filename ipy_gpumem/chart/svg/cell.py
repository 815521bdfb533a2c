"""``cell_svg``: the chart of one cell, a line chart of the samples it saw or a waterfall of its record.

With samples taken during the cell it is the same line chart as the session's, over the cell's
time, plus the exact peak from the record as a dashed line (samples can miss a short spike; the
record's peak cannot). Without samples it is the before / per-line / after waterfall
(:mod:`.waterfall`), which draws only what was measured.
"""
from __future__ import annotations

from typing import Optional

from ..timeline import Timeline
from .base import MIN_HEIGHT, MIN_WIDTH, empty_svg
from .legend import _drawn_keys
from .line_chart import _line_chart
from .slots import _record_title, _subject
from .waterfall import _waterfall


def _samples_series(samples) -> tuple:
    """``(times, series, capacities)`` of probe Samples, times from the first one."""
    timeline = Timeline(max_points=max(8, 2 * len(samples) + 8))
    for sample in samples:
        timeline.add(sample)
    snap = timeline.snapshot()
    return snap.t, dict(snap.series), dict(snap.capacities)


def cell_svg(record, samples=None, width: int = 480, height: int = 200, title: Optional[str] = None,
             ink: Optional[str] = None) -> str:
    """The chart of one cell as an SVG string.

    Args:
        record: the cell's :class:`~ipy_gpumem.core.records.CellRecord` (None gives a placeholder).
        samples: :class:`~ipy_gpumem.core.probes.Sample` objects taken during the cell, or None.
            With two or more, the chart is the line chart over the cell's time with the record's
            exact peak as a dashed line. Otherwise it is the before / per-line / after waterfall
            described in the module doc.
        width: pixels (at least 240 are used).
        height: pixels (at least 120 are used).
        title: text above the plot; defaults to the cell's label and first line.
        ink: the chart's ``currentColor``; None inherits the page's (inline SVG), :data:`IMG_INK`
            for an ``<img>`` (``chart.views.svg_data_uri``), which an untrusted notebook keeps
            where its sanitizer strips inline SVG.
    """
    width, height = max(int(width), MIN_WIDTH), max(int(height), MIN_HEIGHT)
    if record is None:
        return empty_svg("no record", width, ink=ink)
    try:
        points = [s for s in samples if s is not None and hasattr(s, "host")] if samples is not None else []
    except TypeError:
        points = []
    if len(points) >= 2:
        times, series, capacities = _samples_series(points)
        keys = _drawn_keys(series)
        if keys:
            subject = _subject(record)
            # The record's exact peak belongs on the chart only when it is the drawn quantity.
            peak = subject.peak if subject.key.device.is_host == keys[0].device.is_host else None
            if subject.total and subject.key.device.is_cuda:
                capacities.setdefault(subject.key.device, subject.total)
            return _line_chart(times, series, series, keys, capacities=capacities, end=times[-1] if times else 0.0,
                               width=width, height=height, title=title or _record_title(record), peak=peak, ink=ink)
    return _waterfall(record, width, height, title, ink)
