"""Exact live-byte accounting for the tests: ``LiveStorages``, a dispatch mode that sees every storage an op
returns and counts the bytes each frees when it is released (attribution/test_who.py, oom/test_oom_integration.py,
and a cell of the test shell)."""
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveStorages(TorchDispatchMode):
    """Exact live-byte accounting: a ``weakref.finalize`` on every storage an op returns.

    Storage Python objects are preserved for as long as the C++ storage lives, so the
    finalizer runs exactly when the memory is released.
    """

    def __init__(self):
        super().__init__()
        self.freed = 0
        self.ops = 0
        self._nbytes = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t):
        try:
            st = t.untyped_storage()
        except Exception:
            return
        key = id(st)
        if key not in self._nbytes:
            weakref.finalize(st, self._release, key)
        self._nbytes[key] = st.nbytes()  # latest size: some ops resize their outputs

    def _release(self, key):
        self.freed += self._nbytes.pop(key, 0)
