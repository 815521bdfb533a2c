"""What the extension may spend at one cell's end, shared by all it does there: a share of the cell's own time, within a floor and a ceiling.

A cell that moved memory is explained (a census at its end) and may be compared with its earlier
runs (a re-run snapshot); both walk whatever the namespace holds. Each walk has a budget, but two
budgets of their own would add up, and neither would know what the cell itself cost. So a cell's
end gets one :class:`CellBudget`: a quarter of the cell's wall time, at least :data:`FLOOR_S` and
at most :data:`CEILING_S`, which the census takes from first (the line's words) and the re-run
snapshot from what is left. What a walk could not finish says "at least" and names what it left
out; a re-run compared with an incomplete snapshot names no suspect.
"""
from __future__ import annotations

import time
from typing import Optional

__all__ = ["CellBudget", "FLOOR_S", "CEILING_S", "SHARE"]

#: The least a cell's end may spend (a quick cell that moved memory still gets its explanation).
FLOOR_S = 0.1
#: The most: a long training cell's end never waits seconds for a count.
CEILING_S = 0.5
#: The share of the cell's own wall time.
SHARE = 0.25


class CellBudget:
    """The seconds left for one cell's end (read with :meth:`left`), which starts at the cell's
    closing reading. Made at every cell's end, so it keeps the measurement (``start.t`` and ``end.t``:
    ``recorder.Measurement``) and computes nothing until a walk asks."""

    __slots__ = ("_measurement",)

    def __init__(self, measurement):
        self._measurement = measurement

    @property
    def cell_seconds(self) -> Optional[float]:
        """The cell's own time, from its opening reading to its closing one (None: not known)."""
        try:
            return self._measurement.end.t - self._measurement.start.t
        except Exception:  # noqa: BLE001 - no readings: the floor
            return None

    @property
    def ceiling(self) -> float:
        """The most any cell's end may spend (read when asked: a test may raise it)."""
        return CEILING_S

    @property
    def allowed(self) -> float:
        """The seconds this cell's end may spend in all."""
        seconds = self.cell_seconds
        return FLOOR_S if seconds is None else min(CEILING_S, max(FLOOR_S, SHARE * seconds))

    @property
    def deadline(self) -> float:
        try:
            start = float(self._measurement.end.t)
        except Exception:  # noqa: BLE001
            start = time.perf_counter()
        return start + self.allowed

    def left(self, at_least: float = 0.0) -> float:
        """Seconds left (never below ``at_least``: a walk needs a moment to say what it left out)."""
        return max(at_least, self.deadline - time.perf_counter())
