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
   reported). Files and directories open for reading (or read-write) are reopened read-only at the
   same offset, so reading in the child does not move the parent's offset. Everything else
   (sockets, including the kernel's ZMQ ones, pipes, eventfds) becomes ``/dev/null``. Shared memory
   mappings become private copies (:func:`.seccomp.privatise_shared_memory`). The child is also the
   kernel's first choice (``oom_score_adj`` 1000) if memory runs out;
5. the Python shims and the audit hook (:mod:`.shims`);
6. the OS guard (:mod:`.seccomp`), installed last because the steps above still need the calls it
   refuses: what C code does behind Python's back is refused by the kernel with ``EPERM``.

If a step fails, ``fn`` does not run: the child says why on the pipe and exits. Then ``fn`` runs,
and its value (pickled) or its exception (as :class:`~.protocol.ChildError`) goes back on the pipe.

A child of a zygote (a nested run) takes the same steps over what its zygote already sealed, and
inherits the zygote's guards: its Seal comes first so that the zygote's shims and audit hook report
to it, not on the zygote's pipe; it reuses the zygote's ``/dev/null`` descriptor (no write-capable
open passes the zygote's filter); the files the zygote redirected to memory files get fresh memory
files of its own (what the trial writes is its own to report, and the next trial starts from the
zygote's); it keeps the ``oom_score_adj`` it inherited, stays in the zygote's process group, and
dies with the zygote's thread that forked it.
"""
from __future__ import annotations

import builtins
import io
import os
import pickle
import signal
import stat
import sys
import traceback
import warnings
from typing import List, Optional, Tuple

from . import seccomp, shims
from .protocol import ERROR, GUARD, SUMMARY, UNSEALED, VALUE, ChildError, Pipe

_OURS = os.path.dirname(os.path.abspath(__file__))


def run_child(read_end: int, write_end: int, fn, args, kwargs, allow_fork: bool, parent: int,
              thread: Optional[int], sigmask) -> None:
    """The sealed child, from the fork to os._exit; it never returns normally."""
    os.close(read_end)
    pipe = Pipe(write_end)
    try:
        lines, seal = _seal(pipe, allow_fork, parent, thread, sigmask)
    except Exception as exc:  # fn must not run half-sealed: say why, and stop
        pipe.send(UNSEALED, f"the child could not be sealed: {type(exc).__name__}: {exc}".encode("utf-8", "replace"))
        os._exit(71)
    kind, body = _call(fn, args, kwargs)
    for path, memfd in seal.written.values():
        try:
            if os.fstat(memfd).st_size:
                seal.refusals.add(f"write to {shims.show(path)} (opened before the run)")
        except OSError:
            continue  # fn closed it
    pipe.send(SUMMARY, pickle.dumps((lines.count, seal.refusals.more)))
    pipe.send(kind, body)
    os._exit(0)


def _seal(pipe: Pipe, allow_fork: bool, parent: int, thread: Optional[int], sigmask):
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
    _cut_inherited_fds(seal, outer)
    notes = [seccomp.privatise_shared_memory()]
    if outer is None:
        _prefer_oom_kill()
    shims.install()
    notes.insert(0, seccomp.install(seal.pid, allow_fork))
    guard = "python" if notes[0] else "seccomp"
    pipe.send(GUARD, pickle.dumps((guard, "; ".join(n for n in notes if n) or None)))
    return lines, seal


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


def _cut_inherited_fds(seal: shims.Seal, outer: Optional[shims.Seal]) -> None:
    """Leave the child no descriptor shared with its parent; files open for writing go to ``seal.written``."""
    keep = {seal.refusals.pipe.fd, seal.devnull}
    for fd in _open_fds():
        if fd <= 2 or fd in keep:
            continue
        memfd = _replace_fd(fd, seal.devnull, outer)
        if memfd is not None:
            seal.written[fd] = memfd
            keep.add(memfd[1])


def _replace_fd(fd: int, devnull: int, outer: Optional[shims.Seal]) -> Optional[Tuple[str, int]]:
    if outer is not None:  # the zygote's memory files: a fresh one for each file, its own ones unused
        if fd in outer.written and _same_file(fd, outer.written[fd][1]):
            return outer.written[fd][0], _memfd_over(fd)
        if fd in {memfd for _path, memfd in outer.written.values()}:
            _to_devnull(fd, devnull)
            return None
    import fcntl

    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        mode = os.fstat(fd).st_mode
    except OSError:
        return None  # closed meanwhile (the listing's own descriptor)
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        target = ""  # no /proc (not Linux): nothing can be reopened, all becomes /dev/null
    if flags & getattr(os, "O_PATH", 0):
        return None  # can neither read nor write
    access = flags & os.O_ACCMODE
    if stat.S_ISREG(mode) and target.startswith("/") and access == os.O_WRONLY and hasattr(os, "memfd_create"):
        return target, _memfd_over(fd)
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


def _memfd_over(fd: int) -> int:
    """Put a new anonymous memory file in place of ``fd``; the memory file's own descriptor."""
    memfd = os.memfd_create("sealed-write", os.MFD_CLOEXEC)
    os.dup2(memfd, fd, inheritable=False)
    return memfd


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
    """Run fn; (frame kind, pickled value or ChildError)."""
    try:
        value = fn(*args, **kwargs)
    except BaseException as exc:  # SystemExit too: it is what fn did
        return ERROR, pickle.dumps(_child_error(exc), pickle.HIGHEST_PROTOCOL)
    try:
        return VALUE, pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        error = ChildError(type(exc).__name__, f"fn returned a {type(value).__module__}.{type(value).__qualname__}, "
                                               f"which cannot be sent back: {exc}")
        return ERROR, pickle.dumps(error, pickle.HIGHEST_PROTOCOL)


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
            pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
        except Exception:
            continue
        attrs[name] = value
    return ChildError(
        type_name=type(exc).__qualname__,
        message=_text(exc),
        frames=tuple((f.filename, f.lineno or 0, f.name, f.line or "") for f in frames),
        attrs=attrs,
        module=type(exc).__module__,
    )
