"""Charts as plotly figures: plain JSON-ready dicts built by hand, and the live ``FigureWidget`` view.

    timeline   the session timeline (and a snapshot's) as a figure dict; plotly is not imported
    cell       one cell: the waterfall of its lines (``--lines``) or its samples, as a figure dict
    history    the recorded cells (``%gpumem history``), one column per cell
    estimate   a ``--estimate``: the predicted level line by line against the GPU
    bars       what those three share: bars from one level to the next, their layout, hover text
    live       the live chart as a plotly ``FigureWidget`` (imports plotly, when one is asked for)

The SVG charts (``chart.svg``) stay beside every figure as the picture for viewers without plotly.
"""
from .timeline import PLOTLY_MIME, UIREVISION, figure_config, timeline_figure  # noqa: F401

__all__ = ["PLOTLY_MIME", "UIREVISION", "figure_config", "timeline_figure"]
