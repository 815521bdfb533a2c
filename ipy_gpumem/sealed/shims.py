"""The Python-level guard of a sealed child: shims that pretend or refuse, an audit hook for what bypasses them, and the record of each refusal.

Why shims before the OS guard: most side effects of a training step go through Python (``open``,
``torch.save``, ``os.remove``, ``shutil.copy``, ``logging``), and a step should go on as if they
happened, not fail. So writing pretends: ``open`` for writing returns a file on ``/dev/null``;
``torch.save`` to a path, ``os.remove``, ``shutil.copy``... do nothing; ``os.system`` runs nothing and
returns 0. What cannot be pretended is refused with ``PermissionError``: network, new processes
(``subprocess``: its caller reads the output), signals to other processes. An audit hook
catches what bypasses the shims (``posix.remove``, ``_io.FileIO``, a function imported before the
run) and refuses it the same way. Each side effect, pretended or refused, is recorded once as a
short line and sent to the parent the moment it happens, so a run killed at its deadline still
says what it tried; past :data:`MAX_REFUSED` distinct lines, one line counts the rest.
``sqlite3.connect`` opens an in-memory copy of the database (its commits succeed and are listed),
and the run's own pipe is out of Python code's reach: writing on it, duplicating or reopening it
is refused, closing it pretends (so a step cannot garble or forge the answer from Python).

Why one :class:`Seal` per process, read at each call: a child forked by a zygote (a sealed child
run with ``allow_fork=True``) inherits the zygote's shims and its audit hook, which cannot be
removed. The shims and the hook therefore close over nothing of one seal: they ask :func:`current`
which seal this process answers to, and the nested child makes its own current before anything
else, so that what it does is reported on its own pipe, never on the zygote's (the parent would
count it twice, and two writers would interleave their frames). Each shim wraps the function as it
was before any seal (:data:`_ORIGINALS`), not the zygote's shim of it.

A zygote may fork, but only through ``run_sealed`` itself: :func:`own_fork` marks the one thread
that is forking, for the length of that ``os.fork``, and the ``os.fork`` shim and the audit hook let
that fork alone through. ``os.fork`` called by user code, ``subprocess`` and the exec family stay
refused in a zygote as in any sealed child (``os.system`` pretends there too).
"""
from __future__ import annotations

import builtins
import contextlib
import io
import os
import signal
import sys
import threading
from typing import Any, Dict, Optional, Set, Tuple

from . import seccomp
from .protocol import QUIET, REFUSED, Pipe

__all__ = ["MAX_REFUSED", "Refusals", "Seal", "current", "enter", "install", "original", "own_fork", "show", "unreported",
           "sqlite_writes"]

#: Distinct refusals reported one by one; past this, one line counts the rest.
MAX_REFUSED = 20


class Refusals:
    """Each refused side effect, sent once as it happens (a run killed later still reports it)."""

    def __init__(self, pipe: Pipe):
        self.pipe = pipe
        self.seen: set = set()
        self.more = 0

    def add(self, line: str) -> None:
        line = line if len(line) <= 160 else line[:157] + "..."
        if line in self.seen:
            return
        self.seen.add(line)
        if len(self.seen) > MAX_REFUSED:
            self.more += 1
            return
        try:
            self.pipe.send(REFUSED, line.encode("utf-8", "replace"))
        except OSError:
            pass  # the parent is gone; PR_SET_PDEATHSIG ends us


class Seal:
    """What the shims and the audit hook of this process answer to: its refusals, its pid, its ``/dev/null``."""

    def __init__(self, pipe: Pipe, devnull: int, allow_fork: bool):
        self.pid = os.getpid()
        self.refusals = Refusals(pipe)
        #: a descriptor on /dev/null open read-write, made before the OS guard forbids opening one
        self.devnull = devnull
        #: whether run_sealed may fork here (a zygote)
        self.allow_fork = allow_fork
        #: fd -> (path, memfd, (size, mtime) when made): files that were open for writing when the run
        #: began, now memory files (a copy of the file when it was also open for reading)
        self.written: Dict[int, Tuple[str, int, Tuple[int, int]]] = {}
        #: > 0 while the caller's own machinery runs (:func:`unreported`): still sealed, not reported
        self.quiet = 0
        #: the run's own descriptors (its pipe): Python code of the step may not write, dup or close them
        self.guarded: Set[int] = {pipe.fd}
        #: (path as shown, connection) of each sqlite database the step opened: its writes stay in memory
        self.databases: list = []


_SEAL: Optional[Seal] = None
#: (owner, name) -> the function before any seal: a nested seal wraps these, not its zygote's shims
_ORIGINALS: Dict[Tuple[str, str], Any] = {}
#: the threads now inside run_sealed's own os.fork
_FORKING: Set[int] = set()
_HOOKED = False


def current() -> Optional[Seal]:
    """The seal of this process, or None outside a sealed child."""
    return _SEAL


def enter(seal: Seal) -> None:
    """Make ``seal`` this process's: from now on the shims and the hook (a zygote's too) report to it."""
    global _SEAL
    _SEAL = seal
    _FORKING.clear()


def install() -> None:
    """Put the shims in place and add the audit hook (once per process and its forks: it cannot be removed)."""
    global _HOOKED
    _shim_descriptors()
    _shim_open()
    _shim_files()
    _shim_sqlite()
    _shim_processes()
    _shim_network()
    _shim_torch()
    if not _HOOKED:
        sys.addaudithook(_audit_hook)
        _HOOKED = True


@contextlib.contextmanager
def own_fork():
    """Around run_sealed's own ``os.fork``: in a zygote, that fork (this thread, now) passes the guard."""
    ident = threading.get_ident()
    _FORKING.add(ident)
    try:
        yield
    finally:
        _FORKING.discard(ident)


def _own_fork() -> bool:
    seal = _SEAL
    return seal is not None and seal.allow_fork and threading.get_ident() in _FORKING


def _record(line: str) -> None:
    seal = _SEAL
    if seal is not None and not seal.quiet:
        seal.refusals.add(line)


@contextlib.contextmanager
def unreported():
    """Inside a sealed child, around the caller's own machinery (torch importing its compiler's
    config, which probes the temporary directory): every guard still holds, but what it stops is
    not the user's code's doing and is not reported. Outside a sealed child it does nothing."""
    seal = _SEAL
    if seal is None:
        yield
        return
    seal.quiet += 1
    _tell_quiet(seal)
    try:
        yield
    finally:
        seal.quiet -= 1
        _tell_quiet(seal)


def _tell_quiet(seal: Seal) -> None:
    """The parent names C code's refusals (.notify): it is told when they are the caller's, not the step's."""
    try:
        seal.refusals.pipe.send_plain(QUIET, seal.quiet)
    except OSError:
        pass  # the parent is gone


def _real(owner, key: str, name: str):
    """``owner.name`` as it was before any seal (recorded the first time it is asked for)."""
    return _ORIGINALS.setdefault((key, name), getattr(owner, name))


def original(owner, key: str, name: str):
    """``owner.name`` as it was before any seal, for the seal's own use (its pipe writes with the real
    ``os.write``, which a zygote's shim refuses on a guarded descriptor). ``key`` names ``owner`` ("os")."""
    return _real(owner, key, name)


def show(path) -> str:
    """A path as the user wrote it (str), or, from /proc, relative to the working directory."""
    try:
        text = os.fsdecode(path)
    except TypeError:
        return repr(path)
    try:
        cwd = os.getcwd()
    except OSError:
        return text
    return os.path.relpath(text, cwd) if text.startswith(cwd + os.sep) else text


def _writes(mode) -> bool:
    return isinstance(mode, str) and any(c in mode for c in "wax+")


def _refuse(what: str) -> PermissionError:
    return PermissionError(f"sealed run: {what} is not allowed (the step runs in a sealed child)")


# --- files --------------------------------------------------------------------------------------------


def _shim_open() -> None:
    real_open, real_os_open = _real(io, "io", "open"), _real(os, "os", "open")

    def sealed_open(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None, closefd=True,
                    opener=None):
        if _guarded(file):
            _refused(f"open({file}, {mode!r}) on the sealed run's own pipe", "using the sealed run's own pipe")
        if isinstance(file, int) or not _writes(mode):
            return real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
        _record(f"open({show(file)!r}, {mode!r})")
        handle = real_open(os.dup(_SEAL.devnull), mode.replace("x", "w"), buffering, encoding, errors, newline)
        try:
            getattr(handle, "buffer", handle).raw.name = os.fspath(file)  # f.name as the step expects
        except (AttributeError, TypeError):
            pass
        return handle

    def sealed_os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & seccomp.WRITE_FLAGS:
            _record(f"os.open({show(path)!r}, {_flag_names(flags)})")
            return os.dup(_SEAL.devnull)
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    sealed_open.sealed_shim = True
    builtins.open = io.open = sealed_open
    shell = sys.modules.get("IPython.core.interactiveshell")
    io_open = getattr(shell, "io_open", None)
    if io_open is real_open or getattr(io_open, "sealed_shim", False):
        shell.io_open = sealed_open  # IPython gives each notebook its own open(), which calls this
    os.open = sealed_os_open


def _flag_names(flags: int) -> str:
    names = [n for n in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND", "O_EXCL") if flags & getattr(os, n)]
    return "|".join(names)


#: (module, function, how many leading path arguments to show, what it returns when pretending)
_PRETEND = [
    ("os", "remove", 1, None), ("os", "unlink", 1, None), ("os", "rmdir", 1, None), ("os", "removedirs", 1, None),
    ("os", "mkdir", 1, None), ("os", "makedirs", 1, None), ("os", "rename", 2, None), ("os", "renames", 2, None),
    ("os", "replace", 2, None), ("os", "link", 2, None), ("os", "symlink", 2, None), ("os", "chmod", 1, None),
    ("os", "lchmod", 1, None), ("os", "fchmod", 1, None), ("os", "chown", 1, None), ("os", "lchown", 1, None),
    ("os", "fchown", 1, None), ("os", "utime", 1, None), ("os", "mkfifo", 1, None), ("os", "mknod", 1, None),
    ("shutil", "rmtree", 1, None), ("shutil", "move", 2, 1), ("shutil", "copy", 2, 1), ("shutil", "copy2", 2, 1),
    ("shutil", "copyfile", 2, 1), ("shutil", "copytree", 2, 1), ("shutil", "copymode", 2, None),
    ("shutil", "copystat", 2, None), ("shutil", "chown", 1, None),
]


def _shim_files() -> None:
    """Changes to the file system pretend to succeed (the step goes on) and are recorded."""
    for module_name, name, shown, returns in _PRETEND:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, name):
            setattr(module, name, _pretend(f"{module_name}.{name}", shown, returns))
    real_truncate = _real(os, "os", "truncate")

    def truncate(path, length):
        if isinstance(path, int):
            return real_truncate(path, length)  # a descriptor the child holds: only /dev/null or its own
        _record(f"os.truncate({show(path)!r}, {length})")

    os.truncate = truncate


def _pretend(label: str, shown: int, returns: Optional[int]):
    def pretend(*args, **kwargs):
        _record(f"{label}({', '.join(repr(show(a)) for a in args[:shown])})")
        return args[returns] if returns is not None and len(args) > returns else None

    pretend.__name__ = label.rsplit(".", 1)[1]
    return pretend


# --- the run's own descriptors ------------------------------------------------------------------------


def _guarded(fd) -> bool:
    seal = _SEAL
    return seal is not None and type(fd) is int and fd in seal.guarded


#: os functions that write on, duplicate or change a descriptor: (name, positions of descriptors)
_FD_USES = (("write", (0,)), ("writev", (0,)), ("pwrite", (0,)), ("pwritev", (0,)), ("sendfile", (0,)),
            ("splice", (1,)), ("copy_file_range", (1,)), ("dup", (0,)), ("dup2", (0, 1)), ("ftruncate", (0,)),
            ("set_blocking", (0,)), ("set_inheritable", (0,)), ("lseek", (0,)), ("fdopen", (0,)))


def _shim_descriptors() -> None:
    """The run's pipe is not the step's: Python code that writes on it, duplicates, reopens or
    changes it is refused, and closing it pretends. (C code can still reach it: the parent trusts
    no byte it reads, :mod:`.protocol`.)"""
    for name, positions in _FD_USES:
        if hasattr(os, name):
            setattr(os, name, _fd_guard(f"os.{name}", _real(os, "os", name), positions))
    import fcntl

    for name in ("fcntl", "ioctl", "flock", "lockf"):
        setattr(fcntl, name, _fd_guard(f"fcntl.{name}", _real(fcntl, "fcntl", name), (0,)))
    real_close, real_closerange = _real(os, "os", "close"), _real(os, "os", "closerange")

    def close(fd):
        if _guarded(fd):
            _record(f"os.close({fd}) of the sealed run's own pipe")
            return None
        return real_close(fd)

    def closerange(low, high):
        start = low
        for fd in sorted(f for f in (_SEAL.guarded if _SEAL is not None else ()) if low <= f < high):
            _record(f"os.closerange({low}, {high}) over the sealed run's own pipe")
            real_closerange(start, fd)
            start = fd + 1
        real_closerange(start, high)

    os.close, os.closerange = close, closerange


def _fd_guard(label: str, real, positions):
    def guard(*args, **kwargs):
        for index in positions:
            if index < len(args) and _guarded(args[index]):
                _refused(f"{label}({args[index]}) on the sealed run's own pipe", "using the sealed run's own pipe")
        return real(*args, **kwargs)

    guard.__name__ = label.rsplit(".", 1)[1]
    return guard


# --- sqlite -------------------------------------------------------------------------------------------

#: A database file up to this size is copied into memory when the step opens it; a larger one is opened read-only.
SQLITE_COPY_MAX = 64 << 20


def _shim_sqlite() -> None:
    """``sqlite3.connect`` opens an in-memory copy of the database: the step reads what is there, its
    writes and commits succeed and stay in memory, and are listed (:func:`sqlite_writes`)."""
    dbapi = sys.modules.get("sqlite3.dbapi2")
    if dbapi is None:
        return
    real = _real(dbapi, "sqlite3.dbapi2", "connect")

    def connect(database, *args, **kwargs):
        path = _database_path(database, kwargs.get("uri", False))
        if path is None:  # ":memory:", "", or a URI that opens nothing for writing
            return real(database, *args, **kwargs)
        shown = show(path)
        kwargs.pop("uri", None)
        try:
            size = os.stat(path).st_size
        except OSError:
            size = None
        if size is not None and size > SQLITE_COPY_MAX:
            _record(f"sqlite3.connect({shown!r}) opened read-only (too large to copy into memory: its writes fail)")
            return real(_uri(path, "mode=ro"), *args, uri=True, **kwargs)
        kwargs["factory"] = _in_memory(kwargs.get("factory") or dbapi.Connection)
        memory = real(":memory:", *args, **kwargs)
        if size is None:
            _record(f"sqlite3.connect({shown!r}): a new database, kept in memory")
        else:
            for query in ("mode=ro", "immutable=1"):  # a WAL database without its -shm file opens immutable
                try:
                    source = real(_uri(path, query), uri=True)
                except dbapi.Error:
                    continue
                try:
                    source.backup(memory)
                    break
                except dbapi.Error:
                    continue
                finally:
                    source.close()
        memory.sealed_name, memory.sealed_changes = shown, memory.total_changes
        seal = _SEAL
        if seal is not None:
            seal.databases.append(memory)
        return memory

    dbapi.connect = connect
    package = sys.modules.get("sqlite3")
    if package is not None:
        package.connect = connect


def _database_path(database, uri: bool) -> Optional[str]:
    try:
        text = os.fsdecode(database)
    except TypeError:
        return None
    if uri:
        from urllib.parse import parse_qs, unquote, urlsplit

        parts = urlsplit(text)
        if parts.scheme != "file":
            return None
        query = parse_qs(parts.query)
        if query.get("mode", [""])[0] in ("ro", "memory") or query.get("immutable", ["0"])[0] == "1":
            return None
        text = unquote(parts.path)
    return None if text in ("", ":memory:") else text


def _uri(path: str, query: str) -> str:
    from urllib.parse import quote

    return f"file:{quote(os.path.abspath(path))}?{query}"


_FACTORIES: Dict[type, type] = {}


def _in_memory(factory: type) -> type:
    """``factory`` (sqlite3.Connection or the step's subclass of it), whose ``close`` first lists the changes."""
    made = _FACTORIES.get(factory)
    if made is None:
        def close(self):
            _database_written(self)
            return factory.close(self)

        made = _FACTORIES[factory] = type(factory.__name__, (factory,), {"close": close})
    return made


def _database_written(connection) -> None:
    try:
        changed = connection.total_changes > connection.sealed_changes
    except Exception:  # noqa: BLE001 - already closed: listed then
        return
    if changed:
        _record(f"writes to the sqlite database {connection.sealed_name!r} (kept in memory, not written)")


def sqlite_writes(seal: "Seal") -> None:
    """At the end of a run: record each database the step changed and left open (its changes stayed in memory)."""
    for connection in seal.databases:
        _database_written(connection)


# --- processes and network ------------------------------------------------------------------------------


def _refused(line: str, what: str):
    _record(line)
    raise _refuse(what)


def _shim_processes() -> None:
    """New processes and signals to other processes are refused with PermissionError (``os.system`` is
    pretended: it returns 0 having run nothing); in a zygote, run_sealed's own fork passes."""
    real_kill, real_fork = _real(os, "os", "kill"), _real(os, "os", "fork")

    def system(command):
        # Pretended, like a file write: a shell command run for its side effect (``nvidia-smi``, a
        # ``mkdir``) must not stop the step; it did not run, and says so. Its exit status is 0.
        _record(f"os.system({command!r})")
        return 0

    def popen_init(self, args, *rest, **kwargs):
        self._child_created = False  # Popen.__del__ reads it
        _refused(f"subprocess {args!r}", "subprocess")

    def fork_exec(args, *rest, **kwargs):
        _refused(f"subprocess {list(args) if args is not None else args!r}", "subprocess")

    def kill(pid, sig):
        if pid == _SEAL.pid:
            return real_kill(pid, sig)
        _refused(f"os.kill({pid}, {_signal_name(sig)})", "signalling another process")

    def fork():
        if _own_fork():
            return real_fork()
        _refused("os.fork()", "os.fork")

    os.system, os.kill, os.fork = system, kill, fork
    for name in ("forkpty", "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp",
                 "execvpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp",
                 "spawnlpe", "posix_spawn", "posix_spawnp", "killpg"):
        if hasattr(os, name):
            setattr(os, name, _refuser(name))
    subprocess = sys.modules.get("subprocess")
    if subprocess is not None:
        _real(subprocess.Popen, "subprocess.Popen", "__init__")
        subprocess.Popen.__init__ = popen_init
    posixsubprocess = sys.modules.get("_posixsubprocess")
    if posixsubprocess is not None:
        _real(posixsubprocess, "_posixsubprocess", "fork_exec")
        posixsubprocess.fork_exec = fork_exec


def _refuser(name: str):
    def refused(*args, **kwargs):
        shown = repr(os.fsdecode(args[0])) if args and isinstance(args[0], (str, bytes, os.PathLike)) else ""
        _refused(f"os.{name}({shown})", f"os.{name}")

    refused.__name__ = name
    return refused


def _signal_name(sig) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def _shim_network() -> None:
    """Network traffic is refused with PermissionError: connect, bind, send."""
    socket = sys.modules.get("socket")
    if socket is None:
        return

    def method(verb: str, with_address: bool):
        def refused(self, *args, **kwargs):
            address = args[-1] if with_address and args else None
            _refused(f"socket {verb} to {address!r}" if with_address else f"socket {verb}", f"socket {verb}")

        return refused

    for name, verb, with_address in (("connect", "connect", True), ("connect_ex", "connect", True),
                                     ("bind", "bind", True), ("sendto", "send", True), ("send", "send", False),
                                     ("sendall", "send", False), ("sendmsg", "send", False),
                                     ("listen", "listen", False)):
        _real(socket.socket, "socket.socket", name)
        setattr(socket.socket, name, method(verb, with_address))

    def create_connection(address, *args, **kwargs):
        _refused(f"socket connect to {address!r}", "socket connect")

    _real(socket, "socket", "create_connection")
    socket.create_connection = create_connection


def _shim_torch() -> None:
    """torch.save / torch.jit.save to a path pretend to succeed; to a file object they run (the
    object is the step's own memory, or a shimmed /dev/null file)."""
    for module_name, label in (("torch.serialization", "torch.save"), ("torch.jit", "torch.jit.save")):
        module = sys.modules.get(module_name)
        if getattr(module, "save", None) is None:
            continue
        shim = _torch_save(label, _real(module, module_name, "save"))
        module.save = shim
        if module_name == "torch.serialization":
            sys.modules["torch"].save = shim


def _torch_save(label: str, real):
    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, bytes, os.PathLike)):
            _record(f"{label}(..., {show(f)!r})")
            return None
        return real(obj, f, *args, **kwargs)

    return save


# --- the audit hook: what bypasses the shims ----------------------------------------------------------

#: audit event -> how many leading arguments are paths to show
_FILE_EVENTS = {
    "os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1, "os.utime": 1,
    "os.truncate": 1, "os.setxattr": 1, "os.removexattr": 1, "os.chflags": 1, "os.lchflags": 1,
    "os.rename": 2, "os.link": 2, "os.symlink": 2, "shutil.copyfile": 2, "shutil.copymode": 2,
    "shutil.copystat": 2, "shutil.copytree": 2, "shutil.move": 2, "shutil.rmtree": 1, "shutil.chown": 1,
    "shutil.unpack_archive": 2, "shutil.make_archive": 1,
}
_PROCESS_EVENTS = {"os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                   "os.forkpty", "os.kill", "os.killpg"}
_NETWORK_EVENTS = {"socket.connect": "connect", "socket.bind": "bind", "socket.sendto": "send",
                   "socket.sendmsg": "send"}


def _audit_hook(event, args):
    """Refuse (PermissionError) and record the side effects that reached CPython without a shim."""
    seal = _SEAL
    if seal is None:
        return
    line = None
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None))[:3]
        if not isinstance(path, int) and path is not None and (_writes(mode) or (flags or 0) & seccomp.WRITE_FLAGS):
            line = f"open({show(path)!r}, {mode or _flag_names(flags)!r})"
    elif event in _FILE_EVENTS:
        if event == "os.truncate" and isinstance(args[0], int):
            return
        line = f"{event}({', '.join(repr(show(a)) for a in args[:_FILE_EVENTS[event]])})"
    elif event in _PROCESS_EVENTS:
        if (event == "os.kill" and args[0] == seal.pid) or (event == "os.fork" and _own_fork()):
            return
        line = f"{event}({', '.join(repr(a) for a in args[:2])})"
    elif event in _NETWORK_EVENTS:
        line = f"socket {_NETWORK_EVENTS[event]} to {args[1]!r}"
    if line is not None:
        _record(line)
        raise _refuse(event)
