"""The pure core: probes, records, OOM parsing, attribution and diagnosis, in plain Python.

Nothing here imports IPython, torch, plotly or ipywidgets at import time (tests/test_layering.py
checks it): torch is read through ``sys.modules`` only when the user already imported it, so the
core runs and is tested anywhere, and never initializes CUDA on the user's behalf.
"""
