"""The foundation every room builds on: byte units, device names, the memory model, probes and records.

Nothing here imports IPython, torch, plotly or ipywidgets (tests/whole/test_layering.py checks it, for
every room): torch is read through ``sys.modules`` only when the user already imported it, so the
code runs and is tested anywhere, and never initializes CUDA on the user's behalf.
"""
