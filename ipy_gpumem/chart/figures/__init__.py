"""Charts as plotly figures, drawn from the charts' layouts as plain JSON-ready dicts, and the live plotly view.

    timeline   the session chart (``chart.session``) as a figure dict, its traces fixed in number and order
    bars       column charts (``chart.columns``): a cell's waterfall, the history, an estimate
    cell       one cell: its waterfall or its samples
    history    the recorded cells (``%gpumem history``)
    estimate   a ``--estimate``'s predicted lines, scaled to the step
    live       the live chart: the figure as plotly's own output, moved by a small widget with no view

The SVG pictures (``chart.svg``) draw the same layouts, as the picture beside every figure for viewers
without plotly; neither package imports the other.
"""
from .timeline import PLOTLY_MIME, UIREVISION, figure_config, timeline_figure  # noqa: F401

__all__ = ["PLOTLY_MIME", "UIREVISION", "figure_config", "timeline_figure"]
