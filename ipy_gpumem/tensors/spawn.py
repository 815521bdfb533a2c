"""The index torch.multiprocessing gives a process it starts, read from the multiprocessing ``Process`` that runs it.

``torch.multiprocessing.start_processes`` (``spawn``, and elastic's and accelerate's launchers
through it) starts each process with the target ``_wrap(fn, i, args, error_file)``; a ``Process``
keeps its target and arguments in ``_target`` and ``_args`` (Python 3.9 to 3.13) until ``start()``
deletes them (bpo-30775). Only names are read here: no user code runs.
"""
from __future__ import annotations

import types
from typing import Optional

__all__ = ["spawn_index"]


def spawn_index(fields: dict) -> Optional[int]:
    """The index ``i`` torch.multiprocessing passed to the process whose instance dict (``vars(process)``)
    is ``fields``; None when its target is not torch's ``_wrap`` (a pool, a DataLoader worker) or is gone."""
    target, args = fields.get("_target"), fields.get("_args")
    if type(target) is not types.FunctionType:  # a plain function: its names are read, no user code runs
        return None
    if target.__name__ != "_wrap" or target.__module__ != "torch.multiprocessing.spawn":
        return None
    index = args[1] if isinstance(args, tuple) and len(args) > 1 else None
    return index if type(index) is int and index >= 0 else None
