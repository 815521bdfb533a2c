"""run_sealed(): run a function in a forked child that cannot change anything the user owns, and bring back what it returned or raised (the parent's side).

Why a fork: the child starts as an exact copy-on-write image of the user's process (their objects,
modules, torch state); the fork copies page tables, not pages (5 ms with torch imported, 23 ms with
1 GiB of tensors: benchmarks/bench_sealed.py), and nothing is copied until the child writes to it.
What the child changes in its own memory (globals, ``os.environ``, RNG state, torch's default
dtype) dies with it. The child seals itself before calling ``fn`` (:mod:`.child`). Its value or its
exception (as :class:`ChildError`) comes back on a pipe as length-prefixed frames of plain data
(:mod:`.protocol`, :mod:`.plain`), read by :mod:`.answer`, which trusts none of it. Refusals are
sent as they happen, so a run killed at its deadline still says what it tried; the refusals of C
code are named by the parent itself (:mod:`.notify`). The parent reads the pipe while the child
writes (a result of tens of MB never blocks the child), watches the child with a pidfd, ends it
early when it can never go on (:mod:`.stuck`), SIGKILLs it at the deadline and always reaps it. If a sealing step fails,
``fn`` does not run: the outcome's ``exit`` says why.

A zygote (``allow_fork=True``) is a child that may itself call ``run_sealed``, so that a costly
warm-up is paid once and each trial starts from a fresh copy of the warmed state. Ending one needs
more than one SIGKILL, in two places:

- the parent of a zygote: the zygote leads its own process group (both the parent and the child
  call ``setpgid``, so whichever comes first is right). Whenever the zygote ends (its deadline, its
  own exit, Ctrl-C), the parent kills the whole group *before* it reaps the zygote, because until
  then the zygote's pid names the group and cannot belong to anyone else. Nothing the zygote forked
  outlives the run, not even a process C code forked behind ``run_sealed``'s back;
- the zygote itself, as the parent of a trial: it may signal no other process (its shims and its
  filter refuse), so it forks each trial from a thread of its own that then waits. The trial asks
  the kernel for SIGKILL when that thread ends (``PR_SET_PDEATHSIG`` follows the forking thread),
  and its filter cannot take that back; ending the thread is how the trial's deadline kills it.
  The trial stays in the zygote's group, so the outer parent's group kill ends it too.
"""
from __future__ import annotations

import math
import os
import select
import signal
import sys
import threading
import time
import warnings
from typing import Callable, Optional

from . import seccomp, shims
from .answer import Answer, SealedOutcome
from .child import run_child
from .protocol import ChildError
from .shims import MAX_REFUSED
from .stuck import StuckWatch

__all__ = ["run_sealed", "check_seconds", "SealedOutcome", "ChildError", "SealedUnavailable", "MAX_REFUSED"]

#: Seconds a zygote waits for a trial to die once the thread it was forked from has ended.
_TRIAL_DEATH_S = 10.0


class SealedUnavailable(Exception):
    """No sealed run is possible here (no os.fork on this platform, or inside a sealed run that is not
    a zygote); the message says why in one line."""


def run_sealed(fn: Callable, *args, deadline_s: float, allow_fork: bool = False, **kwargs) -> SealedOutcome:
    """Run ``fn(*args, **kwargs)`` in a sealed forked child; SIGKILL it after ``deadline_s`` seconds.

    What ``fn`` returns must be plain data (numbers, strings, bytes, lists, tuples, dicts, sets; at
    most 256 MiB encoded): it comes back as such, never pickled, and anything else is an error
    naming its type. ``deadline_s`` is a positive number of seconds (``inf``: no deadline, Ctrl-C
    still ends the run). A child that waits forever on a lock (one held at the fork by another
    thread of this process) is ended as soon as that is certain, with ``stuck`` set.

    With ``allow_fork=True`` the child is a zygote: sealed the same, except that ``fn`` may call
    ``run_sealed`` (each such trial is a fresh copy of the zygote, sealed again, and may not fork);
    nothing else in the zygote may fork, exec or spawn. The deadline ends the zygote and every
    process it forked.

    Never raises but :class:`SealedUnavailable` (no ``os.fork``; or called inside a sealed run that is
    not a zygote), ``ValueError`` (``deadline_s`` is not a positive number) and ``KeyboardInterrupt``
    (after the child is killed and reaped); never prints.
    """
    deadline_s = check_seconds(deadline_s, "deadline_s")
    if not hasattr(os, "fork"):
        raise SealedUnavailable(f"a sealed run needs os.fork, which {sys.platform} does not have")
    outer = shims.current()
    if outer is not None and not outer.allow_fork:
        raise SealedUnavailable("a sealed run inside a sealed run needs allow_fork=True on the outer run")
    _preload()
    start = time.monotonic()
    # the other threads, latest started first (a kernel's own come first in enumerate()'s order)
    threads = tuple(reversed([t.name for t in threading.enumerate() if t is not threading.current_thread()]))
    read_end, write_end = os.pipe()
    # the ack pipe: the parent says whether it took the child's seccomp listener (.notify); not in a zygote
    ack_read, ack_write = os.pipe() if outer is None and seccomp.unsupported() is None else (-1, -1)
    child = _Child(group=allow_fork and outer is None, nested=outer is not None)
    ends = (read_end, write_end, ack_read, ack_write)
    answer: Optional[Answer] = None
    try:
        child.start(lambda parent, thread, sigmask: run_child(ends, fn, args, kwargs, allow_fork, parent, thread,
                                                              sigmask))
        for fd in (write_end, ack_read):
            if fd >= 0:
                os.close(fd)
        write_end = ack_read = -1
        answer = Answer(child.pid, None if outer is not None else _pidfd(child.pid), ack_write)
        status, timed_out = _watch(child, read_end, start + deadline_s, answer)
        return answer.outcome(status, timed_out, time.monotonic() - start, threads, _describe_exit)
    except Exception as exc:  # our own failure: never the caller's problem
        return SealedOutcome(exit=f"the sealed run failed in the parent: {type(exc).__name__}: {exc}",
                             seconds=time.monotonic() - start, pid=child.pid)
    finally:  # KeyboardInterrupt included: no child outlives the call, no zombie
        child.end()
        if answer is not None:
            answer.close()
            if answer.pidfd is not None:
                os.close(answer.pidfd)
        for fd in (read_end, write_end, ack_read, ack_write):
            if fd >= 0:
                os.close(fd)


def check_seconds(value, name: str = "timeout_s") -> float:
    """``value`` as a float number of seconds > 0 (``inf`` allowed: no limit); ValueError in one line otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds, not {type(value).__name__} {value!r:.40}")
    seconds = float(value)
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be a number of seconds above 0, not {value!r}")
    return seconds


def _preload() -> None:
    """Import, in the parent and once, what the child patches, so that each child does not pay for it."""
    import ctypes  # noqa: F401
    import shutil  # noqa: F401
    import socket  # noqa: F401
    import subprocess  # noqa: F401

    seccomp.prepare()


# --- the child, from the fork until it is reaped -------------------------------------------------------


def _fork(child: "_Child", body: Callable, thread: Optional[int] = None) -> None:
    """Fork (the pid goes into ``child``); in the new process, run ``body`` and never return. SIGINT
    is blocked across the fork so that the child can ignore it before one arrives."""
    parent = os.getpid()
    blocked = hasattr(signal, "pthread_sigmask")
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if blocked else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: "fork() of a multi-threaded process"
            with shims.own_fork():  # in a zygote, the one fork its guard lets through
                child.pid = os.fork()
        if child.pid == 0:
            try:
                body(parent, thread, old)
            finally:
                os._exit(70)
        if child.group:
            try:
                os.setpgid(child.pid, child.pid)
            except OSError:
                pass  # the child has already done it, or is already gone
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Holder(threading.Thread):
    """In a zygote: the thread a trial is forked from, waiting until released; the trial dies when it ends."""

    def __init__(self, fork: Callable[[int], None]):
        super().__init__(name="sealed-trial", daemon=True)
        self._fork = fork
        self.forked = threading.Event()
        self.error: Optional[BaseException] = None
        self._released = threading.Event()

    def run(self) -> None:
        try:
            self._fork(threading.get_native_id())
        except BaseException as exc:  # noqa: B036 - handed to the thread that waits for the fork
            self.error = exc
        finally:
            self.forked.set()
        self._released.wait()

    def release(self) -> None:
        self._released.set()
        if self.ident is not None:  # started (a thread that could not start has nothing to join)
            self.join()


class _Child:
    """The forked child until it is reaped, and how to end it (the module docstring says why three ways)."""

    def __init__(self, group: bool, nested: bool):
        self.pid = 0
        self.group = group  # a zygote: it leads a process group, killed as a whole
        self.nested = nested  # forked inside a sealed process: ended through its holder thread
        self.holder: Optional[_Holder] = None
        self.reaped = False

    def start(self, body: Callable) -> None:
        if not self.nested:
            _fork(self, body)
            return
        self.holder = _Holder(lambda thread: _fork(self, body, thread))
        self.holder.start()
        self.holder.forked.wait()
        if self.holder.error is not None:
            raise self.holder.error

    def poll(self) -> Optional[int]:
        """The wait status once the child has exited (it is then reaped), else None."""
        if self.group:
            if os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return None
            _kill_group(self.pid)  # it exited: what it forked goes too, while its pid still names the group
        done, status = os.waitpid(self.pid, os.WNOHANG)
        if not done:
            return None
        self._done()
        return status

    def ask_where(self) -> None:
        """Ask a stuck child to send where it waits (SIGUSR2; a trial cannot be signalled by its zygote)."""
        if self.holder is None and self.pid:
            try:
                os.kill(self.pid, signal.SIGUSR2)
            except ProcessLookupError:
                pass

    def end(self) -> None:
        """Kill the child if it still runs (a zygote with its group) and reap it: no process outlives the run."""
        if self.reaped:
            return
        if self.holder is not None:
            self.holder.release()  # the thread ends: the kernel sends the trial SIGKILL
        elif self.pid:
            if self.group:
                _kill_group(self.pid)
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.pid:
            self._wait(_TRIAL_DEATH_S if self.holder is not None else None)
        self._done()

    def _wait(self, limit: Optional[float]) -> None:
        """Reap the child, which is dying; give up after ``limit`` seconds (a trial, which we cannot kill
        twice: the outer parent's group kill ends it)."""
        until = None if limit is None else time.monotonic() + limit
        nap = 0.0005
        while True:
            try:
                done, _status = os.waitpid(self.pid, 0 if until is None else os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if done or (until is not None and time.monotonic() > until):
                return
            time.sleep(nap)
            nap = min(nap * 2, 0.05)

    def _done(self) -> None:
        self.reaped = True
        if self.holder is not None:
            self.holder.release()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass  # no such group (the child never led one) or already gone


# --- the parent: read the frames, watch the child, decode -------------------------------------------


#: Seconds a stuck child has, once asked (SIGUSR2), to say where it waits before it is killed.
_STUCK_GRACE_S = 2.0


def _watch(child: _Child, fd: int, deadline: float, answer: Answer):
    """Read frames and serve the listener until the child ends, breaks the protocol, is found stuck or
    outlives the deadline; (wait status or None, timed out).

    ``poll``, not ``select``: a kernel with many open files has descriptors past select's 1024.
    """
    os.set_blocking(fd, False)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if answer.pidfd is not None:
        poller.register(answer.pidfd, select.POLLIN)
    watch, listening = StuckWatch(child.pid), False
    reading, nap = True, 0.0005
    while True:
        status = child.poll()
        if status is not None:
            answer.pull(fd)  # the child is gone: what it wrote is all in the pipe
            return status, False
        now = time.monotonic()
        if answer.broken is not None:
            child.end()  # a forged or garbled answer: nothing more of it is read
            return None, False
        if now >= deadline:
            child.end()
            answer.pull(fd)
            return None, not answer.stuck
        if not answer.stuck and watch.look(now):
            answer.stuck = True  # it can never go on: ask it where it waits, then end it
            deadline = min(deadline, now + _STUCK_GRACE_S)
            child.ask_where()
        if answer.listener is not None and listening is False:
            poller.register(answer.listener.fd, select.POLLIN)
            listening = True
        remaining = deadline - now
        if not reading and answer.pidfd is None:  # end of file and no pidfd: the exit follows at once
            time.sleep(min(nap, remaining))
            nap = min(nap * 2, 0.05)
            continue
        wait = min(remaining, watch.next - now + 0.001, 1.0)
        events = dict(poller.poll(max(1, int(wait * 1000))))
        if reading and fd in events and answer.pull(fd):  # first: a frame sent before a refused call tells about it
            poller.unregister(fd)  # end of file: now only the exit itself is awaited
            reading = False
        if listening and answer.listener.fd in events:
            answer.serve()
            hung_up = events[answer.listener.fd] & (select.POLLHUP | select.POLLERR | select.POLLNVAL)
            if hung_up or answer.listener.dead:
                poller.unregister(answer.listener.fd)  # the child's threads are gone: no call can come (and
                listening = None                       # a hung-up descriptor would wake the loop for nothing)


def _pidfd(pid: int) -> Optional[int]:
    """A descriptor that becomes readable when the child exits (Linux 5.3+), or None to poll (a
    zygote, whose filter refuses pidfd_open, does not ask)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _describe_exit(status: Optional[int]) -> str:
    if status is None:
        return "ended without a report"
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return f"killed by {name}"
    return f"exited with status {os.WEXITSTATUS(status)} without a report"
