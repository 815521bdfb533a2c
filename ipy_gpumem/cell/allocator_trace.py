"""``%%gpumem --trace``: the CUDA allocator's own event history for one cell, started and stopped around it, the user's recording left as it was."""
from __future__ import annotations

import pickle
import sys
import time
from typing import Any, Optional, Tuple

__all__ = ["CellTrace", "DEFAULT_ENTRIES"]

#: Events kept for one cell (torch's own default for ``_record_memory_history``): a ring buffer,
#: so a longer cell keeps its last events and the report says so.
DEFAULT_ENTRIES = 100_000


class CellTrace:
    """The allocator's history for one cell.

    Args:
        api: the torch adapter (``tensors.torch_api.Api``): ``history_enabled()``,
            ``record_history(n)``, ``stop_history()``, ``allocator_snapshot()``.
        path: where to keep the snapshot (a pickle that ``torch.cuda.memory._dump_snapshot`` would
            have written, for memory_viz), or None.
        max_entries: the ring buffer's size when we start the recording.
        clock: seconds since the epoch (the events' ``time_us`` clock).
    """

    def __init__(self, api: Any, path: Optional[str] = None, max_entries: int = DEFAULT_ENTRIES, clock=time.time):
        self.api = api
        self.path = path
        self.max_entries = max_entries
        self.users = bool(api.history_enabled())  # the user records already: leave it exactly as it is
        self.start_us = int(clock() * 1e6)
        if not self.users:
            api.record_history(max_entries)

    @classmethod
    def begin(cls, path: Optional[str] = None, max_entries: int = DEFAULT_ENTRIES) -> Tuple[Optional["CellTrace"], Optional[str]]:
        """``(trace, None)`` when recording runs for the cell, ``(None, why not)`` otherwise; never initializes CUDA."""
        torch = sys.modules.get("torch")
        if torch is None:
            return None, "--trace: torch is not imported, so there is no CUDA allocator to trace"
        cuda = getattr(torch, "cuda", None)
        try:
            if cuda is None or not cuda.is_available():
                return None, "--trace needs a CUDA device (torch.cuda.is_available() is False here)"
            if not cuda.is_initialized():
                return None, ("--trace: CUDA is not initialized yet and recording would initialize it; run a cell "
                              "that uses the GPU first")
        except Exception as exc:  # noqa: BLE001 - a broken CUDA install: say so, run the cell
            return None, f"--trace: CUDA cannot be queried ({type(exc).__name__})"
        from ..tensors.torch_api import api

        adapter = api(torch)
        if adapter is None or adapter.history_enabled() is None:
            return None, "--trace: this torch cannot record the allocator's history (torch >= 2.1 can)"
        try:
            return cls(adapter, path, max_entries), None
        except Exception as exc:  # noqa: BLE001 - the recorder refused: the cell still runs
            return None, f"--trace: recording could not start ({type(exc).__name__}: {str(exc)[:120]})"

    def end(self) -> Tuple[Optional[dict], Optional[str]]:
        """Stop (when we started it) and return ``(snapshot of this cell, note)``; the note says what was cut or saved."""
        notes = []
        try:
            snap = self.api.allocator_snapshot()
        finally:
            if not self.users:
                self.api.stop_history()
        if self.users:
            snap = self._this_cell(snap)
            notes.append("your own recording was on: it is left on, and this report keeps the cell's events only")
        traces = snap.get("device_traces") or []
        if not self.users and any(len(t) >= self.max_entries for t in traces):
            notes.append(f"the cell made more than {self.max_entries} allocator events: the first ones fell out of "
                         "the ring buffer, and the report starts where it does")
        if self.path:
            try:
                with open(self.path, "wb") as stream:
                    pickle.dump(snap, stream, protocol=4)
                notes.append(f"snapshot kept in {self.path} (open it with %gpumem snapshot or pytorch.org/memory_viz)")
            except OSError as exc:
                notes.append(f"the snapshot could not be written to {self.path}: {exc.strerror or exc}")
        return snap, "; ".join(notes) or None

    def _this_cell(self, snap: dict) -> dict:
        """``snap`` with each device's events cut to those since the cell started (a new dict; torch's is left whole)."""
        out = dict(snap)
        out["device_traces"] = [[e for e in trace if e.get("time_us", self.start_us) >= self.start_us]
                                for trace in snap.get("device_traces") or []]
        return out

