"""The last few ``%%gpumem --estimate`` results, by cell: what the OOM panel may cite without running anything.

The estimate side calls :func:`remember` with the estimated cell's source and the result it
showed; after an out-of-memory error the panel calls :func:`recall` with the failing cell's
source. Both sides key the cell by its body: the ``%%gpumem ...`` header line(s) on top are
stripped (the estimated cell has ``--estimate`` there, the real run has none or ``--lines``),
blank lines dropped, and whitespace inside a line and at its end collapsed, so the same code
matches whatever its spacing. Indentation is kept: it is part of what the code means.

Only the result objects passed in are held, the last :data:`LIMIT` of them (an ``Estimate`` or
``CellEstimate``: numbers, no tensor and no reference to the user's namespace), so the registry
costs a few kilobytes and keeps nothing of the user's alive. Imports nothing: it sits under the
OOM room and must stay as cheap to import as the panel it serves.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any, Optional

__all__ = ["LIMIT", "cell_key", "remember", "recall", "forget"]

#: How many estimated cells are remembered; the oldest is dropped first.
LIMIT = 64

_SPACES = re.compile(r"[ \t]+")
_known: "OrderedDict[str, Any]" = OrderedDict()


def cell_key(source: str) -> str:
    """The cell's body as the registry keys it: header lines stripped, whitespace normalised.

    >>> cell_key("%%gpumem --estimate T4\\nout = model( x )  \\n\\n") == cell_key("out = model( x )")
    True
    """
    lines = (source or "").splitlines()
    k = 0
    # The header: leading blank lines and ``%%gpumem ...`` lines (a cell may stack several).
    while k < len(lines) and (not lines[k].strip() or lines[k].lstrip().startswith("%%gpumem")):
        k += 1
    body = []
    for line in lines[k:]:
        if not line.strip():
            continue
        stripped = line.lstrip(" \t")
        indent = line[: len(line) - len(stripped)].expandtabs(4)
        body.append(indent + _SPACES.sub(" ", stripped.rstrip()))
    return "\n".join(body)


def remember(source: str, estimate: Any) -> None:
    """Keep ``estimate`` (what ``%%gpumem --estimate`` showed) as the latest for the cell ``source``."""
    key = cell_key(source)
    if not key:
        return
    _known.pop(key, None)
    _known[key] = estimate
    while len(_known) > LIMIT:
        _known.popitem(last=False)


def recall(source: str) -> Optional[Any]:
    """The latest estimate remembered for the cell ``source`` (with or without its header), or None."""
    return _known.get(cell_key(source)) if source else None


def forget() -> None:
    """Drop every remembered estimate (``%gpumem clear`` and tests)."""
    _known.clear()
