"""The pictures of reports: one cell (the samples it saw, or its waterfall), the recorded cells, an estimate's step.

With samples taken during the cell (and no line-by-line record) a cell's picture is the session's
line chart over the cell's time, plus the exact peak from the record as a dotted line (samples can
miss a short spike; the record's peak cannot). Otherwise it is the before / per-line / after
waterfall, which draws only what was measured. The history and an estimate are column charts too,
so a report's picture is the same chart as its plotly figure.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..columns import cell_layout, estimate_columns, history_columns
from ..session import SessionLayout
from ..words import record_title
from .bars import draw_columns
from .base import MIN_HEIGHT, MIN_WIDTH, empty_svg
from .line_chart import draw_session

__all__ = ["cell_svg", "history_svg", "estimate_svg"]


def cell_svg(record, samples=None, width: int = 480, height: int = 200, title: Optional[str] = None,
             ink: Optional[str] = None) -> str:
    """The chart of one cell as an SVG string.

    Args:
        record: the cell's :class:`~ipy_gpumem.core.records.CellRecord` (None gives a placeholder).
        samples: :class:`~ipy_gpumem.core.probes.Sample` objects taken during the cell, or None.
            With two or more and no line-by-line record, the chart is the line chart over the cell's
            time with the record's exact peak as a dotted line. Otherwise it is the before / per-line /
            after waterfall described in the module doc.
        width: pixels (at least 240 are used).
        height: pixels (at least 120 are used).
        title: text above the plot; defaults to the cell's label and first line.
        ink: the chart's ``currentColor``; None inherits the page's (inline SVG), ``chart.style.IMG_INK``
            for an ``<img>`` (``chart.views.svg_data_uri``), which an untrusted notebook keeps where its
            sanitizer strips inline SVG.
    """
    width, height = max(int(width), MIN_WIDTH), max(int(height), MIN_HEIGHT)
    if record is None:
        return empty_svg("no record", width, ink=ink)
    layout = cell_layout(record, samples, max_columns=max(1, int((width - 80) / 6) - 2))
    if isinstance(layout, SessionLayout):
        return draw_session(layout, width, height, title or record_title(record), ink).svg
    return draw_columns(layout, width, height, title, ink, empty=f"{record.label}: no memory readings for this cell")


def history_svg(records: Sequence, width: int = 720, height: int = 220, ink: Optional[str] = None) -> str:
    """The recorded cells as a column chart (the picture of ``%gpumem history``'s figure)."""
    return draw_columns(history_columns(records), max(int(width), MIN_WIDTH), max(int(height), MIN_HEIGHT), None, ink,
                        empty="no recorded cell has a reading")


def estimate_svg(cell, width: int = 640, height: int = 220, ink: Optional[str] = None) -> str:
    """An estimate's predicted levels line by line (the picture of ``--estimate``'s figure)."""
    return draw_columns(estimate_columns(cell), max(int(width), MIN_WIDTH), max(int(height), MIN_HEIGHT), None, ink,
                        empty="no per-line figures in this estimate")
