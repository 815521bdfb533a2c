"""Memory charts as self-contained SVG pictures drawn from the charts' layouts: no JavaScript, no external resources.

Every picture is a pure function from a layout (``chart.session``, ``chart.columns``) or the plain
data it is computed from to a string, and never raises on empty or None data. The plotly figures
(``chart.figures``) draw the same layouts. One module per part of the drawing:

    line_chart   the session chart: ``draw_session``, ``timeline_svg``, ``draw_timeline``
    bars         column charts: a cell's waterfall, the history, an estimate (``draw_columns``)
    cell         the pictures of reports: ``cell_svg``, ``history_svg``, ``estimate_svg``
    paths        series as SVG path data, the hot loop of a redraw
    legend       the legend row and the peak mark's glyph
    axes         the plot's frame, byte and time axes, horizontal lines
    base         sizes, numbers and text in SVG, the ``<svg>`` element, the empty chart

The whole package is the room's ``svg`` module, which draws: the modules that compute (timeline,
session, columns, sampler) import none of it.
"""
from ..scale import byte_ticks, format_time, time_ticks  # noqa: F401
from ..style import (DEVICE_COLORS, DOWN_COLOR, FAILED_COLOR, HOST_COLOR, IMG_INK, OTHER_ROLE_COLOR,  # noqa: F401
                     PEAK_COLOR, ROLE_COLORS, RUNNING_COLOR, UP_COLOR, device_color, role_color)
from ..words import change_text, series_name, span_hover  # noqa: F401
from .base import CHAR_W, FONT, MIN_HEIGHT, MIN_WIDTH, empty_svg  # noqa: F401
from .cell import cell_svg, estimate_svg, history_svg
from .line_chart import Drawing, HoverBox, draw_session, draw_timeline, timeline_svg  # noqa: F401

__all__ = ["timeline_svg", "draw_timeline", "draw_session", "cell_svg", "history_svg", "estimate_svg", "empty_svg",
           "byte_ticks", "time_ticks", "format_time", "span_hover", "series_name", "change_text", "IMG_INK",
           "ROLE_COLORS"]
