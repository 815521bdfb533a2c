"""Start and stop a ``--lines`` cell's line tracer: its markers go into the shell's AST transformers while it compiles, its hook into ``builtins`` while it may run.

The markers (:mod:`.markers`) are added to IPython's ``ast_transformers`` for the cell that asks
for them and removed when no ``--lines`` cell is running. The hook they call stays in
``builtins`` until no marked code can run any more: a cell that unloads the extension half-way
still runs its remaining markers, and a missing name would raise ``NameError`` into it.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional

__all__ = ["LineTracing"]


class LineTracing:
    """The markers of ``--lines`` cells in one shell.

    Args:
        ast_transformers: the shell's AST transformer list (None: a private list, for tests).
    """

    def __init__(self, ast_transformers: Optional[list] = None):
        self._transformers = ast_transformers if ast_transformers is not None else []
        self._markers = None

    def start(self, probe, devices, track_peaks: bool, census: Optional[Callable] = None):
        """A started tracer for the cell about to compile (its markers armed)."""
        from .lines import LineTracer
        from .markers import LineMarkers

        if self._markers is None:
            self._markers = LineMarkers()
        tracer = LineTracer(probe, devices, track_peaks=track_peaks, census=census)
        tracer.start()
        # Markers go into the cell's syntax tree, which IPython builds after this hook.
        self._markers.tracer = tracer
        self._markers.armed = True
        if self._markers not in self._transformers:
            self._transformers.append(self._markers)
        return tracer

    def stop(self, tracer, others_running: bool) -> None:
        """Stop measuring lines; the markers leave the transformers unless another ``--lines`` cell
        runs (the hook stays until :meth:`remove_hook`)."""
        tracer.stop()
        if not others_running:
            markers = self._markers
            if markers is not None:
                markers.armed = False
                markers.tracer = None
                if markers in self._transformers:
                    self._transformers.remove(markers)

    def remove_hook(self) -> None:
        """Take the markers' hook out of ``builtins`` (no marked code can run any more)."""
        if self._markers is not None or "ipy_gpumem.cell.markers" in sys.modules:
            from .markers import remove_hook

            remove_hook()
