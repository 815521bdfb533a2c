"""Charts as plotly figures: plain JSON-ready dicts built by hand, and the live ``FigureWidget`` view.

    timeline   the session timeline (and a snapshot's) as a figure dict; plotly is not imported
    waterfall  a cell's lines (``--lines``, the estimate) as a figure dict
    live       the live chart as a plotly ``FigureWidget`` (imports plotly, when one is asked for)

The SVG charts (``chart.svg``) stay beside every figure as the picture for viewers without plotly.
"""
from .timeline import PLOTLY_MIME, UIREVISION, figure_config, timeline_figure  # noqa: F401

__all__ = ["PLOTLY_MIME", "UIREVISION", "figure_config", "timeline_figure"]
