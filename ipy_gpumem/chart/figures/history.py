"""The session's recorded cells as a plotly figure dict: one column per cell, from where it started to where it ended.

What ``%gpumem history`` lists as a table, drawn (``chart.columns.history_columns``, the same layout as
its picture): per cell a floating bar from its level before to its level after (red where it grew,
green where it shrank), a mark at its exact peak, and reserved memory after it as a dashed line; one
device (the one that moved most over the session, else host RSS). The hover names the cell, its first
line and its numbers. Idle time between cells takes no room, unlike the timeline, so a long session's
cells stay readable; zoom, pan and PNG export are plotly's.
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..columns import MAX_CELLS, history_columns
from .bars import columns_figure

__all__ = ["history_figure", "MAX_CELLS"]


def history_figure(records: Sequence, *, height: int = 320) -> Optional[dict]:
    """The recorded cells as a plotly figure dict, or None when no cell has a reading."""
    return columns_figure(history_columns(records), height=height, filename="ipy_gpumem-history", legend_y=-0.22)
