"""The parent's reading of one sealed child: its frames checked as they come, the refusals of its C code named, and the SealedOutcome built.

Nothing the child sends is trusted (the step runs there, and C code in it can write on the pipe):
frames are capped and decoded as plain data (:mod:`.protocol`, :mod:`.plain`), each field is
checked for its type, and a child that breaks a rule (a pickle, a header claiming gigabytes,
garbage, a frame cut short, a second answer) is killed and its run ends with ``broken`` saying so
in one line; none of what it sent is used.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional, Set, Tuple

from . import protocol
from .notify import Listener, take_listener
from .protocol import (ERROR, GUARD, LISTEN, QUIET, REFUSED, STUCK, SUMMARY, UNSEALED, VALUE, ChildError, Frames,
                       ProtocolError)
from .shims import MAX_REFUSED, show

__all__ = ["SealedOutcome", "Answer"]


@dataclass(frozen=True)
class SealedOutcome:
    """How a sealed run ended: what ``fn`` returned or raised, and what the seal refused on the way."""

    value: Any = None
    error: Optional[ChildError] = None
    timed_out: bool = False
    #: how the child ended when it did not report ("killed by SIGSEGV", "exited with status 3")
    exit: Optional[str] = None
    #: each refused side effect, one short line, deduplicated; capped at MAX_REFUSED plus a count.
    #: Calls refused in C code end in "(C code)".
    refused: Tuple[str, ...] = ()
    #: lines the child printed (stdout + stderr, Python level), discarded
    printed: int = 0
    #: which guard held: "seccomp" (OS-level filter + Python shims) or "python" (shims only)
    guard: str = ""
    #: one line when the OS-level guard could not be installed (or memory stayed shared), saying why
    guard_note: Optional[str] = None
    seconds: float = 0.0
    #: the child's pid (already reaped)
    pid: int = 0
    #: the child waited forever: every thread of it slept on a lock no thread of it could release
    #: (one held at the fork by a thread of this process), and it was ended before its deadline
    stuck: bool = False
    #: where it waited, when it could say: (filename, lineno, function, source line), outermost first
    stuck_frames: Tuple[Tuple[str, int, str, str], ...] = ()
    #: the other threads of this process when the child was forked (their names, latest started
    #: first): one of them held the lock
    threads: Tuple[str, ...] = ()
    #: why the child's answer was refused (a forged or garbled frame); nothing it sent was used
    broken: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and self.exit is None and not self.stuck \
            and self.broken is None


class Answer:
    """What the parent has read of one child so far; :meth:`pull` after each wake-up, :meth:`outcome` at the end."""

    def __init__(self, pid: int, pidfd: Optional[int], ack_fd: int):
        self.pid = pid
        self.pidfd = pidfd
        self.ack_fd = ack_fd
        self.frames = Frames()
        self.listener: Optional[Listener] = None
        self.broken: Optional[str] = None
        self.stuck = False
        self._refused: List[str] = []
        self._seen: Set[str] = set()
        self._more = 0
        self._guard, self._note, self._printed, self._child_more = "", None, 0, 0
        self._answer: Optional[Tuple[int, Any]] = None
        self._listened = False
        self._quiet = 0  # > 0 while the child runs the caller's own machinery: its C code's refusals are not listed

    # -- reading ----------------------------------------------------------------------------------
    def pull(self, fd: int) -> bool:
        """Read and check what the pipe holds; True at its end, or once the answer is broken."""
        if self.broken is not None:
            return True
        try:
            end = self.frames.pull(fd)
            for kind, body in self.frames.take():
                self._take(kind, body)
            return end
        except ProtocolError as exc:
            self.broken = str(exc)
            return True

    def _take(self, kind: int, body) -> None:
        if self._answer is not None:
            raise ProtocolError("the child sent more after its answer (a forged frame)")
        if kind == REFUSED:
            self.add(protocol.text(body))
        elif kind == GUARD:
            guard, note = self._fields(body, 2)
            self._guard, self._note = protocol.str_(guard), protocol.optional_str(note)
        elif kind == SUMMARY:
            printed, more = self._fields(body, 2)
            self._printed, self._child_more = protocol.int_(printed), protocol.int_(more)
        elif kind == LISTEN:
            self._listen(protocol.int_(protocol.decode(body)))
        elif kind == QUIET:
            self._quiet = protocol.int_(protocol.decode(body))
        elif kind == VALUE:
            self._answer = (kind, protocol.decode(body))
        elif kind == ERROR:
            self._answer = (kind, ChildError.from_plain(protocol.decode(body)))
        elif kind == UNSEALED:
            self._answer = (kind, protocol.text(body))
        elif kind == STUCK:
            if not self.stuck:
                raise ProtocolError("the child said where it waits when it was not asked (a forged frame)")
            frames = protocol.decode(body)
            try:
                checked = tuple((protocol.str_(f[0]), protocol.int_(f[1]), protocol.str_(f[2]), protocol.str_(f[3]))
                                for f in frames)
            except (TypeError, IndexError) as exc:
                raise ProtocolError(f"the child's stack is malformed ({exc})") from None
            self._answer = (kind, checked)
        protocol.release(body)  # free each body as soon as it is read (a value may be tens of MB)

    @staticmethod
    def _fields(body, count: int) -> list:
        value = protocol.decode(body)
        if not isinstance(value, list) or len(value) != count:
            raise ProtocolError(f"a frame of the child holds {type(value).__name__}, not {count} fields")
        return value

    def add(self, line: str) -> None:
        """One refused side effect (from a frame, or named here for C code), once; past MAX_REFUSED, counted."""
        line = line if len(line) <= 200 else line[:197] + "..."
        if line in self._seen:
            return
        self._seen.add(line)
        if len(self._refused) < MAX_REFUSED:
            self._refused.append(line)
        else:
            self._more += 1

    # -- the seccomp listener -------------------------------------------------------------------
    def _listen(self, remote: int) -> None:
        if self._listened or self.ack_fd < 0:
            raise ProtocolError("the child sent a listener it was not asked for")
        self._listened = True
        try:
            self.listener = Listener(take_listener(self.pidfd, remote), show)
            ack = b"1"
        except OSError:
            ack = b"0"  # the child covers it with the plain filter and says so in its guard note
        try:
            os.write(self.ack_fd, ack)
        except OSError:
            pass  # the child is gone

    def serve(self) -> None:
        """Name and refuse what the child's C code is waiting on."""
        if self.listener is not None:
            for line in self.listener.serve():
                if self._quiet <= 0:
                    self.add(line)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()

    # -- the outcome -----------------------------------------------------------------------------
    def outcome(self, status: Optional[int], timed_out: bool, seconds: float, threads: Tuple[str, ...] = (),
                describe_exit=None) -> SealedOutcome:
        refused = list(self._refused)
        more = self._more + self._child_more
        if more:
            refused.append(f"... and {more} more")
        common = dict(refused=tuple(refused), printed=self._printed, guard=self._guard, guard_note=self._note,
                      seconds=seconds, pid=self.pid, threads=threads)
        if self.broken is not None:
            return SealedOutcome(broken=self.broken, **common)
        kind, value = self._answer if self._answer is not None else (None, None)
        if kind == STUCK or (self.stuck and kind is None):
            return SealedOutcome(stuck=True, stuck_frames=value or (), **common)
        if kind == VALUE:
            return SealedOutcome(value=value, **common)
        if kind == ERROR:
            return SealedOutcome(error=value, **common)
        if timed_out:
            return SealedOutcome(timed_out=True, **common)
        exit = value if kind == UNSEALED else describe_exit(status)
        return SealedOutcome(exit=exit, **common)
