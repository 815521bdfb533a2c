"""Memory charts as self-contained inline SVG strings: no JavaScript, no external resources.

Two charts, both pure functions from plain data to a string: :func:`timeline_svg`, the session's
line chart, and :func:`cell_svg`, one cell (the samples it saw, or a waterfall of its record).
Drawing never raises on empty or None data. One module per part of the drawing:

    cell         ``cell_svg``: a cell's samples as a line chart, or the waterfall of its record
    line_chart   the line chart: ``timeline_svg``, ``draw_timeline``, spans, missed peaks
    waterfall    before, one floating bar per line, after
    roles        waterfall columns stacked by role
    slots        a cell's record as waterfall columns: the quantity charted, the lines, their hovers
    paths        series as SVG path data, the hot loop of a redraw
    legend       the series drawn and their names, the legend row, hover texts
    axes         the plot's frame, byte and time ticks, axes, capacity lines
    base         colours, sizes, escaped text, the ``<svg>`` element, the empty chart

The whole package is the room's ``svg`` module, which draws: the modules that compute (timeline,
sampler) import none of it, and its own modules import only each other and what computes.
"""
from .axes import CAPACITY_ON_SCALE, byte_ticks, format_time, time_ticks  # noqa: F401
from .base import (CHAR_W, DASHES, DEVICE_COLORS, DOWN_COLOR, FAILED_COLOR, FONT, HOST_COLOR, IMG_INK,  # noqa: F401
                   MIN_HEIGHT, MIN_WIDTH, OTHER_ROLE_COLOR, ROLE_COLORS, RUNNING_COLOR, UP_COLOR, device_color,
                   empty_svg, role_color)
from .cell import cell_svg
from .legend import change_text, series_name, span_hover
from .line_chart import Drawing, HoverBox, draw_timeline, timeline_svg  # noqa: F401
from .roles import MAX_ROLE_SCALE  # noqa: F401

__all__ = ["timeline_svg", "cell_svg", "empty_svg", "byte_ticks", "time_ticks", "format_time", "span_hover",
           "series_name", "change_text", "IMG_INK", "ROLE_COLORS"]
