"""What every view shares: the ``View`` (text and HTML of one rendering), tables, escaping, the status view, and the words made from the records.

String renderers only: nothing here imports IPython, plotly or ipywidgets.
"""
