"""One cell as a plotly figure dict: the waterfall of its lines (or of the whole cell), or the samples it saw over time.

The same choice and the same layout as ``chart.svg.cell_svg``: a cell with a line-by-line record
draws one column per line (stacked by role where the line counted roles), hovered with the line's
source, what it did and why; a cell without one, sampled two or more times, draws the session
figure over the cell's time with the record's exact peak; otherwise the whole cell as one column.
"""
from __future__ import annotations

from typing import Optional

from ..columns import cell_layout
from ..session import SessionLayout
from ..words import record_title
from .bars import columns_figure
from .timeline import session_figure

__all__ = ["cell_figure", "MAX_COLUMNS"]

#: More lines than this share columns (as the picture does when it runs out of width).
MAX_COLUMNS = 80


def cell_figure(record, samples=None, *, height: int = 300) -> Optional[dict]:
    """The chart of one cell as a plotly figure dict, or None without a record or any reading.

    Args:
        record: the cell's :class:`~ipy_gpumem.core.records.CellRecord`.
        samples: :class:`~ipy_gpumem.core.probes.Sample` objects taken during the cell, or None.
        height: pixels; the width follows the output area.
    """
    if record is None:
        return None
    filename = f"ipy_gpumem-cell-{record.execution_count or 'x'}"
    layout = cell_layout(record, samples, MAX_COLUMNS)
    if isinstance(layout, SessionLayout):
        figure = session_figure(layout, height=height, title=record_title(record), filename=filename)
        figure["layout"]["xaxis"]["rangeslider"]["visible"] = False  # a cell is short: the slider only takes room
        return figure
    return columns_figure(layout, height=height, filename=filename, legend_y=-0.18)
