"""torch's out-of-memory captures for the cell watcher: attach the observer once torch is imported, keep the last capture, hand it to the cell that failed.

torch's observer (``oom.capture``) calls :meth:`OomWatch.on_oom` inside the allocator at the failing
allocation; the cell that then fails with an out-of-memory error takes that capture, once, if it
happened after the cell started. Attached when torch is imported (if CUDA is up; else torch runs
our attach when it initializes, so the first CUDA cell's out-of-memory is captured too).
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Tuple

from ..oom import capture as oom_capture

__all__ = ["OomWatch"]


class OomWatch:
    """The allocator's state at the last CUDA out-of-memory, for the cell that raised it."""

    def __init__(self):
        #: The allocator at the last CUDA out-of-memory (an ``OomCapture``), until a cell takes it.
        self.last_capture = None
        #: torch's observer is attached (checked before every cell).
        self.watching = False

    def ensure(self) -> None:
        """Attach torch's observer once torch is imported (cheap after the first time)."""
        if not self.watching and "torch" in sys.modules:
            self.watching = oom_capture.watch(self.on_oom)

    def on_oom(self, capture) -> None:
        # Runs inside torch's allocator (GIL held, allocator lock released): store, nothing more.
        self.last_capture = capture

    def take(self, since: float):
        """The capture of an out-of-memory that happened after ``since`` (perf_counter), once."""
        capture, self.last_capture = self.last_capture, None
        return capture if capture is not None and capture.t >= since else None

    def failure(self, error: str, message: Optional[str], since: float) -> Tuple[Any, Any]:
        """``(OomReport, capture)`` when a cell's error is an out-of-memory error, else ``(None, None)``."""
        from ..oom.parse import parse_oom  # only when a cell failed

        oom = parse_oom(f"{error}: {message}" if message else error)
        return (oom, self.take(since)) if oom is not None else (None, None)

    def close(self) -> None:
        """Stop forwarding captures (torch cannot detach the observer: it does nothing after this)."""
        oom_capture.unwatch(self.on_oom)
