"""The pipe between a sealed child and its parent: length-prefixed frames, and an exception as plain data.

Why frames: the child sends several things over one pipe as they happen (which guard holds, each
refusal the moment it is refused, the line count, then the value or the error), so that a run
killed at its deadline still says what it tried. Each frame is a kind byte and a length, then the
body; the parent reads them from a non-blocking pipe while the child writes, so a result of tens of
MB never blocks the child, and a big body is read straight into place.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

HEAD = struct.Struct("<BQ")  # frame kind, body length
#: The frame kinds: which guard holds, one refusal, (lines printed, refusals past the cap), the
#: pickled value, the pickled ChildError, why the child could not be sealed.
GUARD, REFUSED, SUMMARY, VALUE, ERROR, UNSEALED = b"GRSVEU"


@dataclass(frozen=True)
class ChildError:
    """What ``fn`` raised in the child, as plain picklable data."""

    type_name: str
    message: str
    #: (filename, lineno, function, source line), outermost first, from ``fn``'s frame inward
    frames: Tuple[Tuple[str, int, str, str], ...] = ()
    #: the exception's picklable instance attributes (e.g. ``EstimateError.line``)
    attrs: Dict[str, Any] = field(default_factory=dict)
    #: the module of the exception's type ("builtins", "ipy_gpumem.preflight.result", ...)
    module: str = ""

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}" if self.message else self.type_name


class Pipe:
    """The child's end of the result pipe: length-prefixed frames, written whole."""

    def __init__(self, fd: int):
        self.fd = fd

    def send(self, kind: int, body) -> None:
        self._write(HEAD.pack(kind, len(body)))
        self._write(body)

    def _write(self, data) -> None:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(self.fd, view):]


class Frames:
    """The parent's end: frames read from a non-blocking pipe; a big body is read straight into place."""

    def __init__(self):
        self.frames: List[Tuple[int, bytearray]] = []
        self._head = bytearray()
        self._kind = 0
        self._body: Optional[memoryview] = None
        self._filled = 0

    def pull(self, fd: int) -> bool:
        """Read all that is there; True at end of file."""
        while True:
            try:
                if self._body is None:
                    chunk = os.read(fd, HEAD.size - len(self._head))
                    if not chunk:
                        return True
                    self._head += chunk
                    if len(self._head) == HEAD.size:
                        self._start_body()
                else:
                    got = os.readv(fd, [self._body[self._filled:]])
                    if not got:
                        return True
                    self._filled += got
                    self._finish_body()
            except BlockingIOError:
                return False

    def _start_body(self):
        self._kind, size = HEAD.unpack(bytes(self._head))
        self._head = bytearray()
        self._body, self._filled = memoryview(bytearray(size)), 0
        self._finish_body()

    def _finish_body(self):
        if self._body is not None and self._filled == len(self._body):
            self.frames.append((self._kind, self._body.obj))
            self._body.release()
            self._body = None
