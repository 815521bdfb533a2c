"""The pipe between a sealed child and its parent: length-prefixed frames of plain data, read with caps checked before anything is allocated, and an exception as plain data.

Why frames: the child sends several things over one pipe as they happen (which guard holds, each
refusal the moment it is refused, the line count, then the value or the error), so that a run
killed at its deadline still says what it tried. Each frame is a kind byte and a length, then the
body; the parent reads them from a non-blocking pipe while the child writes, so a result of tens of
MB never blocks the child, and a big body is read straight into place.

Why caps: the step runs in the child and C code in it can write on the pipe, so the parent trusts
no byte of it. A frame's length is checked against its kind's cap (:data:`MAX_VALUE` for the
answer, :data:`MAX_NOTE` for the rest) when its header arrives, before any memory is set aside,
and a body grows only as its bytes arrive (a header that claims 200 MiB and sends nothing costs
nothing). The frames of one run are capped in number (:data:`MAX_FRAMES`) and in total. Bodies
are plain data (:mod:`.plain`), never pickles. Whatever breaks these rules is a
:class:`ProtocolError`: the parent stops reading, kills the child and says so in one line.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from . import plain

HEAD = struct.Struct("<BQ")  # frame kind, body length
#: The frame kinds: which guard holds, one refusal, (lines printed, refusals past the cap), the
#: value, the ChildError, why the child could not be sealed, the descriptor of the seccomp listener
#: the parent is to take, where the child waited forever (its stack), and how deep the child is in
#: the caller's own machinery (``shims.unreported``: what its C code is refused then is not listed).
GUARD, REFUSED, SUMMARY, VALUE, ERROR, UNSEALED, LISTEN, STUCK, QUIET = b"GRSVEULKQ"
KINDS = frozenset((GUARD, REFUSED, SUMMARY, VALUE, ERROR, UNSEALED, LISTEN, STUCK, QUIET))
#: The answer: one frame of one of these kinds ends what a child has to say.
ANSWERS = frozenset((VALUE, ERROR, UNSEALED, STUCK))

#: Bytes of one answer frame (the encoded value or error), at most.
MAX_VALUE = 256 << 20
#: Bytes of any other frame, at most (a refusal line, the guard's note).
MAX_NOTE = 64 << 10
#: Frames of one run, at most (the child sends a few, at most MAX_REFUSED refusals, and two for
#: each stretch of the caller's own machinery).
MAX_FRAMES = 1024


class ProtocolError(Exception):
    """The child's frames broke the protocol (a forged or garbled frame); the message says how in one line."""


@dataclass(frozen=True)
class ChildError:
    """What ``fn`` raised in the child, as plain data."""

    type_name: str
    message: str
    #: (filename, lineno, function, source line), outermost first, from ``fn``'s frame inward
    frames: Tuple[Tuple[str, int, str, str], ...] = ()
    #: the exception's instance attributes that are plain data (e.g. ``EstimateError.line``)
    attrs: Dict[str, Any] = field(default_factory=dict)
    #: the module of the exception's type ("builtins", "ipy_gpumem.preflight.result", ...)
    module: str = ""

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}" if self.message else self.type_name

    def to_plain(self) -> dict:
        """The fields as plain data (what crosses the pipe)."""
        return {"type_name": self.type_name, "message": self.message, "frames": [list(f) for f in self.frames],
                "attrs": dict(self.attrs), "module": self.module}

    @classmethod
    def from_plain(cls, data: Any) -> "ChildError":
        """The ChildError ``data`` describes; :class:`ProtocolError` if it does not describe one."""
        if not isinstance(data, dict):
            raise ProtocolError(f"the error sent back is a {type(data).__name__}, not a record of one")
        try:
            frames = tuple((str_(f[0]), int_(f[1]), str_(f[2]), str_(f[3])) for f in data.get("frames", ()))
            attrs = data.get("attrs", {})
            if not isinstance(attrs, dict) or not all(type(k) is str for k in attrs):
                raise TypeError("attrs")
            return cls(str_(data["type_name"]), str_(data["message"]), frames, attrs, str_(data.get("module", "")))
        except (KeyError, IndexError, TypeError) as exc:
            raise ProtocolError(f"the error sent back is malformed ({type(exc).__name__}: {exc})") from None


def str_(value: Any) -> str:
    """``value`` if it is a str, else TypeError (checking what came from the child)."""
    if type(value) is not str:
        raise TypeError(f"expected a string, got a {type(value).__name__}")
    return value


def int_(value: Any) -> int:
    """``value`` if it is an int (not a bool), else TypeError."""
    if type(value) is not int:
        raise TypeError(f"expected an int, got a {type(value).__name__}")
    return value


class Pipe:
    """The child's end of the result pipe: length-prefixed frames, written whole."""

    def __init__(self, fd: int, write=os.write):
        self.fd = fd
        self._os_write = write  # os.write as it was before the shims (they refuse this descriptor to the step)

    def send(self, kind: int, body) -> None:
        self._write(HEAD.pack(kind, len(body)))
        self._write(body)

    def send_plain(self, kind: int, value: Any) -> None:
        self.send(kind, plain.encode(value))

    def _write(self, data) -> None:
        view = memoryview(data).cast("B")
        while view:
            view = view[self._os_write(self.fd, view):]


class Frames:
    """The parent's end: frames read from a non-blocking pipe, each checked against the caps as it comes.

    :meth:`pull` reads what is there and raises :class:`ProtocolError` at the first broken rule;
    :meth:`take` hands over the frames completed since the last call.
    """

    def __init__(self):
        self._done: List[Tuple[int, Any]] = []  # (kind, body: a bytearray or an mmap), release() each
        self._head = bytearray()
        self._kind = 0
        self._size = -1  # the body's length while one is being read, else -1
        self._body = bytearray()
        self._filled = 0
        self.count = 0
        self.total = 0

    def pull(self, fd: int) -> bool:
        """Read all that is there; True at end of file (:class:`ProtocolError` if a frame is cut short there)."""
        while True:
            try:
                if self._size < 0:
                    chunk = os.read(fd, HEAD.size - len(self._head))
                    if not chunk:
                        if self._head:
                            raise ProtocolError(f"the child's answer ends inside a frame header ({len(self._head)} "
                                                f"of {HEAD.size} bytes)")
                        return True
                    self._head += chunk
                    if len(self._head) == HEAD.size:
                        self._start_body()
                else:
                    if self._filled == len(self._body):
                        self._grow()
                    got = os.readv(fd, [memoryview(self._body)[self._filled:]])  # straight into place
                    if not got:
                        raise ProtocolError(f"the child's answer ends inside a frame ({self._filled} of "
                                            f"{self._size} bytes)")
                    self._filled += got
                    self._finish_body()
            except BlockingIOError:
                return False

    def take(self) -> List[Tuple[int, Any]]:
        done, self._done = self._done, []
        return done

    def _start_body(self) -> None:
        kind, size = HEAD.unpack(bytes(self._head))
        self._head = bytearray()
        if kind not in KINDS:
            raise ProtocolError(f"the child sent a frame of unknown kind {kind} (a forged or garbled answer)")
        cap = MAX_VALUE if kind in (VALUE, ERROR) else MAX_NOTE
        if size > cap:
            raise ProtocolError(f"the child sent a frame of {size} bytes, more than the {cap} allowed")
        self.count += 1
        self.total += size
        if self.count > MAX_FRAMES:
            raise ProtocolError(f"the child sent more than {MAX_FRAMES} frames")
        if self.total > MAX_VALUE + MAX_FRAMES * MAX_NOTE:
            raise ProtocolError("the child sent more bytes than an answer may have")
        self._kind, self._size, self._body, self._filled = kind, size, bytearray(), 0
        self._finish_body()

    def _grow(self) -> None:
        """Room for more of the body: doubled (from 64 KiB), never past its length, so a body is only
        ever as large as twice what arrived. From 1 MiB on it is an anonymous mapping of its own: freed,
        it goes back to the system whole (growing malloc's heap would keep the kernel's RSS up)."""
        size = min(self._size, max(64 << 10, 2 * len(self._body)))
        body = mmap.mmap(-1, size) if size >= _MAPPED else bytearray(size)
        body[:self._filled] = memoryview(self._body)[:self._filled]  # the view is gone by the next line
        release(self._body)
        self._body = body

    def _finish_body(self) -> None:
        if self._filled == self._size:  # the body's capacity is its size by now (see _grow)
            self._done.append((self._kind, self._body))
            self._size, self._body, self._filled = -1, bytearray(), 0


#: Bodies from this size on are read into anonymous mappings (:meth:`Frames._grow`).
_MAPPED = 1 << 20


def release(body) -> None:
    """Give a frame's body back now (a mapping is unmapped; a bytearray emptied)."""
    try:
        if isinstance(body, mmap.mmap):
            body.close()
        else:
            body[:] = b""
    except BufferError:
        pass  # still viewed (an error's traceback holds a decoder): freed with it

def text(body) -> str:
    """A frame's body as one line of text (a refusal, why the child could not be sealed): at most MAX_NOTE bytes."""
    return bytes(body).decode("utf-8", "replace").replace("\n", " ")


def decode(body) -> Any:
    """A frame's plain value; :class:`ProtocolError` if the body is not one."""
    try:
        return plain.decode(body)
    except plain.PlainError as exc:
        raise ProtocolError(f"the child's answer is not plain data ({exc})") from None


def optional_str(value: Any) -> Optional[str]:
    """``value`` if it is None or a str, else TypeError."""
    return None if value is None else str_(value)
