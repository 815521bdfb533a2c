"""A ``%%gpumem --estimate`` as a plotly figure dict: the predicted level line by line, scaled to the step.

The per-line table drawn (``chart.columns.estimate_columns``, the same layout as its picture): the
allocated level before the step, one floating bar per line of the steady-state (second) run going up
or down by its predicted change, a mark at each line's peak, the predicted peak allocated and
reserved, and the card's usable memory: a line when the step reaches a good part of it, else a number
in the corner, so a 0.5 GiB step on a 15 GiB card is not a 2 px sliver. Hovers name the line and its
source. Nothing here reads torch: the estimate is read by its attributes (``preflight.cell.CellEstimate``).
"""
from __future__ import annotations

from typing import Optional

from ..columns import estimate_columns
from .bars import columns_figure

__all__ = ["estimate_figure"]


def estimate_figure(cell, *, height: int = 300) -> Optional[dict]:
    """The predicted per-line levels of ``cell`` (a ``CellEstimate``) as a figure dict; None without lines."""
    return columns_figure(estimate_columns(cell), height=height, filename="ipy_gpumem-estimate")
