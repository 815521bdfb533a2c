"""What every view shares: the ``View`` (text and HTML of one rendering), tables, escaping, and the status view.

String renderers only: nothing here imports IPython, plotly or ipywidgets.
"""
