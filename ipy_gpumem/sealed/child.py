"""The sealed child, from the fork to ``os._exit``: seal it, step by step, then run ``fn`` and send back what came of it.

A fork does not copy what lives outside the process (files, sockets, other processes, the terminal,
shared memory), so the child seals itself, in this order, before calling ``fn``:

0. its own :class:`~.shims.Seal` first, the one that every refusal in this process is reported to
   (for a child of a zygote, see below), with a descriptor on ``/dev/null`` for writes to go to;
1. signals: SIGINT ignored (the parent owns Ctrl-C and kills the child), Python handlers back to
   the default, ``faulthandler`` off; the whole child runs inside ``try/finally: os._exit()`` so it
   never returns into the parent's code, never runs ``atexit`` handlers, never flushes buffers it
   inherited, and dies with its parent (``PR_SET_PDEATHSIG``); a zygote leads its own process group;
2. output: fds 0/1/2 to ``/dev/null``; ``sys.stdout``/``sys.stderr`` to sinks that only count lines;
   ipykernel's streams and IOPub thread are unplugged (a forked child that writes to them sends
   over a new ZMQ socket to the kernel, which would print in the cell); ``input()`` raises,
   warnings are ignored;
3. torch, when the user imported it: ``set_num_threads(1)`` first, because a torch op in a fork of a
   process that used torch's intra-op pool waits forever on threads that do not exist;
4. inherited file descriptors: none is shared with the parent any more. A file open for writing
   (a log opened in an earlier cell) becomes an anonymous memory file, so writes succeed and go
   nowhere, and the run reports ``"write to log.txt (opened before the run)"`` when the bytes reach
   the OS (a write still sitting in a Python buffer when the child ends is neither written nor
   reported). A file open for reading and writing (an ``a+`` log, a database a connection holds)
   becomes a memory copy of it up to :data:`COPY_MAX`, reported the same way when written. Files
   and directories open for reading (or read-write, larger) are reopened read-only at the same
   offset, so reading in the child does not move the parent's offset. Everything else
   (sockets, including the kernel's ZMQ ones, pipes, eventfds) becomes ``/dev/null``. Shared memory
   mappings become private copies (:func:`.seccomp.privatise_shared_memory`). The child is also the
   kernel's first choice (``oom_score_adj`` 1000) if memory runs out;
5. the Python shims and the audit hook (:mod:`.shims`);
6. the OS guard (:mod:`.seccomp`), installed last because the steps above still need the calls it
   refuses: what C code does behind Python's back is refused by the kernel with ``EPERM``, after
   the parent, which holds the filter's listener, has named it (:mod:`.notify`; the child hands the
   listener over and closes its own before ``fn`` runs).

If a step fails, ``fn`` does not run: the child says why on the pipe and exits. Then ``fn`` runs,
and its value or its exception (as :class:`~.protocol.ChildError`) goes back on the pipe as plain
data (:mod:`.plain`): never a pickle, which the parent would have to trust. Python code of ``fn``
may not write on, duplicate or close the pipe (:mod:`.shims`). While ``fn`` runs, a SIGUSR2 from the
parent (which found every thread waiting forever, :mod:`.stuck`) makes the child send where it
waits, and exit.

A child of a zygote (a nested run) takes the same steps over what its zygote already sealed, and
inherits the zygote's guards: its Seal comes first so that the zygote's shims and audit hook report
to it, not on the zygote's pipe; it reuses the zygote's ``/dev/null`` descriptor (no write-capable
open passes the zygote's filter); the files the zygote redirected to memory files get fresh copies
of those (what the trial writes is its own to report, and the next trial starts from the
zygote's); it keeps the ``oom_score_adj`` it inherited, stays in the zygote's process group, and
dies with the zygote's thread that forked it.
"""
from __future__ import annotations

import builtins
import io
import os
import signal
import stat
import sys
import traceback
import warnings
from typing import List, Optional, Tuple

from . import plain, seccomp, shims
from .protocol import ERROR, GUARD, LISTEN, MAX_VALUE, STUCK, SUMMARY, UNSEALED, VALUE, ChildError, Pipe

_OURS = os.path.dirname(os.path.abspath(__file__))


def run_child(ends: Tuple[int, int, int, int], fn, args, kwargs, allow_fork: bool, parent: int,
              thread: Optional[int], sigmask) -> None:
    """The sealed child, from the fork to os._exit; it never returns normally. ``ends`` are the pipe's
    read and write ends and the ack pipe's (or -1, -1), where the parent answers the handover of the
    seccomp listener (:mod:`.notify`)."""
    read_end, write_end, ack_end, ack_write = ends
    for fd in (read_end, ack_write):
        if fd >= 0:
            os.close(fd)
    pipe = Pipe(write_end, shims.original(os, "os", "write"))
    try:
        lines, seal = _seal(pipe, ack_end, allow_fork, parent, thread, sigmask)
    except Exception as exc:  # fn must not run half-sealed: say why, and stop
        pipe.send(UNSEALED, f"the child could not be sealed: {type(exc).__name__}: {exc}".encode("utf-8", "replace"))
        os._exit(71)
    _on_stuck(pipe)
    kind, body = _call(fn, args, kwargs)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # fn is over: the answer goes out whole
    for path, memfd, made in seal.written.values():
        try:
            if _stamp(memfd) != made:
                seal.refusals.add(f"write to {shims.show(path)} (opened before the run)")
        except OSError:
            continue  # fn closed it
    shims.sqlite_writes(seal)
    pipe.send_plain(SUMMARY, [lines.count, seal.refusals.more])
    pipe.send(kind, body)
    os._exit(0)


def _seal(pipe: Pipe, ack_end: int, allow_fork: bool, parent: int, thread: Optional[int], sigmask):
    """Steps 0 to 6 of the module docstring, in order; (line counter, this process's seal)."""
    outer = shims.current()
    devnull = outer.devnull if outer is not None else os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    seal = shims.Seal(pipe, devnull, allow_fork)
    shims.enter(seal)
    _quiet_signals(sigmask)
    seccomp.die_with_parent(parent, thread)
    if allow_fork and outer is None:
        os.setpgid(0, 0)  # the parent kills this group: whatever the zygote forks dies with it
    sys.dont_write_bytecode = True  # an import in the child must not try to write a .pyc
    lines = _silence_output(devnull)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "set_num_threads"):
        torch.set_num_threads(1)
    _cut_inherited_fds(seal, outer, ack_end)
    notes = [seccomp.privatise_shared_memory()]
    if outer is None:
        _prefer_oom_kill()
    shims.install()
    reason, listener = seccomp.install(seal.pid, allow_fork, notify=ack_end >= 0, nested=outer is not None)
    notes.insert(0, reason)
    if ack_end >= 0:
        notes.append(_hand_over(pipe, ack_end, listener, seal.pid, allow_fork))
    guard = "python" if notes[0] else "seccomp"
    pipe.send_plain(GUARD, [guard, "; ".join(n for n in notes if n) or None])
    return lines, seal


def _hand_over(pipe: Pipe, ack_end: int, listener: Optional[int], pid: int, allow_fork: bool) -> Optional[str]:
    """Give the parent the seccomp listener and close ours before fn runs (the step must never hold it);
    if the parent could not take it, cover it with the plain filter. A note when C code's refusals go unlisted."""
    if listener is None:
        os.close(ack_end)
        return None
    pipe.send_plain(LISTEN, listener)
    answer = b""
    try:
        answer = os.read(ack_end, 1)
    finally:
        os.close(listener)
        os.close(ack_end)
    if answer == b"1":
        return None
    seccomp.install(pid, allow_fork)  # EPERM takes precedence over the listener: nothing waits on it
    return "the refusals of C code are not listed (the parent could not take the seccomp listener)"


def _on_stuck(pipe: Pipe) -> None:
    """When the parent finds every thread of the child waiting forever (:mod:`.stuck`), it sends SIGUSR2:
    the main thread, woken in its wait, sends where it waited (its stack) and exits."""
    def report(signum, frame):
        stack = [f for f in traceback.extract_stack(frame) if os.path.dirname(os.path.abspath(f.filename)) != _OURS]
        try:
            pipe.send_plain(STUCK, [[f.filename, f.lineno or 0, f.name, f.line or ""] for f in stack[-64:]])
        finally:
            os._exit(72)

    signal.signal(signal.SIGUSR2, report)


def _stamp(fd: int) -> Tuple[int, int]:
    """(size, mtime) of a memory file: a write changes it."""
    st = os.fstat(fd)
    return st.st_size, st.st_mtime_ns


# --- 1. signals ----------------------------------------------------------------------------------------


def _quiet_signals(sigmask) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sigmask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, sigmask)  # a SIGINT pending since the fork is now ignored
    for number in signal.valid_signals():
        try:
            if callable(signal.getsignal(number)):
                signal.signal(number, signal.SIG_DFL)
        except (OSError, ValueError, TypeError):
            continue
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass
    import faulthandler

    if faulthandler.is_enabled():
        faulthandler.disable()


# --- 2. output -----------------------------------------------------------------------------------------


class _Lines:
    """Counts the lines written to the child's stdout and stderr."""

    def __init__(self):
        self.newlines = 0
        self.partial = False

    def feed(self, text) -> None:
        if text:
            self.newlines += text.count("\n" if isinstance(text, str) else b"\n")
            self.partial = not text.endswith("\n" if isinstance(text, str) else b"\n")

    @property
    def count(self) -> int:
        return self.newlines + (1 if self.partial else 0)


class _BinarySink(io.RawIOBase):
    def __init__(self, lines: _Lines, fd: int):
        self._lines, self._fd = lines, fd

    def writable(self):
        return True

    def write(self, data):
        self._lines.feed(bytes(data))
        return len(data)

    def fileno(self):
        return self._fd


class _Sink(io.TextIOBase):
    """sys.stdout / sys.stderr in the child: counts lines, keeps nothing."""

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, lines: _Lines, fd: int):
        self._lines, self._fd = lines, fd
        self.buffer = _BinarySink(lines, fd)

    def writable(self):
        return True

    def write(self, text):
        self._lines.feed(text)
        return len(text)

    def isatty(self):
        return False

    def fileno(self):
        return self._fd  # /dev/null, for C code that asks


def _silence_output(devnull: int) -> _Lines:
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    lines = _Lines()
    previous = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Sink(lines, 1), _Sink(lines, 2)
    for old, new in zip(previous, (sys.stdout, sys.stderr)):
        _redirect_stream(old, new)
    sys.stdin = io.StringIO("")
    builtins.input = _no_input
    warnings.simplefilter("ignore")
    _unplug_ipykernel(sys.stdout)
    return lines


def _redirect_stream(old, sink: _Sink) -> None:
    """Make the parent's stream object itself write to ``sink``: a logging handler made in an
    earlier cell holds it, and IPython wraps its ``write`` per instance to keep output history."""
    for name in ("write", "writelines", "flush"):
        try:
            setattr(old, name, getattr(sink, name))
        except (AttributeError, TypeError):
            return  # a plain file object (fd 1 or 2): it writes to /dev/null now


def _no_input(prompt=""):
    raise EOFError("input() is not available in a sealed run")


def _unplug_ipykernel(sink: _Sink) -> None:
    """Objects that still hold the kernel's streams (a logging handler, display()) write nowhere."""
    iostream = sys.modules.get("ipykernel.iostream")
    if iostream is None:
        return
    iostream.OutStream.write = lambda self, text: sink.write(text)
    iostream.OutStream.writelines = lambda self, seq: [sink.write(text) for text in seq] and None
    iostream.OutStream.flush = lambda self: None
    iostream.IOPubThread.schedule = lambda self, f: None
    iostream.IOPubThread.send_multipart = lambda self, *a, **k: None


# --- 4. inherited file descriptors -----------------------------------------------------------------------


def _open_fds() -> List[int]:
    for listing in ("/proc/self/fd", "/dev/fd"):
        try:
            return sorted(int(name) for name in os.listdir(listing))
        except OSError:
            continue
    return list(range(3, 1024))  # no listing: the usual range, closed ones are skipped


#: A file open for reading and writing is copied into its memory file up to this size (larger: read-only).
COPY_MAX = 64 << 20
#: Bytes copied so, for all such files of one run.
COPY_BUDGET = 256 << 20


def _cut_inherited_fds(seal: shims.Seal, outer: Optional[shims.Seal], ack_end: int) -> None:
    """Leave the child no descriptor shared with its parent; files open for writing go to ``seal.written``."""
    keep = {seal.refusals.pipe.fd, seal.devnull, ack_end}
    budget = [COPY_BUDGET]
    for fd in _open_fds():
        if fd <= 2 or fd in keep:
            continue
        memfd = _replace_fd(fd, seal.devnull, outer, budget)
        if memfd is not None:
            seal.written[fd] = memfd
            keep.add(memfd[1])


def _replace_fd(fd: int, devnull: int, outer: Optional[shims.Seal], budget: List[int]):
    """What becomes of ``fd``: None, or (path, memory file, its stamp) for a file whose writes are pretended."""
    import fcntl

    if outer is not None:  # the zygote's memory files: a fresh copy for each file, its own ones unused
        if fd in outer.written and _same_file(fd, outer.written[fd][1]):
            return (outer.written[fd][0],) + _memfd_over(fd, fcntl.fcntl(fd, fcntl.F_GETFL), copy=True)
        if fd in {entry[1] for entry in outer.written.values()}:
            _to_devnull(fd, devnull)
            return None
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        st = os.fstat(fd)
    except OSError:
        return None  # closed meanwhile (the listing's own descriptor)
    mode = st.st_mode
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        target = ""  # no /proc (not Linux): nothing can be reopened, all becomes /dev/null
    if flags & getattr(os, "O_PATH", 0):
        return None  # can neither read nor write
    access = flags & os.O_ACCMODE
    if stat.S_ISREG(mode) and target.startswith("/") and hasattr(os, "memfd_create"):
        if access == os.O_WRONLY:
            return (target,) + _memfd_over(fd, flags, copy=False)
        if access == os.O_RDWR and st.st_size <= min(COPY_MAX, budget[0]):
            # read and written (an "a+" log, a database): a copy, so reads see the file and writes go nowhere
            budget[0] -= st.st_size
            return (target,) + _memfd_over(fd, flags, copy=True)
    readable = stat.S_ISREG(mode) or stat.S_ISDIR(mode) or (stat.S_ISCHR(mode) and access == os.O_RDONLY)
    if not (readable and target.startswith("/") and _reopen_read_only(fd, stat.S_ISDIR(mode))):
        _to_devnull(fd, devnull)
    return None


def _same_file(fd: int, other: int) -> bool:
    """Whether ``fd`` still is the file ``other`` is (the zygote may have closed it and reused the number)."""
    try:
        a, b = os.fstat(fd), os.fstat(other)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _memfd_over(fd: int, flags: int, copy: bool) -> Tuple[int, Tuple[int, int]]:
    """Put a new anonymous memory file in place of ``fd`` (with ``fd``'s bytes and offset when ``copy``);
    (the memory file's own descriptor, its stamp)."""
    import fcntl

    memfd = os.memfd_create("sealed-write", os.MFD_CLOEXEC)
    if copy:
        size, done = os.fstat(fd).st_size, 0
        while done < size:
            sent = os.sendfile(memfd, fd, done, size - done)  # the offset argument leaves fd's own alone
            if sent <= 0:
                break
            done += sent
        try:
            os.lseek(memfd, os.lseek(fd, 0, os.SEEK_CUR), os.SEEK_SET)
        except OSError:
            pass
    if flags & os.O_APPEND:
        fcntl.fcntl(memfd, fcntl.F_SETFL, os.O_APPEND)  # an "a" or "a+" file still appends
    os.dup2(memfd, fd, inheritable=False)
    return memfd, _stamp(memfd)


def _reopen_read_only(fd: int, directory: bool) -> bool:
    """Point ``fd`` at a new open file description of the same file, read-only, at the same offset."""
    try:
        fresh = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0))
    except OSError:
        return False
    try:
        try:
            os.lseek(fresh, os.lseek(fd, 0, os.SEEK_CUR), os.SEEK_SET)
        except OSError:
            pass  # not seekable: the position does not matter
        os.dup2(fresh, fd, inheritable=False)
        return True
    finally:
        os.close(fresh)


def _to_devnull(fd: int, devnull: int) -> None:
    os.dup2(devnull, fd, inheritable=False)


def _prefer_oom_kill() -> None:
    """If memory runs out, the kernel should kill the child, not the user's process."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


# --- running fn ------------------------------------------------------------------------------------------


def _call(fn, args, kwargs) -> Tuple[int, bytes]:
    """Run fn; (frame kind, its value or its ChildError as plain data)."""
    try:
        value = fn(*args, **kwargs)
    except BaseException as exc:  # SystemExit too: it is what fn did
        return ERROR, plain.encode(_child_error(exc).to_plain())
    try:
        body = plain.encode(value)
    except plain.PlainError as exc:
        error = ChildError("PlainError", f"fn returned a value that cannot be sent back: {exc}")
        return ERROR, plain.encode(error.to_plain())
    if len(body) > MAX_VALUE:
        error = ChildError("ValueError", f"fn returned {len(body)} bytes of data, more than the {MAX_VALUE} a sealed "
                                         "run sends back")
        return ERROR, plain.encode(error.to_plain())
    return VALUE, body


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # a broken __str__ must not lose the error
        return object.__repr__(exc)


def _child_error(exc: BaseException) -> ChildError:
    frames = [f for f in traceback.extract_tb(exc.__traceback__)  # ours (_call, the shims) are not fn's
              if os.path.dirname(os.path.abspath(f.filename)) != _OURS]
    attrs = {}
    for name, value in getattr(exc, "__dict__", {}).items():
        try:
            plain.encode(value)
        except Exception:  # noqa: BLE001 - not plain data: left behind
            continue
        if type(name) is str:
            attrs[name] = value
    return ChildError(
        type_name=type(exc).__qualname__,
        message=_text(exc),
        frames=tuple((f.filename, f.lineno or 0, f.name, f.line or "") for f in frames),
        attrs=attrs,
        module=type(exc).__module__,
    )
