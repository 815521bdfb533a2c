"""A child that can never go on: every one of its threads asleep in a wait that has no timeout and that no thread of the child could end.

Why: a fork copies one thread, the one that forked. A lock that another thread of the user's
process held at that moment (a progress bar's monitor, a logging or data thread, the user's own)
stays held in the child for good, since its holder does not exist there; a step that takes it
waits forever, and the deadline would be its only end. The parent sees it from outside without
waiting that long: each thread's current system call is in ``/proc/<pid>/task/<tid>/syscall``. A
thread waiting for a lock sleeps in ``futex`` with no timeout; when every thread of the child does
so for :data:`STUCK_S` seconds, none of them can wake another, and nothing outside can (the
child's shared memory is private, its descriptors are cut): the child is stuck. A thread that
computes, sleeps for a time, reads or polls, or waits with a timeout, is not.
"""
from __future__ import annotations

import os
import platform
import time
from typing import Optional

__all__ = ["STUCK_S", "all_threads_wait_forever", "StuckWatch"]

#: Seconds every thread must have waited forever, seen again and again, before the child is called stuck.
STUCK_S = 2.0
#: Seconds between two looks.
EVERY_S = 0.25
_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_CMD = 0x7F        # the op without FUTEX_PRIVATE_FLAG and FUTEX_CLOCK_REALTIME
_WAITS = {0, 6, 9, 11}   # FUTEX_WAIT, FUTEX_LOCK_PI, FUTEX_WAIT_BITSET, FUTEX_WAIT_REQUEUE_PI


def all_threads_wait_forever(pid: int) -> Optional[bool]:
    """Whether every thread of ``pid`` sleeps in a futex wait without a timeout now; None when it cannot be told."""
    if _FUTEX is None:
        return None
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    if not tasks:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall", "rb") as f:
                fields = f.read(256).split()
        except OSError:
            return None  # the thread ended meanwhile, or /proc refuses: not stuck as far as we know
        try:
            if len(fields) < 5 or int(fields[0]) != _FUTEX:
                return False
            if int(fields[2], 16) & _FUTEX_CMD not in _WAITS or int(fields[4], 16) != 0:
                return False
        except ValueError:
            return False  # "running", or a form we do not know
    return True


class StuckWatch:
    """Looks at a child now and then (:meth:`look`); True once it has been stuck for STUCK_S seconds."""

    def __init__(self, pid: int, stuck_s: float = STUCK_S):
        self.pid = pid
        self.stuck_s = stuck_s
        self.next = time.monotonic() + EVERY_S
        self._since: Optional[float] = None

    def look(self, now: float) -> bool:
        if now < self.next:
            return False
        self.next = now + EVERY_S
        if all_threads_wait_forever(self.pid):
            if self._since is None:
                self._since = now
            return now - self._since >= self.stuck_s
        self._since = None
        return False
