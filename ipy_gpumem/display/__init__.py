"""The display layer: turns core records into text, HTML, SVG and live widget views.

String renderers import nothing heavy; the widget views import plotly and ipywidgets inside the
functions that draw, so they load only when a chart is asked for.
"""
