"""Short texts from the user's source and messages: a cell's first line and the line that names it, clipped to a width, one way."""
from __future__ import annotations

from typing import Optional

__all__ = ["first_line", "cell_name", "clip"]


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


#: A cell of thousands of lines is named on every start: its head is enough.
_HEAD = 4096


def cell_name(source: str, width: Optional[int] = None) -> str:
    """The line that names a cell: its first line that is not blank, or the one after a ``%%magic`` header
    line when code follows it (``%%gpumem --lines`` says nothing about what the cell does).

    Examples:
        >>> cell_name("%%gpumem --lines\nloss = model(x).sum()\nloss.backward()")
        'loss = model(x).sum()'
        >>> cell_name("%%time")
        '%%time'
    """
    head = (source or "")[:_HEAD]
    lines = head.splitlines()
    for i, line in enumerate(lines):
        if line.strip():
            if line.lstrip().startswith("%%"):
                body = first_line("\n".join(lines[i + 1:]), width)
                if body:
                    return body
            break
    return first_line(head, width) or first_line(source, width)
