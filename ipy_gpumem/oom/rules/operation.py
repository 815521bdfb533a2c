"""The rule about the operation that failed: named from its frames, sized by its own arithmetic, and the change that shrinks it."""
from __future__ import annotations

from typing import Optional

from .finding import Finding
from .facts import Facts
from .words import b, where

__all__ = ["RULES", "operation"]

_PHASE_WORDS = {"forward": "the forward pass", "backward": "the backward pass", "step": "the optimizer's update"}


def operation(x: Facts) -> Optional[Finding]:
    """The operation whose allocation failed, when the frames name one that has a fix of its own.

    Certain only when the request is what the operation's arithmetic gives (the shapes read from the
    traceback's frames); named from the frames alone it is likely; when the arithmetic gives another
    size, only what is known is said, as possible.
    """
    op = x.operation
    if op is None or not op.fix:
        return None
    title = f"{op.what}: {b(op.needs)}" if op.sized else op.what
    detail = op.detail
    if x.phase is not None:
        inside = ""
        if x.phase in ("forward", "backward") and any(f[1] == "step" and "optim" in f[0] for f in x.frames):
            inside = ", inside the optimizer's closure (the step calls forward and backward)"
        detail += f" It ran in {_PHASE_WORDS[x.phase]}" + (f" ({where(x.phase_frame)})" if x.phase_frame else "") \
            + inside + "."
    room = x.room(op.needs) if op.sized else ""
    if room:
        detail += f" Not making it at all is {room}."
    confidence = "certain" if op.sized else ("possible" if op.matches is False else "likely")
    return Finding("operation", title, detail.strip(), op.fix, op.snippet, op.needs if op.sized else None, confidence)


RULES = (operation,)
