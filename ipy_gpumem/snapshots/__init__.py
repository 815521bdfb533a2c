"""PyTorch memory snapshots (``torch.cuda.memory._snapshot()``, any generation): read safely, replayed exactly, explained.

Modules, in the order data flows: ``load`` (plain-data unpickling), ``schema`` (every format
generation in one shape), ``replay`` (torch's counters at every event), ``sites`` (who allocated),
``report`` (the result object), ``view`` (text, HTML and chart).
"""
from .load import SnapshotError
from .report import SnapshotReport, read_snapshot

__all__ = ["SnapshotError", "SnapshotReport", "read_snapshot"]
