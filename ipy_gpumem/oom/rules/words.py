"""How findings write what they cite: sizes in torch's spelling, ratios, shares and traceback frames."""
from __future__ import annotations

import re
from typing import Optional, Tuple

from ...core.units import format_bytes

__all__ = ["b", "cap", "times", "pct", "where", "WRONG_SIZE_FIX", "SIZES_COMMENT"]

Frame = Tuple[str, str, str]

#: The fix for a request no machine can hold: the size is the bug, and the failing line's inputs show it.
WRONG_SIZE_FIX = ("The size itself is wrong, so no memory setting helps: print the shapes and values the failing line "
                  "computes with, find the one that is not what you meant, and fix the code that produced it.")
#: The comment on the snippet that prints them.
SIZES_COMMENT = "# the shapes and values the failing line computes with"


def b(n: Optional[int]) -> str:
    """``1610612736`` -> ``"1.50 GiB"``: the spelling of the traceback above the panel."""
    return format_bytes(n)


def cap(text: str) -> str:
    """``"the failing cell"`` -> ``"The failing cell"`` at the start of a sentence."""
    return text[:1].upper() + text[1:]


def times(ratio: float) -> str:
    """``"2.3x"``, ``"45x"``, ``"182,449,534x"``: one decimal only where it is worth reading."""
    return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:,.0f}x"


def pct(part: int, whole: Optional[int]) -> str:
    """``"45%"`` of ``whole``, or ``"?"`` when the whole is unknown."""
    return f"{100.0 * part / whole:.0f}%" if whole else "?"


def where(frame: Optional[Frame]) -> str:
    """``adam.py step()`` for a traceback frame ``(filename, function, line)``."""
    if frame is None:
        return ""
    base = re.split(r"[/\\]", frame[0])[-1] or frame[0]
    return f"{base} {frame[1]}()" if frame[1] else base

