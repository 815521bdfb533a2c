"""Short texts from the user's source and messages: a cell's first line, clipped to a width, one way."""
from __future__ import annotations

from typing import Optional

__all__ = ["first_line", "clip"]


def clip(text: str, width: Optional[int]) -> str:
    """``text`` on one line, cut to ``width`` characters with an ellipsis (None: no limit).

    Examples:
        >>> clip("loss = criterion(model(x), y)", 12)
        'loss = crit…'
    """
    text = " ".join(str(text).split())
    if width is None or len(text) <= width:
        return text
    return text[: max(0, width - 1)] + "…"


def first_line(source: str, width: Optional[int] = None) -> str:
    """The first line of ``source`` that is not blank, stripped and clipped to ``width``.

    Examples:
        >>> first_line("\\n  x = torch.ones(3)\\n  y = x * 2\\n")
        'x = torch.ones(3)'
    """
    for line in (source or "").splitlines():
        if line.strip():
            return clip(line.strip(), width)
    return ""
